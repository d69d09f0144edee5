"""Helpers for custom_vjp rules declared with symbolic_zeros=True (the grouped MoE engine and the
chunked lm-head loss): which inputs are differentiated, and dense cotangents."""

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero


def is_primal(p) -> bool:
  return isinstance(p, CustomVJPPrimal)


def values(tree):
  """The tree with each CustomVJPPrimal(value, perturbed) leaf replaced by its value."""
  return jax.tree.map(lambda p: p.value, tree, is_leaf=is_primal)


def dense(g):
  """A cotangent as an array: zeros where it arrived as a SymbolicZero."""
  return jnp.zeros(g.shape, g.dtype) if isinstance(g, SymbolicZero) else g

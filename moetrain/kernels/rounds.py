"""A sum over a data-dependent number of rounds, differentiable without stacking anything per
round: the overflow rounds of expert parallelism's bounded exchange (model/expert_parallel.py).

Autodiff through a scan of `lax.cond`s (the plain way to skip rounds that are not needed) stacks
each round's residuals, the taken branch's or zeros: at LongCat-Flash's scale the flash LoRA step
went from 33.9 to 103.8 GiB of temporaries per chip with 7 such rounds. Here the forward is a
while loop over the rounds needed, and the backward another that recomputes each round's forward
(jax.vjp) and adds up its cotangents: one round's buffers at a time, and a balanced step runs no
round at all."""

import functools

import jax
import jax.numpy as jnp

from moetrain.kernels import Kernel


def _loop(n, body, init):
  """body(k, acc) for k = 1 .. n - 1: a loop whose trip count the planner's cost count cannot
  read (hlo_cost.analyse counts it zero times in a step's estimate)."""

  def step(carry):
    k, acc = carry
    return k + 1, body(k, acc)

  return jax.lax.while_loop(lambda carry: carry[0] < n, step, (1, init))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _round_sum(fn, rounds, n, diff, static):
  """sum of fn(k, diff, static) for k = 1 .. n - 1 (n <= rounds, traced)."""
  del rounds
  like = jax.eval_shape(fn, 1, diff, static)
  zeros = jnp.zeros(like.shape, like.dtype)
  return _loop(n, lambda k, acc: acc + fn(k, diff, static), zeros)


def _fwd(fn, rounds, n, diff, static):
  return _round_sum(fn, rounds, n, diff, static), (n, diff, static)


def _bwd(fn, rounds, res, g):
  """Cotangents of diff's floating leaves, added up over the rounds; None (zero) for the rest
  (a QLoRA base's integer codes)."""
  del rounds
  n, diff, static = res
  leaves, tree = jax.tree.flatten(diff)
  inexact = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]
  floats = [x for x, f in zip(leaves, inexact) if f]

  def round_fn(k, floats):
    it = iter(floats)
    d = tree.unflatten([next(it) if f else x for x, f in zip(leaves, inexact)])
    return fn(k, d, static)

  def add(k, acc):
    _, pull = jax.vjp(lambda fl: round_fn(k, fl), floats)
    return [a + c for a, c in zip(acc, pull(g)[0])]

  sums = iter(_loop(n, add, [jnp.zeros_like(x) for x in floats]))
  return None, tree.unflatten([next(sums) if f else None for f in inexact]), None


_round_sum.defvjp(_fwd, _bwd)


def _reference(fn, rounds, n, diff, static):
  """Every possible round, each masked by k < n: plain autodiff, rounds x the work."""
  out = [jnp.where(k < n, fn(k, diff, static), 0) for k in range(1, rounds)]
  return sum(out[1:], out[0])


# round_sum(fn, rounds, n, diff, static): sum_{k=1}^{n-1} fn(k, diff, static), rounds a static
# bound on the traced n (rounds > 1). diff: the pytree of arrays differentiated; static: arrays
# that are not (integers: counts, indices, keys).
round_sum = Kernel('round_sum', _round_sum, _reference)

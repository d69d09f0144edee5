"""Permutations of the MoE's rows (dispatch.py's layouts), with backward passes that gather where
autodiff would scatter-add: XLA:CPU runs a scatter-add one row at a time."""

import jax
import jax.numpy as jnp

from moetrain.kernels import Kernel


def _take(x, idx):
  # The barrier was meant to keep XLA from fusing the index arithmetic into the gather. With jax
  # 0.10.2 XLA:CPU drops it before fusion: the compiled layer holds no barrier and the arithmetic
  # sits in the gather's fusion. Gathers rebuilt on clean indices measured the same
  # (bench/RESULTS.md), so it stays as a harmless hint.
  idx = jax.lax.optimization_barrier(idx)
  return jnp.take(x, idx, axis=0, mode='fill', fill_value=0)


@jax.custom_vjp
def _gather_rows(x, idx, inv):
  return _take(x, idx)


_gather_rows.defvjp(
  lambda x, idx, inv: (_take(x, idx), inv), lambda inv, g: (_take(g, inv), None, None)
)

# x[idx] (out-of-range -> zero rows) for an injective idx whose inverse is inv (the backward
# gathers the cotangent through inv).
gather_rows = Kernel(
  'gather_rows',
  _gather_rows,
  lambda x, idx, inv: jnp.take(x, idx, axis=0, mode='fill', fill_value=0),
)


def _token_rows(x_MD, asg_P, slot_R):
  """Slot p's token: asg_P[p] // A, or m (out of range: an empty slot)."""
  m = x_MD.shape[0]
  a = slot_R.shape[0] // m
  return jnp.where(asg_P < m * a, asg_P // a, m)


@jax.custom_vjp
def _dispatch_tokens(x_MD, asg_P, slot_R):
  return _take(x_MD, _token_rows(x_MD, asg_P, slot_R))


def _dispatch_bwd(res, g_PD):
  slot_R, m = res
  # Gather, then sum the A slots of each token. The barrier was meant to keep XLA:CPU from
  # fusing the gather into the reduction (~8x slower, bench/RESULTS.md); see _take on barriers.
  g_RD = jax.lax.optimization_barrier(_take(g_PD, slot_R))
  return g_RD.reshape(m, -1, g_PD.shape[-1]).sum(1), None, None


_dispatch_tokens.defvjp(
  lambda x, asg, slot: (_dispatch_tokens(x, asg, slot), (slot, x.shape[0])), _dispatch_bwd
)

# Buffer rows from tokens: slot p holds token asg_P[p] // A (asg_P out of range = empty). A token
# fills up to A slots, so the backward sums its A assignment slots (slot_R [M*A]: assignment ->
# slot, the inverse of asg_P).
dispatch_tokens = Kernel(
  'dispatch_tokens',
  _dispatch_tokens,
  lambda x, asg, slot: jnp.take(x, _token_rows(x, asg, slot), axis=0, mode='fill', fill_value=0),
)


@jax.custom_vjp
def _take_experts(w_E, expert_U):
  return jnp.take(w_E, expert_U, axis=0)


def _take_experts_bwd(res, g_U):
  expert_U, e = res
  onehot_UE = jax.nn.one_hot(expert_U, e, dtype=g_U.dtype)
  return jnp.tensordot(onehot_UE, g_U, axes=(0, 0)), None


_take_experts.defvjp(lambda w, u: (_take_experts(w, u), (u, w.shape[0])), _take_experts_bwd)

# Per-block weights w[expert_U] (w [E, ...]); the weight gradient is a one-hot matmul over blocks
# (a dense segment sum) instead of XLA:CPU's serial scatter-add.
take_experts = Kernel('take_experts', _take_experts, lambda w, u: jnp.take(w, u, axis=0))

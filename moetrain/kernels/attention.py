"""Softmax attention by blocks of queries, with a backward pass written for XLA:CPU."""

import functools

import jax
import jax.numpy as jnp

from moetrain.kernels import Kernel


def masked_scores(s_BNTS, mask_BTS, scale: float):
  """Scaled scores with the masked ones at the float32 minimum (a row that sees no key gets
  uniform weights rather than NaNs)."""
  return jnp.where(mask_BTS[:, None], s_BNTS * scale, jnp.finfo(jnp.float32).min)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention_core(
  q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale: float, blocks, recompute=True, sinks_N=None
):
  """softmax(scale * q k^T, masked) v, by blocks of queries: block (start, end, keys) takes
  queries [start, end) against keys [0, keys). With sinks_N (gpt-oss), each head's softmax has
  one more logit, sinks_N[n], whose weight goes to no value: the rows' weights sum below 1.

  What the backward pass keeps: the float32 probabilities (recompute=False: O(T * S) per head,
  no extra work), or only each query's softmax max and sum (recompute=True: O(T); the backward
  recomputes each block's scores, one more q k^T product, as flash attention does). Long
  sequences need the latter: at 8k tokens and 64 heads the probabilities are 16 GiB per sequence
  and layer.

  The backward pass is written out for XLA:CPU (bench/RESULTS.md). Autodiff of the same forward
  formed the key and value gradients as ds^T q and p^T dO, contracting the query rows of the big
  [T, S] blocks, which ran in a slow generic dot; and it transposed whole score blocks for the
  shared rope key's gradient. Here they are formed transposed, dK^T = q^T ds and dV^T = dO^T p,
  contracting the query rows of the thin q and dO blocks instead. That form also goes to XLA's
  generic dot (its left operand is column-major), but for these batched products (a head's
  rows out, a 128-query block contracted) it runs ~1.5x faster there than YNNPACK's batched
  matmul on transposed copies, and needs no copies."""
  return _core_fwd(q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale, blocks, recompute, sinks_N)[0]


def _dot(a, b, contract: tuple[int, int], dtype=None):
  """[B, N, ., .] x [B, N, ., .] over a's dimension contract[0] and b's contract[1] (2 or 3)."""
  dims = (((contract[0],), (contract[1],)), ((0, 1), (0, 1)))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=dtype)


def _scores(q_BNTH, k_BNSH, mask_BTS, scale, block):
  """Block (start, end, keys)'s scaled, masked float32 scores [B, N, end - start, keys]."""
  start, end, keys = block
  s_BNTS = _dot(q_BNTH[:, :, start:end], k_BNSH[:, :, :keys], (3, 3), jnp.float32)
  return masked_scores(s_BNTS, mask_BTS[:, start:end, :keys], scale)


def _core_fwd(q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale, blocks, recompute, sinks_N=None):
  outs, kept = [], []
  sink_1N1 = None if sinks_N is None else sinks_N.astype(jnp.float32)[None, :, None]
  for block in blocks:
    z_BNTS = _scores(q_BNTH, k_BNSH, mask_BTS, scale, block)
    max_BNT = jnp.max(z_BNTS, axis=-1)
    if sink_1N1 is not None:
      max_BNT = jnp.maximum(max_BNT, sink_1N1)
    exp_BNTS = jnp.exp(z_BNTS - max_BNT[..., None])
    sum_BNT = jnp.sum(exp_BNTS, axis=-1)
    if sink_1N1 is not None:
      sum_BNT = sum_BNT + jnp.exp(sink_1N1 - max_BNT)
    p_BNTS = exp_BNTS / sum_BNT[..., None]  # the softmax, from the stats the backward may keep
    outs.append(_dot(p_BNTS.astype(v_BNSH.dtype), v_BNSH[:, :, : block[2]], (3, 2)))
    kept.append((max_BNT, sum_BNT) if recompute else (p_BNTS, max_BNT, sum_BNT))
  out_BNTH = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
  return out_BNTH, (q_BNTH, k_BNSH, v_BNSH, out_BNTH, tuple(kept), mask_BTS, sinks_N)


def _sink_grad(sinks_N, kept, delta_BNT, blocks):
  """d sinks: the sink's weight p times (0 - delta), its value being 0, summed over B and T."""
  if sinks_N is None:
    return None
  sink_1N1 = sinks_N.astype(jnp.float32)[None, :, None]
  d_N = jnp.zeros(sinks_N.shape, jnp.float32)
  for (start, end, _), saved in zip(blocks, kept):
    max_BNT, sum_BNT = saved[-2:]
    p_BNT = jnp.exp(sink_1N1 - max_BNT) / sum_BNT
    d_N = d_N - jnp.sum(p_BNT * delta_BNT[:, :, start:end], axis=(0, 2))
  return d_N.astype(sinks_N.dtype)


def _core_bwd(scale, blocks, recompute, res, g_BNTH):
  q_BNTH, k_BNSH, v_BNSH, out_BNTH, kept, mask_BTS, sinks_N = res
  f32, s = jnp.float32, k_BNSH.shape[2]
  g_BNTH = g_BNTH.astype(v_BNSH.dtype)
  if recompute:
    # The recomputed scores are the forward's expression over the same operands: XLA would
    # merge the two (CSE) and keep every block's forward scores alive until here, the O(T * S)
    # this mode exists to avoid (on TPU: 8.25 GiB of the flash LoRA step's temporaries). Tying
    # q and k to the incoming gradient makes them values of the backward pass.
    q_BNTH, k_BNSH, g_BNTH = jax.lax.optimization_barrier((q_BNTH, k_BNSH, g_BNTH))
  # d softmax: ds = p * (dp - sum_s p dp), and sum_s p dp = sum_h g o.
  delta_BNT = jnp.sum(g_BNTH.astype(f32) * out_BNTH.astype(f32), axis=-1)
  b, n, hk, hv = *q_BNTH.shape[:2], q_BNTH.shape[3], g_BNTH.shape[3]
  dq = []
  dk_BNHS, dv_BNHS = jnp.zeros((b, n, hk, s), f32), jnp.zeros((b, n, hv, s), f32)
  for block, saved in zip(blocks, kept):
    start, end, keys = block
    if recompute:  # saved: the block's softmax row max and sum
      max_BNT, sum_BNT = saved
      z_BNTS = _scores(q_BNTH, k_BNSH, mask_BTS, scale, block)
      p_BNTS = jnp.exp(z_BNTS - max_BNT[..., None]) / sum_BNT[..., None]
    else:  # saved: the block's probabilities (and softmax stats)
      p_BNTS = saved[0]
    dp_BNTS = _dot(g_BNTH[:, :, start:end], v_BNSH[:, :, :keys], (3, 3), f32)
    ds_BNTS = p_BNTS * (dp_BNTS - delta_BNT[:, :, start:end, None]) * scale
    # Masked scores get no gradient (as through the forward's select), also in a row that sees
    # no key, whose uniform weights are not zero there.
    ds_BNTS = jnp.where(mask_BTS[:, None, start:end, :keys], ds_BNTS, 0).astype(q_BNTH.dtype)
    dq.append(_dot(ds_BNTS, k_BNSH[:, :, :keys], (3, 2)))
    dk_BNHS = dk_BNHS.at[..., :keys].add(_dot(q_BNTH[:, :, start:end], ds_BNTS, (2, 2), f32))
    p_BNTS = p_BNTS.astype(v_BNSH.dtype)
    dv_BNHS = dv_BNHS.at[..., :keys].add(_dot(g_BNTH[:, :, start:end], p_BNTS, (2, 2), f32))
  dq_BNTH = dq[0] if len(dq) == 1 else jnp.concatenate(dq, axis=2)
  dk_BNSH = dk_BNHS.transpose(0, 1, 3, 2).astype(k_BNSH.dtype)
  dv_BNSH = dv_BNHS.transpose(0, 1, 3, 2).astype(v_BNSH.dtype)
  dsinks_N = _sink_grad(sinks_N, kept, delta_BNT, blocks)
  return dq_BNTH, dk_BNSH, dv_BNSH, None, dsinks_N


_attention_core.defvjp(_core_fwd, _core_bwd)


def _reference(
  q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale: float, blocks, recompute=True, sinks_N=None
):
  """The same blocks, differentiated by autodiff (which keeps the probabilities)."""
  return _core_fwd(q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale, blocks, recompute, sinks_N)[0]


attention_core = Kernel('attention_core', _attention_core, _reference)

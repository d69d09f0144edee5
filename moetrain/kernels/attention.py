"""Softmax attention by blocks of queries, with a backward pass written for XLA:CPU."""

import functools

import jax
import jax.numpy as jnp

from moetrain.kernels import Kernel


def masked_scores(s_BNTS, mask_BTS, scale: float):
  """Scaled scores with the masked ones at the float32 minimum (a row that sees no key gets
  uniform weights rather than NaNs)."""
  return jnp.where(mask_BTS[:, None], s_BNTS * scale, jnp.finfo(jnp.float32).min)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 8))
def _attention_core(
  q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale: float, blocks, recompute=True, sinks_N=None, mask_fn=None
):
  """softmax(scale * q k^T, masked) v, by blocks of queries: block (start, end, keys) takes
  queries [start, end) against keys [0, keys). With sinks_N (gpt-oss), each head's softmax has
  one more logit, sinks_N[n], whose weight goes to no value: the rows' weights sum below 1.

  The mask: [B, T, S] booleans, or with mask_fn (uniform blocks only) a pair (queries' arrays,
  keys' arrays) from which mask_fn(queries' arrays of a block, keys' arrays) makes each block's
  [B, t, S] mask inside the loop: the queries' arrays have T as their last axis (positions,
  segment ids, indices). A context shard at 131,072 keys holds no [T, S] mask then: passed whole,
  XLA:TPU broadcast it over the heads for every block at once (64 GiB of predicates for
  LongCat-Flash's 64 heads and 8,192 queries).

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
  return _core_fwd(q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale, blocks, recompute, sinks_N, mask_fn)[0]


def _dot(a, b, contract: tuple[int, int], dtype=None):
  """[B, N, ., .] x [B, N, ., .] over a's dimension contract[0] and b's contract[1] (2 or 3)."""
  dims = (((contract[0],), (contract[1],)), ((0, 1), (0, 1)))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=dtype)


def _scores(q_BNTH, k_BNSH, mask_BTS, scale, block):
  """Block (start, end, keys)'s scaled, masked float32 scores [B, N, end - start, keys]."""
  start, end, keys = block
  s_BNTS = _dot(q_BNTH[:, :, start:end], k_BNSH[:, :, :keys], (3, 3), jnp.float32)
  return masked_scores(s_BNTS, mask_BTS[:, start:end, :keys], scale)


def _softmax(z_BNTS, sink_1N1):
  """softmax over the last axis, with the sink's logit if any: (p, row max, row sum)."""
  max_BNT = jnp.max(z_BNTS, axis=-1)
  if sink_1N1 is not None:
    max_BNT = jnp.maximum(max_BNT, sink_1N1)
  exp_BNTS = jnp.exp(z_BNTS - max_BNT[..., None])
  sum_BNT = jnp.sum(exp_BNTS, axis=-1)
  if sink_1N1 is not None:
    sum_BNT = sum_BNT + jnp.exp(sink_1N1 - max_BNT)
  return exp_BNTS / sum_BNT[..., None], max_BNT, sum_BNT


def uniform(blocks, t: int, s: int) -> bool:
  """Whether the blocks split the T queries evenly, each scoring all S keys (a context shard's
  queries against the whole row). Such blocks run as one loop (lax.scan) rather than unrolled:
  the loop holds one block's [T / n, S] scores and the key and value gradients' running sums.
  Unrolled, XLA:TPU's scheduler formed the blocks' key-gradient terms ahead of their sum and
  kept them all: a LongCat-Flash layer with 8,192 queries over 32,768 keys held 45 of those
  [64, 192, 32768] float32 terms, 68 GB. A causal split skips keys block by block and stays
  unrolled."""
  step = blocks[0][1] - blocks[0][0]
  even = [(i * step, (i + 1) * step, s) for i in range(len(blocks))]
  return len(blocks) > 1 and t == len(blocks) * step and list(blocks) == even


def _in_blocks(x, n: int, axis: int):
  """x's axis in n equal blocks, the block index leading: [n, ..., size / n, ...]."""
  shape = x.shape
  x = x.reshape(*shape[:axis], n, shape[axis] // n, *shape[axis + 1 :])
  return jnp.moveaxis(x, axis, 0)


def _joined(x, axis: int):
  """_in_blocks' inverse."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])


def _core_fwd(
  q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale, blocks, recompute, sinks_N=None, mask_fn=None
):
  sink_1N1 = None if sinks_N is None else sinks_N.astype(jnp.float32)[None, :, None]
  if uniform(blocks, q_BNTH.shape[2], k_BNSH.shape[2]):
    args = (q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale, blocks, recompute, sinks_N, mask_fn)
    return _scan_fwd(*args)
  if mask_fn is not None:
    raise ValueError('attention_core: a mask_fn needs even blocks over all the keys')
  outs, kept = [], []
  for block in blocks:
    z_BNTS = _scores(q_BNTH, k_BNSH, mask_BTS, scale, block)
    p_BNTS, max_BNT, sum_BNT = _softmax(z_BNTS, sink_1N1)
    outs.append(_dot(p_BNTS.astype(v_BNSH.dtype), v_BNSH[:, :, : block[2]], (3, 2)))
    kept.append((max_BNT, sum_BNT) if recompute else (p_BNTS, max_BNT, sum_BNT))
  out_BNTH = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
  return out_BNTH, (q_BNTH, k_BNSH, v_BNSH, out_BNTH, tuple(kept), mask_BTS, sinks_N)


def _mask_blocks(mask, n: int, mask_fn):
  """The mask's per-block part for a loop over n uniform blocks, and block_mask(part) -> that
  block's [B, t, S] mask: dense, its [n, B, t, S] slices; with mask_fn, the queries' arrays in
  n blocks each, the keys' arrays shared."""
  if mask_fn is None:
    return _in_blocks(mask, n, 1), lambda m: m
  q_meta, k_meta = mask
  parts = jax.tree.map(lambda x: _in_blocks(x, n, x.ndim - 1), q_meta)
  return parts, lambda part: mask_fn(part, k_meta)


def _tied(qb_BNTH, part):
  """A block's queries and mask part through an optimization barrier: the mask made from the
  part then depends on the layer's queries. A mask that depended on the positions alone was the
  same in every layer, and JAX's partial evaluation of the layer scan (its loop-invariant
  residuals) computed it before the loop, broadcast over the heads for all blocks at once, and
  kept it: 64 GiB of predicates for LongCat-Flash's 64 heads and a shard's 8,192 queries over a
  131,072-token row. kernels/ring.py ties its masks' inputs with it too."""
  return jax.lax.optimization_barrier((qb_BNTH, part))


def _scan_fwd(q_BNTH, k_BNSH, v_BNSH, mask, scale, blocks, recompute, sinks_N, mask_fn):
  """_core_fwd of uniform blocks, one block a loop step; kept: the blocks' stats stacked."""
  n = len(blocks)
  sink_1N1 = None if sinks_N is None else sinks_N.astype(jnp.float32)[None, :, None]
  parts, block_mask = _mask_blocks(mask, n, mask_fn)

  def block(_, xs):
    qb_BNTH, part = _tied(*xs)
    zb_BNTS = masked_scores(_dot(qb_BNTH, k_BNSH, (3, 3), jnp.float32), block_mask(part), scale)
    pb_BNTS, maxb_BNT, sumb_BNT = _softmax(zb_BNTS, sink_1N1)
    outb_BNTH = _dot(pb_BNTS.astype(v_BNSH.dtype), v_BNSH, (3, 2))
    return None, (outb_BNTH, (maxb_BNT, sumb_BNT) if recompute else (pb_BNTS, maxb_BNT, sumb_BNT))

  _, (outs, kept) = jax.lax.scan(block, None, (_in_blocks(q_BNTH, n, 2), parts))
  out_BNTH = _joined(outs, 2)
  return out_BNTH, (q_BNTH, k_BNSH, v_BNSH, out_BNTH, kept, mask, sinks_N)


def _sink_grad(sinks_N, stats):
  """d sinks: the sink's weight p times (0 - delta), its value being 0, summed over all but
  the heads. stats: (row max, row sum, delta) triples, heads their second-to-last axis."""
  if sinks_N is None:
    return None
  sink_N1 = sinks_N.astype(jnp.float32)[:, None]
  d_N = jnp.zeros(sinks_N.shape, jnp.float32)
  for max_NT, sum_NT, delta_NT in stats:
    sink = jnp.expand_dims(sink_N1, tuple(range(max_NT.ndim - 2)))
    p_NT = jnp.exp(sink - max_NT) / sum_NT
    d_N = d_N - jnp.sum(jnp.moveaxis(p_NT * delta_NT, -2, 0).reshape(d_N.size, -1), axis=1)
  return d_N.astype(sinks_N.dtype)


def _core_bwd(scale, blocks, recompute, mask_fn, res, g_BNTH):
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
  dk_BNHS, dv_BNHS = jnp.zeros((b, n, hk, s), f32), jnp.zeros((b, n, hv, s), f32)
  grads = functools.partial(_block_grads, k_BNSH, v_BNSH, scale, recompute)
  if uniform(blocks, q_BNTH.shape[2], s):
    parts, block_mask = _mask_blocks(mask_BTS, len(blocks), mask_fn)

    def block(carry, xs):
      qb_BNTH, gb_BNTH, deltab_BNT, saved, part = xs
      qb_BNTH, part = _tied(qb_BNTH, part)
      dqb_BNTH, dk_BNHS, dv_BNHS = grads(qb_BNTH, gb_BNTH, block_mask(part), deltab_BNT, saved)
      return (carry[0] + dk_BNHS, carry[1] + dv_BNHS), dqb_BNTH

    xs = tuple(_in_blocks(x, len(blocks), 2) for x in (q_BNTH, g_BNTH, delta_BNT))
    (dk_BNHS, dv_BNHS), dq = jax.lax.scan(block, (dk_BNHS, dv_BNHS), (*xs, kept, parts))
    dq_BNTH = _joined(dq, 2)
    stats = [(*kept[-2:], _in_blocks(delta_BNT, len(blocks), 2))]
  else:
    dq = []
    for (start, end, keys), saved in zip(blocks, kept):
      qb_BNTH, gb_BNTH, deltab_BNT = (x[:, :, start:end] for x in (q_BNTH, g_BNTH, delta_BNT))
      maskb_BTS = mask_BTS[:, start:end, :keys]
      dqb_BNTH, dkb_BNHS, dvb_BNHS = grads(qb_BNTH, gb_BNTH, maskb_BTS, deltab_BNT, saved, keys)
      dk_BNHS = dk_BNHS.at[..., :keys].add(dkb_BNHS)
      dv_BNHS = dv_BNHS.at[..., :keys].add(dvb_BNHS)
      dq.append(dqb_BNTH)
    dq_BNTH = dq[0] if len(dq) == 1 else jnp.concatenate(dq, axis=2)
    stats = [(*saved[-2:], delta_BNT[:, :, a:e]) for (a, e, _), saved in zip(blocks, kept)]
  dk_BNSH = dk_BNHS.transpose(0, 1, 3, 2).astype(k_BNSH.dtype)
  dv_BNSH = dv_BNHS.transpose(0, 1, 3, 2).astype(v_BNSH.dtype)
  no_mask_grad = jax.tree.map(lambda _: None, mask_BTS)
  return dq_BNTH, dk_BNSH, dv_BNSH, no_mask_grad, _sink_grad(sinks_N, stats)


def _block_grads(
  k_BNSH, v_BNSH, scale, recompute, qb_BNTH, gb_BNTH, maskb_BTS, deltab_BNT, saved, keys=None
):
  """One block of queries' gradients: (dq, and its terms of dK^T and dV^T over the first
  `keys` keys). saved: the block's softmax row max and sum (recompute), or its probabilities
  and those. A name whose stem ends in b is the block's part (qb_BNTH: its queries)."""
  f32 = jnp.float32
  k_BNSH, v_BNSH = k_BNSH[:, :, :keys], v_BNSH[:, :, :keys]
  if recompute:
    maxb_BNT, sumb_BNT = saved
    sb_BNTS = _dot(qb_BNTH, k_BNSH, (3, 3), f32)
    zb_BNTS = masked_scores(sb_BNTS, maskb_BTS, scale)
    pb_BNTS = jnp.exp(zb_BNTS - maxb_BNT[..., None]) / sumb_BNT[..., None]
  else:
    pb_BNTS = saved[0]
  dpb_BNTS = _dot(gb_BNTH, v_BNSH, (3, 3), f32)
  dsb_BNTS = pb_BNTS * (dpb_BNTS - deltab_BNT[..., None]) * scale
  # Masked scores get no gradient (as through the forward's select), also in a row that sees
  # no key, whose uniform weights are not zero there.
  dsb_BNTS = jnp.where(maskb_BTS[:, None], dsb_BNTS, 0).astype(qb_BNTH.dtype)
  dqb_BNTH = _dot(dsb_BNTS, k_BNSH, (3, 2))
  dkb_BNHS = _dot(qb_BNTH, dsb_BNTS, (2, 2), f32)
  dvb_BNHS = _dot(gb_BNTH, pb_BNTS.astype(v_BNSH.dtype), (2, 2), f32)
  return dqb_BNTH, dkb_BNHS, dvb_BNHS


_attention_core.defvjp(_core_fwd, _core_bwd)


def _reference(
  q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale: float, blocks, recompute=True, sinks_N=None, mask_fn=None
):
  """The same blocks, differentiated by autodiff (which keeps the probabilities)."""
  args = (q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale, blocks, recompute, sinks_N, mask_fn)
  return _core_fwd(*args)[0]


attention_core = Kernel('attention_core', _attention_core, _reference)

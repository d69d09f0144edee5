"""Ring attention: a context shard's queries against every shard's keys and values, the key and
value blocks passed once around the 'context' ring."""

import functools

import jax
import jax.numpy as jnp

from moetrain.kernels import Kernel
from moetrain.kernels.attention import _dot, _tied, masked_scores

F32 = jnp.float32


def _pass_on(x, shards: int):
  """x (a pytree) one shard along the ring: shard i's to shard i + 1 (a ppermute over
  'context', whose transpose is the reverse permutation)."""
  return jax.lax.ppermute(x, 'context', [(i, (i + 1) % shards) for i in range(shards)])


def around(fold, state, kv, shards: int):
  """state with every shard's block folded in, fold(state, kv, s) of the block that left its
  shard s steps ago (s = 0: the shard's own), each block passed on beside its products (the
  transfer does not wait on them)."""

  def step(carry, s):
    state, kv = carry
    return (fold(state, kv, s), _pass_on(kv, shards)), None

  (state, kv), _ = jax.lax.scan(step, (state, kv), jnp.arange(shards - 1))
  return fold(state, kv, shards - 1)


def around_back(grads, q_shape, kv, dops, shards: int):
  """The backward's ring: (dq, the shard's block's gradients, dops), float32, summed over the
  visitors; grads(kv, s) -> (dq part, gradients of what kv carries, dops part) of the block
  that left its shard s steps ago. Each block's gradients travel with it and arrive back at
  its owner one step after its last visit; dops (kv_b's) stay on the shard."""

  def add(total, part):
    return jax.tree.map(lambda t, p: t + p.astype(F32), total, part)

  def step(carry, s):
    dq_BNTH, kv, dkv, dops = carry
    dq_part, dkv_part, dops_part = grads(kv, s)
    dkv = add(dkv, dkv_part)
    carry = (dq_BNTH + dq_part, _pass_on(kv, shards), _pass_on(dkv, shards), add(dops, dops_part))
    return carry, None

  dkv = tuple(jnp.zeros(x.shape, F32) for x in kv[:2])
  carry = (jnp.zeros(q_shape, F32), kv, dkv, dops)
  (dq_BNTH, kv, dkv, dops), _ = jax.lax.scan(step, carry, jnp.arange(shards - 1))
  dq_part, dkv_part, dops_part = grads(kv, shards - 1)
  # The last visitor's gradients, one step more: back at the shard that owns the block.
  return dq_BNTH + dq_part, _pass_on(add(dkv, dkv_part), shards), add(dops, dops_part)


def through_expand(block_grads, kv, expand, ops):
  """A visitor's (dq part, gradients of what it carries, gradients of `ops`), float32:
  block_grads(keys, values, k_side) -> (dq part, dk, dv) of its keys and values, taken back
  through expand's VJP when the block carries what makes them (MLA's latent; kv_b's `ops`)."""
  if expand is None:
    dq_part, dk_BNSH, dv_BNSH = block_grads(*kv)
    return dq_part, (dk_BNSH, dv_BNSH), ()
  (k_BNSH, v_BNSH), pull = jax.vjp(expand, kv[0], kv[1], ops)
  dq_part, dk_BNSH, dv_BNSH = block_grads(k_BNSH, v_BNSH, kv[2])
  da, db, dops = pull((dk_BNSH.astype(k_BNSH.dtype), dv_BNSH.astype(v_BNSH.dtype)))
  return dq_part, (da, db), dops


def cotangents(grads, q_BNTH, block, sinks_N, ops, lse_BNT, delta_BNT, shards: int):
  """A ring attention's cotangents of (q, k, v, its two mask operands, sinks, ops), in their
  dtypes: around_back over grads(kv, s) from the shard's own block (k, v, mask side), and the
  sinks' (gpt-oss): each sink's weight times (0 - delta), its value being 0."""
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, F32), ops)
  dq_BNTH, (dk_BNSH, dv_BNSH), dops = around_back(grads, q_BNTH.shape, block, zeros, shards)
  dsinks_N = None
  if sinks_N is not None:
    p_BNT = jnp.exp(sinks_N.astype(F32)[None, :, None] - lse_BNT)
    dsinks_N = (-jnp.sum(p_BNT * delta_BNT, axis=(0, 2))).astype(sinks_N.dtype)
  k_BNSH, v_BNSH = block[:2]
  return (
    dq_BNTH.astype(q_BNTH.dtype),
    dk_BNSH.astype(k_BNSH.dtype),
    dv_BNSH.astype(v_BNSH.dtype),
    None,
    None,
    dsinks_N,
    jax.tree.map(lambda d, x: d.astype(x.dtype), dops, ops),
  )


def _bounds(t: int, chunk: int) -> tuple:
  step = chunk if 0 < chunk < t else t
  return tuple((i, min(i + step, t)) for i in range(0, t, step))


def _heads(kv, groups: int):
  """A visiting block's keys and values with each of its N_kv heads serving its N / N_kv
  consecutive query heads, and its mask's key side."""
  k_BNSH, v_BNSH, k_meta = kv
  return jnp.repeat(k_BNSH, groups, axis=1), jnp.repeat(v_BNSH, groups, axis=1), k_meta


def expanded(kv, expand, ops):
  """A visiting block as its keys and values [B, N_kv, S, H] and mask side: the block itself,
  or expand(a, b, ops) of what it carries (MLA: its latent and rope key, expanded by kv_b's
  arrays `ops` on the receiving shard)."""
  if expand is None:
    return kv
  k_BNSH, v_BNSH = expand(kv[0], kv[1], ops)
  return k_BNSH, v_BNSH, kv[2]


def _start(q_BNTH, v_BNSH, sinks_N):
  """The online softmax before any key: running max, sum and unnormalised output [B, N, T, H]
  (float32). A sink (gpt-oss) starts the max and adds its one weight to the sum, which is how
  it joins the softmax's denominator once and no value."""
  b, n, t = q_BNTH.shape[:3]
  if sinks_N is None:
    max_BNT, sum_BNT = jnp.full((b, n, t), jnp.finfo(F32).min), jnp.zeros((b, n, t), F32)
  else:
    max_BNT = jnp.broadcast_to(sinks_N.astype(F32)[None, :, None], (b, n, t))
    sum_BNT = jnp.ones((b, n, t), F32)
  return max_BNT, sum_BNT, jnp.zeros((b, n, t, v_BNSH.shape[3]), F32)


def _fold(parts, bounds, q_BNTH, kv, q_meta, mask_fn, scale: float):
  """The per-query-block states (running max, sum, output) with a visiting block of keys and
  values folded in. A query block for which all the visiting keys are masked (causally later
  shards, other segments) skips the block's products (lax.cond)."""
  k_BNSH, v_BNSH, k_meta = _heads(kv, q_BNTH.shape[1] // kv[0].shape[1])
  mask_BTS = mask_fn(q_meta, k_meta)
  out = []
  for (start, end), part in zip(bounds, parts, strict=True):

    def fold(part, start=start, end=end):
      max_BNT, sum_BNT, acc_BNTH = part
      s_BNTS = _dot(q_BNTH[:, :, start:end], k_BNSH, (3, 3), F32)
      z_BNTS = masked_scores(s_BNTS, mask_BTS[:, start:end], scale)
      new_BNT = jnp.maximum(max_BNT, jnp.max(z_BNTS, axis=-1))
      exp_BNTS = jnp.exp(z_BNTS - new_BNT[..., None])
      fix_BNT = jnp.exp(max_BNT - new_BNT)  # the earlier keys' weights, rescaled
      sum_BNT = sum_BNT * fix_BNT + jnp.sum(exp_BNTS, axis=-1)
      pv_BNTH = _dot(exp_BNTS.astype(v_BNSH.dtype), v_BNSH, (3, 2), F32)
      return new_BNT, sum_BNT, acc_BNTH * fix_BNT[..., None] + pv_BNTH

    seen = jnp.any(mask_BTS[:, start:end])
    out.append(jax.lax.cond(seen, fold, lambda part: part, part))
  return tuple(out)


def _ring_fwd(
  q_BNTH, k_BNSH, v_BNSH, q_meta, k_meta, sinks_N, ops, mask_fn, scale, chunk, shards, expand
):
  # As attention_core's blocks (_tied): otherwise the layer scan's partial evaluation kept every
  # ring step's and query block's mask, made from the positions alone, broadcast over the heads.
  q_BNTH, (q_meta, k_meta) = _tied(q_BNTH, (q_meta, k_meta))
  bounds = _bounds(q_BNTH.shape[2], chunk)
  v_like = jax.eval_shape(lambda kv: expanded(kv, expand, ops)[1], (k_BNSH, v_BNSH, k_meta))
  parts = tuple(_start(q_BNTH[:, :, a:b], v_like, sinks_N) for a, b in bounds)

  def fold(parts, kv, _):
    return _fold(parts, bounds, q_BNTH, expanded(kv, expand, ops), q_meta, mask_fn, scale)

  parts = around(fold, parts, (k_BNSH, v_BNSH, k_meta), shards)
  max_BNT, sum_BNT, acc_BNTH = (jnp.concatenate(xs, axis=2) for xs in zip(*parts, strict=True))
  out_BNTH = (acc_BNTH / sum_BNT[..., None]).astype(v_like.dtype)
  lse_BNT = max_BNT + jnp.log(sum_BNT)
  return out_BNTH, (q_BNTH, k_BNSH, v_BNSH, q_meta, k_meta, sinks_N, ops, out_BNTH, lse_BNT)


def _block_grads(q_BNTH, g_BNTH, lse_BNT, delta_BNT, kv, q_meta, mask_fn, scale, bounds):
  """A visiting block's share of dq [B, N, T, H], and its keys' and values' gradients at their
  N_kv heads (float32): the scores recomputed from q and the kept log-sum-exp, query block by
  query block, a query block that sees none of the keys skipped; each block adds its terms to
  one pair of running sums."""
  groups = q_BNTH.shape[1] // kv[0].shape[1]
  k_BNSH, v_BNSH, k_meta = _heads(kv, groups)
  mask_BTS = mask_fn(q_meta, k_meta)
  b, n, s = *q_BNTH.shape[:2], k_BNSH.shape[2]
  zeros = lambda h: jnp.zeros((b, n, s, h), F32)  # noqa: E731
  dq, dkv = [], (zeros(k_BNSH.shape[3]), zeros(v_BNSH.shape[3]))
  for start, end in bounds:

    def block(dkv, start=start, end=end):
      q_part, g_part = q_BNTH[:, :, start:end], g_BNTH[:, :, start:end]
      s_BNTS = _dot(q_part, k_BNSH, (3, 3), F32)
      z_BNTS = masked_scores(s_BNTS, mask_BTS[:, start:end], scale)
      p_BNTS = jnp.exp(z_BNTS - lse_BNT[:, :, start:end, None])
      dp_BNTS = _dot(g_part, v_BNSH, (3, 3), F32)
      ds_BNTS = p_BNTS * (dp_BNTS - delta_BNT[:, :, start:end, None]) * scale
      ds_BNTS = jnp.where(mask_BTS[:, None, start:end], ds_BNTS, 0).astype(q_BNTH.dtype)
      dq_BNTH = _dot(ds_BNTS, k_BNSH, (3, 2), F32)
      dk_sum, dv_sum = dkv
      dk_sum = dk_sum + _dot(ds_BNTS, q_part, (2, 2), F32)
      dv_sum = dv_sum + _dot(p_BNTS.astype(v_BNSH.dtype), g_part, (2, 2), F32)
      return dq_BNTH, (dk_sum, dv_sum)

    empty = lambda dkv, start=start, end=end: (  # noqa: E731
      jnp.zeros((b, n, end - start, q_BNTH.shape[3]), F32),
      dkv,
    )
    # The running sums go through the cond: one pair of [B, N, S, H] buffers, not a block's
    # terms each (XLA kept every block's, all live at once, before summing them).
    dq_BNTH, dkv = jax.lax.cond(jnp.any(mask_BTS[:, start:end]), block, empty, dkv)
    dq.append(dq_BNTH)
  dk_BNSH, dv_BNSH = dkv
  per_kv = lambda x: x.reshape(b, n // groups, groups, *x.shape[2:]).sum(2)  # noqa: E731
  return jnp.concatenate(dq, axis=2), per_kv(dk_BNSH), per_kv(dv_BNSH)


def _ring_bwd(mask_fn, scale, chunk, shards, expand, res, g_BNTH):
  q_BNTH, k_BNSH, v_BNSH, q_meta, k_meta, sinks_N, ops, out_BNTH, lse_BNT = res
  g_BNTH = g_BNTH.astype(out_BNTH.dtype)
  delta_BNT = jnp.sum(g_BNTH.astype(F32) * out_BNTH.astype(F32), axis=-1)
  bounds = _bounds(q_BNTH.shape[2], chunk)

  def grads(kv, _):
    def block(k_BNSH, v_BNSH, k_meta):
      args = (q_BNTH, g_BNTH, lse_BNT, delta_BNT, (k_BNSH, v_BNSH, k_meta), q_meta, mask_fn)
      return _block_grads(*args, scale, bounds)

    return through_expand(block, kv, expand, ops)

  block = (k_BNSH, v_BNSH, k_meta)
  return cotangents(grads, q_BNTH, block, sinks_N, ops, lse_BNT, delta_BNT, shards)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _ring_attention(
  q_BNTH,
  k_BNSH,
  v_BNSH,
  q_meta,
  k_meta,
  sinks_N,
  ops,
  mask_fn,
  scale: float,
  chunk: int,
  shards: int,
  expand=None,
):
  """softmax(scale * q k^T, masked) v of one context shard's queries [B, N, T, H] over the row's
  keys, inside a shard_map manual over 'context': the shard's own keys and values [B, N_kv, S,
  H] (S = T) go around the ring of `shards` in shards - 1 ppermutes, and each visiting block
  folds into an online softmax (running max, sum and output, float32), by query blocks of
  `chunk`. mask_fn(q_meta, k_meta) -> [B, T, S] is a visiting block's mask: k_meta (its
  positions, segment ids, token indices) travels with the block. With sinks_N (gpt-oss) each
  head's softmax has one more logit, weighing no value.

  Memory: the forward holds the shard's queries, its own block and the visiting one (and the
  next in transfer); the backward keeps q, k, v, the output and each query's log-sum-exp
  (O(T) per shard, T = the row / shards), recomputes each visiting block's scores (flash
  attention's backward, whatever engine.attention_recompute says: nothing else is kept), and
  sends each block around again with its key and value gradients, which arrive at the owner
  after one more step.

  expand(k, v, ops) -> (keys, values) [B, N, S, H]: the blocks carry what makes the keys and
  values instead, each receiving shard expanding every visitor (MLA: the latent [B, S, K] and
  rope key [B, S, H_r] by kv_b's arrays `ops`, 576 numbers a LongCat-Flash token where its heads
  take 20,480). The backward expands each visitor again, turns its key and value gradients
  into its latent's through expand's VJP (they travel back with it) and sums `ops`'s on the
  shard (the caller's shard_map sums them over the axis)."""
  args = (q_BNTH, k_BNSH, v_BNSH, q_meta, k_meta, sinks_N, ops)
  return _ring_fwd(*args, mask_fn, scale, chunk, shards, expand)[0]


def _reference(
  q_BNTH, k_BNSH, v_BNSH, q_meta, k_meta, sinks_N, ops, mask_fn, scale, chunk, shards, expand=None
):
  """The same ring, differentiated by autodiff: the scan keeps every step's visiting block and
  scores, O(row) keys and values per shard, and transposes the ppermutes."""
  args = (q_BNTH, k_BNSH, v_BNSH, q_meta, k_meta, sinks_N, ops)
  return _ring_fwd(*args, mask_fn, scale, chunk, shards, expand)[0]


_ring_attention.defvjp(_ring_fwd, _ring_bwd)
ring_attention = Kernel('ring_attention', _ring_attention, _reference)

"""Ring attention on the splash kernel: ring.py's ring, each visiting block's scores computed in
JAX's Pallas TPU splash kernel instead of XLA's blocked products, so that they never reach HBM.

The kernel needs a static mask, and between two shards of a causal row there are only a few. In
the row's own order a shard's own block is causal, an earlier shard's all visible and a later
one's all hidden (skipped). Under the load balance's dual-chunk order (shard i holds chunks i
and 2C - 1 - i, each of h = T / 2 slots) the own block is causal too (its slots are in the row's
order), an earlier shard's first chunk is visible to all of the shard's queries and its second
chunk to none, and a later shard's block is visible whole to the shard's second chunk only:
every step after the first runs one whole-mask kernel over half the block, the same work on
every shard. With a sliding window of W <= h keys (gpt-oss's layers), a query sees its own chunk
and at most the chunk before it: the own block takes a windowed causal kernel per chunk, and a
visitor holding the chunk just before one of the shard's takes a band kernel over that pair of
chunks (the other visitors are skipped). A `lax.switch` picks each step's calls; packed rows'
segment ids travel with the blocks.

Forward: each call's output and log-sum-exp (the kernel's residuals) fold into a running pair.
Backward: the kernel's own backward pass, given the whole row's output and log-sum-exp instead
of the call's, gives exactly the call's share of dq, dk and dv (flash attention's backward reads
the softmax's normalisation only through those two). That pass is a private function of the
kernel's module (`_splash_attention_bwd`); tests/test_context.py checks it in Pallas'
interpreter against this module's reference."""

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import (
  splash_attention_kernel,
  splash_attention_mask,
)

from moetrain.core.hlo_cost import FULL_MASK_SCOPE
from moetrain.kernels import Kernel
from moetrain.kernels import splash as splash_lib
from moetrain.kernels.ring import around, cotangents, expanded, through_expand

F32 = jnp.float32
WHOLE = slice(None)


@functools.lru_cache(maxsize=16)
def _cases(heads: int, t: int, reordered: bool, window: int, interpret: bool) -> tuple:
  """Each step's kernel calls, (kernel with residuals, query slots, key slots, whether its mask
  is whole), for a shard's t queries and heads: _case's numbering, the whole rows' cases first,
  then (window > 0) the sliding window's."""
  mask, h = splash_attention_mask, t // 2
  b = splash_lib.block_size(h if reordered else t)

  def build(one):
    return splash_lib.build(mask.MultiHeadMask([one] * heads), b, interpret, residuals=True)

  first, second = slice(0, h), slice(h, None)
  causal = ((build(mask.CausalMask((t, t))), WHOLE, WHOLE, False),)
  if reordered:
    cases = [causal, ((build(mask.FullMask((t, h))), WHOLE, first, True),)]
    cases.append(((build(mask.FullMask((h, t))), second, WHOLE, True),))
  else:
    cases = [causal, ((build(mask.FullMask((t, t))), WHOLE, WHOLE, True),), ()]
  if not window:
    return tuple(cases)
  n = h if reordered else t
  local = build(mask.LocalMask((n, n), (window - 1, 0), 0))  # a chunk over itself
  band = build(mask.LocalMask((n, n), (window - 1, 0), n))  # a chunk over the one before it
  if not reordered:
    return (*cases, ((local, WHOLE, WHOLE, False),), ((band, WHOLE, WHOLE, False),), ())
  own = ((local, first, first, False), (local, second, second, False))
  pairs = ((first, first), (second, second), (second, first))
  bands = tuple(((band, qs, ks, False),) for qs, ks in pairs)
  return (*cases, own, (*own, (band, second, first, False)), *bands, ())


def _case(s, shards: int, reordered: bool, window: int, windowed):
  """Which of _cases' a block that left its shard s steps ago takes here. Whole rows: 0 the
  shard's own, 1 an earlier shard's, 2 a later one's. With a sliding window (windowed, the
  layer's flag), after those, in the row's own order: own, the shard just before, any other;
  under the dual-chunk order: own, own on the middle shard (its two chunks adjacent), then the
  shard holding the chunk before the first chunk, before the second, before the second from
  its first chunk, any other."""
  i = jax.lax.axis_index('context')
  k = (i - s) % shards
  whole = jnp.where(s == 0, 0, jnp.where(k < i, 1, 2))
  if not window:
    return whole
  if reordered:
    own = jnp.where(i == shards - 1, 4, 3)
    near = [k == i - 1, k == i + 1, k == 2 * shards - 2 - i]
    other = jnp.select(near, [5, 6, 7], 8)
  else:
    own, other = 3, jnp.where(k == i - 1, 4, 5)
  return jnp.where(windowed, jnp.where(s == 0, own, other), whole)


def _scope(full: bool):
  """A whole mask's calls under hlo_cost's FULL_MASK_SCOPE: the planner prices them whole (a
  causal one's blocks are half seen)."""
  return jax.named_scope(FULL_MASK_SCOPE) if full else contextlib.nullcontext()


def _forward(kernel, q_BNTH, k_BNSH, v_BNSH, q_seg_BT, k_seg_BS):
  """The kernel's output [B, N, T, H] and log-sum-exp [B, N, T] (float32), row by row."""

  def one(q_NTH, k_NSH, v_NSH, q_seg_T, k_seg_S):
    ids = splash_attention_kernel.SegmentIds(q=q_seg_T, kv=k_seg_S)
    out_NTH, (lse_NT,) = kernel(q_NTH, k_NSH, v_NSH, ids, None)
    return out_NTH, lse_NT

  return jax.vmap(one)(q_BNTH, k_BNSH, v_BNSH, q_seg_BT, k_seg_BS)


def _collapsed(info):
  """A mask info's partial blocks as one stack of blocks, as the kernel's own call passes them."""
  blocks = info.partial_mask_blocks
  return (
    info
    if blocks is None
    else info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))
  )


def _backward(kernel, q_BNTH, k_BNSH, v_BNSH, q_seg_BT, k_seg_BS, out_BNTH, lse_BNT, g_BNTH):
  """The kernel's backward pass row by row, with the given output and log-sum-exp as its
  residuals: (dq, dk, dv) in the operands' dtypes, k's and v's at their N_kv heads."""
  kw = kernel.kwargs
  infos = tuple(_collapsed(i) for i in (kernel.dq_mask_info, kernel.dkv_mask_info))
  statics = ('mask_value', 'is_mqa', 'block_sizes')
  tail = ('mask_function', 'attn_logits_soft_cap', 'interpret')

  def one(q_NTH, k_NSH, v_NSH, q_seg_T, k_seg_S, out_NTH, lse_NT, g_NTH):
    ids = splash_attention_kernel.SegmentIds(q=q_seg_T, kv=k_seg_S)
    res = (q_NTH, k_NSH, v_NSH, ids, None, out_NTH, lse_NT, *infos)
    grads = splash_attention_kernel._splash_attention_bwd(
      False, *(kw[k] for k in statics), None, *(kw[k] for k in tail), res, g_NTH
    )
    return grads[3:6]

  args = (q_BNTH, k_BNSH, v_BNSH, q_seg_BT, k_seg_BS, out_BNTH, lse_BNT, g_BNTH)
  return jax.vmap(one)(*args)


def _fold_in(state, call, q_BNTH, q_seg_BT, kv):
  """state (log-sum-exp [B, N, T], output [B, N, T, H], float32) with one call's (_cases')
  keys folded in. A query the call's mask gives no key (a band's later rows) adds nothing."""
  (kernel, qs, ks, full), (k_BNSH, v_BNSH, k_seg_BS) = call, kv
  lse_BNT, acc_BNTH = state
  args = (q_BNTH[:, :, qs], k_BNSH[:, :, ks], v_BNSH[:, :, ks], q_seg_BT[:, qs], k_seg_BS[:, ks])
  with _scope(full):
    out_BNTH, part_BNT = _forward(kernel, *args)
  new_BNT = jnp.logaddexp(lse_BNT[:, :, qs], part_BNT)
  old = jnp.exp(lse_BNT[:, :, qs] - new_BNT)[..., None] * acc_BNTH[:, :, qs]
  weight = jnp.exp(part_BNT - new_BNT)[..., None]
  acc = old + jnp.where(weight > 0, weight * out_BNTH.astype(F32), 0)  # (no key: 0 / 0 there)
  return lse_BNT.at[:, :, qs].set(new_BNT), acc_BNTH.at[:, :, qs].set(acc)


def _visitor(kv, expand, ops, dtype):
  """A visiting block's keys and values [B, N_kv, S, H] in the queries' dtype, and its
  segment ids."""
  k_BNSH, v_BNSH, k_seg_BS = expanded(kv, expand, ops)
  return k_BNSH.astype(dtype), v_BNSH.astype(dtype), k_seg_BS


def _ring_fwd(q_BNTH, k_BNSH, v_BNSH, seg_BT, windowed, sinks_N, ops, *statics):
  shards, reordered, window, expand, interpret = statics
  cases = _cases(q_BNTH.shape[1], q_BNTH.shape[2], reordered, window, interpret)
  b, n, t = q_BNTH.shape[:3]
  # A sink starts the log-sum-exp: one more weight in the softmax's denominator, and no value.
  sink = -jnp.inf if sinks_N is None else sinks_N.astype(F32)[None, :, None]
  v_like = jax.eval_shape(lambda kv: expanded(kv, expand, ops)[1], (k_BNSH, v_BNSH, seg_BT))
  state = (
    jnp.broadcast_to(sink, (b, n, t)).astype(F32),
    jnp.zeros((b, n, t, v_like.shape[3]), F32),
  )

  def fold(state, kv, s):
    kv = _visitor(kv, expand, ops, q_BNTH.dtype)

    def run(calls, state):
      for call in calls:
        state = _fold_in(state, call, q_BNTH, seg_BT, kv)
      return state

    branches = [functools.partial(run, calls) for calls in cases]
    return jax.lax.switch(_case(s, shards, reordered, window, windowed), branches, state)

  lse_BNT, acc_BNTH = around(fold, state, (k_BNSH, v_BNSH, seg_BT), shards)
  out_BNTH = acc_BNTH.astype(v_like.dtype)
  return out_BNTH, (q_BNTH, k_BNSH, v_BNSH, seg_BT, windowed, sinks_N, ops, out_BNTH, lse_BNT)


def _grads_of(calls, q_BNTH, seg_BT, out_BNTH, lse_BNT, g_BNTH, kv):
  """A visitor's (dq part, dk, dv), float32 and whole-shaped, summed over its calls."""
  k_BNSH, v_BNSH, k_seg_BS = kv
  dq_all, dk_all, dv_all = (jnp.zeros(x.shape, F32) for x in (q_BNTH, k_BNSH, v_BNSH))
  for kernel, qs, ks, full in calls:
    at_q = (q_BNTH[:, :, qs], k_BNSH[:, :, ks], v_BNSH[:, :, ks], seg_BT[:, qs], k_seg_BS[:, ks])
    rest = (out_BNTH[:, :, qs], lse_BNT[:, :, qs], g_BNTH[:, :, qs])
    with _scope(full):
      dq, dk, dv = _backward(kernel, *at_q, *rest)
    dq_all = dq_all.at[:, :, qs].add(dq.astype(F32))
    dk_all, dv_all = (
      dk_all.at[:, :, ks].add(dk.astype(F32)),
      dv_all.at[:, :, ks].add(dv.astype(F32)),
    )
  return dq_all, dk_all, dv_all


def _ring_bwd(shards, reordered, window, expand, interpret, res, g_BNTH):
  q_BNTH, k_BNSH, v_BNSH, seg_BT, windowed, sinks_N, ops, out_BNTH, lse_BNT = res
  cases = _cases(q_BNTH.shape[1], q_BNTH.shape[2], reordered, window, interpret)
  g_BNTH = g_BNTH.astype(out_BNTH.dtype)

  def grads(kv, s):
    def block(k_BNSH, v_BNSH, k_seg_BS):
      kv = (k_BNSH.astype(q_BNTH.dtype), v_BNSH.astype(q_BNTH.dtype), k_seg_BS)
      rest = (q_BNTH, seg_BT, out_BNTH, lse_BNT, g_BNTH, kv)
      branches = [functools.partial(_grads_of, calls, *rest) for calls in cases]
      return jax.lax.switch(_case(s, shards, reordered, window, windowed), branches)

    return through_expand(block, kv, expand, ops)

  delta_BNT = jnp.sum(g_BNTH.astype(F32) * out_BNTH.astype(F32), axis=-1)
  block = (k_BNSH, v_BNSH, seg_BT)
  return cotangents(grads, q_BNTH, block, sinks_N, ops, lse_BNT, delta_BNT, shards)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _ring_splash(
  q_BNTH,
  k_BNSH,
  v_BNSH,
  seg_BT,
  windowed,
  sinks_N,
  ops,
  shards: int,
  reordered: bool,
  window: int,
  expand=None,
  interpret: bool = False,
):
  """softmax(q k^T, causal, each segment alone) v of one context shard's queries [B, N, T, H]
  (already scaled: the kernel applies no scale) over the row's keys, inside a shard_map manual
  over 'context' (and, a Pallas call being opaque to XLA's partitioner, every other axis): the
  shard's own keys and values [B, N_kv, T, H] and segment ids go around the ring of `shards`.
  reordered: the shards hold the dual-chunk order's slots (else the row's own order); window:
  a sliding window's keys (0: none), applied where windowed (a bool array: a layer scan's
  per-layer flag) is true, at most T / 2 (reordered) or T; sinks_N (gpt-oss): one more logit a
  head, weighing no value; expand, ops: ring.py's (MLA's latent travels, each receiving shard
  expands it). T / 2 (reordered) or T a multiple of 128.

  Memory: as ring.py's ring, less the scores: the backward keeps q, k, v, the output and the
  log-sum-exp, and the kernel recomputes each visitor's scores block by block in VMEM."""
  args = (q_BNTH, k_BNSH, v_BNSH, seg_BT, windowed, sinks_N, ops)
  return _ring_fwd(*args, shards, reordered, window, expand, interpret)[0]


def _slots(t: int, shards: int, reordered: bool):
  """The row's token index of each of this shard's t slots (the dual-chunk order's, or the
  row's own)."""
  i = jax.lax.axis_index('context')
  if not reordered:
    return i * t + jnp.arange(t)
  h = t // 2
  return jnp.concatenate([i * h + jnp.arange(h), (2 * shards - 1 - i) * h + jnp.arange(h)])


def _reference(q_BNTH, k_BNSH, v_BNSH, seg_BT, windowed, sinks_N, ops, *statics):
  """The same attention by autodiff: every shard's keys, values and segment ids all-gathered
  over 'context', then softmax attention over the whole row with its causal, segment and
  window mask."""
  shards, reordered, window, expand, _ = statics
  k_BNSH, v_BNSH, _ = _visitor((k_BNSH, v_BNSH, seg_BT), expand, ops, q_BNTH.dtype)
  gather = lambda x, axis: jax.lax.all_gather(x, 'context', axis=axis, tiled=True)  # noqa: E731
  groups = q_BNTH.shape[1] // k_BNSH.shape[1]
  k_BNSH, v_BNSH = (jnp.repeat(gather(x, 2), groups, 1) for x in (k_BNSH, v_BNSH))
  t = q_BNTH.shape[2]
  q_index, k_index = _slots(t, shards, reordered), gather(_slots(t, shards, reordered), 0)
  back_TS = q_index[:, None] - k_index[None]  # how many tokens back each key is
  seen_TS = (back_TS >= 0) & ((back_TS < window) | ~(windowed & (window > 0)))
  mask_BTS = (seg_BT[:, :, None] == gather(seg_BT, 1)[:, None]) & seen_TS[None]
  z_BNTS = jnp.einsum('bnth,bnsh->bnts', q_BNTH.astype(F32), k_BNSH.astype(F32))
  z_BNTS = jnp.where(mask_BTS[:, None], z_BNTS, -jnp.inf)
  if sinks_N is not None:
    sink_BNT1 = jnp.broadcast_to(sinks_N.astype(F32)[None, :, None, None], (*z_BNTS.shape[:3], 1))
    z_BNTS = jnp.concatenate([z_BNTS, sink_BNT1], axis=-1)
  p_BNTS = jax.nn.softmax(z_BNTS, axis=-1)[..., : k_BNSH.shape[2]]
  out_BNTH = jnp.einsum('bnts,bnsh->bnth', p_BNTS, v_BNSH.astype(F32))
  return out_BNTH.astype(v_BNSH.dtype)


_ring_splash.defvjp(_ring_fwd, _ring_bwd)
ring_splash_attention = Kernel('ring_splash_attention', _ring_splash, _reference)

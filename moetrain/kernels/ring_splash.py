"""Ring attention on the splash kernel: ring.py's ring, each visiting block's scores computed in
JAX's Pallas TPU splash kernel instead of XLA's blocked products, so that they never reach HBM.

The kernel needs a static mask, and a causal row split over C shards has three between two
shards: a shard's own block (causal in its slots' order, which is the row's), a block from an
earlier shard and one from a later shard. In the row's own order an earlier shard's block is
all visible and a later one's all hidden (skipped). Under the load balance's dual-chunk order
(shard i holds chunks i and 2C - 1 - i) an earlier shard's first chunk is visible to all of the
shard's queries and its second chunk to none, and a later shard's block is visible whole to the
shard's second chunk only: every step after the first runs one full-mask kernel over half the
block, the same work on every shard. Packed rows' segment ids travel with the blocks.

Forward: each visitor's output and log-sum-exp (the kernel's residuals) fold into a running
pair. Backward: the kernel's own backward pass, given the whole row's output and log-sum-exp
instead of the visitor's, gives exactly the visitor's share of dq, dk and dv (flash attention's
backward reads the softmax's normalisation only through those two). That pass is a private
function of the kernel's module (`_splash_attention_bwd`); tests/test_context.py checks it in
Pallas' interpreter against this module's reference."""

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
from moetrain.kernels.ring import _expanded, around, around_back, sink_grads, through_expand

F32 = jnp.float32
WHOLE = slice(None)


@functools.lru_cache(maxsize=16)
def _kernels(heads: int, t: int, reordered: bool, interpret: bool):
  """((own, earlier, later) kernels with residuals, their spans: (query slots, key slots,
  whether the mask is whole)) for a shard's t queries and heads; later is None where nothing
  of a later shard is seen."""
  mask, h = splash_attention_mask, t // 2
  b = splash_lib.block_size(h if reordered else t)

  def build(one):
    return splash_lib._build(mask.MultiHeadMask([one] * heads), b, interpret, residuals=True)

  own = build(mask.CausalMask((t, t)))
  if not reordered:
    spans = ((WHOLE, WHOLE, False), (WHOLE, WHOLE, True), None)
    return (own, build(mask.FullMask((t, t))), None), spans
  earlier, later = build(mask.FullMask((t, h))), build(mask.FullMask((h, t)))
  spans = ((WHOLE, WHOLE, False), (WHOLE, slice(0, h), True), (slice(h, None), WHOLE, True))
  return (own, earlier, later), spans


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


def _case(s, shards: int):
  """Which of _kernels' three a block that left its shard s steps ago takes here: 0 its own,
  1 from an earlier shard, 2 from a later one."""
  i = jax.lax.axis_index('context')
  owner = (i - s) % shards
  return jnp.where(s == 0, 0, jnp.where(owner < i, 1, 2))


def _fold_in(state, kernel, span, q_BNTH, q_seg_BT, kv):
  """state (log-sum-exp [B, N, T], output [B, N, T, H], float32) with a visitor's keys over
  span (query slots, key slots) folded in."""
  (qs, ks, full), (k_BNSH, v_BNSH, k_seg_BS) = span, kv
  lse_BNT, acc_BNTH = state
  args = (q_BNTH[:, :, qs], k_BNSH[:, :, ks], v_BNSH[:, :, ks], q_seg_BT[:, qs], k_seg_BS[:, ks])
  with _scope(full):
    out_BNTH, part_BNT = _forward(kernel, *args)
  new_BNT = jnp.logaddexp(lse_BNT[:, :, qs], part_BNT)
  old = jnp.exp(lse_BNT[:, :, qs] - new_BNT)[..., None] * acc_BNTH[:, :, qs]
  acc = old + jnp.exp(part_BNT - new_BNT)[..., None] * out_BNTH.astype(F32)
  return lse_BNT.at[:, :, qs].set(new_BNT), acc_BNTH.at[:, :, qs].set(acc)


def _visitor(kv, expand, ops, dtype):
  """A visiting block's keys and values [B, N_kv, S, H] in the queries' dtype, and its
  segment ids."""
  k_BNSH, v_BNSH, k_seg_BS = _expanded(kv, expand, ops)
  return k_BNSH.astype(dtype), v_BNSH.astype(dtype), k_seg_BS


def _ring_fwd(q_BNTH, k_BNSH, v_BNSH, seg_BT, sinks_N, ops, shards, reordered, expand, interpret):
  kernels, spans = _kernels(q_BNTH.shape[1], q_BNTH.shape[2], reordered, interpret)
  b, n, t = q_BNTH.shape[:3]
  # A sink starts the log-sum-exp: one more weight in the softmax's denominator, and no value.
  sink = -jnp.inf if sinks_N is None else sinks_N.astype(F32)[None, :, None]
  v_like = jax.eval_shape(lambda kv: _expanded(kv, expand, ops)[1], (k_BNSH, v_BNSH, seg_BT))
  state = (
    jnp.broadcast_to(sink, (b, n, t)).astype(F32),
    jnp.zeros((b, n, t, v_like.shape[3]), F32),
  )

  def fold(state, kv, s):
    kv = _visitor(kv, expand, ops, q_BNTH.dtype)
    branches = [
      functools.partial(_fold_in, kernel=kernel, span=span, q_BNTH=q_BNTH, q_seg_BT=seg_BT, kv=kv)
      if kernel is not None
      else lambda state: state
      for kernel, span in zip(kernels, spans, strict=True)
    ]
    return jax.lax.switch(_case(s, shards), branches, state)

  lse_BNT, acc_BNTH = around(fold, state, (k_BNSH, v_BNSH, seg_BT), shards)
  out_BNTH = acc_BNTH.astype(v_like.dtype)
  return out_BNTH, (q_BNTH, k_BNSH, v_BNSH, seg_BT, sinks_N, ops, out_BNTH, lse_BNT)


def _grads_of(kernel, span, q_BNTH, seg_BT, out_BNTH, lse_BNT, g_BNTH, kv):
  """A visitor's (dq part, dk, dv), float32 and whole-shaped, from its keys over span."""
  (qs, ks, full), (k_BNSH, v_BNSH, k_seg_BS) = span, kv
  at_q = (q_BNTH[:, :, qs], k_BNSH[:, :, ks], v_BNSH[:, :, ks], seg_BT[:, qs], k_seg_BS[:, ks])
  rest = (out_BNTH[:, :, qs], lse_BNT[:, :, qs], g_BNTH[:, :, qs])
  with _scope(full):
    dq, dk, dv = _backward(kernel, *at_q, *rest)
  put = lambda like, at, x: jnp.zeros(like.shape, F32).at[at].set(x.astype(F32))  # noqa: E731
  both = (WHOLE, WHOLE)
  return put(q_BNTH, (*both, qs), dq), put(k_BNSH, (*both, ks), dk), put(v_BNSH, (*both, ks), dv)


def _ring_bwd(shards, reordered, expand, interpret, res, g_BNTH):
  q_BNTH, k_BNSH, v_BNSH, seg_BT, sinks_N, ops, out_BNTH, lse_BNT = res
  kernels, spans = _kernels(q_BNTH.shape[1], q_BNTH.shape[2], reordered, interpret)
  g_BNTH = g_BNTH.astype(out_BNTH.dtype)
  zeros32 = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, F32), t)  # noqa: E731

  def grads(kv, s):
    def block(k_BNSH, v_BNSH, k_seg_BS):
      kv = (k_BNSH.astype(q_BNTH.dtype), v_BNSH.astype(q_BNTH.dtype), k_seg_BS)
      rest = (q_BNTH, seg_BT, out_BNTH, lse_BNT, g_BNTH, kv)
      branches = [
        functools.partial(_grads_of, kernel, span, *rest)
        if kernel is not None
        else lambda: zeros32((q_BNTH, k_BNSH, v_BNSH))
        for kernel, span in zip(kernels, spans, strict=True)
      ]
      return jax.lax.switch(_case(s, shards), branches)

    return through_expand(block, kv, expand, ops)

  dq_BNTH, (dk_BNSH, dv_BNSH), dops = around_back(
    grads, q_BNTH.shape, (k_BNSH, v_BNSH, seg_BT), zeros32(ops), shards
  )
  delta_BNT = jnp.sum(g_BNTH.astype(F32) * out_BNTH.astype(F32), axis=-1)
  return (
    dq_BNTH.astype(q_BNTH.dtype),
    dk_BNSH.astype(k_BNSH.dtype),
    dv_BNSH.astype(v_BNSH.dtype),
    None,
    sink_grads(sinks_N, lse_BNT, delta_BNT),
    jax.tree.map(lambda d, x: d.astype(x.dtype), dops, ops),
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _ring_splash(
  q_BNTH, k_BNSH, v_BNSH, seg_BT, sinks_N, ops, shards: int, reordered: bool, expand, interpret
):
  """softmax(q k^T, causal, each segment alone) v of one context shard's queries [B, N, T, H]
  (already scaled: the kernel applies no scale) over the row's keys, inside a shard_map manual
  over 'context' (and, a Pallas call being opaque to XLA's partitioner, every other axis): the
  shard's own keys and values [B, N_kv, T, H] and segment ids go around the ring of `shards`.
  reordered: the shards hold the dual-chunk order's slots (else the row's own order); sinks_N
  (gpt-oss): one more logit a head, weighing no value; expand, ops: ring.py's (MLA's latent
  travels, each receiving shard expands it). T / 2 (reordered) or T a multiple of 128.

  Memory: as ring.py's ring, less the scores: the backward keeps q, k, v, the output and the
  log-sum-exp, and the kernel recomputes each visitor's scores block by block in VMEM."""
  args = (q_BNTH, k_BNSH, v_BNSH, seg_BT, sinks_N, ops)
  return _ring_fwd(*args, shards, reordered, expand, interpret)[0]


def _slots(t: int, shards: int, reordered: bool):
  """The row's token index of each of this shard's t slots (the dual-chunk order's, or the
  row's own)."""
  i = jax.lax.axis_index('context')
  if not reordered:
    return i * t + jnp.arange(t)
  h = t // 2
  return jnp.concatenate([i * h + jnp.arange(h), (2 * shards - 1 - i) * h + jnp.arange(h)])


def _reference(q_BNTH, k_BNSH, v_BNSH, seg_BT, sinks_N, ops, shards, reordered, expand, interpret):
  """The same attention by autodiff: every shard's keys, values and segment ids all-gathered
  over 'context', then softmax attention over the whole row with its causal and segment
  mask."""
  del interpret
  k_BNSH, v_BNSH, _ = _visitor((k_BNSH, v_BNSH, seg_BT), expand, ops, q_BNTH.dtype)
  gather = lambda x, axis: jax.lax.all_gather(x, 'context', axis=axis, tiled=True)  # noqa: E731
  groups = q_BNTH.shape[1] // k_BNSH.shape[1]
  k_BNSH, v_BNSH = (jnp.repeat(gather(x, 2), groups, 1) for x in (k_BNSH, v_BNSH))
  t = q_BNTH.shape[2]
  q_index, k_index = _slots(t, shards, reordered), gather(_slots(t, shards, reordered), 0)
  mask_BTS = (seg_BT[:, :, None] == gather(seg_BT, 1)[:, None]) & (
    k_index[None, None] <= q_index[None, :, None]
  )
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

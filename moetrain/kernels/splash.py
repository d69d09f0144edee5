"""Causal self-attention of packed rows on JAX's Pallas TPU splash kernel, sharded by hand.

The kernel (jax.experimental.pallas.ops.tpu.splash_attention) runs one sequence: queries
[N, T, H_qk], keys [N_kv, T, H_qk], values [N_kv, T, H_v], with a static causal block mask (blocks
above the diagonal are never loaded) and segment ids (a packed row's examples see only
themselves). Its backward pass recomputes each block's scores from the saved log-sum-exp, so
what it keeps is O(T) per head, like attention_core's recompute mode, and the [T, S] scores never
reach HBM: on TPU that is most of the chunked XLA attention's traffic (bench/RESULTS.md,
"Peer comparison").

GQA passes N_kv key/value heads as they are (the kernel maps query head n to kv head
n // (N / N_kv)); MLA's query/key width 192 and value width 128 differ, which the kernel allows.
A Pallas call is opaque to XLA's sharding propagation, so it runs in a shard_map: rows over the
batch axes, heads over 'tensor' where the rules shard heads, each device on its own rows.

A row split over the 'context' mesh axis (docs/context.md) runs split_attention: each shard's
queries over the row's gathered keys, with the whole row's block tables split over the shards
(split_kernel), inside the model's shard_map over every mesh axis."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import (
  splash_attention_kernel,
  splash_attention_mask,
)
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info
from jax.sharding import PartitionSpec as P

from moetrain.core.sharding import BATCH_AXES, MESH_AXES, full_shape


def _modules():
  """(kernel, mask) modules, imported on first use: they load Pallas' TPU support."""

  return splash_attention_kernel, splash_attention_mask


def block_size(t: int) -> int:
  """The query/key block: the largest of 512/256/128 dividing T (MaxText's default is 512)."""
  return next(b for b in (512, 256, 128) if t % b == 0)


def supports(t: int) -> bool:
  """Whether a sequence of T positions fits the kernel's blocks (T a multiple of 128)."""
  return t >= 128 and t % 128 == 0


@functools.lru_cache(maxsize=32)
def _kernel(heads: int, t: int, interpret: bool, window: int = 0):
  """The splash kernel for `heads` query heads over a causal T x T mask (with window > 0: each
  query sees its last `window` positions, itself included, and the blocks wholly outside that
  band are never loaded either), built as make_splash_mha builds it but with its block tables
  left as NumPy arrays: they become constants of the program. (make_splash_mha makes them jax
  Arrays, which fails while tracing for an abstract TPU mesh, and which jax 0.12 would pass to
  the step as extra arguments.)"""
  _, mask = _modules()
  one = mask.LocalMask((t, t), (window - 1, 0), 0) if window else mask.CausalMask((t, t))
  return build(mask.MultiHeadMask([one for _ in range(heads)]), block_size(t), interpret)


@functools.lru_cache(maxsize=32)
def _split_kernel(heads: int, t: int, shards: int, order, interpret: bool, window: int = 0):
  """_kernel's T x T mask with its queries split in `shards` along the row (a context split):
  each shard's block tables are its own slice, passed into the shard_map sharded over
  'context' (manual_sharding_spec). order: the token index of each of the row's slots (the load
  balance's dual-chunk order; None: the row's own order), as the mask's query sequence, so the
  static tables skip exactly the blocks a shard's reordered queries do not see; the keys come
  in the row's own order."""
  _, mask = _modules()
  one = mask.LocalMask((t, t), (window - 1, 0), 0) if window else mask.CausalMask((t, t))
  if order is not None:
    one.q_sequence = np.asarray(order, np.int32)
  causal = mask.MultiHeadMask([one for _ in range(heads)])
  return build(causal, block_size(t // (2 * shards)), interpret, shards)


def build(heads_mask, b: int, interpret: bool, q_shards: int = 1, residuals: bool = False):
  """The splash kernel over a multi-head static mask, in blocks of b queries and keys;
  residuals: it also returns each query's log-sum-exp (not differentiable then)."""
  kernel, _ = _modules()
  shards = dict(downcast_smem_data=True, head_shards=1, q_seq_shards=q_shards)
  # dq's blocks are the forward's (the same sizes), so it shares the forward's tables.
  fwd, mask_fn = info.process_mask(heads_mask, (b, b), **shards)
  dkv, _ = info.process_mask_dkv(heads_mask, (b, b), shrink_grid=True, **shards)
  sizes = kernel.BlockSizes(
    block_q=b,
    block_kv=b,
    block_kv_compute=b,
    block_q_dkv=b,
    block_kv_dkv=b,
    block_kv_dkv_compute=b,
    block_q_dq=b,
    block_kv_dq=b,
  )
  return kernel.SplashAttentionKernel(
    fwd,
    fwd,
    dkv,
    block_sizes=sizes,
    is_mqa=False,
    save_residuals=residuals,
    mask_value=kernel.DEFAULT_MASK_VALUE,
    attn_logits_soft_cap=None,
    residual_checkpoint_name=None,
    mask_function=mask_fn,
    interpret=interpret,
  )


def _rows(kernel, q_BNTH, k_BNSH, v_BNSH, q_seg_BT, k_seg_BS, sinks_N):
  """`kernel` over each row of the batch, its queries' and keys' segment ids apart."""
  kernel_mod, _ = _modules()

  def one(q_NTH, k_NSH, v_NSH, q_seg_T, k_seg_S):
    ids = kernel_mod.SegmentIds(q=q_seg_T, kv=k_seg_S)
    return kernel(q_NTH, k_NSH, v_NSH, ids, sinks_N)

  segs = (q_seg_BT.astype(jnp.int32), k_seg_BS.astype(jnp.int32))
  return jax.vmap(one)(q_BNTH, k_BNSH, v_BNSH, *segs)


def scaled(q_BNTH, scale: float, sinks_N):
  """(q times the softmax's scale, which the kernel does not apply; the sinks in float32)."""
  q_BNTH = (q_BNTH.astype(jnp.float32) * scale).astype(q_BNTH.dtype)
  return q_BNTH, None if sinks_N is None else sinks_N.astype(jnp.float32)


def _local(q_BNTH, k_BNTH, v_BNTH, seg_BT, sinks_N, *, interpret: bool, window: int):
  run = _kernel(q_BNTH.shape[1], q_BNTH.shape[2], interpret, window)
  return _rows(run, q_BNTH, k_BNTH, v_BNTH, seg_BT, seg_BT, sinks_N)


def splash_attention(
  q_BNTH,
  k_BNTH,
  v_BNTH,
  segment_ids_BT,
  scale: float,
  *,
  interpret: bool,
  mesh_shape=(),
  head_axis=None,
  window: int = 0,
  sinks_N=None,
):
  """softmax(scale * q k^T) v over keys at or before each query in its own segment (segment 0,
  padding, attends among itself as the XLA path's self_mask does), within its last `window`
  positions when window > 0, and with sinks_N [N] (gpt-oss) one more logit per head whose weight
  goes to no value, as attention_core's. k/v carry N_kv heads.
  interpret: run the kernel in Pallas' interpreter (any platform; what the CPU tests check);
  mesh_shape: the sizes of MESH_AXES of the mesh in context (jax.set_mesh; () = no mesh), over
  which the kernel runs in a shard_map; head_axis: the mesh axis
  the rules shard heads over, or None."""
  # The kernel takes unscaled scores; q scaled first is the same product. Scaled here, outside
  # the shard_map, XLA fuses it into q's producer; inside, it was one more copy of q.
  q_BNTH, sinks_N = scaled(q_BNTH, scale, sinks_N)
  local = functools.partial(_local, interpret=interpret, window=window)
  if not mesh_shape:
    return local(q_BNTH, k_BNTH, v_BNTH, segment_ids_BT, sinks_N)
  sizes = dict(zip(MESH_AXES, full_shape(mesh_shape)))
  batch = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1) or None
  heads = head_axis if head_axis and sizes.get(head_axis, 1) > 1 else None
  qkv = P(batch, heads, None, None)
  specs = (qkv, qkv, qkv, P(batch, None), None if sinks_N is None else P(heads))
  return jax.shard_map(local, in_specs=specs, out_specs=qkv, check_vma=False)(
    q_BNTH, k_BNTH, v_BNTH, segment_ids_BT, sinks_N
  )


def context_supported(t: int, shards: int) -> bool:
  """Whether a row of T tokens split over `shards` context shards fits the kernel's blocks: each
  shard's T / shards queries, and under the dual-chunk order each of its two chunks, a multiple
  of 128."""
  return t % (2 * shards * 128) == 0


def split_attention(
  q_BNTH, k_BNSH, v_BNSH, q_seg_BT, k_seg_BS, scale: float, *, kernel, sinks_N=None
):
  """splash_attention of one context shard's T queries over the row's S keys and values (row
  order), inside the shard_map over 'context' whose `kernel` argument is split_kernel's, its
  block tables sharded over 'context'. Causal in the row's index order, each segment alone."""
  q_BNTH, sinks_N = scaled(q_BNTH, scale, sinks_N)
  return _rows(kernel, q_BNTH, k_BNSH, v_BNSH, q_seg_BT, k_seg_BS, sinks_N)


def split_kernel(heads: int, t: int, order, *, interpret: bool, mesh_shape, window: int = 0):
  """(the kernel for split_attention, its shard_map spec): _split_kernel's for the context axis
  of mesh_shape (the sizes of MESH_AXES), its block tables and query sequence split over it."""
  sizes = full_shape(mesh_shape)
  shards = dict(zip(MESH_AXES, sizes))['context']
  kernel = _split_kernel(heads, t, shards, order, interpret, window)
  mesh = jax.sharding.AbstractMesh(tuple(sizes), MESH_AXES)
  spec = kernel.manual_sharding_spec(jax.sharding.NamedSharding(mesh, P(None, 'context')))
  return kernel, spec

"""Attention: multi-head latent attention (MLA; DeepSeek-V2/V3, LongCat-Flash) and grouped-query
attention (GQA; Qwen3-MoE, Mixtral), over one blocked causal core."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from moetrain.core import axes
from moetrain.core.sharding import BATCH_AXES, MESH_AXES, constrain, full_shape
from moetrain.kernels import splash
from moetrain.kernels.attention import attention_core, masked_scores, uniform
from moetrain.kernels.ring import ring_attention
from moetrain.kernels.ring_splash import ring_splash_attention
from moetrain.model.config import ModelConfig
from moetrain.model.indexer import Indexer, index_scores, kl_loss, top_k_mask
from moetrain.model.layers import Linear, RMSNorm, by_blocks, rope


def attention_mask(q_pos_BT, q_seg_BT, k_pos_BS, k_seg_BS):
  """Causal within a packed segment: key position <= query position and same segment id."""
  causal = k_pos_BS[:, None, :] <= q_pos_BT[:, :, None]
  same = q_seg_BT[:, :, None] == k_seg_BS[:, None, :]
  return causal & same  # [B, T, S]


def attention_probs(s_BNTS, mask_BTS, scale: float):
  """Scaled, masked softmax over keys, in float32."""
  return jax.nn.softmax(masked_scores(s_BNTS, mask_BTS, scale), axis=-1)


def head_mean_probs(q_BTNH, k_BSNH, mask_BTS, scale: float, chunk: int = 0):
  """Each query's attention weights summed over heads and L1-normalised (their mean over heads):
  [B, T, S] float32, without gradient, by blocks of `chunk` queries (0: one block) so that the
  heads' [B, N, T, S] weights never exist whole (the indexer's KL target, indexer.kl_loss)."""
  k_BSNH = jax.lax.stop_gradient(k_BSNH)

  def block(q_BTNH, mask_BTS):
    s_BNTS = jnp.einsum('BTNH,BSNH->BNTS', q_BTNH, k_BSNH, preferred_element_type=jnp.float32)
    return jnp.mean(attention_probs(s_BNTS, mask_BTS, scale), axis=1)

  return by_blocks(block, (jax.lax.stop_gradient(q_BTNH), mask_BTS), chunk)


def window_mask(mask_BTS, q_pos_BT, k_pos_BS, window):
  """mask where each query also sees only the keys of its last `window` positions (0: all;
  window may be traced: a layer's, under the layer scan)."""
  if isinstance(window, int) and not window:
    return mask_BTS
  inside = k_pos_BS[:, None, :] > q_pos_BT[:, :, None] - window
  return mask_BTS & (inside | (window <= 0))


def self_mask(positions_BT, segment_ids_BT, window: int = 0):
  """attention_mask of a sequence over itself, causal in index order too: that changes nothing
  within a segment (positions increase there) and makes padding (segment 0, repeated positions)
  independent of attention_chunk; within the last `window` positions when window > 0."""
  mask = attention_mask(positions_BT, segment_ids_BT, positions_BT, segment_ids_BT)
  t = positions_BT.shape[1]
  mask = mask & jnp.tril(jnp.ones((1, t, t), jnp.bool_))
  return window_mask(mask, positions_BT, positions_BT, window)


def multi_head(
  q_BTNH, k_BSNH, v_BSNH, mask_BTS, cfg: ModelConfig, causal_chunk: int = 0, sinks_N=None
):
  """Softmax attention of T queries over S keys, per head; out [B, T, N, H]. With
  causal_chunk > 0 (self-attention, T == S, positions increasing within each segment) the
  queries go in blocks of that size and block i scores only keys [0, end of block i): later
  keys are masked anyway, so the result is the same while the upper triangle of the T x T
  square is skipped block by block."""
  q_BNTH, k_BNSH, v_BNSH = (x.transpose(0, 2, 1, 3) for x in (q_BTNH, k_BSNH, v_BSNH))
  t, s = q_BNTH.shape[2], k_BNSH.shape[2]
  step = causal_chunk if 0 < causal_chunk < t else t
  blocks = tuple(
    (i, min(i + step, t), min(i + step, t) if causal_chunk else s) for i in range(0, t, step)
  )
  out_BNTH = attention_core(
    q_BNTH,
    k_BNSH,
    v_BNSH,
    mask_BTS,
    cfg.attention_scale,
    blocks,
    cfg.engine.attention_recompute,
    sinks_N,
    reference=cfg.engine.reference_kernels,
  )
  return constrain(out_BNTH.transpose(0, 2, 1, 3), axes.names('BTN') + (None,), cfg.engine.rules)


def causal_self_attention(
  q_BTNH, k_BTNH, v_BTNH, positions_BT, segment_ids_BT, cfg: ModelConfig, window=0, sinks_N=None
):
  """Attention of a packed row over itself (k/v with N_kv heads dividing N): the splash kernel
  where cfg.splash_attention says so, else self_mask and the chunked XLA path. Both are causal in
  index order within each segment (packing restarts positions per example, so that is causal
  by position too), a sliding window and sinks (gpt-oss) included. With the row split over the
  'context' mesh axis: context_self_attention (the XLA path, on TPU too)."""
  if context_split(cfg, q_BTNH.shape[1]):
    return context_self_attention(
      q_BTNH, k_BTNH, v_BTNH, positions_BT, segment_ids_BT, cfg, window, sinks_N
    )
  if cfg.splash_attention(q_BTNH.shape[1]):
    heads = dict(cfg.engine.rules.activations).get('heads')

    def run(w: int):
      return splash.splash_attention(
        *(x.transpose(0, 2, 1, 3) for x in (q_BTNH, k_BTNH, v_BTNH)),
        segment_ids_BT,
        cfg.attention_scale,
        interpret=cfg.engine.platform != 'tpu',
        mesh_shape=cfg.engine.mesh_shape,
        head_axis=heads if isinstance(heads, str) else None,
        window=w,
        sinks_N=sinks_N,
      )

    if isinstance(window, int) or not cfg.sliding_window:
      out_BNTH = run(window if isinstance(window, int) else 0)
    else:  # a layer's window under the layer scan: the kernel's mask is static, so one of two
      out_BNTH = jax.lax.cond(window > 0, lambda: run(cfg.sliding_window), lambda: run(0))
    return constrain(out_BNTH.transpose(0, 2, 1, 3), axes.names('BTN') + (None,), cfg.engine.rules)
  groups = cfg.num_heads // k_BTNH.shape[2]
  k_BTNH, v_BTNH = (jnp.repeat(x, groups, axis=2) for x in (k_BTNH, v_BTNH))
  mask = self_mask(positions_BT, segment_ids_BT, window)
  return multi_head(q_BTNH, k_BTNH, v_BTNH, mask, cfg, cfg.engine.attention_chunk, sinks_N)


def context_split(cfg: ModelConfig, t: int) -> bool:
  """Whether a row of t tokens runs split over the 'context' mesh axis (docs/context.md; the
  engine laid out for a mesh with one, whose context the step runs in): a decode step's single
  token, or a length the axis does not divide, stays whole."""
  c = cfg.engine.context_shards
  return c > 1 and t % c == 0


def context_reordered(cfg: ModelConfig, t: int) -> bool:
  """Whether the step's input rows of t tokens are in dual-chunk order (engine.context_reorder,
  a context split into 2C chunks; not for Gated DeltaNet layers, which read tokens in order)."""
  c = cfg.engine.context_shards
  linear = any(m == 'linear' for m in cfg.layer_mixers())
  return cfg.engine.context_reorder and context_split(cfg, t) and t % (2 * c) == 0 and not linear


def dual_chunk_order(t: int, shards: int) -> np.ndarray:
  """The token order of a row of t under context load balance: the row in 2C chunks, shard i
  holding chunks i and 2C - 1 - i, so each shard's queries see as many earlier keys as every
  other's. order[j] = the original index of the token at j."""
  chunks = np.arange(t).reshape(2 * shards, t // (2 * shards))
  return np.concatenate([np.concatenate([chunks[i], chunks[-1 - i]]) for i in range(shards)])


def gather_tokens(x_BT, cfg: ModelConfig):
  """x [B, T, ...] whole on every 'context' shard (an all-gather over that axis): the keys'
  side of context parallelism. MLA gathers its latent and rope key, before their expansion to
  per-head keys and values."""
  return constrain(x_BT, ('batch', 'kv_seq') + (None,) * (x_BT.ndim - 2), cfg.engine.rules)


def shard_mask(pos_BT, seg_BT, pos_BS, seg_BS, window, index=None):
  """self_mask of one context shard's T queries over the row's S keys (inside the shard_map),
  as attention_core's (queries' arrays, keys' arrays) for block_mask: causal in the row's index
  order too, by the tokens' original indices under dual-chunk order (`index`,
  dual_chunk_order's; None: the row's own order)."""
  t, s = pos_BT.shape[1], pos_BS.shape[1]
  first = jax.lax.axis_index('context') * t  # this shard's first slot in the row
  k_index_S, q_index_T = jnp.arange(s), first + jnp.arange(t)
  if index is not None:
    k_index_S = jnp.asarray(index)
    q_index_T = k_index_S[q_index_T]
  return (pos_BT, seg_BT, q_index_T), (pos_BS, seg_BS, k_index_S, window)


def block_mask(q_meta, k_meta):
  """ring_mask of shard_mask's arrays (attention_core's mask_fn: the queries' arrays a block's)."""
  pos_BT, seg_BT, q_index_T = q_meta
  pos_BS, seg_BS, k_index_S, window = k_meta
  return ring_mask((pos_BT, seg_BT, q_index_T, window), (pos_BS, seg_BS, k_index_S))


def ring_mask(q_meta, k_meta):
  """self_mask of queries over keys from anywhere in the row, each side given as its global
  positions, segment ids and token indices in the row's own order (q_meta also the window):
  what a ring's visiting block carries."""
  pos_BT, seg_BT, q_index_T, window = q_meta
  pos_BS, seg_BS, k_index_S = k_meta
  in_order = k_index_S[None, :] <= q_index_T[:, None]
  mask = attention_mask(pos_BT, seg_BT, pos_BS, seg_BS) & in_order[None]
  return window_mask(mask, pos_BT, pos_BS, window)


def selected_mask(topk: int, q_meta, k_meta):
  """The keys a block of queries attends to under DeepSeek Sparse Attention (attention_core's
  mask_fn): each query's `topk` best by the indexer among those self_mask lets it see, scored
  here from the block's indexer queries [B, N_i, H_i, T] and head weights [B, N_i, T] (T last,
  as the loop splits them) and the row's indexer keys: no [T, S] score or mask exists whole."""
  pos_BT, seg_BT, q_index_T, q_BNHT, w_BNT = q_meta
  pos_BS, seg_BS, k_index_S, k_BSH = k_meta
  allowed_BTS = ring_mask((pos_BT, seg_BT, q_index_T, 0), (pos_BS, seg_BS, k_index_S))
  score_BTS = index_scores(q_BNHT.transpose(0, 3, 1, 2), w_BNT.transpose(0, 2, 1), k_BSH)
  return top_k_mask(score_BTS, allowed_BTS, topk)


ROWS = 'rows'  # in over_context's specs: the batch's row axes (sharding.BATCH_AXES in use)


def over_context(shard, cfg: ModelConfig, in_specs, every_axis: bool = False):
  """shard as a shard_map over 'context' and the axes the batch's rows split over (a spec's
  ROWS), its output split over both; heads and the other axes stay with the compiler. Left
  automatic, the row axes were not kept: the compiler gathered the rows onto every shard (at
  LongCat-Flash's scale a step of over a terabyte per chip). Inside the pipeline's vmap over
  stages (spmd_axis_name 'stage') the batching rule puts 'stage' on the stacked axis of every
  operand: it must be manual here too. every_axis: manual over every mesh axis (a Pallas
  kernel inside: XLA:TPU cannot partition a Mosaic call over an automatic axis, even of size
  1), the operands replicated over the axes their specs do not name."""
  sizes = dict(zip(MESH_AXES, full_shape(cfg.engine.mesh_shape)))
  rows = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
  manual = {'context', *rows} | ({'stage'} if cfg.engine.pipeline_stages > 1 else set())
  manual = set(MESH_AXES) if every_axis else manual

  def spec(s: P) -> P:
    return P(rows or None, *s[1:]) if len(s) and s[0] == ROWS else s

  return jax.shard_map(
    shard,
    in_specs=jax.tree.map(spec, in_specs, is_leaf=lambda s: isinstance(s, P)),
    out_specs=spec(P(ROWS, 'context')),
    axis_names=manual,
    check_vma=False,
  )


def slot_order(cfg: ModelConfig, t: int):
  """The token index of each slot of a row split over 'context' as the data wrote it (the load
  balance's dual-chunk order moves them), or None in the row's own order."""
  c = cfg.engine.context_shards
  return dual_chunk_order(t, c) if context_reordered(cfg, t) else None


def in_slots(x_BT, index, back: bool = False):
  """x [B, T, ...] with its tokens (axis 1) in the context shards' order (slot_order's index;
  None: x as it is); back: from that order to the row's own."""
  if x_BT is None or index is None:
    return x_BT
  return jnp.take(x_BT, np.argsort(index) if back else index, axis=1)


def context_self_attention(
  q_BTNH, k_BSNH, v_BSNH, positions_BT, segment_ids_BT, cfg, window=0, sinks_N=None, expand=None
):
  """causal_self_attention with the row's tokens split over the 'context' mesh axis: each
  shard's queries [B, T / C, N, H] against every shard's keys and values, all-gathered, by
  blocks of attention_chunk queries, the causal mask and packed segments from the global
  positions and indices (the unsplit path's result; each block scores all S keys, up to twice
  the causal work): attention_core in a shard_map over 'context' and the rows' axes; the splash
  kernel where whole rows run it (splash_over_context); ring_self_attention under
  engine.context_attention='ring'. expand: (fn, operands), k and v being what fn(k, v,
  *operands) expands inside each shard (MLA's latent and rope key; kv_b's arrays), so that
  the backward sums the latent's gradient over 'context', not the heads'."""
  if cfg.engine.context_attention == 'ring':
    return ring_self_attention(
      q_BTNH, k_BSNH, v_BSNH, positions_BT, segment_ids_BT, cfg, window, sinks_N, expand
    )
  fn, operands = expand or (None, ())
  groups = 1 if fn else cfg.num_heads // k_BSNH.shape[2]
  dtype, dtypes = k_BSNH.dtype, jax.tree.map(lambda x: x.dtype, operands)
  k_BSNH, v_BSNH = gathered(k_BSNH, cfg), gathered(v_BSNH, cfg)
  operands = jax.tree.map(functools.partial(crossing, cfg=cfg), operands)
  all_seg = gather_tokens(segment_ids_BT, cfg)
  index = slot_order(cfg, q_BTNH.shape[1])
  if context_splash(cfg, q_BTNH.shape[1]):  # k, v float32 on a CPU, as below
    kv = (k_BSNH, v_BSNH, segment_ids_BT, all_seg)
    return splash_over_context(q_BTNH, *kv, cfg, index, window, sinks_N, (fn, operands, dtypes))
  all_pos = gather_tokens(positions_BT, cfg)
  window = jnp.asarray(window, jnp.int32)
  sinks = () if sinks_N is None else (sinks_N,)

  def shard(q_BTNH, k_BSNH, v_BSNH, pos_BT, seg_BT, pos_BS, seg_BS, window, operands, *sinks):
    t, s = q_BTNH.shape[1], k_BSNH.shape[1]
    meta = shard_mask(pos_BT, seg_BT, pos_BS, seg_BS, window, index)
    k_BSNH, v_BSNH = expanded(fn, k_BSNH, v_BSNH, operands, dtype, dtypes)
    k_BSNH, v_BSNH = (jnp.repeat(x, groups, axis=2) for x in (k_BSNH, v_BSNH))
    chunk = cfg.engine.attention_chunk
    step = chunk if 0 < chunk < t else t
    blocks = tuple((i, min(i + step, t), s) for i in range(0, t, step))
    # Even blocks over all the keys: the kernel makes each block's mask in its loop.
    mask, mask_fn = (meta, block_mask) if uniform(blocks, t, s) else (block_mask(*meta), None)
    out_BNTH = attention_core(
      *(x.transpose(0, 2, 1, 3) for x in (q_BTNH, k_BSNH, v_BSNH)),
      mask,
      cfg.attention_scale,
      blocks,
      cfg.engine.attention_recompute,
      sinks[0] if sinks else None,
      mask_fn,
      reference=cfg.engine.reference_kernels,
    )
    return out_BNTH.transpose(0, 2, 1, 3)

  split, whole = P(ROWS, 'context'), P(ROWS)
  specs = (split, whole, whole, split, split, whole, whole, P(), P(), *(P() for _ in sinks))
  args = (positions_BT, segment_ids_BT, all_pos, all_seg, window, operands, *sinks)
  out_BTNH = over_context(shard, cfg, specs)(q_BTNH, k_BSNH, v_BSNH, *args)
  return constrain(out_BTNH, axes.names('BTN') + (None,), cfg.engine.rules)


def crossing(x, cfg: ModelConfig):
  """x as it enters a shard_map that reads it whole on every 'context' shard (gathered keys,
  values or MLA's latent; kv_b's arrays). XLA:CPU aborts compiling the backward's bfloat16 sum
  of it over the axis ("Invalid binary instruction opcode copy", jax 0.12): on a CPU it
  crosses in float32, and the shard casts it back."""
  return x.astype(jnp.float32) if cfg.engine.platform == 'cpu' else x


def gathered(x_BS, cfg: ModelConfig):
  """gather_tokens of what the shards read whole, as it crosses (`crossing`)."""
  return gather_tokens(crossing(x_BS, cfg), cfg)


def expanded(fn, k_BS, v_BS, operands, dtype, dtypes):
  """context_self_attention's keys and values inside a shard: what crossed (`crossing`) back in
  `dtype` and the operands in `dtypes`, then fn's of them (MLA's latent and rope key), or those
  gathered."""
  k_BS, v_BS = k_BS.astype(dtype), v_BS.astype(dtype)
  operands = jax.tree.map(lambda x, d: x.astype(d), operands, dtypes)
  return (k_BS, v_BS) if fn is None else fn(k_BS, v_BS, *operands)


def context_splash(cfg: ModelConfig, t: int) -> bool:
  """Whether a context split of a T-token row runs the splash kernel: where whole rows would
  (cfg.splash_attention), with each shard's chunks in whole kernel blocks and heads not split
  over a mesh axis (the kernel's shard_map leaves them whole)."""
  heads = dict(cfg.engine.rules.activations).get('heads')
  sizes = dict(zip(MESH_AXES, full_shape(cfg.engine.mesh_shape)))
  split_heads = isinstance(heads, str) and sizes.get(heads, 1) > 1
  return (
    cfg.splash_attention(t)
    and splash.context_supported(t, cfg.engine.context_shards)
    and not split_heads
  )


def splash_over_context(
  q_BTNH, k_BSNH, v_BSNH, seg_BT, seg_BS, cfg, index, window, sinks_N, expand=(None, (), ())
):
  """context_self_attention on the splash kernel: each shard's queries over the gathered keys
  and values put back in the row's order, with the kernel's static block tables for the whole
  row split over 'context' (kernels/splash.split_kernel; under the dual-chunk order the tables
  follow each slot's token index), so each shard loads only the key blocks its queries see.
  A window the layer scan gives (an array) picks one of two kernels, the model's sliding
  window's or none, as whole rows do. expand: context_self_attention's, and the operands'
  dtypes inside."""
  if isinstance(window, int) or not cfg.sliding_window:
    windows = (window if isinstance(window, int) else 0,)
  else:
    windows = (cfg.sliding_window, 0)
  order = None if index is None else tuple(int(i) for i in index)
  built = [
    splash.split_kernel(
      cfg.num_heads,
      q_BTNH.shape[1],
      order,
      interpret=cfg.engine.platform != 'tpu',
      mesh_shape=cfg.engine.mesh_shape,
      window=w,
    )
    for w in windows
  ]
  kernels, kernel_specs = tuple(k for k, _ in built), tuple(s for _, s in built)
  back = None if index is None else np.argsort(index)
  sinks = () if sinks_N is None else (sinks_N,)
  fn, operands, dtypes = expand

  def shard(q_BTNH, k_BSNH, v_BSNH, seg_BT, seg_BS, window, kernels, operands, *sinks):
    if back is not None:  # the gathered keys in slot order, to the row's own
      k_BSNH, v_BSNH, seg_BS = k_BSNH[:, back], v_BSNH[:, back], seg_BS[:, back]
    dtype = q_BTNH.dtype
    k_BSNH, v_BSNH = expanded(fn, k_BSNH, v_BSNH, operands, dtype, dtypes)
    qkv = tuple(x.astype(dtype).transpose(0, 2, 1, 3) for x in (q_BTNH, k_BSNH, v_BSNH))

    def attend(kernel):
      sink = sinks[0] if sinks else None
      return splash.split_attention(
        *qkv, seg_BT, seg_BS, cfg.attention_scale, kernel=kernel, sinks_N=sink
      )

    if len(kernels) == 1:
      out_BNTH = attend(kernels[0])
    else:
      out_BNTH = jax.lax.cond(window > 0, lambda: attend(kernels[0]), lambda: attend(kernels[1]))
    return out_BNTH.transpose(0, 2, 1, 3)

  split, whole = P(ROWS, 'context'), P(ROWS)
  specs = (split, whole, whole, split, whole, P(), kernel_specs, P(), *(P() for _ in sinks))
  run = over_context(shard, cfg, specs, every_axis=True)
  window = jnp.asarray(window, jnp.int32)
  out_BTNH = run(q_BTNH, k_BSNH, v_BSNH, seg_BT, seg_BS, window, kernels, operands, *sinks)
  return constrain(out_BTNH, axes.names('BTN') + (None,), cfg.engine.rules)


def ring_self_attention(
  q_BTNH,
  k_BTNH,
  v_BTNH,
  positions_BT,
  segment_ids_BT,
  cfg: ModelConfig,
  window=0,
  sinks_N=None,
  expand=None,
):
  """context_self_attention as a ring (engine.context_attention='ring'; docs/context.md): each
  shard keeps its queries and its own keys and values (N_kv heads) and the key/value blocks
  pass around the 'context' ring, C - 1 ppermutes, each visitor folded into an online softmax
  (kernels/ring.py), so a shard never holds more than its own block and one visitor: O(T / C)
  keys and values where the all-gather holds O(T). The blocks carry their positions, segment
  ids and token indices in the row's own order (dual_chunk_order's under the load balance), and
  the masks are the all-gather path's. expand: context_self_attention's (MLA), the blocks then
  carrying the shard's latent and rope key (k and v here), each receiving shard expanding them
  (kernels/ring.py). Where ring_splash says so, the same ring on the splash kernel
  (splash_ring)."""
  t, c = q_BTNH.shape[1], cfg.engine.context_shards
  if ring_splash(cfg, t):
    return splash_ring(q_BTNH, k_BTNH, v_BTNH, segment_ids_BT, cfg, window, sinks_N, expand)
  index_T = slot_order(cfg, t)
  index_T = np.arange(t) if index_T is None else index_T
  sinks = () if sinks_N is None else (sinks_N,)
  expand_heads, operands = ring_expansion(expand, cfg)

  def shard(q_BTNH, k_BT, v_BT, pos_BT, seg_BT, index_T, window, operands, *sinks):
    kv = (k_BT, v_BT) if expand_heads else (_heads(k_BT), _heads(v_BT))
    meta = (pos_BT, seg_BT, index_T)
    out_BNTH = ring_attention(
      _heads(q_BTNH),
      *kv,
      (*meta, window),
      meta,
      sinks[0] if sinks else None,
      operands,
      ring_mask,
      cfg.attention_scale,
      cfg.engine.attention_chunk,
      c,
      expand_heads,
      reference=cfg.engine.reference_kernels,
    )
    return _heads(out_BNTH)

  split = P(ROWS, 'context')
  specs = (split, split, split, split, split, P('context'), P(), P(), *(P() for _ in sinks))
  index_T, window = jnp.asarray(index_T, jnp.int32), jnp.asarray(window, jnp.int32)
  args = (positions_BT, segment_ids_BT, index_T, window, operands, *sinks)
  out_BTNH = over_context(shard, cfg, specs)(q_BTNH, k_BTNH, v_BTNH, *args)
  return constrain(out_BTNH, axes.names('BTN') + (None,), cfg.engine.rules)


def ring_splash(cfg: ModelConfig, t: int) -> bool:
  """Whether a ring over the context shards of a T-token row runs the splash kernel: where the
  all-gather would (context_splash), with a sliding window (if any) that reaches no further back
  than the chunk before a query's own (kernels/ring_splash.py), a shard's T / C tokens or, under
  the load balance, half of them."""
  chunk = t // cfg.engine.context_shards // (2 if context_reordered(cfg, t) else 1)
  return context_splash(cfg, t) and cfg.sliding_window <= chunk


def splash_ring(q_BTNH, k_BTNH, v_BTNH, segment_ids_BT, cfg: ModelConfig, window, sinks_N, expand):
  """ring_self_attention on the splash kernel (kernels/ring_splash.py): each visiting block's
  scores in the kernel, never in HBM; the shard_map manual over every mesh axis, a Pallas
  call being opaque to XLA's partitioner. window: the layer's (an int, or a layer scan's
  array), the model's sliding window where it is > 0."""
  c, reordered = cfg.engine.context_shards, slot_order(cfg, q_BTNH.shape[1]) is not None
  q_BTNH, sinks_N = splash.scaled(q_BTNH, cfg.attention_scale, sinks_N)  # fused into q's producer
  sinks = () if sinks_N is None else (sinks_N,)
  expand_heads, operands = ring_expansion(expand, cfg)
  interpret = cfg.engine.platform != 'tpu'

  def shard(q_BTNH, k_BT, v_BT, seg_BT, windowed, operands, *sinks):
    kv = (k_BT, v_BT) if expand_heads else (_heads(k_BT), _heads(v_BT))
    seg_BT, sink = seg_BT.astype(jnp.int32), sinks[0] if sinks else None
    args = (_heads(q_BTNH), *kv, seg_BT, windowed, sink, operands, c, reordered)
    out_BNTH = ring_splash_attention(
      *args, cfg.sliding_window, expand_heads, interpret, reference=cfg.engine.reference_kernels
    )
    return _heads(out_BNTH)

  split = P(ROWS, 'context')
  specs = (split, split, split, split, P(), P(), *(P() for _ in sinks))
  run = over_context(shard, cfg, specs, every_axis=True)
  windowed = jnp.asarray(window, jnp.int32) > 0
  out_BTNH = run(q_BTNH, k_BTNH, v_BTNH, segment_ids_BT, windowed, operands, *sinks)
  return constrain(out_BTNH, axes.names('BTN') + (None,), cfg.engine.rules)


def _heads(x):
  """[B, T, N, H] <-> [B, N, T, H]."""
  return x.transpose(0, 2, 1, 3)


def ring_expansion(expand, cfg: ModelConfig):
  """(the ring kernel's expand, or None; its operands as they cross into the shard_map) of
  context_self_attention's `expand` (MLA: kv_b's arrays, `crossing`, cast back inside)."""
  fn, operands = expand or (None, ())
  if fn is None:
    return None, ()
  dtypes = jax.tree.map(lambda x: x.dtype, operands)

  def expand_heads(k_BS, v_BS, ops):  # a visitor's keys and values [B, N, S, H]
    return tuple(map(_heads, expanded(fn, k_BS, v_BS, ops, k_BS.dtype, dtypes)))

  return expand_heads, jax.tree.map(functools.partial(crossing, cfg=cfg), operands)


class MLA(nnx.Module):
  """Low-rank q, compressed kv latent c (K) plus one rope key shared by all heads; with
  cfg.index_n_heads, DeepSeek Sparse Attention: each query attends only to the keys its
  lightning indexer (model/indexer.py) selects."""

  def __init__(self, cfg: ModelConfig, path: str, rngs: nnx.Rngs):
    self.cfg = cfg
    d, n, q, k = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    qk, nope, v, rope = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
    if q:
      self.q_a = Linear('BTD,DQ->BTQ', (d, q), cfg, f'{path}.q_a', rngs)
      self.q_a_norm = RMSNorm(q, 'Q', cfg.mla_norm_eps, cfg)
      self.q_b = Linear('BTQ,QNH->BTNH', (q, n, qk), cfg, f'{path}.q_b', rngs)
    else:  # q_lora_rank 0: one plain projection (DeepSeek-V2-Lite, Moonlight)
      self.q = Linear('BTD,DNH->BTNH', (d, n, qk), cfg, f'{path}.q', rngs)
    self.kv_a = Linear('BTD,DK->BTK', (d, k + rope), cfg, f'{path}.kv_a', rngs)
    self.kv_a_norm = RMSNorm(k, 'K', cfg.mla_norm_eps, cfg)
    self.kv_b = Linear('BTK,KNH->BTNH', (k, n, nope + v), cfg, f'{path}.kv_b', rngs)
    self.o = Linear('BTNH,NHD->BTD', (n, v, d), cfg, f'{path}.o', rngs)
    # Variance alignment of the low-rank paths (TR eq. 6-7); HF applies them unconditionally.
    self.alpha_q = math.sqrt(d / q) if cfg.mla_scale_q_lora and q else 1.0
    self.alpha_kv = math.sqrt(d / k) if cfg.mla_scale_kv_lora else 1.0
    self.indexer = Indexer(cfg, f'{path}.indexer', rngs) if cfg.index_n_heads else None

  def project_q(self, x_BTD, positions_BT, rng=None):
    if self.cfg.q_lora_rank:
      q_BTNH = self.q_b(self.q_a_norm(self.q_a(x_BTD, rng)), rng) * self.alpha_q
    else:
      q_BTNH = self.q(x_BTD, rng)
    nope = self.cfg.qk_nope_head_dim
    q_pe = rope(q_BTNH[..., nope:], positions_BT, self.cfg)
    return q_BTNH[..., :nope], q_pe

  def latent(self, x_BTD, positions_BT, rng=None):
    """The per-token cache content: normalised, scaled latent c [B,T,K] and rope key [B,T,H]."""
    ckv_BTK = self.kv_a(x_BTD, rng)
    k = self.cfg.kv_lora_rank
    c_BTK = self.kv_a_norm(ckv_BTK[..., :k]) * self.alpha_kv
    k_pe = rope(ckv_BTK[..., None, k:], positions_BT, self.cfg)[:, :, 0]
    return c_BTK, k_pe

  def attend(self, q_nope, q_pe, c_BSK, k_pe_BSH, mask_BTS, rng=None, causal_chunk: int = 0):
    """Attention of the T queries over the S keys of the latent c (multi_head's causal_chunk)."""
    q_BTNH, k_BSNH, v_BSNH = self.heads(q_nope, q_pe, c_BSK, k_pe_BSH, rng)
    out_BTNH = multi_head(q_BTNH, k_BSNH, v_BSNH, mask_BTS, self.cfg, causal_chunk)
    return self.o(out_BTNH, rng)

  def heads(self, q_nope, q_pe, c_BSK, k_pe_BSH, rng=None):
    """Per-head queries and keys over [nope | rope] features and values from the latent c: one
    score product, the rope key (shared by all heads) broadcast to each (its gradient sums
    over them)."""
    q_BTNH = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], -1)
    return q_BTNH, *self.keys_values(c_BSK, k_pe_BSH, self.kv_b.operands(), rng)

  def keys_values(self, c_BSK, k_pe_BSH, operands: tuple, rng=None, local: bool = False):
    """heads' keys and values from the latent c and rope key, kv_b's arrays passed in
    (`operands`): a context split runs it inside its shard_map (`local`: on the shard's own
    arrays, where its tokens flatten into one axis for kv_b's 2-D product)."""
    kv_BSNH = self.kv_b.apply(c_BSK, operands, rng, flat=True if local else None)
    nope = self.cfg.qk_nope_head_dim
    k_nope, v_BSNH = kv_BSNH[..., :nope], kv_BSNH[..., nope:]
    k_pe_BSNH = jnp.broadcast_to(
      k_pe_BSH[:, :, None].astype(k_nope.dtype), (*k_nope.shape[:3], k_pe_BSH.shape[-1])
    )
    return jnp.concatenate([k_nope, k_pe_BSNH], -1), v_BSNH

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, rng=None, window=0):
    del window  # no MLA family has sliding windows
    return self.forward(x_BTD, positions_BT, segment_ids_BT, rng)[0]

  def forward(self, x_BTD, positions_BT, segment_ids_BT, rng=None):
    """(the attention's output [B, T, D], the indexer's KL loss summed over the row's tokens:
    None unless cfg.train_indexer)."""
    q_nope, q_pe = self.project_q(x_BTD, positions_BT, rng)
    c_BTK, k_pe = self.latent(x_BTD, positions_BT, rng)
    s = c_BTK.shape[1]
    split = context_split(self.cfg, s)
    trains = self.cfg.train_indexer and self.indexer is not None
    dense = not (self.sparse(s) or trains)
    if split:
      # The all-gather and the ring move the latent, not the heads' keys: each shard expands it
      # to keys and values inside the attention's shard_map (the all-gather: the row's; the
      # ring: each visitor's), so the backward sums the latent's gradient over 'context', not
      # the heads' (36x the bytes for LongCat-Flash). LoRA dropout on kv_b draws its masks
      # outside: inside, every shard of the rows would draw the same (then the all-gather
      # expands the gathered latent outside, and the ring sends the heads).
      if self.cfg.engine.context_attention != 'ring':
        c_BTK, k_pe = gather_tokens(c_BTK, self.cfg), gather_tokens(k_pe, self.cfg)
      if dense and (rng is None or not (self.kv_b.has_lora and self.kv_b.lora_dropout)):
        q_BTNH = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], -1)
        expand = (functools.partial(self.keys_values, local=True), (self.kv_b.operands(),))
        out_BTNH = context_self_attention(
          q_BTNH, c_BTK, k_pe, positions_BT, segment_ids_BT, self.cfg, expand=expand
        )
        return self.o(out_BTNH, rng), None
    q_BTNH, k_BTNH, v_BTNH = self.heads(q_nope, q_pe, c_BTK, k_pe, rng)
    if dense:
      out_BTNH = causal_self_attention(
        q_BTNH, k_BTNH, v_BTNH, positions_BT, segment_ids_BT, self.cfg
      )
      return self.o(out_BTNH, rng), None
    if split:
      raise NotImplementedError('the sparse attention indexer (index_n_heads) over a context split')
    out_BTNH, kl = self.indexed(x_BTD, (q_BTNH, k_BTNH, v_BTNH), positions_BT, segment_ids_BT, rng)
    return self.o(out_BTNH, rng), kl

  def indexed(self, x_BTD, qkv, positions_BT, segment_ids_BT, rng=None):
    """(heads' output [B, T, N, H], KL loss or None) of attention with the indexer: over its
    selection where it selects (sparse), over every key otherwise; the indexer's KL loss
    (cfg.train_indexer) over the same keys, towards these heads' weights."""
    cfg = self.cfg
    qr_BTQ = self.q_a_norm(self.q_a(x_BTD, rng))  # the latent q_b reads (one q_a under jit)
    t, chunk = x_BTD.shape[1], cfg.engine.attention_chunk
    blocks = tuple((i, min(i + chunk, t), t) for i in range(0, t, chunk or t))
    if self.sparse(t) and not cfg.train_indexer and uniform(blocks, t, t):
      return self.selected(x_BTD, qr_BTQ, qkv, positions_BT, segment_ids_BT, blocks), None
    score_BTS = self.indexer.row_scores(x_BTD, qr_BTQ, positions_BT, cfg.engine.attention_chunk)
    keep_BTS = self_mask(positions_BT, segment_ids_BT)
    if self.sparse(x_BTD.shape[1]):
      keep_BTS = top_k_mask(jax.lax.stop_gradient(score_BTS), keep_BTS, cfg.index_topk)
      out_BTNH = multi_head(*qkv, keep_BTS, cfg, cfg.engine.attention_chunk)
    else:
      out_BTNH = causal_self_attention(*qkv, positions_BT, segment_ids_BT, cfg)
    if not cfg.train_indexer:
      return out_BTNH, None
    p_BTS = head_mean_probs(*qkv[:2], keep_BTS, cfg.attention_scale, cfg.engine.attention_chunk)
    return out_BTNH, kl_loss(p_BTS, score_BTS, keep_BTS, segment_ids_BT > 0)

  def selected(self, x_BTD, qr_BTQ, qkv, positions_BT, segment_ids_BT, blocks):
    """indexed's sparse output with the indexer frozen, over even blocks of queries: each
    block's selection made inside attention_core's loop (selected_mask) from the indexer's
    queries, weights and keys, none of them differentiated."""
    x_BTD, qr_BTQ = jax.lax.stop_gradient((x_BTD, qr_BTQ))
    iq_BTNH, w_BTN = self.indexer.queries(x_BTD, qr_BTQ, positions_BT)
    index_T = jnp.arange(x_BTD.shape[1])
    q_meta = (positions_BT, segment_ids_BT, index_T)
    q_meta += (iq_BTNH.transpose(0, 2, 3, 1), w_BTN.transpose(0, 2, 1))
    k_meta = (positions_BT, segment_ids_BT, index_T, self.indexer.keys(x_BTD, positions_BT))
    out_BNTH = attention_core(
      *(x.transpose(0, 2, 1, 3) for x in qkv),
      jax.lax.stop_gradient((q_meta, k_meta)),
      self.cfg.attention_scale,
      blocks,
      self.cfg.engine.attention_recompute,
      None,
      functools.partial(selected_mask, self.cfg.index_topk),
      reference=self.cfg.engine.reference_kernels,
    )
    return constrain(
      out_BNTH.transpose(0, 2, 1, 3), axes.names('BTN') + (None,), self.cfg.engine.rules
    )

  def sparse(self, s: int) -> bool:
    """Whether queries over s keys attend to the indexer's selection: with fewer keys than
    index_topk every query keeps all it sees, the dense path's result, which runs instead."""
    return self.indexer is not None and s > self.cfg.index_topk


class GQA(nnx.Module):
  """Grouped-query attention: N query heads share N_kv key/value heads (N / N_kv each), with
  RMSNorm over each query and key head (Qwen3), or over the whole q and k projections (OLMoE),
  before RoPE when cfg.qk_norm; biases on q/k/v (cfg.qkv_bias) and o (cfg.o_bias); RoPE on part
  of each head (cfg.partial_rotary_factor, GLM-4.5); a learned sink logit per head
  (cfg.attention_sinks) and a sliding window (gpt-oss: the layer's, given at each call); an
  output gate per head and feature (cfg.attn_output_gate, Qwen3-Next)."""

  def __init__(self, cfg: ModelConfig, path: str, rngs: nnx.Rngs):
    self.cfg = cfg
    d, n, g, h = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.gqa_head_dim
    qkv = dict(bias=cfg.qkv_bias)
    # With attn_output_gate each head's projection is [query H | gate H] (as transformers'
    # q_proj rows): the gate rides with the query to attend().
    hq = 2 * h if cfg.attn_output_gate else h
    self.q = Linear('BTD,DNH->BTNH', (d, n, hq), cfg, f'{path}.q', rngs, **qkv)
    # The key/value heads N_kv are heads too ('heads' shards them like the query heads).
    self.k = Linear('BTD,DNH->BTNH', (d, g, h), cfg, f'{path}.k', rngs, **qkv)
    self.v = Linear('BTD,DNH->BTNH', (d, g, h), cfg, f'{path}.v', rngs, **qkv)
    self.o = Linear('BTNH,NHD->BTD', (n, h, d), cfg, f'{path}.o', rngs, bias=cfg.o_bias)
    if cfg.attention_sinks:  # float32, like the softmax it joins
      self.sinks = nnx.Param(jnp.zeros((n,), jnp.float32), axes=axes.names('N'))
    if cfg.qk_norm and cfg.qk_norm_per_head:
      self.q_norm = RMSNorm(h, 'H', cfg.rms_norm_eps, cfg)
      self.k_norm = RMSNorm(h, 'H', cfg.rms_norm_eps, cfg)
    elif cfg.qk_norm:  # one norm over all heads' features: [N * H], [N_kv * H]
      self.q_norm = RMSNorm(n * h, 'O', cfg.rms_norm_eps, cfg)
      self.k_norm = RMSNorm(g * h, 'O', cfg.rms_norm_eps, cfg)

  def norm_qk(self, q_BTNH, k_BTNH):
    if self.cfg.qk_norm_per_head:
      return self.q_norm(q_BTNH), self.k_norm(k_BTNH)
    whole = lambda norm, x: norm(x.reshape(*x.shape[:2], -1)).reshape(x.shape)
    return whole(self.q_norm, q_BTNH), whole(self.k_norm, k_BTNH)

  def project(self, x_BTD, positions_BT, rng=None):
    """Queries [B, T, N, H] and the cache content: keys and values [B, T, N_kv, H]."""
    q_BTNH, k_BTNH = self.q(x_BTD, rng), self.k(x_BTD, rng)
    q_BTNH, gate_BTNH = self.split_gate(q_BTNH)
    if self.cfg.qk_norm:
      q_BTNH, k_BTNH = self.norm_qk(q_BTNH, k_BTNH)
    q_BTNH, k_BTNH = (self.rotate(x, positions_BT) for x in (q_BTNH, k_BTNH))
    if gate_BTNH is not None:
      q_BTNH = jnp.concatenate([q_BTNH, gate_BTNH], -1)
    return q_BTNH, k_BTNH, self.v(x_BTD, rng)

  def split_gate(self, q_BTNH):
    """(queries, output gate or None) of a projection [query | gate] per head."""
    if not self.cfg.attn_output_gate:
      return q_BTNH, None
    h = q_BTNH.shape[-1] // 2
    return q_BTNH[..., :h], q_BTNH[..., h:]

  def output(self, out_BTNH, gate_BTNH, rng=None):
    """The o projection of the heads' outputs, gated per feature first (attn_output_gate)."""
    if gate_BTNH is not None:
      gate = jax.nn.sigmoid(gate_BTNH.astype(jnp.float32))
      out_BTNH = (out_BTNH.astype(jnp.float32) * gate).astype(out_BTNH.dtype)
    return self.o(out_BTNH, rng)

  def rotate(self, x_BTNH, positions_BT):
    """RoPE on the first cfg.rotary_dim features of each head (all but GLM-4.5's: all)."""
    r = self.cfg.rotary_dim
    if r == x_BTNH.shape[-1]:
      return rope(x_BTNH, positions_BT, self.cfg)
    return jnp.concatenate([rope(x_BTNH[..., :r], positions_BT, self.cfg), x_BTNH[..., r:]], -1)

  def attend(self, q_BTNH, k_BSNH, v_BSNH, mask_BTS, rng=None, causal_chunk: int = 0):
    """Each key/value head serves its N / N_kv consecutive query heads (HF's repeat_kv)."""
    groups = self.cfg.num_heads // self.cfg.kv_heads
    k_BSNH, v_BSNH = (jnp.repeat(x, groups, axis=2) for x in (k_BSNH, v_BSNH))
    q_BTNH, gate_BTNH = self.split_gate(q_BTNH)
    out_BTNH = multi_head(q_BTNH, k_BSNH, v_BSNH, mask_BTS, self.cfg, causal_chunk, self.sinks_N)
    return self.output(out_BTNH, gate_BTNH, rng)

  @property
  def sinks_N(self):
    return self.sinks[...] if self.cfg.attention_sinks else None

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, rng=None, window=0):
    q_BTNH, k_BTNH, v_BTNH = self.project(x_BTD, positions_BT, rng)
    q_BTNH, gate_BTNH = self.split_gate(q_BTNH)
    out_BTNH = causal_self_attention(
      q_BTNH, k_BTNH, v_BTNH, positions_BT, segment_ids_BT, self.cfg, window, self.sinks_N
    )
    return self.output(out_BTNH, gate_BTNH, rng)


def make_attention(cfg: ModelConfig, path: str, rngs: nnx.Rngs):
  if cfg.attention == 'mla':
    return MLA(cfg, path, rngs)
  return GQA(cfg, path, rngs)

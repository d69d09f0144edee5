"""Context parallelism: a row's tokens split over the 'context' mesh axis (docs/context.md).
The dual-chunk load balance's token order; attention across the shards, keys and values
all-gathered (the blocked XLA core, or the splash kernel) or passed around a ring (the online
softmax over XLA blocks, or over the splash kernel)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moetrain.core import axes
from moetrain.core.sharding import BATCH_AXES, MESH_AXES, constrain
from moetrain.kernels import splash
from moetrain.kernels.attention import attention_core, uniform
from moetrain.kernels.ring import ring_attention
from moetrain.kernels.ring_splash import ring_splash_attention
from moetrain.model.config import ModelConfig
from moetrain.model.masks import block_mask, ring_mask, shard_mask


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


def gather_tokens(x_BT, cfg: ModelConfig, heads: bool = False):
  """x [B, T, ...] whole on every 'context' shard (an all-gather over that axis): the keys'
  side of context parallelism. MLA gathers its latent and rope key, before their expansion to
  per-head keys and values. heads: x is [B, T, N, H], its heads left split as the rules say."""
  rest = ('heads', None) if heads else (None,) * (x_BT.ndim - 2)
  return constrain(x_BT, ('batch', 'kv_seq') + rest, cfg.engine.rules)


ROWS = 'rows'  # in over_context's specs: the batch's row axes (sharding.BATCH_AXES in use)


def over_context(shard, cfg: ModelConfig, in_specs, every_axis: bool = False, out_spec=None):
  """shard as a shard_map over 'context' and the axes the batch's rows split over (a spec's
  ROWS), its output split over both; heads and the other axes stay with the compiler. Left
  automatic, the row axes were not kept: the compiler gathered the rows onto every shard (at
  LongCat-Flash's scale a step of over a terabyte per chip). Inside the pipeline's vmap over
  stages (spmd_axis_name 'stage') the batching rule puts 'stage' on the stacked axis of every
  operand: it must be manual here too. every_axis: manual over every mesh axis (a Pallas
  kernel inside: XLA:TPU cannot partition a Mosaic call over an automatic axis, even of size
  1), the operands replicated over the axes their specs do not name. out_spec: the output's
  (None: split over the rows' axes and 'context')."""
  rows = tuple(a for a in BATCH_AXES if cfg.engine.axis_size(a) > 1)
  manual = {'context', *rows} | ({'stage'} if cfg.engine.pipeline_stages > 1 else set())
  manual = set(MESH_AXES) if every_axis else manual

  def spec(s: P) -> P:
    return P(rows or None, *s[1:]) if len(s) and s[0] == ROWS else s

  return jax.shard_map(
    shard,
    in_specs=jax.tree.map(spec, in_specs, is_leaf=lambda s: isinstance(s, P)),
    out_specs=spec(P(ROWS, 'context') if out_spec is None else out_spec),
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
  on_splash = context_splash(cfg, q_BTNH.shape[1])  # GQA: heads stay split if the rules say
  k_BSNH, v_BSNH = (gathered(x, cfg, on_splash and not fn) for x in (k_BSNH, v_BSNH))
  operands = jax.tree.map(functools.partial(crossing, cfg=cfg), operands)
  all_seg = gather_tokens(segment_ids_BT, cfg)
  index = slot_order(cfg, q_BTNH.shape[1])
  if on_splash:  # k, v float32 on a CPU, as below
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


def gathered(x_BS, cfg: ModelConfig, heads: bool = False):
  """gather_tokens of what the shards read whole, as it crosses (`crossing`)."""
  return gather_tokens(crossing(x_BS, cfg), cfg, heads)


def expanded(fn, k_BS, v_BS, operands, dtype, dtypes):
  """context_self_attention's keys and values inside a shard: what crossed (`crossing`) back in
  `dtype` and the operands in `dtypes`, then fn's of them (MLA's latent and rope key), or those
  gathered."""
  k_BS, v_BS = k_BS.astype(dtype), v_BS.astype(dtype)
  operands = jax.tree.map(lambda x, d: x.astype(d), operands, dtypes)
  return (k_BS, v_BS) if fn is None else fn(k_BS, v_BS, *operands)


def own_heads(fn, axis, count: int):
  """fn (MLA's expansion of the latent, inside a shard_map) for this device's `count` heads
  along the mesh axis the heads split over; fn itself without one (or without fn)."""
  if fn is None or axis is None:
    return fn
  return functools.partial(fn, heads=(jax.lax.axis_index(axis) * count, count))


def head_axis(cfg: ModelConfig):
  """The mesh axis the rules split attention heads over, or None (none, or one of size 1)."""
  heads = dict(cfg.engine.rules.activations).get('heads')
  return heads if isinstance(heads, str) and cfg.engine.axis_size(heads) > 1 else None


def context_splash(cfg: ModelConfig, t: int) -> bool:
  """Whether a context split of a T-token row runs the splash kernel: where whole rows would
  (cfg.splash_attention), with each shard's chunks in whole kernel blocks. With heads split over
  a mesh axis (head_axis), only where that axis divides the heads (GQA's key/value heads too):
  each device runs the kernel over its own query heads and their keys and values (MLA: each
  device expands the gathered latent into its own heads alone)."""
  n = cfg.engine.axis_size(head_axis(cfg))
  if n > 1 and (cfg.num_heads % n or (cfg.attention != 'mla' and cfg.kv_heads % n)):
    return False
  return cfg.splash_attention(t) and splash.context_supported(t, cfg.engine.context_shards)


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
  h = head_axis(cfg)  # context_splash's: each device's query heads, and their keys and values
  heads = cfg.num_heads // cfg.engine.axis_size(h)
  built = [
    splash.split_kernel(
      heads,
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
    k_BSNH, v_BSNH = expanded(own_heads(fn, h, heads), k_BSNH, v_BSNH, operands, dtype, dtypes)
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

  # Keys and values split over the heads' axis, or MLA's latent and rope key whole on each device.
  split, whole = P(ROWS, 'context', h), P(ROWS, None, None if fn else h)
  specs = (split, whole, whole, P(ROWS, 'context'), P(ROWS), P(), kernel_specs, P())
  specs += tuple(P(h) for _ in sinks)
  run = over_context(shard, cfg, specs, every_axis=True, out_spec=split)
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
  mla_over_heads = cfg.attention == 'mla' and head_axis(cfg) is not None  # not in the ring yet
  return context_splash(cfg, t) and cfg.sliding_window <= chunk and not mla_over_heads


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

  h = head_axis(cfg)  # GQA only (context_splash): each device's query and key/value heads
  split = P(ROWS, 'context', h)
  specs = (split, split, split, P(ROWS, 'context'), P(), P(), *(P(h) for _ in sinks))
  run = over_context(shard, cfg, specs, every_axis=True, out_spec=split)
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

"""Pipeline parallelism: a run of decoder layers split over the 'stage' mesh axis, micro-batches
flowing through the stages in GPipe or circular order (docs/pipeline.md).

The stages run as one SPMD program: the stage function is vmapped over a leading stage axis that
the rules shard over 'stage' (spmd_axis_name), so stage s computes only its own layers, and each
iteration passes the activations on to the next stage with one ppermute (sharding.shift_stages).
The backward pass is autodiff of this scheduled forward: all forwards, then all backwards (GPipe).

Layer l of a group of L layers belongs to repeat r, stage s, slot j with l = (r * S + s) * Lc + j
(Lc = L / (S * R)): with R = engine.pipeline_repeats = 1, stage s holds layers s * Lc ... (s + 1) *
Lc - 1, as the 'layers' axis of the stored weights is split over 'stage'; with R > 1 (circular)
each stage holds R non-adjacent runs, and micro-batch m passes stage s for repeat r at iteration
t = r * M + m + s. Iterations: M * R + S - 1, of which S - 1 are the bubble of every stage.

Stored order: with R > 1 the stacked per-layer arrays (weights, optimizer moments, the frozen
base, router biases) are stored in circular order (`layer_order`), so that the block of the
'layers' axis each stage stores holds its own R runs and no weight moves between stages in a step.
A state is assembled in layer order and put in stored order once (`store`); checkpoints record
the order they hold (checkpoint.Checkpointer) and a restore moves them into the run's.

A batch's rows split over 'stage' (sharding.ROW_AXES), and the micro-batches sit in io [S, K, ...]
(K = M / S), sharded over 'stage': stage s starts with its own rows' micro-batches s * K ...
s * K + K - 1. In iteration t every stage passes io[s + 1, t % K] down to io[s, t % K] and the
last stage files its output there: stage 0 reads micro-batch t at t, and micro-batch j's output
ends on its own stage j // K, in slot (j + S - 1) % K. So the rows stay split over the stages
before, through and after the pipeline, and no stage holds the whole batch. A circular
schedule's later repeats come round from the last stage with the stage permute and wait M - S
iterations on stage 0 (fifo).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moetrain.core import axes
from moetrain.core.sharding import constrain, shift_stages, within_stages
from moetrain.model.config import ModelConfig
from moetrain.model.moe import ROUTING_COUNTS, finish_routing_stats

ACT = axes.names('BTD')
MICRO_IDS = (None, *axes.names('BT'))  # [M, B / M, T]: within_stages, replicated over 'stage'
STAGE_ACT = axes.names('YBTD')
STAGE_MICRO_ACT = (STAGE_ACT[0], None, *ACT)  # [S, K, B / M, T, D]: each stage's micro-batches


def check(cfg: ModelConfig) -> None:
  """The micro-batches must fill the stages and every run of layers must split evenly."""
  s, m, r = (
    cfg.engine.pipeline_stages,
    cfg.engine.pipeline_microbatches,
    cfg.engine.pipeline_repeats,
  )
  if s == 1 and r == 1:
    return
  if m < s or m % s:
    raise ValueError(
      f'engine.pipeline_microbatches={m} must be a multiple of the {s} pipeline stages '
      "(mesh.shape's 'stage' axis): each stage starts with an equal share of the micro-batches, "
      'those of its own rows, and fewer micro-batches than stages leave a stage idle'
    )
  for group in cfg.layer_groups():
    if group.count % (s * r):
      raise ValueError(
        f'model.num_layers={cfg.num_layers}: the {group.count} {group.kind} layers of '
        f"'{group.name}' do not split into {s} pipeline stages x engine.pipeline_repeats={r} "
        'runs of equal length; change the stage count, the repeats or the layer count'
      )


def bubble(cfg: ModelConfig) -> float:
  """The idle share of each stage: (S - 1) / (M * R + S - 1)."""
  s, m, r = (
    cfg.engine.pipeline_stages,
    cfg.engine.pipeline_microbatches,
    cfg.engine.pipeline_repeats,
  )
  return (s - 1) / (m * r + s - 1)


def active(cfg: ModelConfig, rows: int) -> bool:
  """Whether a batch of `rows` runs pipelined (a batch the micro-batches do not divide, such as
  an odd evaluation batch, runs through the stored layers unpipelined: the same result)."""
  m = cfg.engine.pipeline_microbatches
  return (cfg.engine.pipeline_stages > 1 or m > 1) and rows % m == 0


def layout(cfg: ModelConfig) -> tuple[int, int]:
  """The order cfg's stacked layers are stored in, as (stages, repeats): (1, 1) is layer order,
  which every schedule without repeats reads."""
  return (
    (cfg.engine.pipeline_stages, cfg.engine.pipeline_repeats)
    if cfg.engine.pipeline_repeats > 1
    else (1, 1)
  )


def layer_order(count: int, order: tuple[int, int]) -> np.ndarray:
  """Which layer each stored slot of a run of `count` layers holds (stored[p] = layer[out[p]])
  in the stored order `order` = (S, R): slot (s * R + r) * Lc + j holds layer (r * S + s) * Lc +
  j, so stage s's block of the 'layers' axis holds its R runs, repeat by repeat."""
  s, r = order
  return np.arange(count).reshape(r, s, count // (s * r)).transpose(1, 0, 2).reshape(-1)


def in_layer_order(state, cfg: ModelConfig):
  """A group's stacked state (every leaf [L, ...], traced) from stored order to layer order."""
  if layout(cfg) == (1, 1):
    return state
  count = jax.tree.leaves(state)[0].shape[0]
  back = np.argsort(layer_order(count, layout(cfg)))
  return jax.tree.map(lambda x: jnp.take(x, back, axis=0), state)


def is_stacked(x) -> bool:
  """A Variable stacked over a run of layers (its first logical axis is 'layers')."""
  return isinstance(x, nnx.Variable) and x.get_metadata().get('axes', (None,))[:1] == ('layers',)


def reorder(tree, src: tuple[int, int], dst: tuple[int, int]):
  """`tree` (a state, or part of one) with every stacked per-layer array moved from stored order
  `src` to `dst` (`layout`'s pairs), on its devices and in its sharding. The old arrays are
  donated, so the peak is one array more; an array met twice (shared) is moved once."""
  if src == dst:
    return tree
  moved = {}

  def one(x):
    if not is_stacked(x):
      return x
    value = x.get_value()
    if id(value) not in moved:
      count = value.shape[0]
      perm = np.argsort(layer_order(count, src))[layer_order(count, dst)]
      # (the old array kept: its id stays unique)
      moved[id(value)] = (value, _take_rows(value.sharding)(value, perm))
    return x.replace(moved[id(value)][1])

  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


@functools.lru_cache
def _take_rows(where):
  """a[perm] along the first axis, into sharding `where`, `a` donated: one jit per sharding, so
  a weight and its optimizer moments (same shape and sharding) compile once."""
  return jax.jit(lambda a, perm: jnp.take(a, perm, axis=0), out_shardings=where, donate_argnums=0)


def store(tree, cfg: ModelConfig):
  """A state assembled in layer order, put in cfg's stored order (`layout`)."""
  return reorder(tree, (1, 1), layout(cfg))


def to_stages(x, s: int, k: int):
  """[B, ...] -> [S, K, B / (S * K), ...]: micro-batch g = s * K + k is stage shard s's rows
  k, K + k, 2K + k, ... (the rows split over 'stage' first, then the batch axes), so each
  stage's micro-batches start out where its rows are and each keeps a share of every batch
  shard of the stage. With S = 1, micro-batch j is rows j, M + j, 2M + j, ..."""
  x = x.reshape(s, x.shape[0] // (s * k), k, *x.shape[1:])
  return jnp.swapaxes(x, 1, 2)


def from_stages(x):
  return jnp.swapaxes(x, 1, 2).reshape(-1, *x.shape[3:])


def run_group(layer, state, extra_L, cfg: ModelConfig, h_BTD, positions_BT, segment_ids_BT):
  """The group's layers (state: stacked [L, ...]) on h_BTD, pipelined; returns (h_BTD, the
  routing stats per layer as an unpipelined scan gives them, or None for dense layers).
  layer(h_BTD, (layer_state, extra), positions_BT, segment_ids_BT) runs one layer (remat'd);
  extra_L: per-layer data stacked [L, ...] (a tree: the layers' dropout keys or None, their
  attention windows). The micro-batches' io buffer and the fifo: the module's docstring."""
  s, m, r = (
    cfg.engine.pipeline_stages,
    cfg.engine.pipeline_microbatches,
    cfg.engine.pipeline_repeats,
  )
  count = jax.tree.leaves(state)[0].shape[0]
  lc, k = count // (s * r), m // s
  # Stored order (layer_order): stage s's block holds its runs r = 0 .. R - 1 -> [R, S, Lc, ...].
  w = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(s, r, lc, *x.shape[1:]), 0, 1), state)
  keys = jax.tree.map(lambda x: x.reshape(r, s, lc, *x.shape[1:]), extra_L)
  io = constrain(to_stages(h_BTD, s, k), STAGE_MICRO_ACT, cfg.engine.rules)
  pos, seg, share_M = micro_ids(positions_BT, segment_ids_BT, cfg)
  first_Y = (jnp.arange(s) == 0)[:, None, None, None]
  last_Y = (jnp.arange(s) == s - 1)[:, None, None, None]

  def stage(w_L, x_BTD, p_BT, s_BT, k_L):
    with within_stages():
      return jax.lax.scan(lambda h, xs: layer(h, xs, p_BT, s_BT), x_BTD, (w_L, k_L))

  run = jax.vmap(stage, spmd_axis_name='stage' if s > 1 else None)

  def iteration(carry, t):
    state_Y, io, fifo = carry
    i_Y = t - jnp.arange(s)
    valid_Y = (i_Y >= 0) & (i_Y < m * r)
    i_Y = jnp.clip(i_Y, 0, m * r - 1)
    m_Y, r_Y = i_Y % m, i_Y // m
    slot = t % k
    moved_Y = shift_stages(state_Y, s)
    fresh_Y = io[:, slot]
    if r > 1 and s > 1:  # the last stage's output of iteration t - 1 - (M - S) returns now
      back_Y = moved_Y
      if fifo is not None:
        back_Y = fifo[:, t % (m - s)]
        fifo = fifo.at[:, t % (m - s)].set(moved_Y)
      fresh_Y = jnp.where(t < m, fresh_Y, back_Y)
    x_Y = constrain(jnp.where(first_Y, fresh_Y, moved_Y), STAGE_ACT, cfg.engine.rules)
    out_Y, stats = run(per_stage(w, r_Y), x_Y, pos[m_Y], seg[m_Y], per_stage(keys, r_Y))
    io = io.at[:, slot].set(jnp.where(last_Y, out_Y, shift_stages(io[:, slot], s, -1)))
    return (out_Y, io, fifo), (stats, valid_Y, share_M[m_Y], r_Y)

  state_Y = jnp.zeros((s, *io.shape[2:]), io.dtype)
  fifo = None
  if r > 1 and s > 1 and m > s:
    fifo = constrain(
      jnp.zeros((s, m - s, *io.shape[2:]), io.dtype), STAGE_MICRO_ACT, cfg.engine.rules
    )
  (_, io, _), (stats, valid, share, repeat) = jax.lax.scan(
    iteration, (state_Y, io, fifo), jnp.arange(m * r + s - 1)
  )
  h_BTD = constrain(from_stages(jnp.roll(io, 1 - s, axis=1)), ACT, cfg.engine.rules)
  if stats is None:
    return h_BTD, None
  return h_BTD, combine_stats(stats, valid, share, repeat, cfg)


def micro_ids(positions_BT, segment_ids_BT, cfg: ModelConfig):
  """The micro-batches' positions and segment ids [M, B / M, T], whole on every stage (any stage
  runs any micro-batch), and each micro-batch's share of the batch's tokens [M]."""
  s, m = cfg.engine.pipeline_stages, cfg.engine.pipeline_microbatches
  with within_stages():
    pos, seg = (
      constrain(to_stages(x, s, m // s).reshape(m, -1, x.shape[1]), MICRO_IDS, cfg.engine.rules)
      for x in (positions_BT, segment_ids_BT)
    )
  tokens_M = jnp.sum(seg > 0, axis=(1, 2)).astype(jnp.float32)
  return pos, seg, tokens_M / jnp.maximum(tokens_M.sum(), 1.0)


def per_stage(tree, r_Y):
  """Each stage's slice of a [R, S, ...] tree: repeat r_Y[s] of stage s ([S, ...])."""
  if tree is None:
    return None
  if jax.tree.leaves(tree)[0].shape[0] == 1:
    return jax.tree.map(lambda x: x[0], tree)
  return jax.vmap(lambda t, r: jax.tree.map(lambda x: x[r], t), in_axes=(1, 0))(tree, r_Y)


def combine_stats(stats, valid_IY, share_IY, r_IY, cfg: ModelConfig) -> dict:
  """Per-layer routing stats from each iteration's per-stage ones ([I, S, Lc, ...]): counts
  summed over the micro-batches, means weighted by each micro-batch's share of the tokens (as
  gradient accumulation adds them), in layer order [R * S * Lc, ...]."""
  r = cfg.engine.pipeline_repeats
  hit_IYR = (r_IY[..., None] == jnp.arange(r)[None, None]) & valid_IY[..., None]

  def combine(key, x):
    weight_IYR = hit_IYR * (1.0 if key in ROUTING_COUNTS else share_IY[..., None])
    extra = (None,) * (x.ndim - 2)
    summed = jnp.sum(weight_IYR[(..., *extra)] * x[:, :, None], axis=0)  # [S, R, Lc, ...]
    summed = jnp.swapaxes(summed, 0, 1)
    return summed.reshape(-1, *summed.shape[3:])

  return finish_routing_stats({k: combine(k, v) for k, v in stats.items()}, cfg)

"""Pipeline parallelism: a run of decoder layers split over the 'stage' mesh axis, micro-batches
flowing through the stages in GPipe or circular order (docs/pipeline.md).

The stages run as one SPMD program: the stage function is vmapped over a leading stage axis that
the rules shard over 'stage' (spmd_axis_name), so stage s computes only its own layers, and each
iteration passes the activations on to the next stage with one ppermute (sharding.shift_stages).
The backward pass is autodiff of this scheduled forward: all forwards, then all backwards (GPipe).

Layer l of a group of L layers belongs to repeat r, stage s, slot j with l = (r * S + s) * Lc + j
(Lc = L / (S * R)): with R = model.pipeline_repeats = 1, stage s holds layers s * Lc ... (s + 1) *
Lc - 1, as the 'layers' axis of the stored weights is split over 'stage'; with R > 1 (circular)
each stage holds R non-adjacent runs, and micro-batch m passes stage s for repeat r at iteration
t = r * M + m + s. Iterations: M * R + S - 1, of which S - 1 are the bubble of every stage.
"""

import jax
import jax.numpy as jnp

from moetrain import axes
from moetrain.model.config import ModelConfig
from moetrain.model.moe import ROUTING_COUNTS, finish_routing_stats
from moetrain.sharding import constrain, shift_stages

ACT = axes.names('BTD')
MICRO_ACT = (None, *ACT)  # [M, B / M, T, D]: micro-batches, each split over the batch axes
STAGE_ACT = axes.names('YBTD')
STAGE_MICRO_ACT = (STAGE_ACT[0], None, *ACT)  # [S, M, B / M, T, D]: each stage's micro-batch copy


def check(cfg: ModelConfig) -> None:
  """The micro-batches must fill the stages and every run of layers must split evenly."""
  s, m, r = cfg.pipeline_stages, cfg.pipeline_microbatches, cfg.pipeline_repeats
  if s == 1 and r == 1:
    return
  if m < s:
    raise ValueError(
      f"model.pipeline_microbatches={m} must be >= the {s} pipeline stages (mesh.shape's "
      "'stage' axis): fewer micro-batches leave a stage idle for the whole step"
    )
  for group in cfg.layer_groups():
    if group.count % (s * r):
      raise ValueError(
        f'model.num_layers={cfg.num_layers}: the {group.count} {group.kind} layers of '
        f"'{group.name}' do not split into {s} pipeline stages x model.pipeline_repeats={r} "
        'runs of equal length; change the stage count, the repeats or the layer count'
      )


def bubble(cfg: ModelConfig) -> float:
  """The idle share of each stage: (S - 1) / (M * R + S - 1)."""
  s, m, r = cfg.pipeline_stages, cfg.pipeline_microbatches, cfg.pipeline_repeats
  return (s - 1) / (m * r + s - 1)


def active(cfg: ModelConfig, rows: int) -> bool:
  """Whether a batch of `rows` runs pipelined (a batch the micro-batches do not divide, such as
  an odd evaluation batch, runs through the stored layers unpipelined: the same result)."""
  m = cfg.pipeline_microbatches
  return (cfg.pipeline_stages > 1 or m > 1) and rows % m == 0


def split_micro(x, m: int):
  """[B, ...] -> [M, B / M, ...]; micro-batch j holds rows j, M + j, 2M + j, ..., so that each
  keeps a share of every batch shard's rows."""
  return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def merge_micro(x):
  return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def run_group(layer, state, extra_L, cfg: ModelConfig, h_BTD, positions_BT, segment_ids_BT):
  """The group's layers (state: stacked [L, ...]) on h_BTD, pipelined; returns (h_BTD, the
  routing stats per layer as an unpipelined scan gives them, or None for dense layers).
  layer(h_BTD, (layer_state, extra), positions_BT, segment_ids_BT) runs one layer (remat'd);
  extra_L: per-layer data stacked [L, ...] (a tree: the layers' dropout keys or None, their
  attention windows).

  The micro-batches sit in a buffer [S, M, ...] sharded over 'stage': stage 0 reads its inputs
  from its own copy, the last stage writes its outputs into its own, and a circular schedule's
  later repeats reach stage 0 with the stage permute, which stage 0 files into its copy. Every
  read and write takes the same slot on every stage (a select picks whose counts), so no step of
  the loop moves a buffer between stages; only the outputs leave the last stage, once, at the
  end."""
  s, m, r = cfg.pipeline_stages, cfg.pipeline_microbatches, cfg.pipeline_repeats
  count = jax.tree.leaves(state)[0].shape[0]
  lc = count // (s * r)
  w = jax.tree.map(lambda x: x.reshape(r, s, lc, *x.shape[1:]), state)
  keys = jax.tree.map(lambda x: x.reshape(r, s, lc, *x.shape[1:]), extra_L)
  x_M = constrain(split_micro(h_BTD, m), MICRO_ACT, cfg.rules)
  buf = constrain(jnp.broadcast_to(x_M, (s, *x_M.shape)), STAGE_MICRO_ACT, cfg.rules)
  pos, seg = split_micro(positions_BT, m), split_micro(segment_ids_BT, m)
  tokens_M = jnp.sum(seg > 0, axis=(1, 2)).astype(jnp.float32)
  share_M = tokens_M / jnp.maximum(tokens_M.sum(), 1.0)
  first_Y = (jnp.arange(s) == 0)[:, None, None, None]
  last_Y = (jnp.arange(s) == s - 1)[:, None, None, None]

  def stage(w_L, x_BTD, p_BT, s_BT, k_L):
    return jax.lax.scan(lambda h, xs: layer(h, xs, p_BT, s_BT), x_BTD, (w_L, k_L))

  run = jax.vmap(stage, spmd_axis_name='stage' if s > 1 else None)

  def iteration(carry, t):
    state_Y, buf = carry
    i_Y = t - jnp.arange(s)
    valid_Y = (i_Y >= 0) & (i_Y < m * r)
    i_Y = jnp.clip(i_Y, 0, m * r - 1)
    m_Y, r_Y = i_Y % m, i_Y // m
    moved_Y = shift_stages(state_Y, s)
    if r > 1 and s > 1:
      # The last stage's previous output, micro-batch (t - S) % M, is its next repeat's input.
      buf = file_slot(buf, (t - s) % m, moved_Y, first_Y & (t >= s))
    x_Y = jnp.where(first_Y, buf[:, m_Y[0]], moved_Y)
    x_Y = constrain(x_Y, STAGE_ACT, cfg.rules)
    out_Y, stats = run(per_stage(w, r_Y), x_Y, pos[m_Y], seg[m_Y], per_stage(keys, r_Y))
    buf = file_slot(buf, m_Y[-1], out_Y, last_Y & valid_Y[-1])
    return (out_Y, buf), (stats, valid_Y, share_M[m_Y], r_Y)

  state_Y = jnp.zeros((s, *x_M.shape[1:]), x_M.dtype)
  (_, buf), (stats, valid, share, repeat) = jax.lax.scan(
    iteration, (state_Y, buf), jnp.arange(m * r + s - 1)
  )
  h_BTD = constrain(merge_micro(constrain(buf[s - 1], MICRO_ACT, cfg.rules)), ACT, cfg.rules)
  if stats is None:
    return h_BTD, None
  return h_BTD, combine_stats(stats, valid, share, repeat, cfg)


def file_slot(buf_YM, j, x_Y, mask_Y):
  """buf_YM[:, j] = x_Y where mask_Y (per stage), else left as it is: one slot on every stage."""
  return buf_YM.at[:, j].set(jnp.where(mask_Y, x_Y, buf_YM[:, j]))


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
  r = cfg.pipeline_repeats
  hit_IYR = (r_IY[..., None] == jnp.arange(r)[None, None]) & valid_IY[..., None]

  def combine(key, x):
    weight_IYR = hit_IYR * (1.0 if key in ROUTING_COUNTS else share_IY[..., None])
    extra = (None,) * (x.ndim - 2)
    summed = jnp.sum(weight_IYR[(..., *extra)] * x[:, :, None], axis=0)  # [S, R, Lc, ...]
    summed = jnp.swapaxes(summed, 0, 1)
    return summed.reshape(-1, *summed.shape[3:])

  return finish_routing_stats({k: combine(k, v) for k, v in stats.items()}, cfg)

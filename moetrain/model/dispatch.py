"""Dispatch of routed assignments to experts: dropless and capacity strategies, and which
grouped-matmul backend runs them (moetrain/kernels/experts.py: ragged_dot on GPU, the Pallas
megablox kernel on TPU, the grouped loop of moetrain/kernels/grouped.py on CPU, a dense
reference). Expert parallelism over the 'expert' mesh axis is in expert_parallel.py.
(Design: docs/design.md, "moetrain/model/dispatch.py".)"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moetrain.kernels import experts, grouped, quant
from moetrain.kernels.lora import with_lora
from moetrain.kernels.rows import dispatch_tokens, gather_rows
from moetrain.model.config import ModelConfig


def sort_assignments(expert_R, num_experts: int):
  """Assignments sorted by expert (stable: token order within an expert); ids >= E go last."""
  expert_R = jnp.minimum(expert_R, num_experts)
  order_R = jnp.argsort(expert_R, stable=True)
  sizes_E = jnp.bincount(expert_R, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  return order_R, expert_R[order_R], sizes_E


class Layout(NamedTuple):
  """Where sorted assignments go: src_P (buffer slot -> sorted row, or n = empty), dest_R
  (sorted row -> slot, or P = not placed), kept_R, and run(buffer, weights, rng) -> outputs."""

  src_P: jax.Array
  dest_R: jax.Array
  kept_R: jax.Array
  run: object


def identity_layout(valid_R, run=None) -> Layout:
  """The sorted rows are the buffer: slot i holds sorted row i where valid_R, else nothing."""
  r = valid_R.shape[0]
  slots_R = jnp.where(valid_R, jnp.arange(r), r)
  return Layout(slots_R, slots_R, valid_R, run)


def place(layout: Layout, order_R):
  """The layout in original assignment order: slot -> assignment, assignment -> slot."""
  # The inverse permutation by a scatter of R integers (cheaper than a second sort).
  inv_R = jnp.zeros_like(order_R).at[order_R].set(jnp.arange(order_R.shape[0], dtype=order_R.dtype))
  asg_P = jnp.take(order_R, layout.src_P, mode='fill', fill_value=order_R.shape[0])
  return asg_P, layout.dest_R[inv_R], layout.kept_R[inv_R]


def spec(cfg: ModelConfig) -> experts.ExpertSpec:
  """The routed experts as the expert kernels see them."""
  return experts.ExpertSpec(
    cfg.engine,
    cfg.lora,
    cfg.n_routed_experts,
    cfg.expert_ffn_hidden_size,
    cfg.swiglu_limit,
    cfg.expert_bias,
  )


def routed_experts(x_MD, idx_MA, gates_MA, weights, cfg: ModelConfig, rng=None):
  """sum_a gate[m,a] * FFN_{idx[m,a]}(x[m]) over routed (non-zero) experts.

  Returns the output [M, D] in the compute dtype and a [M, A] float mask of dropped assignments.
  This is the engine on one device's rows; expert_parallel.routed_experts shards it over the
  'expert' mesh axis.
  """
  e = cfg.n_routed_experts
  order_R, expert_sorted_R, sizes_E = sort_assignments(idx_MA.reshape(-1), e)
  layout = make_layout(expert_sorted_R, sizes_E, cfg, cfg.engine.moe_dispatch)
  asg_P, slot_R, kept_R = place(layout, order_R)
  ref = cfg.engine.reference_kernels
  x_PD = dispatch_tokens(x_MD.astype(cfg.engine.dtype), asg_P, slot_R, reference=ref)
  y_PD = layout.run(x_PD, weights, rng)
  y_RD = gather_rows(y_PD, slot_R, asg_P, reference=ref)
  return combine(y_RD, kept_R, idx_MA, gates_MA, cfg)


def combine(y_RD, kept_R, idx_MA, gates_MA, cfg: ModelConfig):
  """Weights each kept routed assignment by its gate and sums over A, in float32 (the MoE layer
  adds the zero experts' term before it rounds to the compute dtype, once)."""
  m, a = idx_MA.shape
  routed_MA = idx_MA < cfg.n_routed_experts
  kept_MA = kept_R.reshape(m, a) & routed_MA
  w_MA = jnp.where(kept_MA, gates_MA, 0.0)
  y_MD = jnp.einsum('MAD,MA->MD', y_RD.reshape(m, a, -1).astype(jnp.float32), w_MA)
  return y_MD, (routed_MA & ~kept_MA).astype(jnp.float32)


# Backends that run the expert-sorted rows where they lie (an identity layout). Each gives zero
# rows for zero inputs (no biases), so rows past the groups stay zero and take no gradient.
SORTED_ROW_BACKENDS = ('ragged_dot', 'megablox', 'tokamax', 'dense')


def tokamax_installed() -> bool:
  import importlib.util

  return importlib.util.find_spec('tokamax') is not None


def gpu_engine_warning(cfg: ModelConfig) -> str | None:
  """Where a GPU step's experts would run XLA's ragged_dot (dense over every expert unless its
  cuDNN grouped GEMM applies: bf16/f16 on Ampere or newer with cuDNN >= 9.22), the reason and
  the fix; None elsewhere."""
  if cfg.engine.platform != 'gpu' or cfg.engine.moe_dispatch == 'capacity':
    return None
  if resolve_backend(cfg) != 'ragged_dot':
    return None
  chosen = cfg.engine.moe_backend == 'ragged_dot'
  why = "engine.moe_backend='ragged_dot'" if chosen else 'tokamax is not installed'
  return (
    f"The routed experts run XLA's ragged_dot on this GPU ({why}): XLA:GPU computes it as a "
    'dense product over every expert unless its cuDNN grouped GEMM applies (bf16/f16, Ampere or '
    "newer, cuDNN >= 9.22). pip install 'moetrain[gpu]' for tokamax's grouped kernels "
    "(engine.moe_backend='tokamax', the default where it is installed)."
  )


def resolve_backend(cfg: ModelConfig, rows: int = 0) -> str:
  """The grouped-matmul backend for `rows` assignments (0 = unknown: a training batch)."""
  if cfg.engine.moe_backend != 'auto':
    return cfg.engine.moe_backend
  if cfg.engine.platform == 'tpu' and not cfg.lora.enabled:
    # XLA's TPU compiler lowers ragged_dot's weight gradient as one dense matmul over every row
    # per local expert (G times the FLOPs: 13x the model's for the flash pretraining step);
    # megablox's tgmm computes each expert's from its own rows (bench/RESULTS.md).
    return 'megablox'
  if cfg.engine.platform == 'gpu' and tokamax_installed():
    # XLA:GPU runs ragged_dot as a dense product over every expert unless its cuDNN grouped GEMM
    # applies (bench/RESULTS.md, "GPU: one H100"); tokamax's kernels follow the group sizes.
    return 'tokamax'
  if cfg.engine.platform != 'cpu':
    # A LoRA base's expert weights take no gradient; megablox there is opt-in until it has been
    # timed on a TPU.
    return 'ragged_dot'
  # bench/RESULTS.md: for the medium experts (512 x 256) and a training batch 'grouped' beats
  # 'gathered' and 'blocked'. One batched matmul ('gathered') wins where grouped's per-expert
  # loop iterations cannot be amortised: small experts (the tiny default's 128 x 64) and few
  # rows per expert (decoding a handful of tokens).
  big = cfg.hidden_size * cfg.expert_ffn_hidden_size >= 65536
  many = rows == 0 or rows >= 64 * cfg.n_routed_experts
  return 'grouped' if big and many else 'gathered'


def expected_group(cfg: ModelConfig, assignments: int) -> float:
  """Rows an FFN expert receives on average from `assignments` top-k assignments (all shards'
  together under expert parallelism): the FFN share K_e/K of them, over the routed experts."""
  return assignments * cfg.expected_ffn_experts / cfg.moe_topk / cfg.n_routed_experts


def make_layout(
  expert_sorted_R, sizes_E, cfg: ModelConfig, strategy: str, expect: float | None = None
) -> Layout:
  """expect: rows per expert to plan tiles for (default: expected_group of the R assignments)."""
  r = expert_sorted_R.shape[0]
  e = sizes_E.shape[0]
  if strategy == 'capacity':
    return capacity_layout(expert_sorted_R, sizes_E, capacity(r // cfg.moe_topk, cfg), cfg)
  backend = resolve_backend(cfg, r)
  if backend in ('blocked', 'gathered'):
    return blocked_layout(sizes_E, r, cfg)
  if backend == 'grouped':
    g = expected_group(cfg, r) if expect is None else expect
    return grouped_layout(
      expert_sorted_R, sizes_E, grouped.tile_candidates(g, cfg.engine.moe_block_size), cfg
    )
  # Rows past sum(sizes) are zero-expert assignments.
  ident = identity_layout(expert_sorted_R < e)
  if backend == 'ragged_dot':
    return ident._replace(run=lambda x, w, rng: experts.ragged_ffn(x, sizes_E, w, spec(cfg), rng))
  if backend == 'megablox':
    return ident._replace(run=lambda x, w, rng: experts.megablox_ffn(x, sizes_E, w, spec(cfg), rng))
  if backend == 'tokamax':
    return ident._replace(run=lambda x, w, rng: experts.tokamax_ffn(x, sizes_E, w, spec(cfg), rng))
  if backend == 'dense':
    return ident._replace(
      run=lambda x, w, rng: experts.dense_ffn(x, expert_sorted_R, w, spec(cfg), rng)
    )
  raise ValueError(f'engine.moe_backend={backend!r} is unknown')


def block_size(rows: int, experts: int, requested: int) -> int:
  if requested:
    return requested
  # Padding costs < E*b rows; a block must still be a decent matmul for the CPU.
  target = max(rows // (4 * experts), 1)
  return int(min(256, max(16, 2 ** round(math.log2(target)))))


def blocked_layout(sizes_E, r: int, cfg: ModelConfig) -> Layout:
  """CPU backends: each expert's rows padded to blocks of b rows, every block owned by one expert.
  'blocked' scans the blocks and skips unused ones; 'gathered' runs every block as one batched
  matmul against per-block gathered weights (moving nblocks * D * F per projection). Either way
  cost follows the routed rows plus < E*b padding, where ragged_dot's CPU lowering is a dense
  masked matmul that pays for every expert on every row."""
  e = sizes_E.shape[0]
  b = block_size(r, e, cfg.engine.moe_block_size)
  nblocks = -(-r // b) + e
  blocks_E = -(-sizes_E // b)
  block_end_E = jnp.cumsum(blocks_E)
  pad_start_E = (block_end_E - blocks_E) * b
  group_start_E = jnp.cumsum(sizes_E) - sizes_E
  expert_R = jnp.searchsorted(jnp.cumsum(sizes_E), jnp.arange(r), side='right')
  ex_R = jnp.minimum(expert_R, e - 1)
  valid_R = expert_R < e
  dest_R = jnp.where(valid_R, pad_start_E[ex_R] + jnp.arange(r) - group_start_E[ex_R], nblocks * b)
  block_expert = jnp.minimum(
    jnp.searchsorted(block_end_E, jnp.arange(nblocks), side='right'), e - 1
  )
  slot = jnp.arange(nblocks * b)
  ex_P = block_expert[slot // b]
  j_P = slot - pad_start_E[ex_P]
  used = block_end_E[-1]
  src_P = jnp.where((slot // b < used) & (j_P < sizes_E[ex_P]), group_start_E[ex_P] + j_P, r)

  def run(x_PD, weights, rng):
    x_UPD = x_PD.reshape(nblocks, b, -1)
    if resolve_backend(cfg, r) == 'gathered':
      return experts.gathered_ffn(x_UPD, block_expert, weights, spec(cfg), rng)
    return experts.blocked_ffn(x_UPD, block_expert, used, weights, spec(cfg), rng)

  return Layout(src_P, dest_R, valid_R, run)


def grouped_layout(expert_sorted_R, sizes_E, tiles: tuple, cfg: ModelConfig) -> Layout:
  """The sorted rows are the buffer, plus max(tiles) spare zero rows for the last tile to run
  into."""
  r, e = expert_sorted_R.shape[0], sizes_E.shape[0]
  spare = max(tiles)
  groups = grouped.Groups(
    jnp.cumsum(sizes_E) - sizes_E, sizes_E, grouped.choose_tile(sizes_E, tiles)
  )
  valid_R = expert_sorted_R < e
  rows = jnp.arange(r)
  src_P = jnp.concatenate([jnp.where(valid_R, rows, r), jnp.full((spare,), r, rows.dtype)])

  def run(x_PD, weights, rng):
    w_train, w_frozen = grouped.split_trainable(weights)
    ref = cfg.engine.reference_kernels
    y_PD = grouped.expert_ffn(x_PD, w_train, w_frozen, groups, rng, tiles, spec(cfg), reference=ref)
    return checkpoint_name(y_PD, experts.EXPERT_OUTPUT)

  return Layout(src_P, jnp.where(valid_R, rows, r + spare), valid_R, run)


def capacity(num_tokens: int, cfg: ModelConfig) -> int:
  """Per-expert buffer: capacity_factor times the rows an FFN expert receives at balance from
  num_tokens tokens (expected_group: the K_e of the balancing targets, over the E experts)."""
  share = expected_group(cfg, num_tokens * cfg.moe_topk)
  return max(1, math.ceil(cfg.engine.moe_capacity_factor * share))


def capacity_layout(expert_sorted_R, sizes_E, c: int, cfg: ModelConfig) -> Layout:
  """Fixed buffers [E, C, D]: the first C assignments of each expert (in token order) are kept,
  the rest dropped and reported."""
  r, e = expert_sorted_R.shape[0], sizes_E.shape[0]
  group_start_E = jnp.cumsum(sizes_E) - sizes_E
  ex_R = jnp.minimum(expert_sorted_R, e - 1)
  pos_R = jnp.arange(r) - group_start_E[ex_R]
  kept_R = (expert_sorted_R < e) & (pos_R < c)
  slot = jnp.arange(e * c)
  ex_P, pos_P = slot // c, slot % c
  src_P = jnp.where(pos_P < sizes_E[ex_P], group_start_E[ex_P] + pos_P, r)
  dt = jnp.dtype(cfg.engine.dtype)

  def run(x_PD, weights, rng):
    def mm(x, w):
      return jnp.einsum('ECD,EDF->ECF', x, quant.dequant(w, dt))

    mm = with_lora(mm, weights, cfg, rng)
    return experts.swiglu(x_PD.reshape(e, c, -1), mm, spec(cfg)).reshape(e * c, -1)

  return Layout(src_P, jnp.where(kept_R, ex_R * c + pos_R, e * c), kept_R, run)

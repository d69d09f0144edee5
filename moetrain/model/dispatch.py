"""Dispatch of routed assignments to experts: dropless and capacity strategies, the grouped-matmul
backends (ragged_dot on GPU, the Pallas megablox kernel on TPU, a grouped loop on CPU, a dense
reference). Expert parallelism over the 'expert' mesh axis is in expert_parallel.py.

Every path has the same shape: sort assignments by expert, choose a *layout* (which buffer slot
each assignment occupies), gather tokens into the buffer, run the expert SwiGLU on the buffer,
gather results back to assignments, and sum them with their gates. Index movement is done with
gathers in both passes (custom VJPs): XLA:CPU runs scatters serially, which dominated the step.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moetrain.model import quant, vjp
from moetrain.model.config import ModelConfig
from moetrain.model.layers import dtype_of, lora_dropout, lora_product


def _take(x, idx):
  # The barrier was meant to keep XLA from fusing the index arithmetic into the gather (session
  # 2). With jax 0.10.2 XLA:CPU drops it before fusion: the compiled layer holds no barrier and
  # the arithmetic sits in the gather's fusion. Gathers rebuilt on clean indices measured the
  # same (bench/RESULTS.md, session 5), so it stays as a harmless hint.
  idx = jax.lax.optimization_barrier(idx)
  return jnp.take(x, idx, axis=0, mode='fill', fill_value=0)


@jax.custom_vjp
def gather_rows(x, idx, inv):
  """x[idx] (out-of-range -> zero rows) for an injective idx whose inverse is inv."""
  return _take(x, idx)


gather_rows.defvjp(
  lambda x, idx, inv: (_take(x, idx), inv), lambda inv, g: (_take(g, inv), None, None)
)


@jax.custom_vjp
def dispatch_tokens(x_MD, asg_P, slot_R):
  """Buffer rows from tokens: slot p holds token asg_P[p] // A (asg_P out of range = empty).
  A token fills up to A slots, so the backward sums its A assignment slots (slot_R is [M*A])."""
  m = x_MD.shape[0]
  a = slot_R.shape[0] // m
  return _take(x_MD, jnp.where(asg_P < m * a, asg_P // a, m))


def _dispatch_bwd(res, g_PD):
  slot_R, m = res
  # Gather, then sum the A slots of each token. The barrier was meant to keep XLA:CPU from
  # fusing the gather into the reduction (~8x slower, session 2); see _take on barriers today.
  g_RD = jax.lax.optimization_barrier(_take(g_PD, slot_R))
  return g_RD.reshape(m, -1, g_PD.shape[-1]).sum(1), None, None


dispatch_tokens.defvjp(
  lambda x, asg, slot: (dispatch_tokens(x, asg, slot), (slot, x.shape[0])), _dispatch_bwd
)


def swiglu(x, mm, dtype):
  h = jax.nn.silu(mm(x, 'gate').astype(jnp.float32)) * mm(x, 'up').astype(jnp.float32)
  return mm(h.astype(dtype), 'down')


def with_lora(base_mm, weights, scale, rng, dropout):
  """Adds the per-expert adapters as two small grouped matmuls on the permuted rows. Where they
  are one expert's 2-D factors (the grouped and blocked tiles), layers.lora_product runs them:
  its backward keeps their gradients on the fast matmul path."""

  def mm(x, name):
    y = base_mm(x, weights[name])
    if f'{name}_lora_a' in weights:
      xa = lora_dropout(x, dropout, None if rng is None else jax.random.fold_in(rng, len(name)))
      a, b = weights[f'{name}_lora_a'], weights[f'{name}_lora_b']
      if a.ndim == 2:
        y = y + scale * lora_product(xa, a.astype(xa.dtype), b.astype(xa.dtype))
      else:
        y = y + scale * base_mm(base_mm(xa, a), b)
    return y

  return mm


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


def routed_experts(x_MD, idx_MA, gates_MA, weights, cfg: ModelConfig, rng=None):
  """sum_a gate[m,a] * FFN_{idx[m,a]}(x[m]) over routed (non-zero) experts.

  Returns the output [M, D] in the compute dtype and a [M, A] float mask of dropped assignments.
  This is the engine on one device's rows; expert_parallel.routed_experts shards it over the
  'expert' mesh axis.
  """
  e = cfg.n_routed_experts
  order_R, expert_sorted_R, sizes_E = sort_assignments(idx_MA.reshape(-1), e)
  layout = make_layout(expert_sorted_R, sizes_E, cfg, cfg.moe_dispatch)
  asg_P, slot_R, kept_R = place(layout, order_R)
  x_PD = dispatch_tokens(x_MD.astype(dtype_of(cfg.dtype)), asg_P, slot_R)
  y_PD = layout.run(x_PD, weights, rng)
  y_RD = gather_rows(y_PD, slot_R, asg_P)
  return combine(y_RD, kept_R, idx_MA, gates_MA, cfg)


def combine(y_RD, kept_R, idx_MA, gates_MA, cfg: ModelConfig):
  """Weights each kept routed assignment by its gate and sums over A."""
  m, a = idx_MA.shape
  routed_MA = idx_MA < cfg.n_routed_experts
  kept_MA = kept_R.reshape(m, a) & routed_MA
  w_MA = jnp.where(kept_MA, gates_MA, 0.0)
  y_MD = jnp.einsum('MAD,MA->MD', y_RD.reshape(m, a, -1).astype(jnp.float32), w_MA)
  return y_MD.astype(dtype_of(cfg.dtype)), (routed_MA & ~kept_MA).astype(jnp.float32)


def resolve_backend(cfg: ModelConfig, rows: int = 0) -> str:
  """The grouped-matmul backend for `rows` assignments (0 = unknown: a training batch)."""
  if cfg.moe_backend != 'auto':
    return cfg.moe_backend
  if jax.default_backend() != 'cpu':
    # 'megablox' (the Pallas TPU kernel) is opt-in until it has been timed on a TPU.
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
    return grouped_layout(expert_sorted_R, sizes_E, tile_candidates(g, cfg.moe_block_size), cfg)
  # Rows past sum(sizes) are zero-expert assignments.
  ident = identity_layout(expert_sorted_R < e)
  if backend == 'ragged_dot':
    return ident._replace(run=lambda x, w, rng: ragged_ffn(x, sizes_E, w, cfg, rng))
  if backend == 'megablox':
    return ident._replace(run=lambda x, w, rng: megablox_ffn(x, sizes_E, w, cfg, rng))
  if backend == 'dense':
    return ident._replace(run=lambda x, w, rng: dense_ffn(x, expert_sorted_R, w, cfg, rng))
  raise ValueError(f'model.moe_backend={backend!r} is unknown')


def ragged_ffn(x_RD, sizes_E, weights, cfg: ModelConfig, rng):
  dt = dtype_of(cfg.dtype)

  def mm(x, w):
    return jax.lax.ragged_dot(x, quant.dequant(w, dt), sizes_E, preferred_element_type=dt)

  return swiglu(x_RD, with_lora(mm, weights, cfg.lora.scale, rng, cfg.lora.dropout), dt)


def _gmm_tile(k: int, n: int) -> int | None:
  """One megablox tile for both the K and N dimensions: its VJP reuses the forward's tiling for
  the transposed products, so the tile must suit both (TPU lanes: a multiple of 128 dividing
  each). None where there is none (small LoRA ranks)."""
  return next((t for t in (512, 256, 128) if k % t == 0 and n % t == 0), None)


def megablox_interpret() -> bool:
  """The megablox kernel is Mosaic (TPU) code; elsewhere Pallas interprets it."""
  return jax.default_backend() != 'tpu'


def megablox_ffn(x_RD, sizes_E, weights, cfg: ModelConfig, rng):
  """The Pallas TPU grouped matmul (jax.experimental.pallas.ops.tpu.megablox) for the expert
  weights; the LoRA adapters' thin products (rank < 128) go through ragged_dot. Off TPU the
  kernel runs in Pallas' interpret mode: slow, but it checks this path on CPU. Rows are padded
  to a multiple of the row tile, and the kernel leaves rows past the groups (zero-expert
  assignments, padding) unwritten, so they are masked to zeros, which also keeps their garbage
  out of the gradients."""
  from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

  dt = dtype_of(cfg.dtype)
  r = x_RD.shape[0]
  tm = 128 if r >= 128 else -(-r // 16) * 16
  rows = -(-r // tm) * tm
  inside = (jnp.arange(rows) < jnp.sum(sizes_E))[:, None]
  interpret = megablox_interpret()

  def mm(x, w):
    w = quant.dequant(w, dt)
    t = _gmm_tile(*w.shape[1:])
    if t is None:  # the thin LoRA products: XLA's ragged_dot
      y = jax.lax.ragged_dot(x.astype(dt), w, sizes_E, preferred_element_type=dt)
    else:
      y = megablox.gmm(x.astype(dt), w, sizes_E, dt, (tm, t, t), None, None, False, interpret)
    return jnp.where(inside, y, 0)

  x_PD = jnp.where(inside, jnp.pad(x_RD, ((0, rows - r), (0, 0))), 0)
  mm = with_lora(mm, weights, cfg.lora.scale, rng, cfg.lora.dropout)
  return swiglu(x_PD, mm, dt)[:r]


def dense_ffn(x_RD, expert_R, weights, cfg: ModelConfig, rng):
  """Reference backend: every row multiplies its own expert's gathered weights."""
  dt = dtype_of(cfg.dtype)
  e_R = jnp.minimum(expert_R, cfg.n_routed_experts - 1)

  def mm(x, w):
    return jnp.einsum('rd,rdf->rf', x, quant.dequant(quant.take(w, e_R), dt))

  return swiglu(x_RD, with_lora(mm, weights, cfg.lora.scale, rng, cfg.lora.dropout), dt)


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
  b = block_size(r, e, cfg.moe_block_size)
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
    x_NBD = x_PD.reshape(nblocks, b, -1)
    if resolve_backend(cfg, r) == 'gathered':
      return gathered_ffn(x_NBD, block_expert, weights, cfg, rng)
    return blocked_ffn(x_NBD, block_expert, used, weights, cfg, rng)

  return Layout(src_P, dest_R, valid_R, run)


def blocked_ffn(x_NBD, block_expert_N, used, weights, cfg: ModelConfig, rng):
  """A scan over blocks; blocks past `used` (the padding left by zero-expert assignments) are
  skipped by a cond, so their matmuls never run."""
  n, b, d = x_NBD.shape
  dt = dtype_of(cfg.dtype)

  def ffn(x_BD, ex, k):
    w = {name: quant.take(v, ex) for name, v in weights.items()}
    mm = with_lora(
      lambda x, wt: x @ quant.dequant(wt, dt),
      w,
      cfg.lora.scale,
      None if rng is None else jax.random.fold_in(rng, k),
      cfg.lora.dropout,
    )
    return swiglu(x_BD, mm, dt).astype(dt)

  def body(_, inp):
    x_BD, ex, k = inp
    skip = lambda x, ex, k: jnp.zeros((b, d), dt)
    return None, jax.lax.cond(k < used, ffn, skip, x_BD, ex, k)

  _, y_NBD = jax.lax.scan(body, None, (x_NBD, block_expert_N, jnp.arange(n)))
  return y_NBD.reshape(n * b, d)


@jax.custom_vjp
def take_experts(w_EX, block_expert_N):
  """Per-block weights w[block_expert]; the weight gradient is a one-hot matmul over blocks
  (a dense segment sum) instead of XLA:CPU's serial scatter-add."""
  return jnp.take(w_EX, block_expert_N, axis=0)


def _take_experts_bwd(res, g_NX):
  block_expert_N, e = res
  onehot_NE = jax.nn.one_hot(block_expert_N, e, dtype=g_NX.dtype)
  return jnp.tensordot(onehot_NE, g_NX, axes=(0, 0)), None


take_experts.defvjp(lambda w, n: (take_experts(w, n), (n, w.shape[0])), _take_experts_bwd)


def gathered_ffn(x_NBD, block_expert_N, weights, cfg: ModelConfig, rng):
  n, b, d = x_NBD.shape
  dt = dtype_of(cfg.dtype)
  w_N = {
    name: quant.take(v, block_expert_N)
    if isinstance(v, quant.QTensor)
    else take_experts(v, block_expert_N)
    for name, v in weights.items()
  }

  def mm(x, w):
    return jnp.einsum('NBD,NDF->NBF', x, quant.dequant(w, dt))

  mm = with_lora(mm, w_N, cfg.lora.scale, rng, cfg.lora.dropout)
  return swiglu(x_NBD, mm, dt).reshape(n * b, d)


class Groups(NamedTuple):
  """Expert groups of sorted rows: group e is rows [start[e], start[e] + size[e]); tile picks
  the row tile among the engine's candidates (see choose_tile)."""

  start: jax.Array
  size: jax.Array
  tile: jax.Array | int = 0


def _by_tile(tiles: tuple, groups: Groups, run):
  """run(b) for the row tile b = tiles[groups.tile]: a switch when there are several, so only
  the chosen tiling's loop runs."""
  if len(tiles) == 1:
    return run(tiles[0])
  return jax.lax.switch(groups.tile, [functools.partial(run, b) for b in tiles])


def _group_loop(groups: Groups, b: int, tile, init, open_expert, close_expert=None):
  """For each expert e in order: local = open_expert(e) (its weight slice, an accumulator);
  then for each b-row tile of its group in row order, with row its first row and valid how
  many rows are e's: carry, local = tile(local, row, valid, carry); finally
  carry = close_expert(e, local, carry)."""

  def expert(e, carry):
    def body(j, c):
      size = groups.size[e] - j * b
      return tile(c[1], groups.start[e] + j * b, jnp.minimum(size, b), c[0])

    carry, local = jax.lax.fori_loop(0, -(-groups.size[e] // b), body, (carry, open_expert(e)))
    return close_expert(e, local, carry) if close_expert else carry

  return jax.lax.fori_loop(0, groups.size.shape[0], expert, init)


def _split_trainable(weights: dict):
  """Float weights may get gradients; quantised (QLoRA) base weights are frozen by construction.
  Which float weights are actually differentiated (not the base under LoRA) is known only in the
  VJP's forward rule (symbolic zeros), which narrows the gradient work to those."""
  frozen = {k: v for k, v in weights.items() if isinstance(v, quant.QTensor)}
  return {k: v for k, v in weights.items() if k not in frozen}, frozen


def _expert_slice(tree, e):
  return jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, e, keepdims=False), tree)


def _tile_fns(cfg: ModelConfig):
  """The expert SwiGLU on one tile in two halves, so the forward loop can keep gate and up for
  the backward instead of recomputing them: (gate, up) = first(w, x); y = second(w, gate, up).
  LoRA dropout keys fold in the tile's first row, so both loops draw the same masks."""
  dt = dtype_of(cfg.dtype)

  def mm(w, key):
    return with_lora(
      lambda x, wt: x @ quant.dequant(wt, dt), w, cfg.lora.scale, key, cfg.lora.dropout
    )

  def first(w, x, key):
    f = mm(w, key)
    return f(x, 'gate'), f(x, 'up')

  def second(w, gate, up, key):
    h = jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)
    return mm(w, key)(h.astype(dt), 'down')

  return first, second


def _tile_key(rng, row):
  return None if rng is None else jax.random.fold_in(rng, row)


def _ffn_forward(x_PD, w_train, w_frozen, groups, rng, tiles, cfg):
  first, second = _tile_fns(cfg)
  f = cfg.expert_ffn_hidden_size
  p, dt = x_PD.shape[0], x_PD.dtype
  init = (jnp.zeros_like(x_PD), jnp.zeros((p, f), dt), jnp.zeros((p, f), dt))

  def weights(e):
    return {**_expert_slice(w_train, e), **_expert_slice(w_frozen, e)}

  def loop(b):
    def tile(w, row, valid, carry):
      key = _tile_key(rng, row)
      gate, up = first(w, jax.lax.dynamic_slice_in_dim(x_PD, row, b), key)
      y = second(w, gate, up, key)
      put = lambda buf, v: jax.lax.dynamic_update_slice_in_dim(buf, v.astype(dt), row, 0)
      return tuple(put(buf, v) for buf, v in zip(carry, (y, gate, up))), w

    return _group_loop(groups, b, tile, init, weights)

  return _by_tile(tiles, groups, loop)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def expert_ffn(x_PD, w_train, w_frozen, groups: Groups, rng, tiles: tuple, cfg: ModelConfig):
  """The routed experts' SwiGLU (with their LoRA adapters) over expert-sorted rows, sized by the
  dynamic group sizes: per expert, a loop over its group's b-row tiles, each a few 2-D matmuls
  against that expert's weights (sliced once per expert). The CPU backend: cost follows the
  routed rows plus < b per expert, where ragged_dot's CPU lowering pays for every expert on
  every row. A group's last tile runs into the next group's rows, which that group's own tiles
  overwrite later (tiles go in row order); the max(tiles) spare rows at the end take the last
  overrun. The tile is tiles[groups.tile], chosen at run time from the group sizes; forward and
  backward use the same one (LoRA dropout keys fold in each tile's first row)."""
  return _ffn_forward(x_PD, w_train, w_frozen, groups, rng, tiles, cfg)[0]


def _expert_ffn_fwd(x_PD, w_train, w_frozen, groups, rng, tiles, cfg):
  # symbolic_zeros: each leaf arrives as CustomVJPPrimal(value, perturbed). Weights that no one
  # differentiates (frozen experts under LoRA) get no gradient loop work at all.
  need = {k: p.value for k, p in w_train.items() if p.perturbed}
  rest = {k: p.value for k, p in w_train.items() if not p.perturbed} | vjp.values(w_frozen)
  x_PD, groups, rng = vjp.values((x_PD, groups, rng))
  y, gate, up = _ffn_forward(x_PD, need, rest, groups, rng, tiles, cfg)
  return y, (x_PD, gate, up, need, rest, groups, rng, dict.fromkeys(w_train))


def _expert_ffn_bwd(tiles, cfg, res, g_PD):
  x_PD, gate_PF, up_PF, w_train, w_frozen, groups, rng, train_keys = res
  g_PD = vjp.dense(g_PD)
  first, second = _tile_fns(cfg)
  f32 = lambda t: jax.tree.map(lambda v: v.astype(jnp.float32), t)

  def open_expert(e):
    # The expert's weights and a float32 accumulator for its weight gradients.
    zero = jax.tree.map(lambda v: jnp.zeros(v.shape[1:], jnp.float32), w_train)
    return _expert_slice(w_train, e), _expert_slice(w_frozen, e), zero

  def close_expert(e, local, carry):
    dx_PD, dw_E = carry
    put = lambda d, a: jax.lax.dynamic_update_index_in_dim(d, a, e, 0)
    return dx_PD, jax.tree.map(put, dw_E, local[2])

  def loop(b):
    rows = lambda buf, row: jax.lax.dynamic_slice_in_dim(buf, row, b)

    def tile(local, row, valid, carry):
      (dx_PD, dw_E), (train_e, frozen_e, acc) = carry, local
      key = _tile_key(rng, row)
      g = rows(g_PD, row).astype(x_PD.dtype)
      if w_train:
        # Rows past the group belong to the next expert: they must not reach this expert's
        # weight gradients. (Their dx rows are rewritten by the next expert's tiles, later.)
        g = jnp.where((jnp.arange(b) < valid)[:, None], g, 0)
      _, vjp2 = jax.vjp(
        lambda wt, gate, up: second({**wt, **frozen_e}, gate, up, key),
        train_e,
        rows(gate_PF, row),
        rows(up_PF, row),
      )
      dw2, dgate, dup = vjp2(g)
      _, vjp1 = jax.vjp(lambda wt, x: first({**wt, **frozen_e}, x, key), train_e, rows(x_PD, row))
      dw1, dx = vjp1((dgate, dup))
      dx_PD = jax.lax.dynamic_update_slice_in_dim(dx_PD, dx.astype(dx_PD.dtype), row, 0)
      acc = jax.tree.map(lambda a, u, v: a + u + v, acc, f32(dw1), f32(dw2))
      return (dx_PD, dw_E), (train_e, frozen_e, acc)

    dw_init = jax.tree.map(lambda v: jnp.zeros(v.shape, jnp.float32), w_train)
    init = (jnp.zeros_like(x_PD), dw_init)
    return _group_loop(groups, b, tile, init, open_expert, close_expert)

  dx_PD, dw_E = _by_tile(tiles, groups, loop)
  dw = {k: dw_E[k].astype(w_train[k].dtype) if k in w_train else None for k in train_keys}
  return dx_PD, dw, None, None, None


expert_ffn.defvjp(_expert_ffn_fwd, _expert_ffn_bwd, symbolic_zeros=True)


TILE_OVERHEAD_ROWS = 32  # a tile's fixed cost (loop trip, slices) in rows of matmul work


def tile_rows(expect: float, most: int = 256) -> int:
  """The row tile that fits groups of about `expect` rows: the fewest tiles of at most `most`
  rows that cover 1.1 x expect (a typical group's spread), each a multiple of 16."""
  need = 1.1 * max(expect, 1.0)
  return int(16 * math.ceil(need / math.ceil(need / most) / 16))


def tile_candidates(expect: float, requested: int = 0) -> tuple:
  """The grouped engine's row tiles for groups of about `expect` rows (model.moe_block_size
  fixes one): the tile that fits them, 128 for skewed routing (a group's last tile is padded,
  by b/2 rows on average) and, for groups up to 512 rows, one tile per group (each tile is a loop
  trip: fewer, larger tiles run faster when the groups are even, as under LongCat's balancing).
  choose_tile picks one per batch from the actual group sizes."""
  if requested:
    return (requested,)
  one = {tile_rows(expect, 512)} if 1.1 * expect <= 512 else set()  # one tile per group
  return tuple(sorted({tile_rows(expect), 128} | one))


def choose_tile(sizes_E, tiles: tuple):
  """Index of the tile with the least work for these group sizes: padded rows plus a fixed cost
  per tile."""
  if len(tiles) == 1:
    return 0
  cost = [jnp.sum(-(-sizes_E // b) * (b + TILE_OVERHEAD_ROWS)) for b in tiles]
  return jnp.argmin(jnp.stack(cost)).astype(jnp.int32)


def grouped_layout(expert_sorted_R, sizes_E, tiles: tuple, cfg: ModelConfig) -> Layout:
  """The sorted rows are the buffer, plus max(tiles) spare zero rows for the last tile to run
  into."""
  r, e = expert_sorted_R.shape[0], sizes_E.shape[0]
  spare = max(tiles)
  groups = Groups(jnp.cumsum(sizes_E) - sizes_E, sizes_E, choose_tile(sizes_E, tiles))
  valid_R = expert_sorted_R < e
  rows = jnp.arange(r)
  src_P = jnp.concatenate([jnp.where(valid_R, rows, r), jnp.full((spare,), r, rows.dtype)])

  def run(x_PD, weights, rng):
    w_train, w_frozen = _split_trainable(weights)
    return expert_ffn(x_PD, w_train, w_frozen, groups, rng, tiles, cfg)

  return Layout(src_P, jnp.where(valid_R, rows, r + spare), valid_R, run)


def capacity(num_tokens: int, cfg: ModelConfig) -> int:
  """Per-expert buffer: capacity_factor times the uniform share of the M*A assignments."""
  share = num_tokens * cfg.moe_topk / cfg.num_experts_total
  return max(1, math.ceil(cfg.moe_capacity_factor * share))


def capacity_layout(expert_sorted_R, sizes_E, c: int, cfg: ModelConfig) -> Layout:
  """Fixed buffers [E, C, D]: the first C assignments of each expert (in token order) are kept,
  the rest dropped and reported."""
  r, e = expert_sorted_R.shape[0], sizes_E.shape[0]
  group_start_E = jnp.cumsum(sizes_E) - sizes_E
  ex_R = jnp.minimum(expert_sorted_R, e - 1)
  pos_R = jnp.arange(r) - group_start_E[ex_R]
  kept_R = (expert_sorted_R < e) & (pos_R < c)
  slot = jnp.arange(e * c)
  ex_S, pos_S = slot // c, slot % c
  src_S = jnp.where(pos_S < sizes_E[ex_S], group_start_E[ex_S] + pos_S, r)
  dt = dtype_of(cfg.dtype)

  def run(x_SD, weights, rng):
    def mm(x, w):
      return jnp.einsum('ECD,EDF->ECF', x, quant.dequant(w, dt))

    mm = with_lora(mm, weights, cfg.lora.scale, rng, cfg.lora.dropout)
    return swiglu(x_SD.reshape(e, c, -1), mm, dt).reshape(e * c, -1)

  return Layout(src_S, jnp.where(kept_R, ex_R * c + pos_R, e * c), kept_R, run)

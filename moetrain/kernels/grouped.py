"""The grouped expert engine, the CPU default (engine.moe_backend 'grouped'): the routed experts'
SwiGLU over expert-sorted rows as, per expert, a loop over row tiles of its group, each a few 2-D
matmuls against that expert's weights. Cost follows the routed rows (plus < one tile per expert),
where ragged_dot's CPU lowering pays for every expert on every row. The row tile is chosen per
batch from the group sizes (choose_tile). dispatch.grouped_layout places rows for it.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moetrain.kernels import Kernel, experts, quant, vjp
from moetrain.kernels.lora import with_lora


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


def split_trainable(weights: dict):
  """Float weights may get gradients; quantised (QLoRA) base weights are frozen by construction.
  Which float weights are actually differentiated (not the base under LoRA) is known only in the
  VJP's forward rule (symbolic zeros), which narrows the gradient work to those."""
  frozen = {k: v for k, v in weights.items() if isinstance(v, quant.QTensor)}
  return {k: v for k, v in weights.items() if k not in frozen}, frozen


def _expert_slice(tree, e):
  return jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, e, keepdims=False), tree)


def _tile_fns(spec: experts.ExpertSpec):
  """The expert SwiGLU on one tile in two halves, so the forward loop can keep gate and up for
  the backward instead of recomputing them: (gate, up) = first(w, x); y = second(w, gate, up).
  LoRA dropout keys fold in the tile's first row, so both loops draw the same masks."""
  dt = jnp.dtype(spec.engine.dtype)

  def mm(w, key):
    return with_lora(lambda x, wt: x @ quant.dequant(wt, dt), w, spec, key)

  def first(w, x, key):
    f = mm(w, key)
    return experts.biased(f, x, 'gate', spec), experts.biased(f, x, 'up', spec)

  def second(w, gate, up, key):
    h = experts.activation(gate, up, spec).astype(dt)
    return experts.biased(mm(w, key), h, 'down', spec)

  return first, second


def _tile_key(rng, row):
  return None if rng is None else jax.random.fold_in(rng, row)


def _ffn_forward(x_PD, w_train, w_frozen, groups, rng, tiles, spec):
  first, second = _tile_fns(spec)
  f = spec.hidden
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
def _expert_ffn(
  x_PD, w_train, w_frozen, groups: Groups, rng, tiles: tuple, spec: experts.ExpertSpec
):
  """The routed experts' SwiGLU (with their LoRA adapters) over expert-sorted rows, sized by the
  dynamic group sizes: per expert, a loop over its group's b-row tiles, each a few 2-D matmuls
  against that expert's weights (sliced once per expert). The CPU backend: cost follows the
  routed rows plus < b per expert, where ragged_dot's CPU lowering pays for every expert on
  every row. A group's last tile runs into the next group's rows, which that group's own tiles
  overwrite later (tiles go in row order); the max(tiles) spare rows at the end take the last
  overrun. The tile is tiles[groups.tile], chosen at run time from the group sizes; forward and
  backward use the same one (LoRA dropout keys fold in each tile's first row)."""
  return _ffn_forward(x_PD, w_train, w_frozen, groups, rng, tiles, spec)[0]


def _expert_ffn_fwd(x_PD, w_train, w_frozen, groups, rng, tiles, spec):
  # symbolic_zeros: each leaf arrives as CustomVJPPrimal(value, perturbed). Weights that no one
  # differentiates (frozen experts under LoRA) get no gradient loop work at all.
  need = {k: p.value for k, p in w_train.items() if p.perturbed}
  rest = {k: p.value for k, p in w_train.items() if not p.perturbed} | vjp.values(w_frozen)
  x_PD, groups, rng = vjp.values((x_PD, groups, rng))
  y, gate, up = _ffn_forward(x_PD, need, rest, groups, rng, tiles, spec)
  # Named as experts.swiglu names them: a remat policy that saves them (engine.remat='save_moe',
  # with the outputs named in dispatch.grouped_layout) spares the backward pass this loop's
  # second run, its matmuls and dequantisation (bench/RESULTS.md, "CPU host plans").
  x_PD = checkpoint_name(x_PD, experts.EXPERT_INPUT)
  gate, up = checkpoint_name(gate, experts.EXPERT_GATE), checkpoint_name(up, experts.EXPERT_UP)
  return y, (x_PD, gate, up, need, rest, groups, rng, dict.fromkeys(w_train))


def _expert_ffn_bwd(tiles, spec, res, g_PD):
  x_PD, gate_PF, up_PF, w_train, w_frozen, groups, rng, train_keys = res
  g_PD = vjp.dense(g_PD)
  first, second = _tile_fns(spec)
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


_expert_ffn.defvjp(_expert_ffn_fwd, _expert_ffn_bwd, symbolic_zeros=True)


def _expert_ffn_reference(x_PD, w_train, w_frozen, groups: Groups, rng, tiles: tuple, spec):
  """Every row of a group against its expert's gathered weights (experts.dense_ffn), rows past
  the groups zero. LoRA dropout masks are drawn per projection over all rows, not per tile: with
  lora.dropout > 0 this agrees with the fast path in distribution, not value by value."""
  ends_E = groups.start + groups.size
  expert_P = jnp.searchsorted(ends_E, jnp.arange(x_PD.shape[0]), side='right')
  y_PD = experts.dense_ffn(x_PD, expert_P, {**w_train, **w_frozen}, spec, rng)
  inside_P = expert_P < ends_E.shape[0]  # groups start at row 0 and follow one another
  return jnp.where(inside_P[:, None], y_PD, 0).astype(x_PD.dtype)


expert_ffn = Kernel('expert_ffn', _expert_ffn, _expert_ffn_reference)


TILE_OVERHEAD_ROWS = 32  # a tile's fixed cost (loop trip, slices) in rows of matmul work


def tile_rows(expect: float, most: int = 256) -> int:
  """The row tile that fits groups of about `expect` rows: the fewest tiles of at most `most`
  rows that cover 1.1 x expect (a typical group's spread), each a multiple of 16."""
  need = 1.1 * max(expect, 1.0)
  return int(16 * math.ceil(need / math.ceil(need / most) / 16))


def tile_candidates(expect: float, requested: int = 0) -> tuple:
  """The grouped engine's row tiles for groups of about `expect` rows (engine.moe_block_size
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

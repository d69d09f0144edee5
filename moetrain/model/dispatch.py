"""Dispatch of routed assignments to experts: dropless and capacity strategies, and the
grouped-matmul backends (ragged_dot on GPU/TPU, an expert-blocked loop on CPU, a dense reference).

Every backend runs the same expert function `swiglu(x, matmul)`, where `matmul(x, name)` knows
how this backend multiplies rows by the weights of their own expert.
"""

import math

import jax
import jax.numpy as jnp

from moetrain.model import quant
from moetrain.model.config import ModelConfig
from moetrain.model.layers import dtype_of, lora_dropout


def swiglu(x, mm, dtype):
  h = jax.nn.silu(mm(x, 'gate').astype(jnp.float32)) * mm(x, 'up').astype(jnp.float32)
  return mm(h.astype(dtype), 'down')


def with_lora(base_mm, weights, scale, rng, dropout):
  """Adds the per-expert adapters as two small grouped matmuls on the permuted rows."""

  def mm(x, name):
    y = base_mm(x, weights[name])
    if f'{name}_lora_a' in weights:
      xa = lora_dropout(x, dropout, None if rng is None else jax.random.fold_in(rng, len(name)))
      h = base_mm(xa, weights[f'{name}_lora_a'])
      y = y + scale * base_mm(h, weights[f'{name}_lora_b'])
    return y

  return mm


def sort_assignments(idx_MA, num_experts: int):
  """Flattened assignments sorted by expert; zero-expert ones (id >= E) go last, unsized."""
  m, a = idx_MA.shape
  expert_R = jnp.minimum(idx_MA.reshape(m * a), num_experts)
  order_R = jnp.argsort(expert_R, stable=True)
  sizes_E = jnp.bincount(expert_R, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  return order_R, expert_R[order_R], sizes_E


def routed_experts(x_MD, idx_MA, gates_MA, weights, cfg: ModelConfig, rng=None):
  """sum_a gate[m,a] * FFN_{idx[m,a]}(x[m]) over routed (non-zero) experts.

  Returns the output [M, D] in the compute dtype and a [M, A] float mask of dropped assignments.
  With an 'expert' mesh axis > 1 the experts run expert-parallel (see expert_parallel).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if cfg.moe_expert_parallel and not mesh.empty and dict(mesh.shape).get('expert', 1) > 1:
    return expert_parallel(x_MD, idx_MA, gates_MA, weights, cfg, rng, mesh)
  return local_routed_experts(x_MD, idx_MA, gates_MA, weights, cfg, rng)


def local_routed_experts(x_MD, idx_MA, gates_MA, weights, cfg: ModelConfig, rng=None):
  m, a = idx_MA.shape
  e = cfg.n_routed_experts
  dt = dtype_of(cfg.dtype)
  order_R, expert_sorted_R, sizes_E = sort_assignments(idx_MA, e)
  x_RD = x_MD.astype(dt)[order_R // a]
  if cfg.moe_dispatch == 'capacity':
    y_RD, kept_R = capacity_ffn(x_RD, expert_sorted_R, sizes_E, weights, cfg, rng)
  else:
    y_RD, kept_R = grouped_ffn(x_RD, sizes_E, weights, cfg, rng), expert_sorted_R < e
  inv_R = jnp.argsort(order_R)
  y_MAD = y_RD[inv_R].reshape(m, a, -1)
  routed_MA = (idx_MA < e)
  kept_MA = kept_R[inv_R].reshape(m, a)
  w_MA = jnp.where(kept_MA & routed_MA, gates_MA, 0.0)
  y_MD = jnp.einsum('MAD,MA->MD', y_MAD.astype(jnp.float32), w_MA)
  return y_MD.astype(dt), (routed_MA & ~kept_MA).astype(jnp.float32)


def resolve_backend(cfg: ModelConfig) -> str:
  if cfg.moe_backend != 'auto':
    return cfg.moe_backend
  return 'blocked' if jax.default_backend() == 'cpu' else 'ragged_dot'


def grouped_ffn(x_RD, sizes_E, weights, cfg: ModelConfig, rng=None):
  """Dropless: rows sorted by expert, group sizes E; rows past sum(sizes) come back as zeros."""
  dt = dtype_of(cfg.dtype)
  backend = resolve_backend(cfg)
  lora = (cfg.lora.scale, rng, cfg.lora.dropout)
  if backend == 'ragged_dot':
    def mm(x, w):
      return jax.lax.ragged_dot(x, quant.dequant(w, dt), sizes_E, preferred_element_type=dt)
    return swiglu(x_RD, with_lora(mm, weights, *lora), dt)
  if backend == 'dense':
    expert_R = jnp.searchsorted(jnp.cumsum(sizes_E), jnp.arange(x_RD.shape[0]), side='right')
    valid_R = expert_R < sizes_E.shape[0]
    expert_R = jnp.minimum(expert_R, sizes_E.shape[0] - 1)

    def mm(x, w):
      return jnp.einsum('rd,rdf->rf', x, quant.dequant(quant.take(w, expert_R), dt))
    y = swiglu(x_RD, with_lora(mm, weights, *lora), dt)
    return jnp.where(valid_R[:, None], y, 0)
  return blocked_ffn(x_RD, sizes_E, weights, cfg, rng)


def block_size(rows: int, experts: int, requested: int) -> int:
  if requested:
    return requested
  # Padding costs < E*b rows; a block must still be a decent matmul for the CPU.
  target = max(rows // (4 * experts), 1)
  return int(min(256, max(32, 2 ** round(math.log2(target)))))


def blocked_ffn(x_RD, sizes_E, weights, cfg: ModelConfig, rng=None):
  """CPU backend: groups padded to blocks of b rows, each block owned by one expert; a scan over
  blocks runs the expert FFN on blocks in use and skips the rest, so cost follows the routed rows
  (not E x rows as ragged_dot's dense lowering on CPU does)."""
  r, d = x_RD.shape
  e = sizes_E.shape[0]
  dt = dtype_of(cfg.dtype)
  b = block_size(r, e, cfg.moe_block_size)
  nblocks = -(-r // b) + e
  blocks_E = -(-sizes_E // b)
  block_end_E = jnp.cumsum(blocks_E)
  pad_start_E = (block_end_E - blocks_E) * b
  group_start_E = jnp.cumsum(sizes_E) - sizes_E
  expert_R = jnp.searchsorted(jnp.cumsum(sizes_E), jnp.arange(r), side='right')
  valid_R = expert_R < e
  expert_R = jnp.minimum(expert_R, e - 1)
  dest_R = jnp.where(valid_R, pad_start_E[expert_R] + jnp.arange(r) - group_start_E[expert_R],
                     nblocks * b)
  x_pad = jnp.zeros((nblocks * b, d), dt).at[dest_R].set(x_RD, mode='drop')
  block_expert = jnp.minimum(jnp.searchsorted(block_end_E, jnp.arange(nblocks), side='right'), e - 1)
  used = block_end_E[-1]

  def body(_, inp):
    x_bD, ex, k = inp
    w = {n: quant.take(v, ex) for n, v in weights.items()}
    mm = with_lora(lambda x, wt: x @ quant.dequant(wt, dt), w, cfg.lora.scale,
                   None if rng is None else jax.random.fold_in(rng, k), cfg.lora.dropout)
    y = jax.lax.cond(k < used, lambda: swiglu(x_bD, mm, dt).astype(dt),
                     lambda: jnp.zeros((b, d), dt))
    return None, y

  _, y_blocks = jax.lax.scan(
    body, None, (x_pad.reshape(nblocks, b, d), block_expert, jnp.arange(nblocks)))
  y_RD = y_blocks.reshape(nblocks * b, -1)[jnp.minimum(dest_R, nblocks * b - 1)]
  return jnp.where(valid_R[:, None], y_RD, 0)


def capacity(num_tokens: int, cfg: ModelConfig) -> int:
  """Per-expert buffer: capacity_factor times the uniform share of the M*A assignments."""
  share = num_tokens * cfg.moe_topk / cfg.num_experts_total
  return max(1, math.ceil(cfg.moe_capacity_factor * share))


def capacity_ffn(x_RD, expert_sorted_R, sizes_E, weights, cfg: ModelConfig, rng=None):
  """Fixed buffers [E, C, D]: the first C assignments of each expert (in token order) are kept,
  the rest dropped and reported."""
  r, d = x_RD.shape
  e = sizes_E.shape[0]
  dt = dtype_of(cfg.dtype)
  c = capacity(r // cfg.moe_topk, cfg)
  group_start_E = jnp.cumsum(sizes_E) - sizes_E
  ex_R = jnp.minimum(expert_sorted_R, e - 1)
  pos_R = jnp.arange(r) - group_start_E[ex_R]
  kept_R = (expert_sorted_R < e) & (pos_R < c)
  slot_R = jnp.where(kept_R, ex_R * c + pos_R, e * c)
  x_ECD = jnp.zeros((e * c, d), dt).at[slot_R].set(x_RD, mode='drop').reshape(e, c, d)

  def mm(x, w):
    return jnp.einsum('ECD,EDF->ECF', x, quant.dequant(w, dt))

  y_ECD = swiglu(x_ECD, with_lora(mm, weights, cfg.lora.scale, rng, cfg.lora.dropout), dt)
  y_RD = y_ECD.reshape(e * c, -1)[jnp.minimum(slot_R, e * c - 1)]
  return jnp.where(kept_R[:, None], y_RD, 0), kept_R


def expert_parallel(x_MD, idx_MA, gates_MA, weights, cfg: ModelConfig, rng, mesh):
  """shard_map over the mesh: tokens stay sharded over the batch axes, experts over 'expert'.
  Each shard packs its assignments into fixed [ep, cap, D] send buffers by destination shard,
  all_to_all's them (fixed sizes: this runs on XLA:CPU, which lacks ragged_all_to_all), runs its
  local experts on what it received, and all_to_all's the results back."""
  sizes = dict(mesh.shape)
  batch = tuple(a for a in ('data', 'fsdp', 'expert') if sizes.get(a, 1) > 1)
  tok = jax.sharding.PartitionSpec(batch)
  w_specs = jax.tree.map(lambda _: jax.sharding.PartitionSpec('expert'), weights)
  rng_data = None if rng is None else jax.random.key_data(rng)

  def local(x, idx, gates, w, key_data):
    key = None if key_data is None else jax.random.fold_in(
      jax.random.wrap_key_data(key_data), jax.lax.axis_index(batch))
    return _ep_shard(x, idx, gates, w, cfg, sizes['expert'], key)

  fn = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, w_specs, jax.sharding.PartitionSpec()),
                     out_specs=(tok, tok), check_vma=False)
  return fn(x_MD, idx_MA, gates_MA, weights, rng_data)


def ep_capacity(rows: int, cfg: ModelConfig, ep: int) -> int:
  """Send-buffer rows per destination shard: all local rows for dropless (no drop is possible),
  else capacity_factor times a shard's uniform share."""
  if cfg.moe_dispatch == 'dropless':
    return rows
  share = rows * cfg.n_routed_experts / cfg.num_experts_total / ep
  return max(1, min(rows, math.ceil(cfg.moe_capacity_factor * share)))


def _ep_shard(x_MD, idx_MA, gates_MA, weights, cfg: ModelConfig, ep: int, rng):
  m, a = idx_MA.shape
  d = x_MD.shape[-1]
  e = cfg.n_routed_experts
  e_loc = e // ep
  dt = dtype_of(cfg.dtype)
  r = m * a
  order_R, expert_sorted_R, _ = sort_assignments(idx_MA, e)
  dest_R = expert_sorted_R // e_loc  # == ep for zero-expert assignments
  counts = jnp.bincount(dest_R, length=ep + 1)[:ep]
  start = jnp.cumsum(counts) - counts
  pos_R = jnp.arange(r) - start[jnp.minimum(dest_R, ep - 1)]
  cap = ep_capacity(r, cfg, ep)
  kept_R = (dest_R < ep) & (pos_R < cap)
  slot_R = jnp.where(kept_R, dest_R * cap + pos_R, ep * cap)
  send_x = jnp.zeros((ep * cap, d), dt).at[slot_R].set(x_MD.astype(dt)[order_R // a], mode='drop')
  send_e = jnp.full((ep * cap,), e_loc, jnp.int32).at[slot_R].set(
    (expert_sorted_R % e_loc).astype(jnp.int32), mode='drop')
  recv_x = jax.lax.all_to_all(send_x.reshape(ep, cap, d), 'expert', 0, 0).reshape(ep * cap, d)
  recv_e = jax.lax.all_to_all(send_e.reshape(ep, cap), 'expert', 0, 0).reshape(ep * cap)
  # Local experts on the received rows (padding rows carry id e_loc and sort last).
  order2 = jnp.argsort(recv_e, stable=True)
  sizes = jnp.bincount(recv_e, length=e_loc + 1)[:e_loc].astype(jnp.int32)
  y_sorted = grouped_ffn(recv_x[order2], sizes, weights, cfg, rng)
  y_recv = y_sorted[jnp.argsort(order2)].reshape(ep, cap, d)
  y_back = jax.lax.all_to_all(y_recv, 'expert', 0, 0).reshape(ep * cap, d)
  y_R = jnp.where(kept_R[:, None], y_back[jnp.minimum(slot_R, ep * cap - 1)], 0)
  inv_R = jnp.argsort(order_R)
  y_MAD = y_R[inv_R].reshape(m, a, d)
  routed_MA = idx_MA < e
  kept_MA = kept_R[inv_R].reshape(m, a)
  w_MA = jnp.where(kept_MA & routed_MA, gates_MA, 0.0)
  y_MD = jnp.einsum('MAD,MA->MD', y_MAD.astype(jnp.float32), w_MA)
  return y_MD.astype(dt), (routed_MA & ~kept_MA).astype(jnp.float32)

"""Expert parallelism over the 'expert' mesh axis: the routed experts' weights are sharded over it
and each token's assignments travel to the shards that own their experts and back, in fixed-size
buffers (all_to_all: runs everywhere, XLA:CPU included) or ragged ones (ragged_all_to_all on
GPU/TPU, emulated from fixed-size collectives on CPU). Each shard runs the single-device engine of
moetrain.model.dispatch on the rows it received.
"""

import math

import jax
import jax.numpy as jnp

from moetrain.core import axes
from moetrain.core.sharding import MESH_AXES, logical_to_spec
from moetrain.kernels.exchange import Exchange, ragged_exchange
from moetrain.kernels.rounds import round_sum
from moetrain.kernels.rows import dispatch_tokens, gather_rows
from moetrain.model import dispatch
from moetrain.model.config import ModelConfig


def routed_experts(x_MD, idx_MA, gates_MA, weights, cfg: ModelConfig, rng=None):
  """dispatch.routed_experts, expert-parallel (see expert_parallel) when the routed experts are
  split over more than one shard (cfg.expert_shards, from the mesh startup.build laid it out for);
  on each batch shard (per_batch_shard) where the backend is a kernel XLA cannot partition, and
  for capacity dispatch: each shard's experts keep capacity_factor times that shard's balanced
  rows (GShard's groups, as the fixed exchange does under expert parallelism). Left to XLA, the
  capacity sort ran over the whole global batch: Mixtral-8x7B at 32,768 tokens per chip on a
  v6e-256 asked 1.66 TB of temporaries per chip (bench/RESULTS.md, "Calibration on MaxText's
  published runs")."""
  if cfg.engine.expert_shards > 1:
    return expert_parallel(x_MD, idx_MA, gates_MA, weights, cfg, rng)
  unpartitioned = (
    dispatch.resolve_backend(cfg) == 'megablox' or cfg.engine.moe_dispatch == 'capacity'
  )
  if unpartitioned and math.prod(cfg.engine.mesh_shape) > 1:
    return per_batch_shard(x_MD, idx_MA, gates_MA, weights, cfg, rng)
  return dispatch.routed_experts(x_MD, idx_MA, gates_MA, weights, cfg, rng)


def _sharded(shard, x_MD, idx_MA, gates_MA, weights, cfg: ModelConfig, w_spec, rng):
  """shard(x, idx, gates, w, key) in a shard_map over the mesh in context: tokens sharded over
  the batch axes and 'context' (a row's tokens split over it stay split: [B, T] flattened row by
  row keeps T's shards inner), the weights by w_spec (one spec for every leaf, or a tree of them
  like weights'), each shard's dropout key folded with its index. Tokens that the shards do not
  divide (a decode step's one per row) are padded with rows for no expert, as moe.py's padding."""
  sizes = dict(zip(MESH_AXES, cfg.engine.mesh_shape))
  batch = tuple(a for a in ('data', 'fsdp', 'expert', 'context') if sizes.get(a, 1) > 1)
  tok = jax.sharding.PartitionSpec(batch)
  m, pad = x_MD.shape[0], -x_MD.shape[0] % math.prod(sizes[a] for a in batch)
  if pad:
    rows = ((0, pad), (0, 0))
    x_MD, gates_MA = jnp.pad(x_MD, rows), jnp.pad(gates_MA, rows)
    idx_MA = jnp.pad(idx_MA, rows, constant_values=cfg.num_experts_total)
  rng_data = None if rng is None else jax.random.key_data(rng)

  def local(x, idx, gates, w, key_data):
    key = (
      None
      if key_data is None
      else jax.random.fold_in(jax.random.wrap_key_data(key_data), jax.lax.axis_index(batch))
    )
    return shard(x, idx, gates, w, key)

  fn = jax.shard_map(
    local,
    in_specs=(tok, tok, tok, w_spec, jax.sharding.PartitionSpec()),
    out_specs=(tok, tok),
    check_vma=False,
  )
  y_MD, dropped_MA = fn(x_MD, idx_MA, gates_MA, weights, rng_data)
  return y_MD[:m], dropped_MA[:m]


# Logical letters of the routed experts' stacked weights (model/moe.py Experts).
# Their biases (gpt-oss) are weights of one input ('I'), the constant 1.
EXPERT_LETTERS = {
  'gate': 'EDF',
  'up': 'EDF',
  'down': 'EFD',
  'gate_bias': 'EIF',
  'up_bias': 'EIF',
  'down_bias': 'EID',
}


def stored_specs(weights, cfg: ModelConfig) -> dict:
  """Each expert weight's PartitionSpec as the rules store it (plain base arrays), P() for the
  rest (LoRA adapters, a quantised base: small, or codes the engine decodes whole)."""
  sizes = dict(zip(MESH_AXES, cfg.engine.mesh_shape))
  whole = jax.sharding.PartitionSpec()

  def spec(name, w):
    if name not in EXPERT_LETTERS or not isinstance(w, jax.Array | jax.ShapeDtypeStruct):
      return jax.tree.map(lambda _: whole, w)
    names = axes.names(EXPERT_LETTERS[name], F=axes.EXPERT_MLP)
    return logical_to_spec(names, w.shape, cfg.engine.rules.weights, sizes)

  return {name: spec(name, w) for name, w in weights.items()}


def gathered(w, spec, dtype):
  """w (a shard inside a shard_map whose in_spec for it was `spec`) cast to `dtype` and gathered
  whole along every dimension the spec shards. Autodiff sums its gradient over the shards as a
  reduce-scatter in `dtype` (XLA:TPU: an all-reduce and a slice), as GSPMD sums every other
  weight's gradient in the step. Taken replicated (in_specs P()) and cast inside instead, the
  weight's gradient was summed whole in float32: 1.75 GiB per layer and chip alive at the
  Mixtral-8x7B step's peak (bench/RESULTS.md, "Peer comparison")."""
  w = w.astype(dtype)
  for dim, mesh_axes in enumerate(spec):
    if mesh_axes is not None:
      w = jax.lax.all_gather(w, mesh_axes, axis=dim, tiled=True)
  return w


def per_batch_shard(x_MD, idx_MA, gates_MA, weights, cfg: ModelConfig, rng):
  """The single-device engine on each batch shard's tokens: for megablox, whose Mosaic kernel
  XLA cannot partition ("Mosaic kernels cannot be automatically partitioned"), and for capacity
  dispatch (its capacity from the shard's tokens). The experts'
  weights enter as the rules store them and are gathered whole in the compute dtype inside
  (gathered), so their gradients leave by reduce-scatter."""
  specs = stored_specs(weights, cfg)
  dtype = jnp.dtype(cfg.engine.dtype)

  def shard(x, idx, gates, w, key):
    w = {k: gathered(v, specs[k], dtype) if k in EXPERT_LETTERS else v for k, v in w.items()}
    return dispatch.routed_experts(x, idx, gates, w, cfg, key)

  return _sharded(shard, x_MD, idx_MA, gates_MA, weights, cfg, specs, rng)


def resolve_ep_comm(cfg: ModelConfig) -> str:
  if cfg.engine.moe_ep_comm != 'auto':
    return cfg.engine.moe_ep_comm
  return 'fixed' if cfg.engine.platform == 'cpu' else 'ragged'


def expert_parallel(x_MD, idx_MA, gates_MA, weights, cfg: ModelConfig, rng):
  """shard_map over the mesh of cfg.mesh_shape (the one in context, jax.set_mesh): tokens stay sharded over the batch axes, experts over 'expert'.
  Two token exchanges (engine.moe_ep_comm):
    fixed:  each shard packs its assignments into [ep, cap, D] send buffers by destination shard
            and all_to_all's them (fixed sizes, so it runs everywhere, XLA:CPU included); the
            receiver sorts what it got by local expert.
    ragged: ragged_all_to_all sends each expert group straight to its place in the receiver's
            expert-sorted buffer (GPU/TPU; on CPU an emulation from fixed-size collectives, so
            the bookkeeping is tested on CPU meshes).
  Either way the local experts run on the received rows and the results travel back the same way.
  Capacity dispatch keeps per-expert buffers: ragged keeps each expert's first C assignments of
  the exchange's shards in token order (exactly one device's capacity dispatch of those tokens);
  fixed keeps each expert's first c of every shard's own assignments (GShard's groups; c from
  one shard's tokens), so a skewed shard can drop rows one device would have kept."""
  ep = dict(zip(MESH_AXES, cfg.engine.mesh_shape))['expert']

  def shard(x, idx, gates, w, key):
    run = _ep_ragged_shard if resolve_ep_comm(cfg) == 'ragged' else _ep_shard
    return run(x, idx, gates, w, cfg, ep, key)

  w_spec = jax.sharding.PartitionSpec('expert')
  return _sharded(
    shard, x_MD, idx_MA, gates_MA, weights, cfg, jax.tree.map(lambda _: w_spec, weights), rng
  )


def ep_capacity(rows: int, cfg: ModelConfig, ep: int) -> int:
  """Send-buffer rows per destination shard of the fixed exchange, for `rows` local assignments:
  all of them for dropless (no drop is possible); for capacity, each of the destination's
  experts' buffer of dispatch.capacity(this shard's tokens) rows."""
  if cfg.engine.moe_dispatch == 'dropless':
    return rows
  return cfg.n_routed_experts // ep * dispatch.capacity(rows // cfg.moe_topk, cfg)


def _ep_shard(x_MD, idx_MA, gates_MA, weights, cfg: ModelConfig, ep: int, rng):
  ref = cfg.engine.reference_kernels
  d = x_MD.shape[-1]
  e = cfg.n_routed_experts
  e_loc = e // ep
  # Send layout: slots [ep, cap] by destination shard (zero-expert assignments go nowhere).
  order_R, expert_sorted_R, sizes_E = dispatch.sort_assignments(idx_MA.reshape(-1), e)
  cap = ep_capacity(expert_sorted_R.shape[0], cfg, ep)
  if cfg.engine.moe_dispatch == 'capacity':
    # Per-expert buffers of this shard's tokens (GShard's groups): slots [E, c] are [ep, e_loc*c]
    # by destination shard. Each expert keeps the first c of each shard's assignments.
    send = dispatch.capacity_layout(expert_sorted_R, sizes_E, cap // e_loc, cfg)
  else:
    shard_sizes = sizes_E.reshape(ep, e_loc).sum(-1)
    send = dispatch.capacity_layout(
      jnp.minimum(expert_sorted_R // e_loc, ep), shard_sizes, cap, cfg
    )
  asg_P, slot_R, kept_R = dispatch.place(send, order_R)
  send_x = dispatch_tokens(x_MD.astype(cfg.engine.dtype), asg_P, slot_R, reference=ref)
  send_e = jnp.take(
    (expert_sorted_R % e_loc).astype(jnp.int32), send.src_P, mode='fill', fill_value=e_loc
  )
  recv_x = jax.lax.all_to_all(send_x.reshape(ep, cap, d), 'expert', 0, 0).reshape(ep * cap, d)
  recv_e = jax.lax.all_to_all(send_e.reshape(ep, cap), 'expert', 0, 0).reshape(ep * cap)
  # Local experts on the received rows (padding rows carry id e_loc and are never placed).
  order2, sorted2, sizes2 = dispatch.sort_assignments(recv_e, e_loc)
  local = dispatch.make_layout(
    sorted2, sizes2, cfg, 'dropless', dispatch.expected_group(cfg, ep * idx_MA.size)
  )
  asg2, slot2, _ = dispatch.place(local, order2)
  y_buf = local.run(gather_rows(recv_x, asg2, slot2, reference=ref), weights, rng)
  y_recv = gather_rows(y_buf, slot2, asg2, reference=ref).reshape(ep, cap, d)
  y_back = jax.lax.all_to_all(y_recv, 'expert', 0, 0).reshape(ep * cap, d)
  return dispatch.combine(
    gather_rows(y_back, slot_R, asg_P, reference=ref), kept_R, idx_MA, gates_MA, cfg
  )


def ep_recv_rows(rows: int, cfg: ModelConfig, ep: int) -> int:
  """Receive buffer of the ragged exchange, for `rows` local assignments per shard: for capacity,
  the local experts' buffers of dispatch.capacity(all shards' tokens) rows each."""
  if cfg.engine.moe_dispatch == 'capacity':
    return cfg.n_routed_experts // ep * ep_expert_capacity(rows, cfg, ep)
  if cfg.engine.moe_ep_recv_factor:
    return max(1, min(ep * rows, math.ceil(cfg.engine.moe_ep_recv_factor * rows)))
  return ep * rows


def ep_expert_capacity(rows: int, cfg: ModelConfig, ep: int) -> int:
  """The ragged exchange's per-expert capacity: the single-device one for all shards' tokens."""
  return dispatch.capacity(ep * rows // cfg.moe_topk, cfg)


def ep_rounds(rows: int, cfg: ModelConfig, ep: int) -> int:
  """Exchange rounds a dropless ragged exchange may need for `rows` local assignments per shard:
  1 with the worst-case buffer; with a bounded one (engine.moe_ep_overflow='rounds') as many as
  the worst case fills (each round runs only where some shard's rows still overflow)."""
  if cfg.engine.moe_dispatch != 'dropless' or cfg.engine.moe_ep_overflow != 'rounds':
    return 1
  return -(-ep * rows // ep_recv_rows(rows, cfg, ep))


def ragged_plan(counts_GE, me, e_loc: int, buf: int, cap: int = 0, start=0):
  """The exchange of expert groups for every shard's group sizes counts_GE [ep, E] (all shards
  compute the same plan). Receive buffers are sorted by local expert, then by source shard, so
  the received rows are already grouped for the grouped matmul. With cap > 0 each expert keeps
  its first cap rows in source-shard order, i.e. in global token order, as one device's capacity
  dispatch does. A buffer of `buf` rows takes rows [start, start + buf) of that order (a round
  of the exchange; rows outside it are sent in another round or dropped). Returns the exchange,
  this shard's rows per expert sent in it [E] and its local experts' received group sizes
  [e_loc]."""
  ep, e = counts_GE.shape
  before_GE = jnp.cumsum(counts_GE, axis=0) - counts_GE  # the expert's rows on earlier shards
  sent_GE = jnp.clip(cap - before_GE, 0, counts_GE) if cap else counts_GE
  total_GE = sent_GE.sum(0).reshape(ep, e_loc)
  start_E = (jnp.cumsum(total_GE, axis=1) - total_GE).reshape(e)
  off_GE = start_E[None] + jnp.cumsum(sent_GE, axis=0) - sent_GE
  # Each group's rows before the round's window, and before its end.
  lo_GE = jnp.clip(start - off_GE, 0, sent_GE)
  kept_GE = jnp.clip(start + buf - off_GE, 0, sent_GE) - lo_GE
  out_GE = jnp.clip(off_GE + lo_GE - start, 0, buf)  # outside the window: empty slices at an end
  in_GE = jnp.cumsum(counts_GE, axis=1) - counts_GE + lo_GE
  # What I receive, source-major: [ep sources, my e_loc experts] flattened.
  mine = lambda a_GE: jax.lax.dynamic_slice_in_dim(a_GE, me * e_loc, e_loc, axis=1).reshape(e)
  ex = Exchange(
    in_off=in_GE[me],
    send=kept_GE[me],
    out_off=out_GE[me],
    recv=mine(kept_GE),
    recv_off=mine(out_GE),
    src_off=mine(in_GE),
  )
  return ex, kept_GE[me], mine(kept_GE).reshape(ep, e_loc).sum(0)


def _ep_ragged_shard(x_MD, idx_MA, gates_MA, weights, cfg: ModelConfig, ep: int, rng):
  """One shard's side of the ragged exchange: sort by expert, send each group to its expert's
  shard, run the local experts on the (already expert-sorted) rows received, send them back.
  A bounded receive buffer either drops what overflows it or takes it in further rounds."""
  ref = cfg.engine.reference_kernels
  e = cfg.n_routed_experts
  e_loc = e // ep
  order_R, expert_sorted_R, sizes_E = dispatch.sort_assignments(idx_MA.reshape(-1), e)
  r = expert_sorted_R.shape[0]
  buf = ep_recv_rows(r, cfg, ep)
  rounds = ep_rounds(r, cfg, ep)
  cap = ep_expert_capacity(r, cfg, ep) if cfg.engine.moe_dispatch == 'capacity' else 0
  counts_GE = jax.lax.all_gather(sizes_E, 'expert')
  me = jax.lax.axis_index('expert')
  ex, kept_E, local_sizes = ragged_plan(counts_GE, me, e_loc, buf, cap)
  # Send buffer: the expert-sorted rows; each group sends its first kept_E[e] rows (all of them,
  # over the rounds).
  sent_R = expert_sorted_R < e
  if rounds == 1:
    ex_R = jnp.minimum(expert_sorted_R, e - 1)
    sent_R &= jnp.arange(r) - ex.in_off[ex_R] < kept_E[ex_R]
  asg_P, slot_R, kept_R = dispatch.place(dispatch.identity_layout(sent_R), order_R)
  send_x = dispatch_tokens(x_MD.astype(cfg.engine.dtype), asg_P, slot_R, reference=ref)
  emulate = cfg.engine.platform == 'cpu'
  expect = dispatch.expected_group(cfg, ep * idx_MA.size)

  def exchange(ex: Exchange, local_sizes, send_x, weights, key):
    """send_x's rows of `ex` to their experts' shards, through the local experts, and back (in
    send order; rows not in `ex` come back zero)."""
    recv_x = ragged_exchange(send_x, ex, buf, 'expert', emulate, reference=ref)
    # Received rows are sorted by local expert; rows past the groups are empty (id e_loc).
    expert_P = jnp.searchsorted(jnp.cumsum(local_sizes), jnp.arange(buf), side='right')
    local = dispatch.make_layout(expert_P, local_sizes, cfg, 'dropless', expect)
    if dispatch.resolve_backend(cfg, buf) in dispatch.SORTED_ROW_BACKENDS:
      # The received rows are the layout: no copy in and out of it (each a [buf, D] buffer in
      # both passes). Rows past the groups are zeros (the exchange's fill) and are never sent
      # back.
      y_recv = local.run(recv_x, weights, key)
    else:
      y_buf = local.run(gather_rows(recv_x, local.src_P, local.dest_R, reference=ref), weights, key)
      y_recv = gather_rows(y_buf, local.dest_R, local.src_P, reference=ref)
    return ragged_exchange(y_recv, ex.reverse(), r, 'expert', emulate, reference=ref)

  y_sorted = exchange(ex, local_sizes, send_x, weights, rng)
  if rounds > 1:
    # Rows [k * buf, (k + 1) * buf) of every receiver's stream in round k, while the fullest
    # receiver (the same on every shard: from the all-gathered counts) has rows there.
    most = jnp.max(counts_GE.sum(0).reshape(ep, e_loc).sum(1))

    def overflow(k, diff, static):
      counts_GE, me, key = static  # arrays come in as arguments: round_sum's VJP reruns this
      ex, _, local_sizes = ragged_plan(counts_GE, me, e_loc, buf, 0, k * buf)
      return exchange(ex, local_sizes, *diff, None if key is None else jax.random.fold_in(key, k))

    n = (most + buf - 1) // buf
    static = (counts_GE, me, rng)
    y_sorted += round_sum(overflow, rounds, n, (send_x, weights), static, reference=ref)
  return dispatch.combine(
    gather_rows(y_sorted, slot_R, asg_P, reference=ref), kept_R, idx_MA, gates_MA, cfg
  )

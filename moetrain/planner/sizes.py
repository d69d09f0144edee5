"""A run's size without running it: parameter counts (total, routed, active per token,
adapters), the expert-parallel exchange and loss-block buffers, and the step's largest buffers by
arithmetic. Shared by the planner's CLI (tools/plan.py), its TPU compiles (planner/tpu_plan.py)
and the trainer's --dry_run."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.core import sharding
from moetrain.model import expert_parallel
from moetrain.model.transformer import Transformer
from moetrain.run.startup import build


def _size(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


def param_counts(cfg) -> dict:
  """Base parameters (LoRA adapters apart) and those a token activates, by FFN experts used.
  Counted unquantised: a QLoRA base holds the same parameters in fewer bytes."""
  cfg = cfg.with_engine(quant='none')
  model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
  adapters = _size(nnx.state(model, nnx.LoRAParam))
  base = _size(nnx.state(model, nnx.Param)) - adapters
  embed = cfg.vocab_size * cfg.hidden_size
  per_expert = 3 * cfg.hidden_size * cfg.expert_ffn_hidden_size * cfg.num_moe_layers
  routed = per_expert * cfg.n_routed_experts
  k_e = balance_target(cfg)
  active = {k: base - embed - routed + k * per_expert for k in (0, k_e, cfg.moe_topk)}
  return {'total': base, 'routed_experts': routed, 'adapters': adapters, 'active': active}


def balance_target(cfg) -> float:
  """K_e, the FFN experts per token that balancing aims at (LongCat: 8 of top-12); an int
  where it is whole, as param_counts' 'active' keys hold it."""
  k_e = cfg.expected_ffn_experts
  return int(k_e) if float(k_e).is_integer() else k_e


def ep_exchange(cfg, mesh_shape, seq_len: int, batch_size: int) -> dict:
  """Per MoE layer and shard, the expert-parallel exchange's receive buffer (rows, and bytes in
  the compute dtype) for each exchange `engine.moe_ep_comm` may use, for `batch_size` rows per
  forward pass (a micro-batch under gradient accumulation); {} without expert parallelism.
  Dropless buffers are sized for the worst case unless bounded (engine.moe_ep_recv_factor; then
  `rounds` is the most rounds of that buffer the exchange may take, engine.moe_ep_overflow)."""
  sizes = dict(zip(sharding.MESH_AXES, sharding.full_shape(mesh_shape)))
  ep = sizes.get('expert', 1)
  if ep <= 1 or not cfg.engine.moe_expert_parallel:
    return {}
  # A row split over 'context' splits its tokens there too (model/expert_parallel.py).
  shards = sizes.get('data', 1) * sizes.get('fsdp', 1) * ep * sizes.get('context', 1)
  rows = batch_size * seq_len // shards * cfg.moe_topk  # local assignments
  recv = {
    'fixed': ep * expert_parallel.ep_capacity(rows, cfg, ep),
    'ragged': expert_parallel.ep_recv_rows(rows, cfg, ep),
  }
  comms = ('fixed', 'ragged') if cfg.engine.moe_ep_comm == 'auto' else (cfg.engine.moe_ep_comm,)
  itemsize = jnp.dtype(cfg.engine.dtype).itemsize
  return {
    c: {
      'local_rows': rows,
      'recv_rows': recv[c],
      'recv_bytes': recv[c] * cfg.hidden_size * itemsize,
      'worst_case': recv[c] == ep * rows,
      'rounds': expert_parallel.ep_rounds(rows, cfg, ep) if c == 'ragged' else 1,
    }
    for c in comms
  }


def routed_rows(cfg, mesh_shape, seq_len: int, batch_size: int) -> float:
  """The rows a balanced routing sends each device's grouped expert matmuls in one forward pass
  of `batch_size` rows (a micro-batch under gradient accumulation): its tokens (the batch split
  over data, fsdp, expert and context) times the FFN experts per token (LongCat's zero experts
  take no rows). With expert parallelism each shard receives as many as it sends, whatever its
  receive buffer holds. Pipeline stages split the micro-batch again: the rows of one of
  engine.pipeline_microbatches."""
  sizes = dict(zip(sharding.MESH_AXES, sharding.full_shape(mesh_shape)))
  shards = sizes['data'] * sizes['fsdp'] * sizes['expert'] * sizes['context']
  if cfg.engine.pipeline_stages > 1:
    batch_size = batch_size / cfg.engine.pipeline_microbatches
  return batch_size * seq_len / shards * cfg.expected_ffn_experts


def loss_block(cfg, mesh_shape, seq_len: int, batch_size: int) -> dict:
  """The largest activation of the loss: one block of float32 logits, [B, loss_chunk, V], per
  device (after the activation rules shard it over the mesh) for `batch_size` rows per forward
  pass (a micro-batch under gradient accumulation), and the whole-logits size it replaces."""
  c = cfg.engine.loss_chunk if 0 < cfg.engine.loss_chunk < seq_len else seq_len
  mesh = jax.sharding.AbstractMesh(sharding.full_shape(mesh_shape), sharding.MESH_AXES)
  shape = (batch_size, c, cfg.vocab_size)
  spec = sharding.logical_to_spec(
    ('batch', 'seq', 'vocab'), shape, cfg.engine.rules.activations, dict(mesh.shape)
  )
  local = jax.sharding.NamedSharding(mesh, spec).shard_shape(shape)
  return {
    'block_shape': local,
    'block_bytes': math.prod(local) * 4,
    'whole_bytes': math.prod(local) * 4 * seq_len // c,
  }


def step_buffers(cfg, mesh_shape, seq_len: int, batch_size: int) -> dict:
  """The arithmetic of one training step's largest temporaries per device, for `batch_size` rows
  per forward pass, to set beside the compiler's figure. Under remat the peak is the backward of
  one MoE layer, which holds, each once: the rows the experts run on (received rows, [R, D]),
  their gate/up products [R, 2F] and SwiGLU [R, F], the same three as gradients plus the
  gradient arriving at the outputs [R, D]; the shard's own assignment rows (sent, returned and
  their two gradients, [r, D] each); its experts' weights, a buffer of their own whether
  gathered over fsdp or sliced out of the scanned stack (the grouped-matmul kernels cannot read
  a slice in place), dequantised for QLoRA. Beside it: the
  layer inputs the scan keeps (one [b, T, D] per layer), one attention block's float32 scores and
  their gradient, one loss block's float32 logits and their gradient. R is the exchange's
  receive buffer (engine.moe_ep_recv_factor) or, without expert parallelism, the local rows; a
  bounded buffer that takes overflow in rounds holds one more round's rows in the backward."""
  sizes = dict(zip(sharding.MESH_AXES, sharding.full_shape(mesh_shape)))
  shards = sizes['data'] * sizes['fsdp'] * sizes['expert']
  b = max(batch_size // shards, 1)  # rows per device
  item = jnp.dtype(cfg.engine.dtype).itemsize
  d, f = cfg.hidden_size, cfg.expert_ffn_hidden_size
  ex = ep_exchange(cfg, mesh_shape, seq_len, batch_size)
  comm = expert_parallel.resolve_ep_comm(cfg) if ex else None
  t = seq_len // sizes['context']  # a device's tokens of a row
  local = ex[comm]['local_rows'] if ex else b * t * cfg.moe_topk
  recv = ex[comm]['recv_rows'] if ex else local
  ep = sizes['expert'] if ex else 1
  quant_item = {'none': jnp.dtype(cfg.engine.param_dtype).itemsize, 'int8': 1, 'int4': 0.5}[
    cfg.engine.quant
  ]
  gathered = cfg.n_routed_experts // ep * 3 * d * f
  gathered *= (item if cfg.engine.quant != 'none' else 0) + quant_item
  chunk = cfg.engine.attention_chunk if 0 < cfg.engine.attention_chunk < seq_len else seq_len
  heads = (
    cfg.num_heads // sizes['tensor'] if cfg.num_heads % sizes['tensor'] == 0 else cfg.num_heads
  )
  moe = {
    'received rows [R, D] and their gradient, gradient at the outputs': 3 * recv * d * item,
    'gate/up [R, 2F], SwiGLU [R, F] and their gradients': 6 * recv * f * item,
    'assignment rows [r, D]: sent, returned, two gradients': 4 * local * d * item,
    "the layer's expert weights (gathered over fsdp or sliced; dequantised)": gathered,
  }
  if ex and ex[comm]['rounds'] > 1:
    # Overflow rounds (engine.moe_ep_overflow): one round recomputed with its gradient while the
    # first round's buffers are kept for its own backward.
    moe['an overflow round: its received rows, gate/up, SwiGLU and gradients'] = (
      3 * recv * d + 6 * recv * f
    ) * item
  out = {
    'moe_layer': moe,
    'moe_layer_bytes': sum(moe.values()),
    'recv_rows': recv,
    'local_rows': local,
    'layer_inputs_bytes': cfg.num_layers * b * t * d * item,
    'attention_block_bytes': 2 * b * heads * chunk * seq_len * 4,
    'loss_block_bytes': 2 * loss_block(cfg, mesh_shape, seq_len, batch_size)['block_bytes'],
  }
  out['total_bytes'] = (
    out['moe_layer_bytes']
    + out['layer_inputs_bytes']
    + max(out['attention_block_bytes'], out['loss_block_bytes'])
  )
  return out


def count_text(n: float) -> str:
  for unit, size in (('B', 1e9), ('M', 1e6), ('K', 1e3)):
    if n >= size:
      return f'{n / size:.2f}{unit}'
  return f'{n:.0f}'


def bytes_text(n: float) -> str:
  for unit, size in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
    if n >= size:
      return f'{n / size:.2f} {unit}'
  return f'{n:.0f} bytes'


def dry_run(config) -> dict:
  # The mesh is validated for the smallest device count it fits, not this machine's devices.
  setup = build(config, num_devices=math.prod(s for s in config.mesh.shape if s > 0))
  counts = param_counts(setup.model)
  print(
    f'parameters: total {count_text(counts["total"])} '
    f'(routed experts {count_text(counts["routed_experts"])}), LoRA adapters '
    f'{count_text(counts["adapters"])}'
  )
  for k, v in counts['active'].items():
    print(
      f'activated per token with {k:>4g} FFN experts (input embedding excluded): {count_text(v)}'
    )
  # One forward pass sees a micro-batch (optim.grad_accum_steps of them make the global batch).
  micro = setup.data.global_batch_size // setup.optim.grad_accum_steps
  ex = ep_exchange(setup.model, setup.mesh_shape, setup.data.seq_len, micro)
  for comm, e in ex.items():
    print(
      f'expert-parallel exchange {comm!r} (engine.moe_ep_comm), per MoE layer and shard: '
      f'{e["local_rows"]} local assignments, receive buffer {e["recv_rows"]} rows = '
      f'{bytes_text(e["recv_bytes"])}'
      + (f', up to {e["rounds"]} rounds where it overflows' if e['rounds'] > 1 else '')
    )
  lb = loss_block(setup.model, setup.mesh_shape, setup.data.seq_len, micro)
  print(
    f'loss block (engine.loss_chunk) per device: float32 logits {list(lb["block_shape"])} = '
    f'{bytes_text(lb["block_bytes"])} (whole logits: {bytes_text(lb["whole_bytes"])})'
  )
  if any(e['worst_case'] for e in ex.values()):
    print(
      'worst-case (dropless) receive buffers: bound them with engine.moe_ep_recv_factor '
      '(ragged: what overflows goes in further rounds, still dropless) or '
      "engine.moe_dispatch='capacity'"
    )
  return {**counts, 'ep_exchange': ex, 'loss_block': lb}


def pipeline_traffic(setup) -> dict | None:
  """The pipeline's schedule and the activation bytes it moves per step (None without one):
  each of the M * R + S - 1 iterations of every micro-batch run (grad accumulation's), forward
  and backward, passes one micro-batch's [rows, seq, hidden] over each stage boundary each way
  (model/pipeline.py: the activations to the next stage, the micro-batch buffer's rotation to
  the one before; a ring, the last stage's edge to the first included). With 'stage' over
  d > 1 slices (mesh.dcn_shape), d of the ring's boundaries cross the data-center network:
  the bytes all chips send between slices, activations only (the embedding's and lm head's
  gradients, summed over the stages, come on top)."""
  cfg = setup.model
  s, m, r = (
    cfg.engine.pipeline_stages,
    cfg.engine.pipeline_microbatches,
    cfg.engine.pipeline_repeats,
  )
  if s == 1:
    return None
  accum = setup.optim.grad_accum_steps
  rows = setup.data.global_batch_size // accum // m
  act = rows * setup.data.seq_len * cfg.hidden_size * jnp.dtype(cfg.engine.dtype).itemsize
  iterations = m * r + s - 1
  edge = 2 * 2 * accum * iterations * act
  slices = sharding.check_dcn_shape(setup.mesh_dcn, setup.mesh_shape)[0]
  return {
    'stages': s,
    'microbatches': m,
    'repeats': r,
    'bubble': (s - 1) / iterations,
    'micro_activation_bytes': act,
    'boundary_bytes_per_step': edge,
    'dcn_bytes_per_step': edge * slices if slices > 1 else 0,
  }

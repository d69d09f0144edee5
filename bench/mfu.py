"""Model FLOPs utilisation of full training steps of a LongCat-shaped MoE with ~1B active params.

  python -m bench.mfu [--preset mfu1b] [--batch 1,2,4] [--seq 4096] [--remat save_dots]
                      [--dispatch dropless|capacity] [--scan_layers 0|1] [--loss_chunk 256]

Meant for a GPU or TPU (bf16 compute, float32 master weights, AdamW), on one device. MFU =
tokens/s x model FLOPs per token / the device's dense bf16 peak (moetrain.run.metrics.PEAK_FLOPS).
Model FLOPs per token (moetrain.run.metrics.flops_per_token) = 6 x the weights a token multiplies
(both attention blocks, both dense MLPs, the router, the *expected* number of FFN experts
K*E/(E+Z) and lm_head; not the embedding lookup) + 6 x the causal attention score/value FLOPs
(half the T x T square). Zero experts, rematerialisation, dispatch and capacity padding are not
counted as useful work. On a CPU there is no peak to divide by: the script reports achieved
FLOP/s (use --preset tiny --batch 2 --seq 128 to smoke-test it).

Each --batch size is compiled ahead of time and its memory plan printed before it runs; a size
that does not fit (RESOURCE_EXHAUSTED) is recorded as such and the larger ones are skipped.
One JSON record per batch size.
"""

import argparse
import statistics
import sys
import time

import jax

from bench.common import emit, machine
from bench.train_step import build_step
from moetrain.model import dispatch
from moetrain.model.config import LONGCAT_PRESETS, ModelConfig
from moetrain.run import metrics

# ~1.07B active (5.33 FFN experts of 32 + 16 zero, top-8), ~2.5B total parameters.
MFU_1B = ModelConfig(
  vocab_size=32768,
  hidden_size=2048,
  num_layers=8,
  num_heads=16,
  q_lora_rank=768,
  kv_lora_rank=512,
  qk_nope_head_dim=128,
  qk_rope_head_dim=64,
  v_head_dim=128,
  ffn_hidden_size=5632,
  expert_ffn_hidden_size=1024,
  n_routed_experts=32,
  zero_expert_num=16,
  moe_topk=8,
)
GIB = 2**30


def _memory(compiled) -> dict:
  try:
    m = compiled.memory_analysis()
  except Exception:  # not every backend reports one
    return {}
  if m is None:
    return {}
  return {
    'argument_gib': round(m.argument_size_in_bytes / GIB, 2),
    'temp_gib': round(m.temp_size_in_bytes / GIB, 2),
    'output_gib': round(m.output_size_in_bytes / GIB, 2),
  }


def _out_of_memory(e: Exception) -> bool:
  return 'RESOURCE_EXHAUSTED' in str(e) or 'out of memory' in str(e).lower()


def run_one(cfg, batch_size: int, seq: int, steps: int) -> dict:
  """Compiles (timed apart), then times `steps` steps; the median step and what it means."""
  step, state, batch = build_step(cfg, batch_size, seq)
  batch = jax.device_put(batch)  # once: the timed steps move no data from the host
  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  out = {'compile_s': round(time.perf_counter() - t0, 1), **_memory(compiled)}
  print(f'# batch {batch_size}: compiled in {out["compile_s"]} s, memory {out}', flush=True)
  state, m = compiled(state, batch)  # warm-up
  jax.block_until_ready((state, m))
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, m = compiled(state, batch)
    jax.block_until_ready((state, m))
    times.append(time.perf_counter() - start)
  step_s = statistics.median(times)
  tokens_per_s = batch_size * seq / step_s
  flops = metrics.flops_per_token(cfg, seq, cfg.expected_ffn_experts)
  peak = metrics.peak_flops(jax.devices()[0])
  achieved = tokens_per_s * flops  # one device: the step runs unsharded on the first
  return {
    **out,
    'median_step_s': step_s,
    'min_step_s': min(times),
    'steps': len(times),
    'tokens_per_sec': tokens_per_s,
    'model_flops_per_token': flops,
    'achieved_flops': achieved,
    'peak_flops': peak,
    'mfu': achieved / peak if peak else None,
    'loss': float(m['loss']),
    # The routing of this random-init model (layer means): against the expected K*E/(E+Z) that
    # the FLOP count uses, and what capacity dispatch dropped.
    'ffn_experts_mean': float(m['moe']['ffn_experts_mean'].mean()),
    'dropped_frac': float(m['moe']['dropped_frac'].mean()),
  }


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--preset', default='mfu1b', choices=['mfu1b', *LONGCAT_PRESETS])
  ap.add_argument('--batch', default='1,2,4', help='batch sizes, comma-separated, ascending')
  ap.add_argument('--seq', type=int, default=4096)
  ap.add_argument('--steps', type=int, default=10)
  ap.add_argument('--remat', default='save_dots')
  ap.add_argument('--backend', default='auto')
  ap.add_argument('--tokamax', default='auto', help='engine.tokamax_implementation')
  ap.add_argument('--dispatch', default='dropless', choices=['dropless', 'capacity'])
  ap.add_argument('--capacity_factor', type=float, default=1.25)
  ap.add_argument('--dtype', default='bfloat16')
  ap.add_argument('--scan_layers', type=int, default=1, choices=[0, 1])
  ap.add_argument('--loss_chunk', type=int, default=LONGCAT_PRESETS['medium'].engine.loss_chunk)
  args = ap.parse_args()
  base = MFU_1B if args.preset == 'mfu1b' else LONGCAT_PRESETS[args.preset]
  cfg = base.with_engine(
    dtype=args.dtype,
    remat=args.remat,
    moe_backend=args.backend,
    tokamax_implementation=args.tokamax,
    moe_dispatch=args.dispatch,
    moe_capacity_factor=args.capacity_factor,
    param_dtype='float32',
    scan_layers=bool(args.scan_layers),
    loss_chunk=args.loss_chunk,
  ).laid_out(jax.default_backend(), ())  # the engine 'auto' picks for this machine
  cfg.validate()
  common = {
    'bench': 'mfu',
    'preset': args.preset,
    'active_params': metrics.matmul_params_per_token(cfg, cfg.expected_ffn_experts),
    'seq': args.seq,
    'dtype': args.dtype,
    'remat': args.remat,
    'backend': args.backend,
    'engine': dispatch.resolve_backend(cfg),
    'tokamax_implementation': args.tokamax,
    'dispatch': args.dispatch,
    'capacity_factor': args.capacity_factor if args.dispatch == 'capacity' else None,
    'scan_layers': cfg.engine.scan_layers,
    'loss_chunk': cfg.engine.loss_chunk,
    **machine(),
  }
  for b in sorted(int(x) for x in args.batch.split(',')):
    try:
      result = run_one(cfg, b, args.seq, args.steps)
    except Exception as e:
      if not _out_of_memory(e):
        raise
      emit({**common, 'batch': b, 'out_of_memory': str(e).splitlines()[0][:300]})
      break  # larger batches will not fit either
    emit({**common, 'batch': b, **result})


if __name__ == '__main__':
  sys.exit(main())

"""Model FLOPs utilisation of full training steps of a LongCat-shaped MoE with ~1B active params.

  python -m bench.mfu [--preset mfu1b] [--batch 8] [--seq 4096] [--remat save_dots]
                      [--scan_layers 0|1] [--loss_chunk 256]

Meant for a GPU or TPU (bf16 compute, float32 master weights, AdamW). MFU = tokens/s x model
FLOPs per token / the device's dense bf16 peak (moetrain.metrics.PEAK_FLOPS). Model FLOPs per
token (moetrain.metrics.flops_per_token) = 6 x the weights a token multiplies (both attention
blocks, both dense MLPs, the router, the *expected* number of FFN experts K*E/(E+Z) and lm_head;
not the embedding lookup) + 6 x the causal attention score/value FLOPs (half the T x T square).
Zero experts, rematerialisation and dispatch are not counted as useful work. On a CPU there is
no peak to divide by: the script reports achieved FLOP/s (use --preset tiny to smoke-test it).
"""

import argparse
import dataclasses
import statistics
import sys
import time

import jax

from bench.common import emit, machine
from bench.train_step import build_step
from moetrain import metrics
from moetrain.model.config import PRESETS, ModelConfig

# ~1.07B active (5.33 FFN experts of 32 + 16 zero, top-8), ~2.4B total parameters.
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


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--preset', default='mfu1b', choices=['mfu1b', *PRESETS])
  ap.add_argument('--batch', type=int, default=8)
  ap.add_argument('--seq', type=int, default=4096)
  ap.add_argument('--steps', type=int, default=10)
  ap.add_argument('--remat', default='save_dots')
  ap.add_argument('--backend', default='auto')
  ap.add_argument('--dtype', default='bfloat16')
  ap.add_argument('--scan_layers', type=int, default=1, choices=[0, 1])
  ap.add_argument('--loss_chunk', type=int, default=PRESETS['medium'].loss_chunk)
  args = ap.parse_args()
  base = MFU_1B if args.preset == 'mfu1b' else PRESETS[args.preset]
  cfg = dataclasses.replace(
    base,
    dtype=args.dtype,
    remat=args.remat,
    moe_backend=args.backend,
    param_dtype='float32',
    scan_layers=bool(args.scan_layers),
    loss_chunk=args.loss_chunk,
  )
  step, state, batch = build_step(cfg, args.batch, args.seq)
  b, t = args.batch, args.seq
  state, m = step(state, batch)  # compile
  jax.block_until_ready(m['loss'])
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m['loss'])
    times.append(time.perf_counter() - start)
  step_s = statistics.median(times)
  tokens_per_s = b * t / step_s
  flops = metrics.flops_per_token(cfg, t, cfg.expected_ffn_experts)
  peak = metrics.peak_flops(jax.devices()[0])
  achieved = tokens_per_s * flops / jax.device_count()
  emit(
    {
      'bench': 'mfu',
      'preset': args.preset,
      'active_params': metrics.matmul_params_per_token(cfg, cfg.expected_ffn_experts),
      'batch': b,
      'seq': t,
      'dtype': args.dtype,
      'remat': args.remat,
      'backend': args.backend,
      'scan_layers': cfg.scan_layers,
      'loss_chunk': cfg.loss_chunk,
      'median_step_s': step_s,
      'tokens_per_sec': tokens_per_s,
      'model_flops_per_token': flops,
      'achieved_flops_per_device': achieved,
      'peak_flops_per_device': peak,
      'mfu': achieved / peak if peak else None,
      'loss': float(m['loss']),
      **machine(),
    }
  )


if __name__ == '__main__':
  sys.exit(main())

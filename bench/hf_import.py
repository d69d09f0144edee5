"""Hugging Face import throughput (GB/s from local disk) on the medium config.

  python -m bench.hf_import [--dtype bfloat16] [--repeats 3] [--dir /tmp/moetrain_medium_hf_<dtype>]

Writes a random medium LongCat checkpoint with save_hf (once), then times load_params reading it
back into device arrays (block_until_ready). The first load includes compiling the per-layer
placement functions; the median of the later ones is the steady-state rate.
"""

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from bench.common import emit, machine
from moetrain.convert import hf
from moetrain.model.config import LONGCAT_PRESETS
from moetrain.model.transformer import Transformer


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--dtype', default='bfloat16')
  ap.add_argument('--repeats', type=int, default=3)
  ap.add_argument('--dir', default='', help='default /tmp/moetrain_medium_hf_<dtype>')
  ap.add_argument('--quant', default='none')
  args = ap.parse_args()
  if args.repeats < 1:
    ap.error('--repeats must be >= 1')
  args.dir = args.dir or f'/tmp/moetrain_medium_hf_{args.dtype}'  # a cached file per dtype
  cfg = LONGCAT_PRESETS['medium'].with_engine(param_dtype=args.dtype, dtype=args.dtype)
  if not os.path.exists(os.path.join(args.dir, 'config.json')):
    model = Transformer(cfg.with_engine(param_dtype='float32'), nnx.Rngs(0))
    hf.save_hf(model, cfg, args.dir, dtype=jnp.dtype(args.dtype))
  size = sum(
    os.path.getsize(os.path.join(args.dir, f))
    for f in os.listdir(args.dir)
    if f.endswith('.safetensors')
  )
  load_cfg = cfg.with_engine(quant=args.quant)
  times = []
  for _ in range(args.repeats + 1):
    t = time.perf_counter()
    loaded = hf.load_params(args.dir, load_cfg)
    jax.block_until_ready((loaded.params, loaded.frozen, loaded.moe_bias))
    times.append(time.perf_counter() - t)
  warm = statistics.median(times[1:])
  emit(
    {
      'bench': 'hf_import',
      'dtype': args.dtype,
      'quant': args.quant,
      'bytes': size,
      'first_s': times[0],
      'median_s': warm,
      'gb_per_s': size / warm / 1e9,
      **machine(),
    }
  )


if __name__ == '__main__':
  main()

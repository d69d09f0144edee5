"""Start-up from a Hugging Face checkpoint with and without init.base_cache, on a large local model.

  python -m bench.base_cache [--quant none|int8|int4] [--repeats 3] [--dir /tmp/moetrain_large_hf]

Writes (once) a random LongCat checkpoint of LARGE's shapes (~2.4B parameters, 4.9 GB of bf16
safetensors), then times, each in a fresh process as a start is, the initial-state phase of a
LoRA run (startup.initial_state: what the cache replaces; the train step's compile is the same
either way): converting the safetensors (no cache), converting and saving the entry (the first
start with a cache), and restoring the entry (every later start). Medians over --repeats, the
files in the page cache for both (warm reads: the comparison of work, not of the disk).
"""

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from bench.common import emit, machine

LARGE = dict(
  vocab_size=32768,
  hidden_size=2048,
  num_layers=6,
  num_heads=16,
  q_lora_rank=512,
  kv_lora_rank=256,
  qk_nope_head_dim=64,
  qk_rope_head_dim=32,
  v_head_dim=64,
  ffn_hidden_size=4096,
  expert_ffn_hidden_size=1024,
  n_routed_experts=64,
  zero_expert_num=16,
  moe_topk=6,
)


def write_checkpoint(directory: str) -> None:
  import jax.numpy as jnp
  from flax import nnx

  from moetrain.convert import hf
  from moetrain.model.config import LONGCAT_PRESETS
  from moetrain.model.transformer import Transformer

  cfg = dataclasses.replace(LONGCAT_PRESETS['tiny'], **LARGE).with_engine(
    param_dtype='bfloat16', dtype='bfloat16'
  )
  model = Transformer(cfg, nnx.Rngs(0))
  hf.save_hf(model, cfg, directory, dtype=jnp.bfloat16)


def one(directory: str, quant: str, cache: str) -> dict:
  """In this (fresh) process: the initial-state phase of the LoRA config on `directory`."""
  import jax

  from configs import longcat_lora
  from moetrain.data.demo_task import DEMO_DIR
  from moetrain.run import startup
  from moetrain.training import optim

  config = longcat_lora.get_config('variant=tiny')
  config.init.hf_checkpoint = directory
  config.data.tokenizer = str(DEMO_DIR / 'base' / 'tokenizer.model')  # (any that fits)
  config.init.base_cache = cache
  config.engine.quant = quant
  config.engine.param_dtype = 'bfloat16'
  config.train.compilation_cache = ''
  setup = startup.build(config)
  optimizer = optim.make_optimizer(setup.optim, setup.train.steps)
  mesh = setup.make_mesh()
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    state = startup.initial_state(setup, optimizer, mesh)
    jax.block_until_ready(state)
  return {'seconds': time.perf_counter() - start}


def run(directory: str, quant: str, cache: str) -> float:
  out = subprocess.run(
    [sys.executable, '-m', 'bench.base_cache', '--one', f'--dir={directory}', f'--quant={quant}']
    + ([f'--cache={cache}'] if cache else []),
    capture_output=True,
    text=True,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )
  if out.returncode:
    raise RuntimeError(out.stderr[-3000:])
  return json.loads(out.stdout.strip().splitlines()[-1])['seconds']


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--quant', default='none')
  ap.add_argument('--repeats', type=int, default=3)
  ap.add_argument('--dir', default='/tmp/moetrain_large_hf')
  ap.add_argument('--cache', default='')
  ap.add_argument('--one', action='store_true', help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.one:
    print(json.dumps(one(args.dir, args.quant, args.cache)))
    return
  if not os.path.exists(os.path.join(args.dir, 'config.json')):
    write_checkpoint(args.dir)
  size = sum(
    os.path.getsize(os.path.join(args.dir, f))
    for f in os.listdir(args.dir)
    if f.endswith('.safetensors')
  )
  cache = f'{args.dir}_base_cache_{args.quant}'
  shutil.rmtree(cache, ignore_errors=True)
  run(args.dir, args.quant, '')  # (the files into the page cache)
  convert = [run(args.dir, args.quant, '') for _ in range(args.repeats)]
  first = run(args.dir, args.quant, cache)  # converts and saves the entry
  restore = [run(args.dir, args.quant, cache) for _ in range(args.repeats)]
  entry = sum(
    os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(cache) for f in files
  )
  emit(
    {
      'bench': 'base_cache',
      'quant': args.quant,
      'safetensors_bytes': size,
      'cache_bytes': entry,
      'convert_s': convert,
      'first_start_with_cache_s': first,
      'restore_s': restore,
      'convert_median_s': statistics.median(convert),
      'restore_median_s': statistics.median(restore),
      'ratio': statistics.median(convert) / statistics.median(restore),
      **machine(),
    }
  )


if __name__ == '__main__':
  main()

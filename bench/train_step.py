"""Whole training step (forward, backward, AdamW) on the medium LongCat config, tokens/s.

  python -m bench.train_step --mode full|lora [--quant none|int8|int4] [--hf]

Medium config: hidden 512, 4 layers, 8 heads, MLA ranks 256/128, 16 routed + 8 zero experts of
width 256, top-4, vocab 32768, batch 4 x 512 tokens. With --hf the same step of transformers 4.57
(bench/hf_reference_step.py, run with the interpreter in $HF_PYTHON) is timed in the same run,
alternating with moetrain, and the ratio of median tokens/s is reported.

  python -m bench.train_step --memory [--vocab 131072 --batch 1 --seq 4096] [--loss_chunk 0]

compiles the step only and reports its temporary bytes (XLA's memory analysis), e.g. the logits
that --loss_chunk 0 (one block: the whole [B, T, V] logits) holds and the default does not.
"""

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import jax
import numpy as np
import optax

from bench.common import emit, machine
from moetrain.core.engine import LoraConfig, split_engine_keys
from moetrain.model.config import LONGCAT_PRESETS
from moetrain.training.train_state import init_state
from moetrain.training.train_step import StepConfig, jit_train_step

LORA_TARGETS = r'attn_\d\.(q_a|q_b|kv_a|kv_b|o)$|mlp_\d\.(gate|up|down)$|experts\.(gate|up|down)$'


def make_step(mode: str, quant: str, dtype: str, remat: str, backend: str, batch=4, seq=512, **kw):
  """The medium config and batch; kw overrides other model or engine keys."""
  lora = LoraConfig(rank=16, alpha=32.0, targets=LORA_TARGETS) if mode == 'lora' else LoraConfig()
  kw, engine = split_engine_keys(kw)
  cfg = dataclasses.replace(LONGCAT_PRESETS['medium'], lora=lora, **kw).with_engine(
    dtype=dtype, remat=remat, quant=quant, moe_backend=backend, **engine
  )
  return build_step(cfg, batch, seq)


def build_step(cfg, batch_size: int, seq_len: int):
  """A jitted AdamW train step of `cfg` (state donated), its initial state and a random batch."""
  opt = optax.adamw(1e-4)
  state = jax.jit(lambda: init_state(cfg, opt, 0))()
  step = jit_train_step(StepConfig(model=cfg), opt, lambda s: 1e-4)
  b, t = batch_size, seq_len
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, t + 1)).astype(np.int32)
  batch = {
    'inputs': ids[:, :-1],
    'targets': ids[:, 1:],
    'segment_ids': np.ones((b, t), np.int32),
    'positions': np.tile(np.arange(t, dtype=np.int32), (b, 1)),
    'loss_mask': np.ones((b, t), np.float32),
  }
  return step, state, batch


def time_moetrain(step, state, batch, steps: int):
  """(state, [(wall s, system s)] per step). System time is the kernel's share, nearly all of it
  page faults on XLA's per-call temporaries: on these VMs it jumps from ~0.1 s to 2-5 s in some
  steps (the host reclaims memory the process freed), which is the machine, not the step."""
  state, m = step(state, batch)  # compile + warm up
  jax.block_until_ready(m['loss'])
  times = []
  for _ in range(steps):
    sys0, t = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m['loss'])
    wall = time.perf_counter() - t
    times.append((wall, resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys0))
  return state, times


def quiet(times, share: float = 0.1):
  """Wall times of the steps whose system time stayed under `share` of their wall time."""
  return [w for w, s in times if s < share * w]


def time_hf(mode: str, steps: int) -> dict:
  py = os.environ.get('HF_PYTHON', '/work/hfvenv/bin/python')
  script = os.path.join(os.path.dirname(__file__), 'hf_reference_step.py')
  out = subprocess.run(
    [
      py,
      script,
      '--mode',
      mode,
      '--steps',
      str(steps),
      '--warmup',
      '1',
      '--threads',
      str(os.cpu_count()),
    ],
    capture_output=True,
    text=True,
    check=True,
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--mode', default='lora', choices=['full', 'lora'])
  ap.add_argument('--quant', default='none', choices=['none', 'int8', 'int4'])
  ap.add_argument('--dtype', default='float32')
  ap.add_argument('--remat', default='none')
  ap.add_argument('--backend', default='auto')
  ap.add_argument('--steps', type=int, default=5)
  ap.add_argument('--rounds', type=int, default=1, help='alternating moetrain/HF rounds')
  ap.add_argument('--hf', action='store_true')
  ap.add_argument('--loss_chunk', type=int, default=LONGCAT_PRESETS['medium'].engine.loss_chunk)
  ap.add_argument('--vocab', type=int, default=LONGCAT_PRESETS['medium'].vocab_size)
  ap.add_argument(
    '--scan_layers', type=int, default=0, choices=[0, 1], help='0: unrolled (4 layers: faster)'
  )
  ap.add_argument(
    '--attention_recompute',
    type=int,
    default=int(LONGCAT_PRESETS['medium'].attention_recompute),
    choices=[0, 1],
    help='1: attention keeps softmax stats and recomputes scores; 0: keeps the probabilities',
  )
  ap.add_argument('--batch', type=int, default=4)
  ap.add_argument('--seq', type=int, default=512)
  ap.add_argument(
    '--memory', action='store_true', help="compile only; report the step's temporary bytes"
  )
  args = ap.parse_args()
  if args.hf and (args.vocab, args.batch, args.seq) != (
    LONGCAT_PRESETS['medium'].vocab_size,
    4,
    512,
  ):
    ap.error('--hf runs the reference at the issue shapes: leave --vocab, --batch, --seq alone')
  shape = dict(
    batch=args.batch,
    seq=args.seq,
    vocab_size=args.vocab,
    loss_chunk=args.loss_chunk,
    scan_layers=bool(args.scan_layers),
    attention_recompute=bool(args.attention_recompute),
  )
  step, state, batch = make_step(
    args.mode, args.quant, args.dtype, args.remat, args.backend, **shape
  )
  if args.memory:
    mem = step.lower(state, batch).compile().memory_analysis()
    emit(
      {
        'bench': 'train_step_memory',
        'mode': args.mode,
        **shape,
        'temp_mib': mem.temp_size_in_bytes / 2**20,
        'args_mib': mem.argument_size_in_bytes / 2**20,
      }
    )
    return
  ours, theirs = [], []
  for _ in range(args.rounds):
    state, times = time_moetrain(step, state, batch, args.steps)
    ours += times
    if args.hf:
      theirs.append(time_hf(args.mode, args.steps))
  tokens = args.batch * args.seq
  walls, calm = [w for w, _ in ours], quiet(ours)
  rec = {
    'bench': 'train_step',
    'mode': args.mode,
    'quant': args.quant,
    'dtype': args.dtype,
    'remat': args.remat,
    **shape,
    'median_step_s': statistics.median(walls),
    'min_step_s': min(walls),
    'tokens_per_sec': tokens / statistics.median(walls),
    'median_system_s': statistics.median(s for _, s in ours),
    # The same without the steps that paged (system time >= 10% of the step), and how many.
    'quiet_steps': f'{len(calm)}/{len(ours)}',
    'quiet_median_step_s': statistics.median(calm) if calm else None,
    **machine(),
  }
  if theirs:
    hf_tps = statistics.median(r['tokens_per_s'] for r in theirs)
    rec.update(
      hf_tokens_per_sec=hf_tps,
      hf_median_step_s=tokens / hf_tps,
      speedup=rec['tokens_per_sec'] / hf_tps,
    )
    if calm:
      rec['quiet_speedup'] = tokens / statistics.median(calm) / hf_tps
  emit(rec)


if __name__ == '__main__':
  sys.exit(main())

"""Context parallelism on 8 emulated CPU devices: the LoRA demo's step (configs/longcat_lora.py)
with each row's tokens split over the 'context' axis or not. Two tables:

- the same work (8 rows of --tokens tokens a step) with context 1, 2, 4, 8 and FSDP over the rest
  of the 8 devices: the compiled step's memory per device and the median step time, the runs
  interleaved --repeats times (each a fresh process);
- rows of --long tokens, one per batch shard: FSDP over 8 (8 rows, a whole row on each
  device) against context 8 (1 row, an eighth of it on each device);
- with --memory_only: the compiled step's memory per device against the row's length, one row
  per batch shard (8 / C rows a step), context C = 1, 2, 4, 8;
- with --ring LENGTHS: one row of each length over context 8, its keys all-gathered against
  passed around the ring (`engine.context_attention`), the runs interleaved --repeats times;
- with --tpu TOPOLOGY: the same table from the planner's libtpu compile of Qwen3-30B-A3B's LoRA
  step (configs/qwen3_moe_lora.py) for a TPU slice, one row per batch shard (chips / C rows),
  with its estimated step: estimates, not measurements.

  python -m bench.context --tokens 2048 --long 8192,32768 --steps 6 --repeats 2
  python -m bench.context --memory_only 4096,16384,65536   # the compiled step's memory only
  python -m bench.context --ring 8192,16384 --steps 4 --repeats 2
  python -m bench.context --tpu v5p-16 --memory_only 8192,32768,131072
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from bench.common import RunFailed, emit, machine, run_main

COMPILED = re.compile(r'Compiled in [\d.]+ s: ([\d.]+) GiB per device')


def demo_args(
  context: int, tokens: int, rows: int, steps: int, workdir: str, attention: str = 'all_gather'
) -> list[str]:
  """`moetrain.main`'s arguments for the demo step on mesh (1, 1, 8 / context, 1, context, 1),
  the context shards' attention `attention` (engine.context_attention)."""
  return [
    'moetrain.main',
    '--config=configs/longcat_lora.py',
    f'--config.mesh.shape=(1,1,{8 // context},1,{context},1)',
    f'--config.data.seq_len={tokens}',
    f'--config.data.global_batch_size={rows}',
    f'--config.train.steps={steps}',
    '--config.optim.warmup_steps=0',
    '--config.train.log_every=1',
    '--config.train.eval_every=0',
    '--config.data.eval_split=',
    f'--config.engine.context_attention={attention}',
    f'--workdir={workdir}',
  ]


def run(context: int, tokens: int, rows: int, steps: int, attention: str = 'all_gather') -> dict:
  """One run of the demo step: its compiled memory per device and median step time (a failed
  run: the error's last line, and no figures)."""
  with tempfile.TemporaryDirectory(prefix='bench_context') as workdir:
    try:
      out = run_main(demo_args(context, tokens, rows, steps, workdir, attention))
    except RunFailed as e:
      print(e, file=sys.stderr, flush=True)
      return {'gib_per_device': None, 'step_s': None, 'error': str(e).splitlines()[-1]}
    gib = float(COMPILED.search(out).group(1))
    records = [json.loads(x) for x in open(os.path.join(workdir, 'metrics.jsonl'))]
    train = [r for r in records if r.get('kind') == 'train']
    times = [(b['time'] - a['time']) / b['window_steps'] for a, b in zip(train, train[1:])]
  return {'gib_per_device': gib, 'step_s': statistics.median(times) if times else None}


def compiled_gib(context: int, tokens: int, rows: int) -> float:
  """The train step's compiled memory per device for one mesh and row length: the run is stopped
  once it prints it (no step runs)."""
  with tempfile.TemporaryDirectory(prefix='bench_context') as workdir:
    cmd = [sys.executable, '-m', *demo_args(context, tokens, rows, 1, workdir)]
    env = {**os.environ, 'PYTHONPATH': '.'}
    proc = subprocess.Popen(
      cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
      for line in proc.stdout:
        if m := COMPILED.search(line):
          return float(m.group(1))
    finally:
      proc.kill()
      proc.wait()
  raise RuntimeError(f'no compiled memory printed by {" ".join(cmd)}')


def memory_table(lengths: list[int]) -> None:
  """Per-device memory against the row's length with one row per batch shard (8 / C rows a
  step, FSDP over 8 / C devices): each device holds 1 / C of a row, context C = 1 to 8."""
  for tokens in lengths:
    for c in (1, 2, 4, 8):
      emit({'table': 'memory', 'tokens_per_row': tokens, 'context': c, 'rows': 8 // c,
            'gib_per_device': compiled_gib(c, tokens, 8 // c)})  # fmt: skip


def tpu_table(topology_name: str, lengths: list[int]) -> None:
  """Per-chip memory and the estimated step against the row's length on a TPU slice, context C =
  1, 2, 4, 8 with FSDP over the rest, chips / C rows a step: each chip holds 1 / C of a row."""
  from configs import qwen3_moe_lora
  from moetrain.planner import topology, tpu_plan

  for tokens in lengths:
    for c in (1, 2, 4, 8):
      config = qwen3_moe_lora.get_config('variant=qwen3_30b_a3b')
      chips = topology.parse(topology_name).chips
      over = {'mesh.shape': (1, 1, -1, 1, c, 1), 'data.seq_len': tokens,
              'data.global_batch_size': chips // c, 'data.eval_batch_size': chips // c}  # fmt: skip
      r = tpu_plan.plan(config, topology_name, over)
      need = r.get('need_bytes') or (r.get('per_chip_bytes') or {}).get('total')
      emit({'table': 'tpu memory', 'topology': topology_name, 'tokens_per_row': tokens, 'context': c,
            'rows': chips // c, 'fits': r.get('fits'),
            'gib_per_chip': None if need is None else round(need / 2**30, 2),
            'est_step_s': r.get('est_step_seconds'), 'est_mfu': r.get('est_mfu'),
            'compile_s': r.get('compile_seconds'), 'error': r.get('error')})  # fmt: skip


def ring_table(lengths: list[int], steps: int, repeats: int) -> None:
  """One row of each length over context 8: the all-gather's step against the ring's."""
  for tokens in lengths:
    runs = {'all_gather': [], 'ring': []}
    for _ in range(repeats):
      for attention, done in runs.items():
        done.append(run(8, tokens, 1, steps, attention))
    for attention, done in runs.items():
      good = [r['step_s'] for r in done if r['step_s'] is not None]
      emit({'table': 'ring', 'context': 8, 'rows': 1, 'tokens_per_row': tokens,
            'attention': attention, 'gib_per_device': done[0]['gib_per_device'],
            'step_s_median': statistics.median(good) if good else None,
            'step_s': [r['step_s'] for r in done]})  # fmt: skip


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--tokens', type=int, default=2048)
  p.add_argument('--long', default='8192,32768')
  p.add_argument('--steps', type=int, default=6)
  p.add_argument('--repeats', type=int, default=2)
  p.add_argument('--memory_only', default='', help='row lengths: only the compiled memory table')
  p.add_argument('--tpu', default='', help="a TPU topology: the planner's memory table for it")
  p.add_argument('--ring', default='', help='row lengths: all-gather against ring, context 8')
  args = p.parse_args()
  os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
  emit({'machine': machine()})
  if args.tpu:
    return tpu_table(args.tpu, [int(t) for t in args.memory_only.split(',')])
  if args.ring:
    return ring_table([int(t) for t in args.ring.split(',')], args.steps, args.repeats)
  if args.memory_only:
    return memory_table([int(t) for t in args.memory_only.split(',')])
  same = {c: [] for c in (1, 2, 4, 8)}
  for _ in range(args.repeats):
    for c in same:
      same[c].append(run(c, args.tokens, 8, args.steps))
  for c, runs in same.items():
    good = [r for r in runs if r['step_s'] is not None]
    step = statistics.median(r['step_s'] for r in good) if good else None
    emit({'table': 'same work', 'context': c, 'tokens_per_row': args.tokens, 'rows': 8,
          'gib_per_device': good[0]['gib_per_device'] if good else None, 'step_s_median': step,
          'step_s': [r['step_s'] for r in runs],
          'errors': [r['error'] for r in runs if 'error' in r]})  # fmt: skip
  for tokens in (int(t) for t in args.long.split(',') if t):
    for c in (1, 8):
      r = run(c, tokens, 8 // c, args.steps)
      emit({'table': 'long rows', 'context': c, 'rows': 8 // c, 'tokens_per_row': tokens, **r})


if __name__ == '__main__':
  main()

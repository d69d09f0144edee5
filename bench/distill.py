"""Distillation on the demo task (configs/distill.py): at equal steps, the distilled student vs
the student alone, online vs offline (cached top-k) teacher logits, other initialisations, the
cached logits' bytes per position, and the distillation step's time vs the student alone's.

  python -m bench.distill [--steps 200] [--top_k 64] [--seeds 0,1,2] [--only SUBSTRING,...]
      [--set distill.temperature=1 ...]

Each variant runs as its own `python -m moetrain.main` in a fresh directory; the eval figures
are the final evaluation's (completion tokens of the demo eval split), the step time the median
of the logged windows' (metrics.jsonl). Each variant runs once per seed (`config.seed`: the
student's initialisation and dropout; the data order and the cached logits stay the same); a
summary record per variant gives the medians, and standard error gets bench/RESULTS.md's table
of the whole run (each seed's eval loss, the median, the spread), with the least eval loss any
model can reach on the task (demo_task.shuffle_entropy).
"""

import argparse
import os
import statistics
import sys
import tempfile

from bench.common import emit, machine, run_main, run_result
from moetrain.data import demo_task

VARIANTS = {
  'distilled (online, whole vocabulary)': [],
  'student alone (alpha=0)': ['--config.distill.alpha=0'],
  'distilled, online top-k': ['--config.distill.top_k={k}'],
  'distilled, offline top-k': [
    '--config.distill.top_k={k}',
    '--config.distill.teacher_logits={logits}',
  ],
  'init: teacher layers + most-used experts': ['--config.distill.init_from_teacher=most_used'],
  'from random weights, distilled': ['--config.distill.init_from_teacher='],
  'from random weights, alone': ['--config.distill.init_from_teacher=', '--config.distill.alpha=0'],
}


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--steps', type=int, default=200)
  p.add_argument('--top_k', type=int, default=64)
  p.add_argument('--seeds', default='0,1,2')
  p.add_argument('--only', default='', help='comma-separated substrings of variant names')
  p.add_argument('--set', action='append', default=[], help='KEY=VALUE config overrides for all')
  a = p.parse_args()
  seeds = [int(s) for s in a.seeds.split(',')]
  only = [o for o in a.only.split(',') if o]
  variants = {n: v for n, v in VARIANTS.items() if not only or any(o in n for o in only)}
  common = [f'--config.train.steps={a.steps}', *(f'--config.{kv}' for kv in a.set)]
  base = ['moetrain.main', '--config=configs/distill.py', *common]
  with tempfile.TemporaryDirectory(prefix='bench_distill') as tmp:
    logits = os.path.join(tmp, 'logits')
    if any('offline' in n for n in variants):
      out = run_main(
        ['moetrain.tools.teacher_logits', '--config=configs/distill.py', f'--out={logits}']
        + [f'--top_k={a.top_k}', *common]
      )
      emit({'bench': 'distill', 'what': 'offline logits', 'line': out.strip().splitlines()[-1]})
    table = []
    for name, extra in variants.items():
      runs = []
      for seed in seeds:
        workdir = os.path.join(tmp, f'{abs(hash(name))}_{seed}')
        args = [x.format(k=a.top_k, logits=logits) for x in extra]
        run_main([*base, f'--workdir={workdir}', f'--config.seed={seed}', *args])
        runs.append({'seed': seed, **run_result(workdir)})
        emit({'bench': 'distill', 'variant': name, 'steps': a.steps, 'top_k': a.top_k, **runs[-1]})
      med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != 'seed'}
      emit(
        {'bench': 'distill', 'variant': name, 'steps': a.steps, 'top_k': a.top_k, 'seeds': seeds}
        | {f'median_{k}': v for k, v in med.items()}
        | machine()
      )
      table.append(table_row(name, runs, med))
  floor = demo_task.shuffle_entropy(demo_task.generate_shuffle()['eval'])
  print('\n'.join(table_head(seeds) + table), file=sys.stderr)
  print(f"The task's floor (the eval split's entropy): {floor:.3f}", file=sys.stderr)


def table_head(seeds: list[int]) -> list[str]:
  """bench/RESULTS.md's table of a run of this benchmark (printed to standard error)."""
  each = ' / '.join(map(str, seeds))
  return [
    f'| run | eval loss, seeds {each} | median | min-max | median accuracy |',
    '|---|---|---|---|---|',
  ]


def table_row(name: str, runs: list[dict], med: dict) -> str:
  losses = [r['eval_loss'] for r in runs]
  each = ' / '.join(f'{x:.3f}' for x in losses)
  return (
    f'| {name} | {each} | {med["eval_loss"]:.3f} | {min(losses):.3f}-{max(losses):.3f} | '
    f'{med["eval_accuracy"]:.3f} |'
  )


if __name__ == '__main__':
  main()

"""Distillation on the demo task (configs/distill.py): at equal steps, the distilled student vs
the student alone, online vs offline (cached top-k) teacher logits, three initialisations, the
cached logits' bytes per position, and the distillation step's time vs the student alone's.

  python -m bench.distill [--steps 200] [--top_k 8]

Each variant runs as its own `python -m moetrain.main` in a fresh directory; the eval figures
are the final evaluation's (completion tokens of the demo eval split), the step time the median
of the logged windows' (metrics.jsonl).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench.common import emit, machine

VARIANTS = {
  'distilled (online, whole vocabulary)': [],
  'student alone (alpha=0)': ['--config.distill.alpha=0'],
  'distilled, online top-k': ['--config.distill.top_k={k}'],
  'distilled, offline top-k': [
    '--config.distill.top_k={k}',
    '--config.distill.teacher_logits={logits}',
  ],
  'init: teacher layers + most-used experts': ['--config.distill.init_from_teacher=most_used'],
  'init: teacher layers + random experts': ['--config.distill.init_from_teacher=random'],
}


def _run(args: list[str]) -> str:
  env = {**os.environ, 'PYTHONPATH': '.'}
  return subprocess.run(
    [sys.executable, '-m', *args], check=True, env=env, capture_output=True, text=True
  ).stdout


def _result(workdir: str) -> dict:
  records = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  train = [r for r in records if r.get('kind') == 'train']
  last = [r for r in records if r.get('kind') == 'eval'][-1]
  # Seconds per step between consecutive log records (the median skips the windows an
  # evaluation or the first compile fell in).
  times = [(b['time'] - a['time']) / b['window_steps'] for a, b in zip(train, train[1:])]
  return {
    'eval_loss': last['loss'],
    'eval_accuracy': last['accuracy'],
    'step_seconds': statistics.median(times),
  }


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--steps', type=int, default=200)
  p.add_argument('--top_k', type=int, default=8)
  a = p.parse_args()
  base = ['moetrain.main', '--config=configs/distill.py', f'--config.train.steps={a.steps}']
  with tempfile.TemporaryDirectory(prefix='bench_distill') as tmp:
    logits = os.path.join(tmp, 'logits')
    out = _run(
      ['moetrain.tools.teacher_logits', '--config=configs/distill.py', f'--out={logits}']
      + [f'--top_k={a.top_k}', f'--config.train.steps={a.steps}']
    )
    emit({'bench': 'distill', 'what': 'offline logits', 'line': out.strip().splitlines()[-1]})
    for name, extra in VARIANTS.items():
      workdir = os.path.join(tmp, str(abs(hash(name))))
      args = [x.format(k=a.top_k, logits=logits) for x in extra]
      _run([*base, f'--workdir={workdir}', *args])
      emit({'bench': 'distill', 'variant': name, 'steps': a.steps, **_result(workdir), **machine()})


if __name__ == '__main__':
  main()

"""Preference tuning on the demo task (configs/dpo.py): per loss, the eval before and after
training (the chosen completions' next-token accuracy, pref/accuracy, pref/margin), and the
preference step's time and temporary memory against the supervised step's on the same rows.

  python -m bench.preference [--losses sigmoid,simpo,orpo] [--steps 100] [--set KEY=VALUE ...]
  python -m bench.preference --losses= --time_steps 20       # the step times alone

Each loss runs as its own `python -m moetrain.main` in a fresh directory, from the same start
(the LoRA demo's result, moetrain/data/demo/sft). The step times: both steps compiled in one process on the
demo's batches (16 rows of 128 tokens of packed pairs; the supervised step trains the same rows
as next-token prediction, both completions scored), run alternately, medians.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import emit, machine

# SimPO's and ORPO's own scales (TRL's defaults: SimPO beta 2, gamma 0.5; ORPO lambda 0.1).
LOSS_ARGS = {
  'sigmoid': [],
  'ipo': [],
  'hinge': [],
  'simpo': ['--config.preference.beta=2.0', '--config.preference.gamma=0.5'],
  'orpo': ['--config.preference.beta=0.1'],
  'kto': [],
}


def _evals(workdir: str) -> list[dict]:
  records = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  return [r for r in records if r.get('kind') == 'eval']


def run_loss(loss: str, steps: int, sets: list[str], tmp: str) -> dict:
  workdir = os.path.join(tmp, loss)
  args = ['--config=configs/dpo.py', f'--workdir={workdir}', f'--config.preference.loss={loss}']
  args += [f'--config.train.steps={steps}', *LOSS_ARGS[loss], *(f'--config.{kv}' for kv in sets)]
  t = time.perf_counter()
  env = {**os.environ, 'PYTHONPATH': '.'}
  subprocess.run([sys.executable, '-m', 'moetrain.main', *args], check=True, env=env)
  first, last = _evals(workdir)[0], _evals(workdir)[-1]
  keys = ('accuracy', 'pref/accuracy', 'pref/margin', 'pref/loss')
  return {
    'loss': loss,
    'steps': steps,
    'seconds': round(time.perf_counter() - t, 1),
    **{f'eval_{k}_before': round(first[k], 4) for k in keys},
    **{f'eval_{k}_after': round(last[k], 4) for k in keys},
  }


def step_times(steps: int) -> dict:
  """Median seconds of the sigmoid step and of the supervised step on the same rows."""
  import dataclasses

  import jax
  import optax

  from configs import dpo
  from moetrain.data import loader, packing
  from moetrain.run import startup
  from moetrain.training import aot, train_state
  from moetrain.training.train_step import jit_train_step

  setup = startup.build(dpo.get_config())
  tokenizer = loader.make_tokenizer(setup.data, None)
  pairs = next(loader.make_train_iterator(setup.data, tokenizer))
  pairs = {k: v for k, v in pairs.items() if k in packing.ROW_KEYS}
  sft = dict(pairs)  # (next-token training on the same rows: every completion token scores)
  opt = optax.adam(1e-3)
  state = train_state.init_state(setup.model, opt, 0)
  fns = {
    'preference': jit_train_step(setup.step, opt, lambda s: 1e-3, donate=False),
    'supervised': jit_train_step(
      dataclasses.replace(setup.step, preference=None), opt, lambda s: 1e-3, donate=False
    ),
  }
  batches = {'preference': pairs, 'supervised': sft}
  times = {k: [] for k in fns}
  memory = {}
  for name, fn in fns.items():  # compile, and the compiled program's temporaries
    memory[name] = aot.memory_of(fn.lower(state, batches[name]).compile())['temporaries']
    jax.block_until_ready(fn(state, batches[name]))
  for _ in range(steps):
    for name, fn in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(fn(state, batches[name]))
      times[name].append(time.perf_counter() - t)
  med = {k: statistics.median(v) for k, v in times.items()}
  return {
    'what': 'step time, same rows',
    **{f'{k}_s': round(v, 4) for k, v in med.items()},
    'ratio': round(med['preference'] / med['supervised'], 3),
    **{f'{k}_temporaries_mib': round(v / 2**20, 2) for k, v in memory.items()},
    'steps': steps,
  }


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--losses', default='sigmoid,simpo,orpo')
  p.add_argument('--steps', type=int, default=100)
  p.add_argument('--time_steps', type=int, default=20)
  p.add_argument('--set', action='append', default=[], help='KEY=VALUE config overrides')
  a = p.parse_args()
  with tempfile.TemporaryDirectory(prefix='bench_preference') as tmp:
    for loss in filter(None, a.losses.split(',')):
      emit({'bench': 'preference', **run_loss(loss, a.steps, a.set, tmp)} | machine())
  if a.time_steps:
    emit({'bench': 'preference', **step_times(a.time_steps)} | machine())


if __name__ == '__main__':
  main()

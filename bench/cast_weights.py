"""What `engine.cast_weights_once` does to training quality: three full-training demos, each over
several seeds with it on and off, final eval loss and accuracy per run, then each arm's median and
spread (min, max).

  python -m bench.cast_weights [--seeds 0,1,2] [--only SUBSTRING,...] [--steps N]

The demos (every weight trains, float32 weights, bfloat16 compute, so the flag applies):
  pretraining   configs/longcat_pretrain.py (the tiny model from random weights, demo data)
  full FT       configs/longcat_lora.py with lora.rank=0 and learning rate 1e-3 (the shipped base
                fine-tuned to reverse, as bench.quality's full_ft)
  distillation  configs/distill.py (the student)
Each run is its own `python -m moetrain.main` in a fresh directory with `seed` and `data.seed` both
set to the seed (the full-FT demo has no random initialisation, so its data order is what varies).
"""

import argparse
import os
import statistics
import tempfile

from bench.common import emit, machine, run_main, run_result

DEMOS = {
  'pretraining': ['--config=configs/longcat_pretrain.py'],
  'full FT': [
    '--config=configs/longcat_lora.py',
    '--config.lora.rank=0',
    '--config.optim.learning_rate=1e-3',
  ],
  'distillation': ['--config=configs/distill.py'],
}


def summary(runs: list[dict]) -> dict:
  """Median, min and max of each figure over an arm's seeds."""
  out = {}
  for key in ('eval_loss', 'eval_accuracy'):
    xs = [r[key] for r in runs]
    out |= {f'median_{key}': statistics.median(xs), f'min_{key}': min(xs), f'max_{key}': max(xs)}
  return out


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--seeds', default='0,1,2')
  p.add_argument('--only', default='', help='comma-separated substrings of demo names')
  p.add_argument('--steps', type=int, default=0, help="0 = each config's own")
  a = p.parse_args()
  seeds = [int(s) for s in a.seeds.split(',')]
  only = [o for o in a.only.split(',') if o]
  demos = {n: v for n, v in DEMOS.items() if not only or any(o in n for o in only)}
  steps = [f'--config.train.steps={a.steps}'] if a.steps else []
  with tempfile.TemporaryDirectory(prefix='bench_cast') as tmp:
    for name, args in demos.items():
      for on in (True, False):
        runs = []
        for seed in seeds:
          workdir = os.path.join(tmp, f'{abs(hash(name))}_{on}_{seed}')
          run_main(
            ['moetrain.main', *args, *steps, f'--workdir={workdir}']
            + [f'--config.seed={seed}', f'--config.data.seed={seed}']
            + [f'--config.engine.cast_weights_once={str(on).lower()}']
          )
          runs.append({'seed': seed, **run_result(workdir)})
          emit({'bench': 'cast_weights', 'demo': name, 'cast_weights_once': on, **runs[-1]})
        emit(
          {'bench': 'cast_weights', 'demo': name, 'cast_weights_once': on, 'seeds': seeds}
          | summary(runs)
          | machine()
        )


if __name__ == '__main__':
  main()

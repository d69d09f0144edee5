"""Demo-task quality after the same number of steps: bf16 LoRA, QLoRA int8 / int4, full FT.

  python -m bench.quality [--steps 200]

Each variant runs configs/longcat_lora.py (tiny) through train.run into a fresh directory and
reports the final eval (completion-token loss and accuracy on the demo eval split).
"""

import argparse
import importlib.util
import os
import tempfile
import time

from bench.common import emit, machine
from moetrain.run import train

ROOT = os.path.join(os.path.dirname(__file__), '..')

VARIANTS = {
  'lora_bf16': dict(quant='none', param_dtype='bfloat16', rank=8),
  'qlora_int8': dict(quant='int8', param_dtype='float32', rank=8),
  'qlora_int4': dict(quant='int4', param_dtype='float32', rank=8),
  'full_ft': dict(quant='none', param_dtype='float32', rank=0),
}


def config_for(variant: dict, steps: int):
  path = os.path.join(ROOT, 'configs', 'longcat_lora.py')
  spec = importlib.util.spec_from_file_location('longcat_lora', path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  config = mod.get_config('variant=tiny')
  config.engine.quant = variant['quant']
  config.engine.param_dtype = variant['param_dtype']
  config.lora.rank = variant['rank']
  if variant['rank'] == 0:
    config.optim.learning_rate = 1e-3  # full fine-tuning of every weight wants a smaller step
  config.train.steps = steps
  config.train.eval_every = 0
  config.train.log_every = 50
  return config


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--steps', type=int, default=200)
  ap.add_argument('--variants', default=','.join(VARIANTS))
  args = ap.parse_args()
  for name in args.variants.split(','):
    with tempfile.TemporaryDirectory() as workdir:
      t = time.time()
      out = train.run(config_for(VARIANTS[name], args.steps), workdir)
      emit(
        {
          'bench': 'quality',
          'variant': name,
          'steps': args.steps,
          'eval_loss': out['eval_loss'],
          'eval_accuracy': out['eval_accuracy'],
          'train_loss': out['loss'],
          'wall_s': time.time() - t,
          **machine(),
        }
      )


if __name__ == '__main__':
  main()

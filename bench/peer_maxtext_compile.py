"""Compile MaxText's training step for a TPU slice (run by bench/peer_plans.py with the peer's
own Python, in which maxtext[tpu] is installed; moetrain is not importable there).

  .peer/maxtext/bin/python bench/peer_maxtext_compile.py OUT_DIR key=value ...

Runs MaxText's own AOT entry point (maxtext.trainers.pre_train.train_compile) on its base.yml
with the given overrides, keeps the compiled executable its jit_and_compile returns, and writes
OUT_DIR/train_step.hlo.txt (the optimized HLO) and OUT_DIR/memory.json (per-device bytes as memory_analysis() gives them)."""

import json
import os
import sys


def main(out_dir: str, overrides: list[str]) -> None:
  os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')  # no TPU metadata server on this host
  import maxtext
  from maxtext.trainers.pre_train import train_compile

  compiled = {}
  original = train_compile.jit_and_compile

  def keep(*args, **kwargs):
    compiled['step'] = original(*args, **kwargs)
    return compiled['step']

  train_compile.jit_and_compile = keep
  base = os.path.join(os.path.dirname(maxtext.__file__), 'configs', 'base.yml')
  train_compile.main(['train_compile', base, *overrides])
  step = compiled['step']
  m = step.memory_analysis()
  memory = {
    'arguments': m.argument_size_in_bytes,
    'temporaries': m.temp_size_in_bytes,
    'outputs': m.output_size_in_bytes,
    'aliased': m.alias_size_in_bytes,
    'code': m.generated_code_size_in_bytes,
    'host': m.host_temp_size_in_bytes,
  }
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, 'train_step.hlo.txt'), 'w') as f:
    f.write(step.as_text())
  with open(os.path.join(out_dir, 'memory.json'), 'w') as f:
    json.dump({'memory': memory, 'overrides': overrides}, f, indent=1)


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2:])

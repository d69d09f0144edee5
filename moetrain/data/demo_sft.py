"""The preference demo's start: the LoRA demo's result (configs/longcat_lora.py, the shipped base
with its adapters trained for 200 steps to reverse word lists), merged into one Hugging Face
checkpoint, so that configs/dpo.py starts where supervised fine-tuning ended and trains new
adapters from there.

Shipped in moetrain/data/demo/sft (config.json, float32 model.safetensors, the base's
tokenizer.model; 4.5 MB: a preference run needs no supervised run first), rebuilt by this module:

  python -m moetrain.data.demo_sft           # ~4 minutes on 2 CPU cores

which trains configs/longcat_lora.py's demo and exports it merged. Its eval accuracy (0.8338)
and what preference tuning does from it: bench/RESULTS.md, "Preference tuning on the demo task".
"""

import tempfile
from pathlib import Path

from moetrain.data import demo_base, demo_task

DIR = demo_task.DEMO_DIR / 'sft'


def build(out: Path = DIR) -> None:
  with tempfile.TemporaryDirectory(prefix='demo_sft') as tmp:
    demo_base.train_and_export(
      str(Path(tmp) / 'run'),
      out,
      'float32',
      '--config=configs/longcat_lora.py',
      f'--config.init.hf_checkpoint={demo_base.DIR}',
    )


if __name__ == '__main__':
  build()

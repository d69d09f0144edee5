"""The distillation demo's teacher: the demo base (demo_base.py) with every weight fine-tuned on
the shuffling task (demo_task.py: the prompt's words in any order), so that it gives, for each
next word, the distribution over the words not yet written that configs/distill.py distils.

Shipped in moetrain/data/demo/teacher as a Hugging Face checkpoint (config.json, bfloat16
model.safetensors, the base's tokenizer.model; 2.3 MB), rebuilt by this module:

  python -m moetrain.data.demo_teacher       # ~6 minutes on 2 CPU cores

which trains configs/longcat_pretrain.py (tiny) from the shipped base for STEPS steps on the
task's 'teacher' split (prompts apart from the student's train and eval splits, so the
teacher has not learnt the orders the student's labels hold) and exports it. Its eval loss:
bench/RESULTS.md, "Distillation on the demo task".
"""

import tempfile
from pathlib import Path

from moetrain.data import demo_base, demo_task

DIR = demo_task.DEMO_DIR / 'teacher'
STEPS = 400


def build(out: Path = DIR, steps: int = STEPS) -> None:
  with tempfile.TemporaryDirectory(prefix='demo_teacher') as tmp:
    splits = demo_task.generate_shuffle()
    demo_task.write_splits(Path(tmp) / 'data', {'train': splits['teacher'], 'eval': splits['eval']})
    demo_base.train_and_export(
      str(Path(tmp) / 'run'),
      out,
      'bfloat16',
      '--config=configs/longcat_pretrain.py',
      f'--config.init.hf_checkpoint={demo_base.DIR}',
      '--config.data.source=jsonl',
      f'--config.data.path={tmp}/data/{{split}}.jsonl',
      '--config.optim.learning_rate=1e-3',
      f'--config.train.steps={steps}',
      '--config.train.eval_every=100',
    )


if __name__ == '__main__':
  build()

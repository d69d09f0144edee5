"""The demo's pretrained base: a tiny LongCat-shaped MoE that can copy word lists, not reverse them.

`make train` LoRA-fine-tunes it on the demo task (reverse the words, demo_task.py): the base
knows the words, the prompt format and how to copy from the prompt, so the adapters have a skill
to adapt rather than a language to learn from nothing. Shipped in moetrain/data/demo/base as a
Hugging Face checkpoint (config.json, bfloat16 model.safetensors, tokenizer.model; 2.3 MB),
rebuilt by this module:

  python -m moetrain.data.demo_base          # ~5 minutes on 2 CPU cores

which writes the copy task (4000 train, 200 eval examples of the same 32 words, seed
COPY_SEED), trains a SentencePiece tokenizer on the copy and reversal texts (text only), trains
every weight with configs/longcat_pretrain.py (tiny) for STEPS steps, and exports it. The
shipped base (bench/RESULTS.md, "The demo's pretrained base"): copy accuracy 0.957 at step 600; on the reversal
task it scores 0.20 and its LoRA adapters 0.84 after 200 steps (a random base's: ~0.2).
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from moetrain.data import demo_task
from moetrain.data import tokenizer as tokenizer_lib

DIR = demo_task.DEMO_DIR / 'base'
STEPS = 600
COPY_SEED = 7


def _run(*args: str) -> None:
  subprocess.run([sys.executable, '-m', *args], check=True, env={**os.environ, 'PYTHONPATH': '.'})


def train_and_export(workdir: str, out: Path, dtype: str, *main_args: str) -> None:
  """`python -m moetrain.main main_args` in `workdir`, then its merged export into `out` (the
  shipped demo checkpoints: the base, the teacher, the preference demo's start)."""
  _run('moetrain.main', *main_args, f'--workdir={workdir}')
  _run(
    'moetrain.tools.export', f'--workdir={workdir}', f'--out={out}', f'--dtype={dtype}', '--replace'
  )


def build(out: Path = DIR, steps: int = STEPS) -> None:
  with tempfile.TemporaryDirectory(prefix='demo_base') as tmp:
    tmp = Path(tmp)
    copy = demo_task.generate(seed=COPY_SEED, make=demo_task.make_copy_example)
    (tmp / 'data').mkdir()
    for split, examples in copy.items():
      (tmp / 'data' / f'{split}.jsonl').write_text(demo_task.to_jsonl(examples))
    texts = [e['prompt'] + e['completion'] for e in copy['train'] + demo_task.generate()['train']]
    tokenizer_lib.train_sentencepiece(texts, 512, tmp / tokenizer_lib.SPM_FILE)
    train_and_export(
      str(tmp / 'run'),
      out,
      'bfloat16',
      '--config=configs/longcat_pretrain.py',
      '--config.data.source=jsonl',
      f'--config.data.path={tmp}/data/{{split}}.jsonl',
      f'--config.data.tokenizer={tmp / tokenizer_lib.SPM_FILE}',
      f'--config.train.steps={steps}',
      '--config.train.eval_every=200',
    )


if __name__ == '__main__':
  build()

"""Shows examples as the trainer sees them before packing: their tokens and which ones train.

  python -m moetrain.tools.preview_data --config=configs/longcat_lora.py --num=3
  python -m moetrain.tools.preview_data --config=... --config.data.source=jsonl \\
      --config.data.path='chats/{split}.jsonl' --config.data.tokenizer=MODEL_DIR --json

The first --num examples of the split, in file order (training shuffles them), are tokenized by
the trainer's own path (chat template, bos/eos, truncation to data.seq_len + 1 tokens or
splitting of long texts). Text output decodes each one with its trained tokens between [[ and ]]
(in green on a terminal); --json prints one object per example (per piece of a split text),
{"ids": [...], "loss_mask": [...]}, where loss_mask[i] = 1 if token i is a training target.
No model is built and nothing is written (a run without data.tokenizer trains its SentencePiece
model into a temporary directory, or reuses --workdir's).
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Sequence

import grain
from absl import app, flags
from ml_collections import config_flags

from moetrain.core import runtime
from moetrain.data import loader
from moetrain.run import startup

GREEN, RESET = '\033[32m', '\033[0m'


def define_flags():
  config_flags.DEFINE_config_file('config', None, "Experiment config (default: the run's own).")
  flags.DEFINE_string('workdir', None, 'A run directory: its config and tokenizer.')
  flags.DEFINE_string('split', None, 'Split to show (default data.train_split).')
  flags.DEFINE_integer('num', 3, 'Examples to show.')
  flags.DEFINE_bool('json', False, 'One {"ids", "loss_mask"} object per line.')


def preview(cfg: loader.DataConfig, workdir: str | None, split: str, num: int):
  """The tokenizer, and the tokenized pieces of the split's first `num` examples (an example
  gives several when data.split_long_texts splits it, none for a dropped part of a long text).
  `cfg` is validated already (startup.tool_setup)."""
  if num <= 0:
    raise ValueError(f'--num={num} must be positive')
  tokenizer = loader.make_tokenizer(cfg, workdir)
  source = loader.open_source(cfg, split)
  ds = grain.MapDataset.source([source[i] for i in range(min(num, len(source)))])
  out = loader.tokenized(cfg, tokenizer, ds, grain.ReadOptions(num_threads=1))
  return tokenizer, [p for p in out if len(p['tokens'])]


def marked(tokenizer, ids: Sequence[int], mask: Sequence[float], color: bool) -> str:
  """The decoded ids with the trained runs between markers. Each run's text is the difference
  of decoding the ids up to its end and up to its start (decoding a run alone would lose the
  spaces SentencePiece-style tokenizers write as part of a token)."""
  decode = getattr(tokenizer, 'decode_with_special', tokenizer.decode)
  start, end = (GREEN, RESET) if color else ('[[', ']]')
  out, done, at = [], '', 0
  for trained, run in itertools.groupby(mask, key=bool):
    at += len(list(run))
    text = decode(ids[:at])
    out.append(f'{start}{text[len(done) :]}{end}' if trained else text[len(done) :])
    done = text
  return ''.join(out)


def main(argv):
  runtime.start_command(preemption=False)
  del argv
  f = flags.FLAGS
  cfg = startup.tool_setup(f.config, f.workdir).data
  split = f.split or cfg.train_split
  color = sys.stdout.isatty()
  tokenizer, pieces = preview(cfg, f.workdir, split, f.num)
  for piece in pieces:
    ids = [int(t) for t in piece['tokens']]
    mask = [int(m) for m in piece['is_target']]
    if f.json:
      print(json.dumps({'ids': ids, 'loss_mask': mask}))
      continue
    cut = ' (cut to data.seq_len + 1 tokens)' if piece['truncated'] else ''
    print(f'--- {len(ids)} tokens, {sum(mask)} trained{cut}')
    print(marked(tokenizer, ids, mask, color))


if __name__ == '__main__':
  define_flags()
  app.run(runtime.short_errors(main), flags_parser=runtime.parse_flags)

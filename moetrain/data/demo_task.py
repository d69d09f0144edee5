"""Synthetic word-reversal task shipped as demo/{train,eval}.jsonl, and the distillation demo's
word-shuffling task shipped as demo/shuffle/{train,eval}.jsonl; run this module to rebuild them.

Each example asks to reverse 3-6 distinct words drawn from a fixed list of 32 everyday words:
  {"prompt": "reverse: red fox cup =", "completion": " cup fox red"}
The answer is fully determined by the prompt, so completion-token accuracy is a clean signal: a
randomly initialised model is at chance and a tiny one learns the copy-in-reverse pattern quickly.

The shuffling task asks for the same words in any order, and each example holds one order drawn
at random:
  {"prompt": "shuffle: red fox cup =", "completion": " fox cup red"}
Its next word is a draw from the words not yet written, so a label is one sample of a
distribution that a teacher gives whole: what distillation has to offer (docs/distillation.md).
"""

import json
import math
import random
from pathlib import Path

DEMO_DIR = Path(__file__).parent / 'demo'
SPLITS = {'train': 4000, 'eval': 200}
SEED = 20240601

WORDS = tuple(
  'red blue green gold pink gray cat dog fox owl bee cow sun moon star rain '
  'snow wind tree leaf rock sand lake hill cup pen box key map hat bell ship'.split()
)
MIN_WORDS, MAX_WORDS = 3, 6
SHUFFLE_DIR = DEMO_DIR / 'shuffle'
# The student's splits, shipped, and the teacher's own (demo_teacher.py; built, not shipped): no
# prompt is in two of them, so the teacher has not seen the orders the student's labels hold.
SHUFFLE_SPLITS = {'train': 4000, 'eval': 200, 'teacher': 8000}
SHUFFLE_SEED, SHUFFLE_ORDER_SEED = 11, 5


def make_copy_example(words: list[str]) -> dict[str, str]:
  """The demo base's pretraining task (demo_base.py): the same words in the same order."""
  return {'prompt': f'copy: {" ".join(words)} =', 'completion': ' ' + ' '.join(words)}


def make_example(words: list[str]) -> dict[str, str]:
  # The trailing '=' marks where the prompt ends: without it the model cannot tell whether
  # another input word follows. The example's text is prompt + completion, so the completion
  # starts with the space that separates it from the '='.
  return {'prompt': f'reverse: {" ".join(words)} =', 'completion': ' ' + ' '.join(reversed(words))}


def make_shuffle_example(words: list[str], rng: random.Random) -> dict[str, str]:
  """The distillation demo's task (configs/distill.py): the words in an order drawn by `rng`."""
  order = list(words)
  rng.shuffle(order)
  return {'prompt': f'shuffle: {" ".join(words)} =', 'completion': ' ' + ' '.join(order)}


def reversal_exact(completions: list[str], records: list[dict]) -> list[float]:
  """The demo's reward for reinforcement learning: 1 for the right reversal, word for word."""
  return [float(c.split() == r['completion'].split()) for c, r in zip(completions, records)]


def reversal_positions(completions: list[str], records: list[dict]) -> list[float]:
  """Partial credit: the share of the answer's positions holding the right word (a longer or
  shorter completion is scored against the longer of the two)."""
  out = []
  for c, r in zip(completions, records):
    got, want = c.split(), r['completion'].split()
    out.append(sum(a == b for a, b in zip(got, want)) / max(len(got), len(want)))
  return out


def generate(
  splits: dict[str, int] = SPLITS, seed: int = SEED, make=None
) -> dict[str, list[dict[str, str]]]:
  """Draws distinct word lists; no list appears in two splits, so eval measures generalisation.
  `make` turns a list into an example (default make_example: reversal)."""
  make = make or make_example
  rng = random.Random(seed)
  seen = set()
  out = {}
  for split, count in splits.items():
    examples = []
    while len(examples) < count:
      words = tuple(rng.sample(WORDS, rng.randint(MIN_WORDS, MAX_WORDS)))
      if words not in seen:
        seen.add(words)
        examples.append(make(list(words)))
    out[split] = examples
  return out


def generate_shuffle() -> dict[str, list[dict[str, str]]]:
  """The shuffling task's splits: 'train' and 'eval' (the student's) and 'teacher'."""
  rng = random.Random(SHUFFLE_ORDER_SEED)
  return generate(SHUFFLE_SPLITS, SHUFFLE_SEED, lambda words: make_shuffle_example(words, rng))


def shuffle_entropy(examples: list[dict[str, str]]) -> float:
  """The least eval loss any model can reach on shuffled examples, in nats per completion token
  (each word, then the end of text; one token each in the demo's tokenizer): an order of n
  distinct words is one of n! equally likely."""
  words = [len(e['completion'].split()) for e in examples]
  return sum(math.lgamma(n + 1) for n in words) / sum(n + 1 for n in words)


def to_jsonl(examples: list[dict[str, str]]) -> str:
  return ''.join(json.dumps(e) + '\n' for e in examples)


def write_splits(out_dir: Path, splits: dict[str, list[dict[str, str]]]) -> None:
  out_dir.mkdir(parents=True, exist_ok=True)
  for split, examples in splits.items():
    with open(out_dir / f'{split}.jsonl', 'w', encoding='utf-8', newline='\n') as f:
      f.write(to_jsonl(examples))


def write(out_dir: Path = DEMO_DIR) -> None:
  write_splits(out_dir, generate())
  shuffle = generate_shuffle()
  write_splits(out_dir / 'shuffle', {k: shuffle[k] for k in ('train', 'eval')})


if __name__ == '__main__':
  write()

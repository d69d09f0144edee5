"""Synthetic word-reversal task shipped as demo/{train,eval}.jsonl; run this module to rebuild them.

Each example asks to reverse 3-6 distinct words drawn from a fixed list of 32 everyday words:
  {"prompt": "reverse: red fox cup =", "completion": " cup fox red"}
The answer is fully determined by the prompt, so completion-token accuracy is a clean signal: a
randomly initialised model is at chance and a tiny one learns the copy-in-reverse pattern quickly.
"""

import json
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


def make_copy_example(words: list[str]) -> dict[str, str]:
  """The demo base's pretraining task (demo_base.py): the same words in the same order."""
  return {'prompt': f'copy: {" ".join(words)} =', 'completion': ' ' + ' '.join(words)}


def make_example(words: list[str]) -> dict[str, str]:
  # The trailing '=' marks where the prompt ends: without it the model cannot tell whether
  # another input word follows. The example's text is prompt + completion, so the completion
  # starts with the space that separates it from the '='.
  return {'prompt': f'reverse: {" ".join(words)} =', 'completion': ' ' + ' '.join(reversed(words))}


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


def to_jsonl(examples: list[dict[str, str]]) -> str:
  return ''.join(json.dumps(e) + '\n' for e in examples)


def write(out_dir: Path = DEMO_DIR) -> None:
  out_dir.mkdir(parents=True, exist_ok=True)
  for split, examples in generate().items():
    with open(out_dir / f'{split}.jsonl', 'w', encoding='utf-8', newline='\n') as f:
      f.write(to_jsonl(examples))


if __name__ == '__main__':
  write()

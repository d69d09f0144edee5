"""Prompts for reinforcement learning: JSON Lines records with a 'prompt' (a string, or a list of
messages the chat template renders with its generation prompt), every other key kept for the
reward functions (an answer to check against, test cases, ...); or the demo task's reversal
prompts, whose records hold the right answer as their 'completion'. The order of the prompts
is a function of the seed and the rollout's index alone, so a resumed run samples the same
prompts again."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from moetrain.data import chat, sources
from moetrain.data.tokenizer import Tokenizer


class PromptSource:
  """JSON Lines of prompt records, each checked for a 'prompt' when the source is built."""

  def __init__(self, paths: Sequence[str]):
    self._records = []
    for path in paths:
      with open(path, 'rb') as f:
        for line_no, raw in enumerate(f, start=1):
          if raw.strip():
            self._records.append(self._parse(raw, f'{path}:{line_no}'))

  @staticmethod
  def _parse(raw: bytes, where: str) -> dict:
    try:
      record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f'{where}: malformed JSON: {e}') from e
    if not isinstance(record, dict):
      raise ValueError(f'{where}: expected a JSON object, got {type(record).__name__}')
    prompt = record.get('prompt')
    ok = (
      isinstance(prompt, str)
      and prompt
      or (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt))
    )
    if not ok:
      raise ValueError(f"{where}: 'prompt' must be a non-empty string or list of messages")
    return {**record, 'where': where}

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, i: int) -> dict:
    return self._records[i]


class DemoPrompts:
  """The demo task's reversal prompts, each record with its answer as 'completion'."""

  def __init__(self, split: str):
    self._source = sources.demo_source(split)

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i: int) -> dict:
    return {**self._source[i], 'where': f'demo {i}'}


def open_prompts(source: str, path: str, split: str):
  """The prompt records of one split: data.source 'demo', or 'jsonl' files at data.path."""
  if source == 'demo':
    prompts = DemoPrompts(split)
  elif source == 'jsonl':
    prompts = PromptSource(sources.expand_paths(path, split))
  else:
    raise ValueError(f"rl reads its prompts from data.source='demo' or 'jsonl', not {source!r}")
  if len(prompts) == 0:
    raise ValueError(f'split {split!r} of data.source={source!r} ({path}) has no prompts')
  return prompts


def order(n: int, seed: int, start: int, count: int) -> list[int]:
  """Indices start .. start + count - 1 of the endless stream of shuffled epochs of n prompts."""
  out, epochs = [], {}
  for j in range(start, start + count):
    epoch = j // n
    if epoch not in epochs:
      epochs[epoch] = np.random.default_rng((seed, epoch)).permutation(n)
    out.append(int(epochs[epoch][j % n]))
  return out


def prompt_ids(record: dict, tokenizer: Tokenizer, chat_format: chat.ChatFormat) -> list[int]:
  """A record's prompt as training tokenizes one (bos, then its tokens); messages rendered by the
  chat template with its generation prompt (bos only under the built-in template)."""
  prompt = record['prompt']
  if isinstance(prompt, list):
    text, bos = chat_format.prompt(prompt), chat_format.builtin
  else:
    text, bos = prompt, True
  ids = tokenizer.encode(text)
  return ([tokenizer.bos_id] if bos and tokenizer.bos_id is not None else []) + list(ids)

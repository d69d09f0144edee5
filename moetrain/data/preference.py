"""Preference data: pairs {prompt, chosen, rejected} and unpaired (KTO) examples {prompt,
completion, label}, tokenized and packed so that a pair never leaves its row.

A pair is packed as one element of two sequences, prompt + chosen and prompt + rejected, each
with its own positions and segment; an unpaired example is one sequence, followed by a second,
its prompt with another example's completion (KTO's estimate of the KL term). In a packed row
the element packed s-th (grain's segment id s) gives segment ids 3 (s - 1) + role, role 1 for
chosen (or a desirable completion), 2 for rejected (or undesirable), 3 for the mismatched
sequence, so that training/preference.py reads a pair's sequences from the ids alone. Only the
completions' tokens (and their end-of-text) are scored; a pair too long for a row loses its
prompt's first tokens (counted as truncated), or, where the completions alone do not fit, is
dropped (check_pairs counts these in a sample before training).

Records are strings or message lists: a prompt of messages and completions of messages
(assistant turns), or chosen and rejected holding whole conversations whose shared first
messages are the prompt. Message lists are rendered by the model's chat template; the
completion's tokens are those of the conversation after the prompt's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from moetrain.data import chat, demo_task, packing, sources
from moetrain.data.tokenizer import Tokenizer

ROLES = {'chosen': 1, 'rejected': 2, 'mismatched': 3}
SEGMENTS_PER_ELEMENT = len(ROLES)
KINDS = ('paired', 'unpaired')


def _text_or_messages(record: dict, key: str, where: str) -> str | list:
  value = record.get(key)
  if value is None:
    raise ValueError(f'{where}: the record has no {key!r}')
  if isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(m, dict) for m in value):
    return [sources._plain(m, where, key) for m in value]
  raise ValueError(f'{where}: {key!r} must be a string or a list of messages')


def _split_conversations(record: dict, where: str) -> dict:
  """{prompt, chosen, rejected} where chosen and rejected hold whole conversations: the shared
  first messages become the prompt."""
  chosen, rejected = record['chosen'], record['rejected']
  n = 0
  while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
    n += 1
  if n == 0:
    raise ValueError(f'{where}: chosen and rejected share no first message to read as the prompt')
  return {'prompt': chosen[:n], 'chosen': chosen[n:], 'rejected': rejected[n:]}


def to_pair(record: dict, kind: str, where: str) -> dict[str, Any]:
  """A record as {prompt, chosen, rejected} (paired) or {prompt, completion, label} (unpaired),
  with its `where`; a missing key, an empty completion or chosen equal to rejected is named."""
  if kind == 'unpaired':
    out = {k: _text_or_messages(record, k, where) for k in ('prompt', 'completion')}
    label = record.get('label')
    if not isinstance(label, bool):
      raise ValueError(f"{where}: 'label' must be true (desirable) or false, not {label!r}")
    if not out['completion']:
      raise ValueError(f"{where}: 'completion' is empty")
    return {**out, 'label': label, 'where': where}
  if 'prompt' not in record and isinstance(record.get('chosen'), list):
    record = _split_conversations(
      {k: _text_or_messages(record, k, where) for k in ('chosen', 'rejected')}, where
    )
  out = {k: _text_or_messages(record, k, where) for k in ('prompt', 'chosen', 'rejected')}
  for key in ('chosen', 'rejected'):
    if not out[key]:
      raise ValueError(f'{where}: {key!r} is empty')
  if out['chosen'] == out['rejected']:
    raise ValueError(f"{where}: 'chosen' equals 'rejected' (the pair teaches nothing)")
  return {**out, 'where': where}


class PairSource(sources.JsonlSource):
  """JSON Lines of preference records (to_pair), each validated when the source is built."""

  def __init__(self, paths: Sequence[str], kind: str = 'paired'):
    self.kind = kind
    super().__init__(paths)

  def _parse(self, raw: bytes, where: str) -> dict:
    try:
      record = json.loads(raw.rstrip(b'\r\n'))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f'{where}: malformed JSON: {e}') from e
    if not isinstance(record, dict):
      raise ValueError(f'{where}: expected a JSON object, got {type(record).__name__}')
    return to_pair(record, self.kind, where)


def demo_rejected(words: list[str], i: int) -> str:
  """A plausible wrong answer to reversing `words`: the copy (even i), or the reversal with two
  neighbouring words swapped (odd i; which two from i)."""
  if i % 2 == 0:
    return ' ' + ' '.join(words)
  out = list(reversed(words))
  j = (i // 2) % (len(out) - 1)
  out[j], out[j + 1] = out[j + 1], out[j]
  return ' ' + ' '.join(out)


class DemoPairs:
  """The demo task as preference pairs: chosen the right reversal, rejected a plausible wrong
  answer (demo_rejected); unpaired, alternately a desirable and an undesirable completion."""

  def __init__(self, split: str, kind: str = 'paired'):
    self._source, self.kind = sources.demo_source(split), kind

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i: int) -> dict:
    ex = self._source[i]
    words = ex['prompt'].removeprefix('reverse: ').removesuffix(' =').split()
    where = f'{demo_task.DEMO_DIR}/demo pair {i}'
    if self.kind == 'unpaired':
      good = i % 2 == 0
      completion = ex['completion'] if good else demo_rejected(words, i // 2)
      return {'prompt': ex['prompt'], 'completion': completion, 'label': good, 'where': where}
    rejected = demo_rejected(words, i)
    return {
      'prompt': ex['prompt'],
      'chosen': ex['completion'],
      'rejected': rejected,
      'where': where,
    }


class WithMismatched:
  """Unpaired examples, each with the completion of another example (KTO's KL estimate): the
  one after it in the source, so that the pairing is fixed whatever the shuffle."""

  def __init__(self, source):
    self._source = source

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i: int) -> dict:
    other = self._source[(i + 1) % len(self._source)]
    return {**self._source[i], 'mismatched': other['completion']}


def texts(example: dict) -> list[str]:
  """The strings of a preference record (what a tokenizer trained on the data reads)."""
  keys = ('prompt', 'chosen', 'rejected', 'completion')
  parts = [example[k] for k in keys if k in example]
  as_text = lambda x: x if isinstance(x, str) else chat.ChatFormat().apply({'messages': x})[0]
  return [as_text(p) for p in parts if p]


def open_pairs(path_or_demo: str, split: str, kind: str):
  """The preference source of a split: 'demo', or a JSONL path ('{split}' replaced)."""
  if path_or_demo == 'demo':
    source = DemoPairs(split, kind)
  else:
    source = PairSource(sources.expand_paths(path_or_demo, split), kind)
  return WithMismatched(source) if kind == 'unpaired' else source


def _sequence(tokenizer, prompt, completion, chat_format) -> tuple[list, list, int]:
  """(tokens, is_target, prompt length) of prompt + completion: text as training encodes
  prompt/completion examples, messages through the chat template (the completion's tokens are
  the conversation's after the prompt's)."""
  if isinstance(prompt, str) and isinstance(completion, str):
    tokens, target = packing._tokens({'prompt': prompt, 'completion': completion}, tokenizer, False)
    return tokens, target, target.index(1.0) if 1.0 in target else len(tokens)
  as_messages = lambda x: [{'role': 'user', 'content': x}] if isinstance(x, str) else x
  chat_format = chat_format or chat.ChatFormat()
  convo = {'messages': as_messages(prompt) + as_messages(completion)}
  tokens, _ = packing._tokens(convo, tokenizer, False, chat_format)
  # The prompt as generation renders it (the assistant's turn opened): what the completion
  # continues. Its tokens are the conversation's first ones, up to where the two part.
  head = tokenizer.encode(chat_format.prompt(as_messages(prompt)))
  if chat_format.builtin and tokenizer.bos_id is not None:
    head = [tokenizer.bos_id] + head
  n = 0
  while n < min(len(head), len(tokens)) and head[n] == tokens[n]:
    n += 1
  return tokens, [0.0] * n + [1.0] * (len(tokens) - n), n


def tokenize_element(
  example: dict, tokenizer: Tokenizer, *, max_len: int, chat_format=None
) -> dict[str, np.ndarray | int]:
  """One packing element of a pair (chosen, rejected) or an unpaired example (its completion,
  the mismatched one): tokens, is_target, role, pos (positions that restart per sequence),
  truncated. Longer than max_len together: the prompt loses its first tokens (after bos), or
  the element is empty (dropped) when the completions alone do not fit."""
  if 'chosen' in example:
    parts = [('chosen', example['chosen']), ('rejected', example['rejected'])]
  else:
    own = 'chosen' if example['label'] else 'rejected'
    parts = [(own, example['completion']), ('mismatched', example['mismatched'])]
  seqs = [(role, *_sequence(tokenizer, example['prompt'], c, chat_format)) for role, c in parts]
  over = sum(len(tokens) for _, tokens, _, _ in seqs) - max_len
  keep = 1 if tokenizer.bos_id is not None else 0
  cut = -(-over // len(seqs)) if over > 0 else 0  # prompt tokens each sequence loses
  if cut and any(n - keep < cut for _, _, _, n in seqs):
    return {
      **packing._piece([], [], True),
      'role': np.zeros(0, np.int32),
      'pos': np.zeros(0, np.int32),
    }
  tokens, target, role, pos = [], [], [], []
  for name, t, m, _ in seqs:
    t, m = t[:keep] + t[keep + cut :], m[:keep] + m[keep + cut :]
    tokens += t
    target += m
    role += [ROLES[name]] * len(t)
    pos += list(range(len(t)))
  piece = packing._piece(tokens, target, cut > 0)
  return {**piece, 'role': np.asarray(role, np.int32), 'pos': np.asarray(pos, np.int32)}


def finalize_row(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A packed row of elements as the batch's rows (packing.ROW_DTYPES): segment ids
  3 (s - 1) + role, positions restarting at each sequence, targets within a sequence."""
  s, role = row['tokens_segment_ids'], row['role']
  segments = np.where(s > 0, SEGMENTS_PER_ELEMENT * (s - 1) + role, 0)
  same = (segments[1:] == segments[:-1]) & (segments[:-1] != 0)
  return {
    'inputs': row['tokens'][:-1].astype(np.int32),
    'targets': row['tokens'][1:].astype(np.int32),
    'segment_ids': segments[:-1].astype(np.int32),
    'positions': row['pos'][:-1].astype(np.int32),
    'loss_mask': (row['is_target'][1:] * same).astype(np.float32),
    packing.TRUNCATED_KEY: np.int32(sum(row['truncated'])),
  }


def pack(ds: grain.IterDataset, *, seq_len: int, num_bins: int, pad_id: int) -> grain.IterDataset:
  """Tokenized elements (tokenize_element) packed into rows; an element never spans two rows."""
  length = seq_len + 1
  ds = ds.filter(lambda e: len(e['tokens']) > 0)
  packed = grain.experimental.FirstFitPackIterDataset(
    ds,
    length_struct={'tokens': length, 'is_target': length, 'role': length, 'pos': length},
    num_packing_bins=num_bins,
    shuffle_bins=False,
    meta_features=('truncated',),
    padding_struct={'tokens': pad_id, 'is_target': 0.0, 'role': 0, 'pos': 0},
  )
  return packed.map(finalize_row)


def tokenized(
  ds: grain.MapDataset, tokenizer, *, seq_len: int, chat_format=None, read_options=None
):
  fn = functools.partial(
    tokenize_element, tokenizer=tokenizer, max_len=seq_len + 1, chat_format=chat_format
  )
  return ds.map(fn).to_iter_dataset(read_options or grain.ReadOptions())


def check_pairs(source, tokenizer, *, seq_len: int, chat_format=None, sample: int = 256) -> dict:
  """Tokenizes the first `sample` examples before training (a message list the template cannot
  render is named): {'checked', 'cut', 'dropped'}."""
  out = {'checked': 0, 'cut': 0, 'dropped': 0}
  for i in range(min(sample, len(source))):
    e = tokenize_element(source[i], tokenizer, max_len=seq_len + 1, chat_format=chat_format)
    out['checked'] += 1
    out['dropped'] += len(e['tokens']) == 0
    out['cut'] += bool(len(e['tokens'])) and bool(e['truncated'])
  return out

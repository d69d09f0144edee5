"""Tokenises examples into tokens + loss targets and packs them into fixed-length training rows.
(Design: docs/design.md, "moetrain/data/packing.py".)"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import grain
import numpy as np

from moetrain.data import chat, sources
from moetrain.data.sources import Example
from moetrain.data.tokenizer import Tokenizer

# The batch's schema: each key's dtype, every array shaped [rows, seq_len] (the step's input,
# training/aot.py abstract_batch, is built from it too).
ROW_DTYPES = {
  'inputs': np.int32,
  'targets': np.int32,
  'segment_ids': np.int32,
  'positions': np.int32,
  'loss_mask': np.float32,
}
ROW_KEYS = tuple(ROW_DTYPES)
# Rows also carry how many of their examples were cut to fit; loader.py sums and removes it.
TRUNCATED_KEY = 'num_truncated'


def _tokens(
  example: Example,
  tokenizer: Tokenizer,
  loss_on_prompt: bool,
  chat_format: chat.ChatFormat | None = None,
) -> tuple[list, list]:
  """An example's whole token list (bos, prompt, completion or text, eos) and is_target. A part
  of a long text (sources.PART_KEY) has bos only if it is the first, eos only if the last. A
  chat is its rendered text's tokens, framed with bos/eos only under the built-in template (a
  model's template writes its own special tokens), trained on its assistant turns (chat.py)."""
  part = example.get(sources.PART_KEY, '')
  bos = [] if tokenizer.bos_id is None or part in ('middle', 'last') else [tokenizer.bos_id]
  eos = [] if tokenizer.eos_id is None or part in ('first', 'middle') else [tokenizer.eos_id]
  if 'messages' in example:
    chat_format = chat_format or chat.ChatFormat()
    text, spans = chat_format.apply(example)
    ids, offsets = tokenizer.encode_offsets(text)
    trained = [1.0] * len(ids) if loss_on_prompt else chat.trained_tokens(offsets, spans)
    if not chat_format.builtin:
      return ids, trained
    return bos + ids + eos, [0.0] * len(bos) + trained + [1.0] * len(eos)
  if 'text' in example:
    prompt, completion = [], tokenizer.encode(example['text'])
  else:
    prompt, completion = split_encode(tokenizer, example['prompt'], example['completion'])
  tokens = bos + prompt + completion + eos
  is_target = [0.0] * len(bos) + [float(loss_on_prompt)] * len(prompt)
  return tokens, is_target + [1.0] * (len(completion) + len(eos))


def _piece(tokens: list, is_target: list, truncated: bool) -> dict[str, np.ndarray | int]:
  return {
    'tokens': np.asarray(tokens, np.int32),
    'is_target': np.asarray(is_target, np.float32),
    'truncated': int(truncated),
  }


def tokenize(
  example: Example,
  tokenizer: Tokenizer,
  *,
  max_len: int,
  loss_on_prompt: bool = False,
  chat_format: chat.ChatFormat | None = None,
) -> dict[str, np.ndarray | int]:
  """Returns `tokens` [n <= max_len] int32, `is_target` [n] float32 and `truncated` (0 or 1).

  is_target[i] says whether token i is trained on when it appears as a prediction target: never
  for bos, for prompt tokens only with loss_on_prompt, always for completion/text tokens and eos.
  Examples longer than max_len keep their first max_len tokens (losing eos); so a long text's
  parts after the first (sources.PART_KEY) give no tokens.
  """
  if example.get(sources.PART_KEY) in ('middle', 'last'):
    return _piece([], [], False)
  tokens, is_target = _tokens(example, tokenizer, loss_on_prompt, chat_format)
  return _piece(tokens[:max_len], is_target[:max_len], len(tokens) > max_len)


def tokenize_split(
  example: Example,
  tokenizer: Tokenizer,
  *,
  max_len: int,
  loss_on_prompt: bool = False,
  chat_format: chat.ChatFormat | None = None,
) -> list[dict[str, np.ndarray | int]]:
  """`tokenize`, except that a plain-text example longer than max_len becomes several pieces
  (data.split_long_texts) instead of losing its tail: piece k holds tokens
  [k (max_len - 1), k (max_len - 1) + max_len), so each piece starts with the token the previous
  one ended on and every token after the first is a target exactly once. Pieces are packed as
  examples of their own (positions restart, no attention across them), as in concatenate-and-
  chunk pretraining. Prompt/completion and chat examples are truncated as before: their
  completion makes sense only after its prompt."""
  tokens, is_target = _tokens(example, tokenizer, loss_on_prompt, chat_format)
  if 'text' not in example or len(tokens) <= max_len:
    return [_piece(tokens[:max_len], is_target[:max_len], len(tokens) > max_len)]
  stride = max_len - 1
  return [
    _piece(tokens[i : i + max_len], is_target[i : i + max_len], False)
    for i in range(0, len(tokens) - 1, stride)
  ]


def split_encode(tokenizer: Tokenizer, prompt: str, completion: str) -> tuple[list, list]:
  """The tokens of prompt + completion as one text, split where the prompt's own tokens end.

  Encoding the completion alone would not give the tokens of the text: a SentencePiece model
  (or a tokenizer.json with a Metaspace pre-tokenizer) starts every text it encodes with a
  space, so 'A:\nfox' would be trained as 'A:\n fox'. Where a token of the joint text spans
  the boundary, the two are encoded apart instead (the prompt's tokens must be those it has
  alone: generation encodes the prompt by itself), the completion without that space where the
  tokenizer can (SentencePieceTokenizer.encode_continuation)."""
  head, joint = tokenizer.encode(prompt), tokenizer.encode(prompt + completion)
  if joint[: len(head)] == head:
    return head, joint[len(head) :]
  return head, getattr(tokenizer, 'encode_continuation', tokenizer.encode)(completion)


def finalize_row(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Splits a packed row of seq_len + 1 tokens into shifted inputs/targets and their masks."""
  tokens, segments = row['tokens'], row['tokens_segment_ids']
  # A target counts only if it belongs to the same (non-padding) example as its input.
  same_segment = (segments[1:] == segments[:-1]) & (segments[:-1] != 0)
  return {
    'inputs': tokens[:-1].astype(np.int32),
    'targets': tokens[1:].astype(np.int32),
    'segment_ids': segments[:-1].astype(np.int32),
    'positions': row['tokens_positions'][:-1].astype(np.int32),
    'loss_mask': (row['is_target'][1:] * same_segment).astype(np.float32),
    TRUNCATED_KEY: np.int32(sum(row['truncated'])),
  }


def pack(ds: grain.IterDataset, *, seq_len: int, num_bins: int, pad_id: int) -> grain.IterDataset:
  """Packs tokenized examples (see `tokenize`) into rows; see the module docstring for the format.

  More bins pack tighter but hold more examples in flight; one batch worth is a good default.
  """
  length = seq_len + 1
  # An empty text under a tokenizer with neither bos nor eos has no tokens: it would take a
  # segment id without occupying a position.
  ds = ds.filter(lambda example: len(example['tokens']) > 0)
  packed = grain.experimental.FirstFitPackIterDataset(
    ds,
    length_struct={'tokens': length, 'is_target': length},
    num_packing_bins=num_bins,
    shuffle_bins=False,  # examples arrive shuffled already; keep rows in a reproducible order
    meta_features=('truncated',),
    padding_struct={'tokens': pad_id, 'is_target': 0.0},
  )
  return packed.map(finalize_row)


class _Pieces(grain.experimental.FlatMapTransform):
  """Each element is a list of pieces (tokenize_split): yields them in order."""

  max_fan_out = 1 << 30  # unused by FlatMapIterDataset; a piece list has no fixed bound

  def flat_map(self, pieces):
    return pieces


def tokenized(
  ds: grain.MapDataset,
  tokenizer: Tokenizer,
  *,
  max_len: int,
  loss_on_prompt: bool = False,
  split_long_texts: bool = False,
  read_options: grain.ReadOptions | None = None,
  chat_format: chat.ChatFormat | None = None,
) -> grain.IterDataset:
  """Examples -> tokenized examples (`tokenize`, or `tokenize_split`'s pieces with
  split_long_texts), read ahead with read_options. Both resume exactly (grain's flat map saves
  its parent's position and the index in the current example's pieces)."""
  kw = dict(
    tokenizer=tokenizer, max_len=max_len, loss_on_prompt=loss_on_prompt, chat_format=chat_format
  )
  fn = tokenize_split if split_long_texts else tokenize
  out = ds.map(functools.partial(fn, **kw)).to_iter_dataset(read_options or grain.ReadOptions())
  return grain.experimental.FlatMapIterDataset(out, _Pieces()) if split_long_texts else out


def pack_examples(
  examples: Sequence[Example],
  tokenizer: Tokenizer,
  *,
  seq_len: int,
  num_bins: int = 8,
  loss_on_prompt: bool = False,
  split_long_texts: bool = False,
  chat_format: chat.ChatFormat | None = None,
) -> list[dict[str, np.ndarray]]:
  """Tokenizes and packs a small in-memory list of examples (tools and tests)."""
  ds = tokenized(
    grain.MapDataset.source(list(examples)),
    tokenizer,
    max_len=seq_len + 1,
    loss_on_prompt=loss_on_prompt,
    split_long_texts=split_long_texts,
    chat_format=chat_format,
  )
  return list(pack(ds, seq_len=seq_len, num_bins=num_bins, pad_id=tokenizer.pad_id))

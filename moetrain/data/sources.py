"""Random-access record sources (JSONL, plain text, TFDS, the demo task) yielding example dicts.

Every source has `len()` and `[i]`, so grain can shuffle, shard and checkpoint by index. An example
is {'prompt': str, 'completion': str} (loss on the completion), {'text': str} (loss on all of
it) or a chat, {'messages': [...], 'tools': [...] (if the record has them), 'where': 'file:line'},
which the packer renders with the model's chat template (chat.py). Local files are indexed and validated when the source is built, so bad input fails
before training starts, with the file and line number in the message.

A plain text longer than `max_text_bytes` (a paragraph of a text file, a JSONL record's text) is
read as several examples, its parts, cut before a space where there is one: memory stays bounded
by the part, not the document (one 50 MB line would otherwise be tokenized whole, by every
read-ahead thread). A part carries PART_KEY ('first', 'middle' or 'last'); only the first gets
the beginning-of-text token and only the last the end-of-text token (packing._tokens).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from moetrain.core import storage
from moetrain.data import chat, demo_task

Example = dict[str, Any]

UTF8_BOM = b'\xef\xbb\xbf'  # editors on Windows start text files with it
MAX_TEXT_BYTES = 1 << 20  # the default part size of long texts (see the module docstring)
PART_KEY = 'part'
PART_KINDS = ('', 'first', 'middle', 'last')  # '' = a whole text (index 0)


@dataclasses.dataclass(frozen=True)
class Fields:
  """Record field names; '' disables a kind. A record is read as chat if it has `messages`, else
  as prompt/completion if it has both, else as plain text."""

  text: str = 'text'
  prompt: str = 'prompt'
  completion: str = 'completion'
  messages: str = 'messages'
  tools: str = 'tools'


def _as_str(value: Any, where: str, key: str) -> str:
  if isinstance(value, bytes):  # TFDS Text features (np.bytes_ is a bytes subclass)
    try:
      return value.decode('utf-8')
    except UnicodeDecodeError as e:
      raise ValueError(f'{where}: field {key!r} is not valid UTF-8: {e}') from e
  if not isinstance(value, str):
    raise ValueError(f'{where}: field {key!r} should be a string, got {type(value).__name__}')
  # JSON may escape a lone half of a surrogate pair ("\ud83d", an emoji cut in two): a string no
  # tokenizer can encode, which would stop the run at the step that reads it, naming no line.
  try:
    value.encode('utf-8')
  except UnicodeEncodeError as e:
    raise ValueError(f'{where}: field {key!r} is not valid Unicode: {e}') from e
  return value


def _plain(value: Any, where: str, key: str) -> Any:
  """A message's field as plain JSON-like Python (TFDS gives bytes and numpy arrays)."""
  if isinstance(value, (bytes, str)):
    return _as_str(value, where, key)
  if isinstance(value, np.ndarray):
    value = value.tolist()
  if isinstance(value, Mapping):
    return {str(k): _plain(v, where, f'{key}.{k}') for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v, where, key) for v in value]
  return value.item() if isinstance(value, np.generic) else value


def chat_example(messages: Any, tools: Any, where: str) -> dict[str, Any]:
  """A chat record's messages [{role, content, ...}, ...] (and tools) as a chat example; the
  template renders whatever else a message holds (tool_calls, content parts, reasoning).

  TFDS stores such a list (a Sequence of {role, content} features) as parallel columns,
  {'role': [...], 'content': [...]}; that form is accepted too. Tools may be a JSON string."""
  if isinstance(messages, Mapping) and 'role' in messages and 'content' in messages:
    roles, contents = list(messages['role']), list(messages['content'])
    if len(roles) != len(contents):
      raise ValueError(f'{where}: messages have {len(roles)} roles but {len(contents)} contents')
    messages = [{'role': r, 'content': c} for r, c in zip(roles, contents)]
  if isinstance(messages, (tuple, np.ndarray)):
    messages = list(messages)
  if not isinstance(messages, list) or not messages:
    raise ValueError(f'{where}: messages should be a non-empty list of {{role, content}} objects')
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping) or not isinstance(m.get('role'), (str, bytes)):
      raise ValueError(f'{where}: message {i} should be an object with a "role" string')
  example = {'messages': _plain(messages, where, 'messages'), 'where': where}
  if not any(m['role'] == 'assistant' for m in example['messages']):
    raise ValueError(f'{where}: the conversation has no assistant message to train on')
  if isinstance(tools, (str, bytes)) and tools:
    try:
      tools = json.loads(tools)
    except json.JSONDecodeError as e:
      raise ValueError(f'{where}: field tools is not valid JSON: {e}') from e
  if tools is not None and len(tools):
    if not all(isinstance(t, Mapping) for t in tools):
      raise ValueError(f'{where}: tools should be a list of JSON schemas (objects)')
    example['tools'] = _plain(tools, where, 'tools')
  return example


def to_example(record: Mapping[str, Any], fields: Fields, where: str) -> Example:
  """Normalises one record into an example dict; `where` prefixes error messages."""
  if fields.messages and fields.messages in record:
    tools = record.get(fields.tools) if fields.tools else None
    return chat_example(record[fields.messages], tools, where)
  if (
    fields.prompt and fields.completion and fields.prompt in record and fields.completion in record
  ):
    return {
      'prompt': _as_str(record[fields.prompt], where, fields.prompt),
      'completion': _as_str(record[fields.completion], where, fields.completion),
    }
  if fields.text and fields.text in record:
    return {'text': _as_str(record[fields.text], where, fields.text)}
  raise ValueError(
    f'{where}: record has none of the configured fields (data.messages_key={fields.messages!r}, '
    f'data.prompt_key={fields.prompt!r} + data.completion_key={fields.completion!r}, '
    f'data.text_key={fields.text!r}); its keys are {sorted(record)}'
  )


def example_texts(example: Example) -> list[str]:
  """The strings that get tokenized for an example (what a tokenizer should be trained on; a
  trained tokenizer has no chat template of its own, so chats are rendered with the built-in)."""
  if 'messages' in example:
    return [chat.ChatFormat().apply(example)[0]]
  return [example['text']] if 'text' in example else [example['prompt'] + example['completion']]


def expand_paths(pattern: str, split: str) -> list[str]:
  """Files for `split`: '{split}' in the pattern is replaced by the split name, then globbed
  ('**' matches any number of directories)."""
  pattern = pattern.replace('{split}', split)
  paths = storage.glob(pattern)
  if not paths:
    raise FileNotFoundError(f'no file matches {pattern!r} (data.path, split {split!r})')
  return [storage.local_copy(p) for p in paths]  # (gs:// files: copied once, then read here)


def cut(window: bytes, limit: int) -> int:
  """Where to end a part that starts at window[0] (window: the next limit + 1 bytes or more of
  UTF-8): before the last space, or after the last line break, in the second half of the first
  `limit` bytes, else at the last character boundary (a text with no spaces: CJK, base64)."""
  for sep, after in ((b' ', 0), (b'\n', 1)):
    at = window.rfind(sep, limit // 2, limit + 1 - after)
    if at > 0:
      return at + after
  at = limit
  while at > 0 and window[at] & 0xC0 == 0x80:  # a UTF-8 continuation byte
    at -= 1
  return at


def text_parts(data: bytes, limit: int) -> list[tuple[int, int]]:
  """Byte ranges [lo, hi) cutting UTF-8 `data` into parts of at most `limit` bytes (`cut`)."""
  parts, lo = [], 0
  while len(data) - lo > limit:
    hi = lo + cut(data[lo : lo + limit + 1], limit)
    parts.append((lo, hi))
    lo = hi
  return parts + [(lo, len(data))]


def part_kinds(n: int) -> list[int]:
  """PART_KINDS indices of a text's n parts."""
  return [0] if n == 1 else [1] + [2] * (n - 2) + [3]


def with_part(example: Example, kind: int) -> Example:
  return {**example, PART_KEY: PART_KINDS[kind]} if kind else example


class _FileRecords:
  """Where each record lives (file, byte offset, byte length, line number, and for a part of a
  long text its kind and byte range in the text): an index, not the data, so large files are
  never held in memory and reads are safe from any thread or process. Each file's size and
  modification time are kept: a file changed after indexing is an error naming it, not a record
  read at a stale offset under a wrong line number."""

  def __init__(self, paths: Sequence[str]):
    self.paths = list(paths)
    self._stat = [self._stamp(os.stat(p)) for p in self.paths]
    self._file, self._span, self._line, self._kind = [], [], [], []
    self._range = {}  # record -> (lo, hi) for the parts of a JSONL record's text only

  @staticmethod
  def _stamp(st: os.stat_result) -> tuple[int, int]:
    return st.st_size, st.st_mtime_ns

  def add(self, file: int, start: int, length: int, line: int, kind: int = 0, text_range=None):
    """One record: a whole text or record (kind 0), or a part of a long text (PART_KINDS),
    with its byte range in the record's text (`text_range`, JSONL) or in the file (text)."""
    if text_range is not None:
      self._range[len(self._file)] = text_range
    self._file.append(file)
    self._span.append((start, length))
    self._line.append(line)
    self._kind.append(kind)

  def freeze(self) -> None:
    self._file = np.asarray(self._file, np.int32)
    self._span = np.asarray(self._span, np.int64).reshape(-1, 2)
    self._line = np.asarray(self._line, np.int64)
    self._kind = np.asarray(self._kind, np.int8)

  def __len__(self) -> int:
    return len(self._file)

  def part(self, i: int) -> tuple[int, tuple[int, int] | None]:
    """Record i's PART_KINDS index, and its byte range in the record's text (JSONL parts)."""
    return int(self._kind[i]), self._range.get(i)

  def read(self, i: int) -> tuple[bytes, str]:
    """The raw bytes of record i and its 'file:line' for messages."""
    path = self.paths[self._file[i]]
    start, length = (int(x) for x in self._span[i])
    with open(path, 'rb') as f:
      if self._stamp(os.fstat(f.fileno())) != self._stat[self._file[i]]:
        raise ValueError(
          f'{path} changed after the run indexed it at start-up: training data must not change '
          'while a run reads it (write new data to a new file; a restarted run resumes from its '
          'last checkpoint and indexes the file again)'
        )
      f.seek(start)
      return f.read(length), f'{path}:{self._line[i]}'


class JsonlSource:
  """JSON Lines files, one record per non-blank line (a long text: several parts)."""

  def __init__(
    self, paths: Sequence[str], fields: Fields = Fields(), max_text_bytes: int = MAX_TEXT_BYTES
  ):
    self.fields = fields
    self._records = _FileRecords(paths)
    for f_idx, path in enumerate(self._records.paths):
      offset = 0
      with open(path, 'rb') as f:
        for line_no, raw in enumerate(f, start=1):
          if raw.strip():
            # Validated now, to fail before training.
            example = self._parse(raw, f'{path}:{line_no}')
            text = example.get('text', '').encode('utf-8')
            if len(text) <= max_text_bytes:
              self._records.add(f_idx, offset, len(raw), line_no)
            else:
              parts = text_parts(text, max_text_bytes)
              for kind, part in zip(part_kinds(len(parts)), parts):
                self._records.add(f_idx, offset, len(raw), line_no, kind, part)
          offset += len(raw)
    self._records.freeze()

  def _parse(self, raw: bytes, where: str) -> Example:
    try:
      record = json.loads(raw.rstrip(b'\r\n'))  # one line: e.colno is the column in it
    except json.JSONDecodeError as e:
      raise ValueError(f'{where}: malformed JSON at column {e.colno}: {e.msg}') from e
    except UnicodeDecodeError as e:
      raise ValueError(f'{where}: malformed JSON: {e}') from e
    if not isinstance(record, dict):
      raise ValueError(f'{where}: expected a JSON object, got {type(record).__name__}')
    return to_example(record, self.fields, where)

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, i: int) -> Example:
    example = self._parse(*self._records.read(i))
    kind, text_range = self._records.part(i)
    if not kind:
      return example
    lo, hi = text_range
    text = example['text'].encode('utf-8')[lo:hi].decode('utf-8')
    return with_part({'text': text}, kind)


class TextSource:
  """UTF-8 text files; a document is a paragraph, i.e. lines up to the next blank line, so
  documents may span several lines (a file with no blank lines is one document; a paragraph
  longer than max_text_bytes is read as parts)."""

  def __init__(self, paths: Sequence[str], max_text_bytes: int = MAX_TEXT_BYTES):
    self._records = _FileRecords(paths)
    for f_idx, path in enumerate(self._records.paths):
      with open(path, 'rb') as f:
        for start, end, line_no in self._paragraphs(path):
          parts = [(start, end)]
          if end - start > max_text_bytes:  # cut in windows: the paragraph is never read whole
            parts, lo = [], start
            while end - lo > max_text_bytes:
              f.seek(lo)
              hi = lo + cut(f.read(max_text_bytes + 1), max_text_bytes)
              parts.append((lo, hi))
              lo = hi
            parts.append((lo, end))
          for kind, (lo, hi) in zip(part_kinds(len(parts)), parts):
            self._records.add(f_idx, lo, hi - lo, line_no, kind)
    self._records.freeze()

  @staticmethod
  def _paragraphs(path: str):
    """Yields (start, end, first line number) byte spans of blank-line-separated paragraphs."""
    start = first_line = None
    offset = 0
    with open(path, 'rb') as f:
      for line_no, raw in enumerate(f, start=1):
        if line_no == 1 and raw.startswith(UTF8_BOM):  # spans start after it
          offset, raw = len(UTF8_BOM), raw[len(UTF8_BOM) :]
        if raw.strip() and start is None:
          start, first_line = offset, line_no
        elif not raw.strip() and start is not None:
          yield start, offset, first_line
          start = None
        try:
          raw.decode('utf-8')
        except UnicodeDecodeError as e:
          raise ValueError(f'{path}:{line_no}: not valid UTF-8: {e}') from e
        offset += len(raw)
    if start is not None:
      yield start, offset, first_line

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, i: int) -> Example:
    raw, _ = self._records.read(i)
    # The line breaks around the paragraph go, its first line's indentation stays (code, verse).
    example = {'text': raw.decode('utf-8').strip('\r\n')}
    return with_part(example, self._records.part(i)[0])


class TfdsSource:
  """A TFDS dataset prepared in array_record format, read with tfds.data_source (no TensorFlow)."""

  def __init__(self, name: str, split: str, data_dir: str = '', fields: Fields = Fields()):
    # Imported here: tensorflow_datasets is slow to import and only this source needs it.
    import tensorflow_datasets as tfds

    self.fields = fields
    self._where = f'tfds {name!r} split {split!r}'
    try:
      self._source = tfds.data_source(name, split=split, data_dir=data_dir or None)
    except Exception as e:
      raise ValueError(f'{self._where} (data_dir {data_dir or "default"!r}): {e}') from e

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i: int) -> Example:
    return to_example(self._source[i], self.fields, f'{self._where} record {i}')


def demo_source(split: str) -> JsonlSource:
  """The shipped word-reversal task (see demo_task.py); splits 'train' and 'eval'."""
  path = demo_task.DEMO_DIR / f'{split}.jsonl'
  if not os.path.isfile(path):
    raise ValueError(f'the demo source has splits {sorted(demo_task.SPLITS)}, not {split!r}')
  return JsonlSource([str(path)])

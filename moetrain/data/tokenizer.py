"""Tokenizers behind one small interface: SentencePiece models and Hugging Face tokenizer.json."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import sentencepiece as spm
import tokenizers
from absl import logging
from etils.epath import Path  # (pathlib's, and gs:// URLs: moetrain/core/storage.py)

from moetrain.core import storage
from moetrain.data import chat

SPM_FILE = 'tokenizer.model'
HF_FILE = 'tokenizer.json'
HF_CONFIG_FILE = 'tokenizer_config.json'
SPECIAL_TOKENS_FILE = 'special_tokens_map.json'

# Ids fixed by train_sentencepiece; bos=1 and eos=2 match LongCat-Flash's config.
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

# Used only when tokenizer_config.json has no entry for the token (first match wins); an entry
# of null means the tokenizer has no such token (e.g. Qwen's bos).
_GUESSES = {
  'bos': ('<s>', '<|begin_of_text|>', '<bos>', '<|startoftext|>', '<|im_start|>'),
  'eos': ('</s>', '<|end_of_text|>', '<eos>', '<|endoftext|>', '<|im_end|>'),
  'pad': ('<pad>', '[PAD]', '<|pad|>', '<|finetune_right_pad_id|>'),
}

# Lines longer than this are cut into pieces for SentencePiece training.
MAX_SENTENCE_CHARS = 4096

Special = int | str | None  # an override: a token id, a token string, or None for the default


@runtime_checkable
class Tokenizer(Protocol):
  """What the pipeline, evaluation and generation need from a tokenizer.

  `encode` never adds special tokens (packing adds bos/eos itself); `decode` drops them.
  bos_id / eos_id are None when the tokenizer has no such token. pad_id is always a valid id:
  padding is marked by segment id 0, so its value only has to be in range.
  """

  vocab_size: int
  bos_id: int | None
  eos_id: int | None
  pad_id: int

  def encode(self, text: str) -> list[int]: ...

  def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """`encode`, with each token's character range [start, end) in `text`."""
    ...

  def decode(self, ids: Sequence[int]) -> str: ...


def _resolve(
  override: Special,
  default: int | None,
  lookup: Callable[[str], int | None],
  *,
  what: str,
  vocab_size: int,
  where: str,
) -> int | None:
  """Turns an override (id or token string) or the tokenizer's own default into an id."""
  if override is None:
    return default
  if isinstance(override, str):
    token_id = lookup(override)
    if token_id is None:
      raise ValueError(f'{where}: {what} token {override!r} is not in the vocabulary')
    return token_id
  if not 0 <= override < vocab_size:
    raise ValueError(f'{where}: {what} id {override} is outside the vocabulary [0, {vocab_size})')
  return int(override)


class SentencePieceTokenizer:
  """A SentencePiece `.model`; picklable (grain worker processes get the serialized proto)."""

  def __init__(
    self,
    model_proto: bytes,
    *,
    bos: Special = None,
    eos: Special = None,
    pad: Special = None,
    name: str = '<sentencepiece proto>',
  ):
    self._state = dict(model_proto=model_proto, bos=bos, eos=eos, pad=pad, name=name)
    self.name = name
    self.chat_template = None  # a .model file has none: chats use chat.BUILTIN
    if not model_proto:  # (SentencePiece takes an empty proto for a model of no pieces)
      raise ValueError(f'{name} is empty: not a SentencePiece model')
    try:
      self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    except RuntimeError as e:
      first = (str(e).strip().splitlines() or [''])[0]
      raise ValueError(f'{name} is not a readable SentencePiece model ({first})') from e
    self.vocab_size = self._sp.vocab_size()
    if not self.vocab_size:
      raise ValueError(f'{name} is not a readable SentencePiece model (it holds no pieces)')
    self._continuation = None

    def lookup(piece: str) -> int | None:
      token_id = self._sp.piece_to_id(piece)
      return token_id if self._sp.id_to_piece(token_id) == piece else None

    def own(token_id: int) -> int | None:  # SentencePiece reports a disabled token as -1
      return token_id if token_id >= 0 else None

    common = dict(lookup=lookup, vocab_size=self.vocab_size, where=name)
    self.bos_id = _resolve(bos, own(self._sp.bos_id()), what='bos', **common)
    self.eos_id = _resolve(eos, own(self._sp.eos_id()), what='eos', **common)
    self.pad_id = _resolve(pad, own(self._sp.pad_id()), what='pad', **common) or 0
    ids = dict(bos_token=self.bos_id, eos_token=self.eos_id, pad_token=self.pad_id)
    self.template_variables = {k: self._sp.id_to_piece(v) for k, v in ids.items() if v is not None}

  @classmethod
  def from_file(cls, path: str | os.PathLike, **overrides: Special) -> SentencePieceTokenizer:
    return cls(Path(path).read_bytes(), name=str(path), **overrides)

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text, out_type=int)

  def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    pieces = self._sp.encode(text, return_type='proto').pieces
    # Byte offsets; a character written as byte pieces has all its bytes on the last piece.
    spans = [(p.begin, p.end) for p in pieces]
    for i in range(len(spans) - 2, -1, -1):
      if spans[i][0] == spans[i][1] and pieces[i].piece.startswith('<0x'):
        spans[i] = spans[i + 1]
    return [p.id for p in pieces], _chars(text, spans)

  def encode_continuation(self, text: str) -> list[int]:
    """The tokens of `text` continuing an earlier text: without the space that the model's
    normaliser puts before every text it encodes (add_dummy_prefix)."""
    if self._continuation is None:  # built on first use (a race builds it twice: harmless)
      try:  # the model's protobuf; sentencepiece's generated module wants a matching protobuf
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto.FromString(self._state['model_proto'])
        proto.normalizer_spec.add_dummy_prefix = False
        self._continuation = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
      except Exception as e:  # ImportError, protobuf's VersionError
        logging.warning(
          'SentencePiece continuations are encoded with the leading space the model adds to '
          'every text (its protobuf module did not load: %s)',
          e,
        )
        self._continuation = self._sp
    return self._continuation.encode(text, out_type=int)

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def __getstate__(self) -> dict:
    return self._state

  def __setstate__(self, state: dict) -> None:
    self.__init__(**state)


def _config_token(config: dict, key: str) -> str | None:
  """tokenizer_config.json writes a special token as a string or as {'content': ...}."""
  value = config.get(key)
  if isinstance(value, dict):
    value = value.get('content')
  return value if isinstance(value, str) else None


class HFTokenizer:
  """A Hugging Face `tokenizer.json`, with special tokens from tokenizer_config.json if present.

  Precedence for bos/eos/pad: explicit override > tokenizer_config.json > common token names.
  """

  def __init__(
    self,
    tokenizer_json: str,
    config: dict | None = None,
    *,
    bos: Special = None,
    eos: Special = None,
    pad: Special = None,
    name: str = '<tokenizer.json>',
    chat_template: str | dict[str, str] | None = None,
  ):
    config = config or {}
    self._state = dict(
      tokenizer_json=tokenizer_json,
      config=config,
      bos=bos,
      eos=eos,
      pad=pad,
      name=name,
      chat_template=chat_template,
    )
    self.name = name
    # The model's chat template (chat.py), and the special-token variables it may read.
    self.chat_template = chat_template
    self.template_variables = chat.token_variables(config)
    try:
      self._tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # the library raises a bare Exception
      raise ValueError(f'{name} is not a readable Hugging Face tokenizer.json: {e}') from e
    # Ids can be sparse (added tokens past the base vocab): size the embedding by the largest id.
    self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
    lookup = self._tok.token_to_id

    def default(kind: str) -> int | None:
      key = f'{kind}_token'
      named = _config_token(config, key)
      if named is not None and lookup(named) is not None:
        return lookup(named)
      if config.get(key) is not None and kind != 'pad':  # a pad value is never read: guess
        raise ValueError(
          f'{name}: {HF_CONFIG_FILE} gives {key} {config[key]!r}, which is not in the '
          'vocabulary (a tokenizer_config.json from another tokenizer?)'
        )
      if key in config and config[key] is None:  # declared absent, e.g. Qwen's "bos_token": null
        return None
      return next((lookup(t) for t in _GUESSES[kind] if lookup(t) is not None), None)

    def resolve(kind: str, override: Special) -> int | None:
      fallback = default(kind) if override is None else None
      return _resolve(override, fallback, lookup, what=kind, vocab_size=self.vocab_size, where=name)

    self.bos_id = resolve('bos', bos)
    self.eos_id = resolve('eos', eos)
    self.pad_id = resolve('pad', pad) or 0
    self._continuation = None

  @classmethod
  def from_file(cls, path: str | os.PathLike, **overrides: Special) -> HFTokenizer:
    path = Path(path)
    config = {}
    for file in (HF_CONFIG_FILE, SPECIAL_TOKENS_FILE):  # the second fills what the first lacks
      if path.with_name(file).is_file():
        try:
          config = json.loads(path.with_name(file).read_text(encoding='utf-8')) | config
        except json.JSONDecodeError as e:
          raise ValueError(f'{path.with_name(file)} is not valid JSON: {e}') from None
    template = chat.template_from_config(config, path.parent)
    return cls(
      path.read_text(encoding='utf-8'),
      config,
      name=str(path),
      chat_template=template,
      **overrides,
    )

  def encode(self, text: str) -> list[int]:
    # Special tokens written in the text ('<|im_start|>' in data rendered with a model's chat
    # template) are read as those tokens, as transformers' tokenizers do by default.
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    encoding = self._tok.encode(text, add_special_tokens=False)
    return encoding.ids, encoding.offsets

  def encode_continuation(self, text: str) -> list[int]:
    """The tokens of `text` continuing an earlier text: without the word-start marker that a
    SentencePiece-style tokenizer.json puts before every text it encodes (a Metaspace
    pre-tokenizer's prepend_scheme, or a Prepend normalizer as in Llama 2's)."""
    if self._continuation is None:  # built on first use (a race builds it twice: harmless)
      spec = json.loads(self._state['tokenizer_json'])
      changed = _drop_prepend(spec)
      self._continuation = tokenizers.Tokenizer.from_str(json.dumps(spec)) if changed else self._tok
    return self._continuation.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def decode_with_special(self, ids: Sequence[int]) -> str:
    """`decode`, keeping special tokens (<|im_start|>): what a chat template wrote."""
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

  def __getstate__(self) -> dict:
    return self._state

  def __setstate__(self, state: dict) -> None:
    self.__init__(**state)


def _chars(text: str, byte_spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
  """UTF-8 byte offsets in `text` -> character offsets (a byte inside a character maps to it)."""
  starts = np.cumsum([0] + [len(c.encode('utf-8')) for c in text])  # byte start of character i
  flat = np.searchsorted(starts, np.asarray(byte_spans, np.int64).reshape(-1), side='right') - 1
  return [(int(a), int(b)) for a, b in flat.reshape(-1, 2)]


def _drop_prepend(node) -> bool:
  """Turns off, in a tokenizer.json spec (in place), what prepends the word-start marker to a
  text: Metaspace pre-tokenizers' prepend_scheme (and the older add_prefix_space) and Prepend
  normalizers. Returns whether anything changed."""
  changed = False
  if isinstance(node, dict):
    if node.get('type') == 'Metaspace':
      changed = node.get('prepend_scheme', 'never') != 'never' or bool(node.get('add_prefix_space'))
      node['prepend_scheme'] = 'never'
      node.pop('add_prefix_space', None)
    if node.get('type') == 'Sequence':
      for key in ('normalizers', 'pretokenizers'):
        items = node.get(key) or []
        kept = [n for n in items if not (isinstance(n, dict) and n.get('type') == 'Prepend')]
        changed |= len(kept) != len(items)
        if key in node:
          node[key] = kept
    for key, value in node.items():
      if key == 'normalizer' and isinstance(value, dict) and value.get('type') == 'Prepend':
        node[key], changed = None, True
      elif isinstance(value, dict | list):
        changed |= _drop_prepend(value)
  elif isinstance(node, list):
    for item in node:
      changed |= _drop_prepend(item)
  return changed


def tokenizer_file(path: str | os.PathLike) -> Path | None:
  """The file a tokenizer path reads: the path itself, or for a directory (read the way a
  Hugging Face checkpoint is) its tokenizer.json, else its tokenizer.model; None for a directory
  holding neither."""
  path = Path(path)
  if not path.is_dir():
    return path
  return next((c for c in (path / HF_FILE, path / SPM_FILE) if c.is_file()), None)


def tokenizer_files(path: str | os.PathLike) -> list[str]:
  """The files a tokenizer path reads (tokenizer_file; beside a tokenizer.json, the special-token
  and chat-template files present too): what a run's fingerprint of its tokenizer covers."""
  file = tokenizer_file(path)
  if file is None or not file.is_file():
    return []
  beside = (
    (HF_CONFIG_FILE, SPECIAL_TOKENS_FILE, chat.TEMPLATE_FILE) if file.suffix == '.json' else ()
  )
  return [str(f) for f in (file, *(file.with_name(n) for n in beside)) if f.is_file()]


def load_tokenizer(
  path: str | os.PathLike, *, bos: Special = None, eos: Special = None, pad: Special = None
) -> Tokenizer:
  """Loads a `.model` file, a `tokenizer.json` file, or a directory holding either
  (tokenizer_file). bos/eos/pad override the tokenizer's own special tokens (id or string)."""
  overrides = dict(bos=bos, eos=eos, pad=pad)
  file = tokenizer_file(path)
  if file is None:
    raise FileNotFoundError(f'tokenizer directory {path} holds neither {HF_FILE} nor {SPM_FILE}')
  path = file
  if not path.is_file():
    raise FileNotFoundError(f'tokenizer {path} does not exist')
  if path.suffix == '.model':
    return SentencePieceTokenizer.from_file(path, **overrides)
  if path.suffix == '.json':
    return HFTokenizer.from_file(path, **overrides)
  raise ValueError(f'tokenizer {path}: expected a SentencePiece .model or a tokenizer.json file')


def train_sentencepiece(
  texts: Iterable[str], vocab_size: int, model_path: str | os.PathLike, *, model_type: str = 'bpe'
) -> SentencePieceTokenizer:
  """Trains a byte-fallback SentencePiece model on `texts` and writes it to `model_path`.

  Ids: pad=0, bos=1, eos=2, unk=3. Identity normalisation and kept whitespace make
  decode(encode(text)) reproduce the text. `vocab_size` is an upper bound: a small corpus may run
  out of merges first. Single-threaded so that the same texts always give the same model bytes.
  """
  # SentencePiece skips "sentences" longer than max_sentence_length (bytes), silently: feed
  # documents by line, and long lines in pieces of at most MAX_SENTENCE_CHARS characters.
  lines = (
    line[i : i + MAX_SENTENCE_CHARS]
    for text in texts
    for line in text.splitlines()
    if line.strip()
    for i in range(0, len(line), MAX_SENTENCE_CHARS)
  )
  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=lines,
      model_writer=model,
      vocab_size=vocab_size,
      model_type=model_type,
      byte_fallback=True,
      pad_id=PAD_ID,
      bos_id=BOS_ID,
      eos_id=EOS_ID,
      unk_id=UNK_ID,
      max_sentence_length=4 * MAX_SENTENCE_CHARS,  # UTF-8: at most 4 bytes a character
      normalization_rule_name='identity',
      remove_extra_whitespaces=False,
      allow_whitespace_only_pieces=True,
      split_digits=True,
      hard_vocab_limit=False,
      num_threads=1,
      minloglevel=2,
    )
  except RuntimeError as e:
    raise ValueError(f'training a SentencePiece model for {model_path} failed: {e}') from e
  storage.write_atomic(os.fspath(model_path), model.getvalue())  # (hosts racing here: whole)
  return SentencePieceTokenizer(model.getvalue(), name=str(model_path))


def get_or_train_tokenizer(
  path: str, workdir: str | os.PathLike, texts_fn: Callable[[], Iterable[str]], vocab_size: int
) -> Tokenizer:
  """Loads `path`; with no path, reuses <workdir>/tokenizer.model or trains and caches it there.

  Training is deterministic, so hosts sharing a workdir that race here write identical bytes.
  """
  if path:
    return load_tokenizer(path)
  model_path = Path(workdir) / SPM_FILE
  if model_path.is_file():
    return SentencePieceTokenizer.from_file(model_path)
  return train_sentencepiece(texts_fn(), vocab_size, model_path)

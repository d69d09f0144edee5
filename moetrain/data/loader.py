"""DataConfig and the deterministic, resumable, per-host grain pipelines built from it."""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from collections.abc import Iterator

import grain
import numpy as np
from absl import logging

from moetrain.core import storage
from moetrain.core.fields import check, field
from moetrain.data import chat, packing, preference, sources
from moetrain.data import tokenizer as tokenizer_lib
from moetrain.data.tokenizer import Tokenizer, get_or_train_tokenizer

SOURCES = ('demo', 'jsonl', 'text', 'tfds')
DEMO_SPLITS = ('train', 'eval')
MIN_SPM_VOCAB = 300  # 256 byte-fallback pieces + 4 specials + room for characters and merges
MAX_TOKENIZER_EXAMPLES = 100_000  # examples (evenly spaced over the train split) to train spm on
# Threads that read and tokenize ahead of packing when worker_count is 0 (order is preserved).
READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=256)
stream = functools.partial(field, role='stream')


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """The `config.data` section. Splits: for jsonl/text, '{split}' in `path` is replaced by the
  split name (e.g. 'data/{split}.jsonl'); eval_split='' means there is no eval set."""

  source: str = stream('demo', choices=SOURCES)  # where the examples come from
  # What a record is: 'examples' (text, prompt/completion or chat), or preference records,
  # 'paired' {prompt, chosen, rejected} or 'unpaired' {prompt, completion, label}, which
  # preference.loss sets (docs/preference.md)
  records: str = stream('examples', choices=('examples', *preference.KINDS))
  # jsonl/text file or glob; '{split}' is replaced by the split name.
  path: str = stream('', role=('stream', 'path'))
  tfds_name: str = stream('')  # tfds dataset name (prepared locally; read via tfds.data_source)
  tfds_data_dir: str = field('', role='path')  # tfds data_dir
  train_split: str = stream('train')  # the split trained on
  eval_split: str = 'eval'  # '' = no evaluation
  text_key: str = stream('text')  # field holding plain text
  prompt_key: str = stream('prompt')  # field holding a prompt (loss off unless loss_on_prompt)
  completion_key: str = stream('completion')  # field holding the completion
  messages_key: str = stream('messages')  # field holding chat messages [{role, content}]
  tools_key: str = stream('tools')  # field holding a chat's tool schemas (for its template)
  # A Jinja chat template file for chats; '' = the tokenizer's own (tokenizer_config.json or
  # chat_template.jinja), or the built-in <|role|> template for a tokenizer that has none.
  chat_template: str = stream('', role=('stream', 'path'))
  chat_loss: str = field('all', choices=chat.LOSSES)  # which assistant turns of a chat train
  # A sentencepiece .model, a tokenizer.json or a directory with one; '' = a sentencepiece model
  # trained into the run directory on first use (of vocab_size pieces).
  tokenizer: str = stream('', role=('stream', 'path'))
  vocab_size: int = 512  # pieces of a sentencepiece model trained on first use
  seq_len: int = stream(128)  # tokens per packed row
  global_batch_size: int = stream(16)  # rows per step over all hosts
  eval_batch_size: int = 16  # rows per eval batch over all hosts
  shuffle: bool = stream(True)  # shuffle training examples (reshuffled every epoch)
  seed: int = stream(0)  # data order
  loss_on_prompt: bool = False  # also train on prompt tokens
  # Text longer than seq_len + 1 tokens is split into rows (else cut).
  split_long_texts: bool = stream(True)
  num_epochs: int | None = stream(None)  # None = repeat forever
  worker_count: int = stream(0)  # grain worker processes (0 = in-process)
  reslice_on_resume: bool = False  # resume on another host count: restart the data in new slices

  @property
  def fields(self) -> sources.Fields:
    return sources.Fields(
      self.text_key, self.prompt_key, self.completion_key, self.messages_key, self.tools_key
    )


def _validate_sizes(cfg: DataConfig, process_count: int) -> None:
  if cfg.seq_len <= 0:
    raise ValueError(f'data.seq_len={cfg.seq_len} must be positive (e.g. 128, or 4096)')
  for name in ('global_batch_size', 'eval_batch_size'):
    size = getattr(cfg, name)
    if size <= 0 or size % process_count:
      raise ValueError(
        f'data.{name}={size} must be a positive multiple of the process count ({process_count}): '
        f'each host loads {name} // process_count rows'
      )
  if cfg.num_epochs is not None and cfg.num_epochs < 1:
    raise ValueError(f'data.num_epochs={cfg.num_epochs}: use None to repeat forever, or >= 1')
  if cfg.worker_count < 0:
    raise ValueError(f'data.worker_count={cfg.worker_count}: use 0 (no worker processes) or more')
  if not 0 <= cfg.seed < 2**32:
    raise ValueError(f'data.seed={cfg.seed} must be in [0, 2**32)')


def _validate_tokenizer(cfg: DataConfig) -> None:
  if cfg.tokenizer and not storage.exists(cfg.tokenizer):
    raise ValueError(
      f'data.tokenizer={cfg.tokenizer!r} does not exist: give a .model file, a tokenizer.json or a '
      "checkpoint directory, or '' to train a SentencePiece model into the workdir"
    )
  if cfg.tokenizer and tokenizer_lib.tokenizer_file(cfg.tokenizer) is None:
    raise ValueError(
      f'data.tokenizer={cfg.tokenizer!r} holds neither {tokenizer_lib.HF_FILE} nor '
      f'{tokenizer_lib.SPM_FILE}: point data.tokenizer at the one the weights go with (left '
      "empty, it is init.hf_checkpoint's)"
    )
  if cfg.chat_template and not storage.isfile(cfg.chat_template):
    raise ValueError(
      f'data.chat_template={cfg.chat_template!r} is not a file: give a Jinja chat template '
      "(.jinja), or '' for the tokenizer's own"
    )
  if not cfg.tokenizer and cfg.vocab_size < MIN_SPM_VOCAB:
    raise ValueError(
      f'data.vocab_size={cfg.vocab_size} is too small for a byte-fallback SentencePiece model: '
      f'use at least {MIN_SPM_VOCAB}, or set data.tokenizer'
    )


def _validate_source(cfg: DataConfig) -> None:
  if not (cfg.text_key or (cfg.prompt_key and cfg.completion_key) or cfg.messages_key):
    raise ValueError(
      'data.text_key, data.prompt_key/completion_key and data.messages_key are all '
      'empty: set at least one so records can be read'
    )
  splits = {'train_split': cfg.train_split, 'eval_split': cfg.eval_split}
  if cfg.source == 'demo':
    for name, split in splits.items():
      if split and split not in DEMO_SPLITS:
        raise ValueError(f'data.{name}={split!r}: the demo source has splits {DEMO_SPLITS}')
  elif cfg.source == 'tfds' and not cfg.tfds_name:
    raise ValueError("data.tfds_name is empty: data.source='tfds' needs a dataset name")
  elif cfg.source in ('jsonl', 'text'):
    if not cfg.path:
      raise ValueError(
        f'data.path is empty: data.source={cfg.source!r} reads the files matching '
        "data.path ('{split}' in it is replaced by the split name)"
      )
    if cfg.eval_split and '{split}' not in cfg.path:
      raise ValueError(
        f"data.eval_split={cfg.eval_split!r} needs '{{split}}' in "
        f"data.path={cfg.path!r} to find its files (e.g. 'data/{{split}}.jsonl'); "
        "or set data.eval_split='' for no eval set"
      )
    for name, split in splits.items():
      if split:
        try:
          sources.expand_paths(cfg.path, split)
        except FileNotFoundError as e:
          raise ValueError(f'data.path={cfg.path!r} with data.{name}: {e}') from e


def check_training_data(cfg: DataConfig) -> None:
  """What a training run must not start with, though a tool reading an older run's settings
  may (it trains nothing): fields the source does not read, and an eval set that is (or shares
  files with) the training set."""
  # A field the source does not read is a config mistake (e.g. data.path set, data.source left
  # at 'demo'): training on other data than asked for must not pass silently.
  unread = {
    'path': cfg.source not in ('jsonl', 'text'),
    'tfds_name': cfg.source != 'tfds',
    'tfds_data_dir': cfg.source != 'tfds',
  }
  for name, is_unread in unread.items():
    if is_unread and getattr(cfg, name):
      raise ValueError(
        f'data.{name}={getattr(cfg, name)!r} is not read by data.source={cfg.source!r}: set '
        f"data.source to the source it is for ('jsonl' or 'text' for data.path, 'tfds' for "
        f'data.tfds_*), or clear data.{name}'
      )
  if cfg.eval_split and cfg.eval_split == cfg.train_split:
    raise ValueError(
      f'data.eval_split={cfg.eval_split!r} is also data.train_split: evaluating on the training '
      "data says nothing about generalisation; use another split, or '' for no eval set"
    )
  if cfg.source in ('jsonl', 'text') and cfg.path and cfg.train_split and cfg.eval_split:
    train, ev = (set(sources.expand_paths(cfg.path, s)) for s in (cfg.train_split, cfg.eval_split))
    if shared := sorted(train & ev):
      raise ValueError(
        f'data.path={cfg.path!r} gives data.train_split={cfg.train_split!r} and '
        f'data.eval_split={cfg.eval_split!r} the same files ({", ".join(shared[:3])}'
        f'{", ..." if len(shared) > 3 else ""}): the eval set would be trained on. Make the '
        'pattern match each split alone'
      )


def validate(cfg: DataConfig, process_count: int = 1) -> None:
  """Raises ValueError naming the bad `data.*` field and how to fix it."""
  check(cfg, 'data')
  _validate_sizes(cfg, process_count)
  _validate_tokenizer(cfg)
  _validate_source(cfg)


def max_text_bytes(cfg: DataConfig) -> int:
  """The part size of long texts (sources.MAX_TEXT_BYTES), at least 4 bytes per token of a row:
  a token covers at least one byte, so a truncated text's first part holds its first row."""
  return max(sources.MAX_TEXT_BYTES, 4 * (cfg.seq_len + 1))


def open_source(cfg: DataConfig, split: str):
  """The random-access record source for one split; an empty split is an error naming it."""
  if cfg.records != 'examples' and cfg.source in ('demo', 'jsonl'):
    source = preference.open_pairs(cfg.path or 'demo', split, cfg.records)
  elif cfg.records != 'examples':
    raise ValueError(
      f"data.records={cfg.records!r} reads data.source='demo' or 'jsonl', not {cfg.source!r}"
    )
  elif cfg.source == 'demo':
    source = sources.demo_source(split)
  elif cfg.source == 'jsonl':
    paths = sources.expand_paths(cfg.path, split)
    source = sources.JsonlSource(paths, cfg.fields, max_text_bytes(cfg))
  elif cfg.source == 'text':
    source = sources.TextSource(sources.expand_paths(cfg.path, split), max_text_bytes(cfg))
  elif cfg.source == 'tfds':
    source = sources.TfdsSource(cfg.tfds_name, split, cfg.tfds_data_dir, cfg.fields)
  else:
    raise ValueError(f'data.source={cfg.source!r} is unknown: use one of {SOURCES}')
  if len(source) == 0:
    where = cfg.tfds_name if cfg.source == 'tfds' else cfg.path.replace('{split}', split)
    raise ValueError(f'split {split!r} of data.source={cfg.source!r} ({where}) has no examples')
  return source


def make_tokenizer(cfg: DataConfig, workdir: str | os.PathLike | None) -> Tokenizer:
  """Loads data.tokenizer, or reuses / trains <workdir>/tokenizer.model on the train split
  (without a workdir, in a fresh directory: never a model cached for other data)."""
  workdir = workdir or tempfile.mkdtemp(prefix='moetrain')

  def texts():
    source = open_source(cfg, cfg.train_split)
    step = max(1, len(source) // MAX_TOKENIZER_EXAMPLES)
    for i in range(0, len(source), step):
      yield from (
        preference.texts(source[i])
        if cfg.records != 'examples'
        else (sources.example_texts(source[i]))
      )

  try:
    return get_or_train_tokenizer(cfg.tokenizer, workdir, texts, cfg.vocab_size)
  except ValueError as e:
    if not cfg.tokenizer:
      raise
    raise ValueError(f'data.tokenizer={cfg.tokenizer!r}: {e}') from e


class DataIterator(Iterator[dict[str, np.ndarray]]):
  """Host-local batches with a JSON-serialisable, exactly-resumable state.

  Batches hold packing.ROW_KEYS, each shaped [rows, seq_len]. `num_truncated` counts the examples
  cut to seq_len + 1 tokens so far; it is part of the state so it survives a restore. `examples`
  (this host's examples per epoch) is saved too: a position restored onto files that have since
  grown or shrunk points elsewhere in the new stream, which set_state says.
  """

  def __init__(self, ds: grain.IterDataset, examples: int | None = None):
    self._it = iter(ds)
    self.num_truncated = 0
    self.examples = examples

  def __next__(self) -> dict[str, np.ndarray]:
    batch = next(self._it)
    self.num_truncated += int(batch.pop(packing.TRUNCATED_KEY).sum())
    return batch

  def get_state(self) -> dict:
    state = {'grain': self._it.get_state(), 'num_truncated': self.num_truncated}
    return state if self.examples is None else {**state, 'examples': self.examples}

  def set_state(self, state: dict) -> None:
    saved = state.get('examples')  # (absent in checkpoints from before it was saved)
    changed = saved is not None and self.examples is not None and saved != self.examples
    if changed:
      logging.warning(
        'The training data changed since the checkpoint: this host read %d examples per epoch, '
        'now %d. The saved position is applied to the new data: examples around it may be '
        'skipped or read twice. Restore the files for an exact continuation.',
        saved,
        self.examples,
      )
    try:
      self._it.set_state(state['grain'])
    except IndexError as e:  # grain: the position is past the end of a finite stream
      if not changed:
        raise
      raise ValueError(
        f'the saved data position lies past the end of the training data, which has changed '
        f'since the checkpoint ({saved} examples per epoch for this host then, {self.examples} '
        'now): restore the files, raise data.num_epochs, or start a new --workdir'
      ) from e
    self.num_truncated = state['num_truncated']

  def close(self) -> None:
    """Stops grain worker processes, if any (otherwise left to garbage collection)."""
    close = getattr(self._it, 'close', None)
    if close is not None:
      close()


def chat_format(cfg: DataConfig, tokenizer: Tokenizer) -> chat.ChatFormat:
  """How this run renders chats (data.chat_template, data.chat_loss; chat.py)."""
  if cfg.chat_template:
    template = storage.read_text(cfg.chat_template)
    name = f'data.chat_template={cfg.chat_template!r}'
  else:
    template = getattr(tokenizer, 'chat_template', None)
    name = f'the chat template of {getattr(tokenizer, "name", "the tokenizer")}'
  if template is None:
    return chat.ChatFormat(loss=cfg.chat_loss)
  variables = tuple(sorted(getattr(tokenizer, 'template_variables', {}).items()))
  return chat.ChatFormat(template, variables, cfg.chat_loss, builtin=False, name=name)


def tokenized(
  cfg: DataConfig, tokenizer: Tokenizer, ds: grain.MapDataset, read_options=READ_OPTIONS
) -> grain.IterDataset:
  """Examples -> tokenized examples as training reads them, before packing (packing.tokenized)."""
  return packing.tokenized(
    ds,
    tokenizer,
    max_len=cfg.seq_len + 1,
    loss_on_prompt=cfg.loss_on_prompt,
    split_long_texts=cfg.split_long_texts,
    read_options=read_options,
    chat_format=chat_format(cfg, tokenizer),
  )


def make_train_iterator(
  cfg: DataConfig, tokenizer: Tokenizer, *, process_index: int = 0, process_count: int = 1
) -> DataIterator:
  """Endless (or num_epochs) host-local training batches of global_batch_size // process_count rows.

  Each host reads a disjoint 1/process_count slice of the examples (never the others'), shuffles
  it with data.seed, reshuffled every epoch, then packs and batches it. With data.num_epochs set,
  hosts may run out a batch apart; the training loop stops all of them at the first one's end
  (train.next_batch).
  """
  validate(cfg, process_count)
  local_batch = cfg.global_batch_size // process_count
  ds = grain.MapDataset.source(open_source(cfg, cfg.train_split))
  ds = ds[process_index::process_count]
  if len(ds) == 0:
    raise ValueError(
      f'data.train_split={cfg.train_split!r} has no examples for host '
      f'{process_index} of {process_count}'
    )
  examples = len(ds)
  if cfg.records == 'examples':
    check_examples(ds, cfg, chat_format(cfg, tokenizer))
  else:
    check_pairs(ds, cfg, tokenizer)
  if cfg.shuffle:
    ds = ds.shuffle(seed=cfg.seed)
  ds = ds.repeat(cfg.num_epochs)
  rows = packed(cfg, tokenizer, ds, local_batch)
  batches = rows.batch(local_batch, drop_remainder=True)
  if cfg.worker_count:
    # Each worker packs its own slice of examples: the stream depends on worker_count, so a
    # checkpoint resumes exactly only with the same worker_count.
    batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count))
  return DataIterator(batches, examples=examples)


def packed(cfg: DataConfig, tokenizer: Tokenizer, ds: grain.MapDataset, bins: int):
  """Examples (or preference records) -> packed rows of seq_len tokens."""
  kw = dict(seq_len=cfg.seq_len, num_bins=bins, pad_id=tokenizer.pad_id)
  if cfg.records == 'examples':
    return packing.pack(tokenized(cfg, tokenizer, ds), **kw)
  fmt = chat_format(cfg, tokenizer)
  elements = preference.tokenized(
    ds, tokenizer, seq_len=cfg.seq_len, chat_format=fmt, read_options=READ_OPTIONS
  )
  return preference.pack(elements, **kw)


def check_pairs(ds: grain.MapDataset, cfg: DataConfig, tokenizer: Tokenizer) -> None:
  """Tokenizes the first preference records before training (a conversation the chat template
  cannot render is named) and warns of those too long for a row."""
  fmt = chat_format(cfg, tokenizer)
  seen = preference.check_pairs(ds, tokenizer, seq_len=cfg.seq_len, chat_format=fmt)
  if seen['dropped'] or seen['cut']:
    logging.warning(
      '%s: of the first %d preference records, %d are longer than data.seq_len + 1 = %d tokens '
      "together and lose their prompt's first tokens, and %d have completions too long to fit "
      'and are dropped: raise data.seq_len to keep them whole',
      f'data.train_split={cfg.train_split!r}',
      seen['checked'],
      seen['cut'],
      cfg.seq_len + 1,
      seen['dropped'],
    )


def check_examples(
  ds: grain.MapDataset, cfg: DataConfig, chat_format: chat.ChatFormat, sample: int = 256
) -> None:
  """Checks the first `sample` examples before training: chats must render with the chat
  template and give their assistant turns text to train on (an error names the record);
  prompt/completion examples train on their completion and its end-of-text token, so where the
  completions are all empty, only end-of-text would train, which is refused (some empty ones
  are a warning)."""
  seen = [ds[i] for i in range(min(sample, len(ds)))]
  for example in seen:
    if 'messages' in example:
      chat_format.apply(example)
  if cfg.loss_on_prompt:
    return
  paired = [ex for ex in seen if 'completion' in ex]
  empty = sum(not ex['completion'].strip() for ex in paired)
  where = f'data.train_split={cfg.train_split!r}'
  if paired and empty == len(paired):
    raise ValueError(
      f'{where}: the completion of each of the first {len(paired)} examples is empty, so only '
      f'the end-of-text token would be trained. Check data.completion_key='
      f'{cfg.completion_key!r}, or set data.loss_on_prompt=True'
    )
  if empty:
    logging.warning(
      '%s: %d of the first %d prompt/completion examples have an empty completion (only their '
      'end-of-text token trains)',
      where,
      empty,
      len(paired),
    )


# Past this many tokens per whitespace-separated word, a tokenizer was made for other text (a
# tokenizer made for the text it encodes takes ~1.2-1.6 tokens per English word).
MAX_TOKENS_PER_WORD = 3.0


def tokens_per_word(cfg: DataConfig, tokenizer: Tokenizer, sample: int = 64) -> float:
  """Tokens per word of the first `sample` training examples' text under `tokenizer`."""
  source = open_source(cfg, cfg.train_split)

  def texts_of(example):  # a chat's messages without its template's markup
    if 'messages' in example:
      return [m.get('content') or '' for m in example['messages'] if isinstance(m, dict)]
    return sources.example_texts(example)

  texts = [t for i in range(min(sample, len(source))) for t in texts_of(source[i])]
  texts = [t for t in texts if isinstance(t, str)]
  words = sum(len(t.split()) for t in texts)
  return sum(len(tokenizer.encode(t)) for t in texts) / max(words, 1)


def warn_if_tokenizer_is_foreign(cfg: DataConfig, tokenizer: Tokenizer, hf_checkpoint='') -> float:
  """A warning, with the fix, when the training text takes many tokens per word: the tokenizer
  came from elsewhere (the demo base's small one, or one trained on other data) and the model
  would learn spelling instead of the task. hf_checkpoint: init.hf_checkpoint, whose tokenizer a
  run takes when data.tokenizer is empty, so the fix leaves it out too. Returns the ratio."""
  if cfg.source == 'demo':
    return 0.0
  ratio = tokens_per_word(cfg, tokenizer)
  if ratio > MAX_TOKENS_PER_WORD:
    logging.warning(
      '%s encodes the training text (%s) at %.1f tokens per word: it was made for other text '
      "(a demo base's small vocabulary reads real words a few letters at a time). Train from a "
      'base checkpoint made for such text (init.hf_checkpoint, whose tokenizer comes with it), '
      'or let the run train a tokenizer on this data: %s',
      tokenizer_origin(cfg, hf_checkpoint),
      cfg.path or cfg.tfds_name,
      ratio,
      own_tokenizer_fix(cfg, hf_checkpoint),
    )
  return ratio


def tokenizer_origin(cfg: DataConfig, hf_checkpoint: str) -> str:
  if hf_checkpoint and cfg.tokenizer == hf_checkpoint:
    return f"init.hf_checkpoint={hf_checkpoint!r}'s tokenizer"
  return f'data.tokenizer={cfg.tokenizer!r}' if cfg.tokenizer else "the run's own tokenizer"


def own_tokenizer_fix(cfg: DataConfig, hf_checkpoint: str) -> str:
  """The flags that make a run train its tokenizer on its data: no data.tokenizer and no
  checkpoint to take one from, in a run directory without a tokenizer trained on other data."""
  flags = []
  if hf_checkpoint:
    flags.append("--config.init.hf_checkpoint=''")
  if cfg.tokenizer and cfg.tokenizer != hf_checkpoint:
    flags.append("--config.data.tokenizer=''")
  if not flags:
    return "a fresh --workdir (this one's tokenizer was trained on other data)."
  base = (
    ' (a random base: configs/longcat_lora.py:variant=tiny, or configs/longcat_pretrain.py to '
    'train every weight)'
  )
  return ' '.join(flags) + (base if hf_checkpoint else '') + ' with a fresh --workdir.'


def _padding_rows(batch: dict[str, np.ndarray], rows: int, pad_id: int) -> dict[str, np.ndarray]:
  """Appends all-padding rows (segment id 0, zero loss) to reach `rows` rows."""
  missing = rows - len(batch['inputs'])
  out = {}
  for key, value in batch.items():
    fill = pad_id if key in ('inputs', 'targets') else 0
    pad = np.full((missing, *value.shape[1:]), fill, value.dtype)
    out[key] = np.concatenate([value, pad])
  return out


def make_eval_batches(
  cfg: DataConfig,
  tokenizer: Tokenizer,
  *,
  max_batches: int | None = None,
  process_index: int = 0,
  process_count: int = 1,
) -> list[dict[str, np.ndarray]]:
  """The eval split, packed in file order, as host-local batches of eval_batch_size // process_count.

  Every host packs the whole eval split and keeps its rows of each global batch, so all hosts get
  the same number of batches (no host waits on another at the last one). The last batch is filled
  up with all-padding rows. Batches are held in memory: cap large eval sets with max_batches.
  """
  validate(cfg, process_count)
  if not cfg.eval_split:
    return []
  local = cfg.eval_batch_size // process_count
  ds = grain.MapDataset.source(open_source(cfg, cfg.eval_split))
  rows = packed(cfg, tokenizer, ds, cfg.eval_batch_size)
  batches, truncated = [], 0
  for batch in rows.batch(cfg.eval_batch_size):
    if max_batches is not None and len(batches) >= max_batches:
      break
    truncated += int(batch.pop(packing.TRUNCATED_KEY).sum())
    batch = _padding_rows(batch, cfg.eval_batch_size, tokenizer.pad_id)
    batches.append(
      {k: v[process_index * local : (process_index + 1) * local] for k, v in batch.items()}
    )
  if truncated and process_index == 0:
    logging.warning(
      '%d eval examples are longer than data.seq_len + 1 = %d tokens and lose their tail (their '
      'completion, or part of it, is not scored): raise data.seq_len to evaluate them whole',
      truncated,
      cfg.seq_len + 1,
    )
  return batches

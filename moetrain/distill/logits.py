"""The teacher's cached top-k logits (tools/teacher_logits.py writes them, a run with
distill.teacher_logits reads them): per host, ArrayRecord shards of STEPS_PER_SHARD records, one
record per training step holding that host's rows of the step's batch, in the order the trainer
reads them; each scored position's k token ids (int32) and log-probabilities (float32, at
temperature 1). manifest.json says what they were written from; a run whose teacher, tokenizer,
data settings, k or steps differ is refused, naming the field."""

import hashlib
import json

import grain
import numpy as np

from moetrain.convert import safetensors_io as stio
from moetrain.core import fields, storage
from moetrain.data import loader
from moetrain.data import tokenizer as tokenizer_lib

MANIFEST = 'manifest.json'
VERSION = 1


def shard_path(directory: str, process: int, shard: int, done: bool = False) -> str:
  """A shard's ArrayRecord file, or (done) the file written once it is whole: the data
  position after it, which a resumed writer continues from."""
  name = f'shard-{shard:05d}.' + ('json' if done else 'array_record')
  return storage.join(directory, f'host{process:03d}', name)


def _digest(path: str) -> str:
  with storage.open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def manifest(setup, top_k: int, steps_per_shard: int, process_count: int) -> dict:
  """What the logits are of: the teacher (its path and files), the tokenizer (its content), the
  data stream, k, the steps and hosts, the shard size."""

  teacher = setup.distill.teacher
  files = {
    n: storage.getsize(storage.join(teacher, n))
    for n in storage.listdir(teacher)
    if stio.is_model_file(n) or n == 'config.json'
  }
  tokenizer = str(tokenizer_lib.tokenizer_file(setup.data.tokenizer) or setup.data.tokenizer)
  stream = {k: getattr(setup.data, k) for k in fields.with_role(loader.DataConfig, 'stream')}
  return json.loads(
    json.dumps(
      {
        'version': VERSION,
        'distill.teacher': {'path': teacher, 'files': files},
        'data.tokenizer': _digest(tokenizer),
        **{f'data.{k}': v for k, v in stream.items() if k != 'tokenizer'},
        'distill.top_k': top_k,
        'train.steps': setup.train.steps,
        'processes': process_count,
        'steps_per_shard': steps_per_shard,
      }
    )
  )


def check(setup, directory: str, process_count: int) -> dict:
  """The manifest of `directory`, refused (one line, naming the field) unless it was written
  for this run's teacher, tokenizer, data, at least its k and steps, and its host count."""
  where = f'distill.teacher_logits={directory!r}'
  path = storage.join(directory, MANIFEST)
  if not storage.isfile(path):
    raise FileNotFoundError(
      f'{where} holds no {MANIFEST}: write it with python -m moetrain.tools.teacher_logits'
    )
  saved = json.loads(storage.read_text(path))
  now = manifest(setup, setup.distill.top_k, saved.get('steps_per_shard', 1), process_count)
  redo = 'write them again for this run (python -m moetrain.tools.teacher_logits)'
  for key, want in now.items():
    have = saved.get(key)
    short = key in ('distill.top_k', 'train.steps') and have is not None and have >= want
    if have != want and not short and key != 'steps_per_shard':
      raise ValueError(
        f'{where} was written for {key}={_said(have)}, this run has {_said(want)}: {redo}'
      )
  return saved


def _said(value) -> str:
  text = repr(value['path'] if isinstance(value, dict) and 'path' in value else value)
  return text if len(text) < 80 else text[:77] + '...'


def encode(mask_BT: np.ndarray, ids_BTW: np.ndarray, logp_BTW: np.ndarray) -> bytes:
  """One step's record: the scored positions' flat indices, their ids and log-probabilities."""
  where = np.flatnonzero(mask_BT.reshape(-1) > 0).astype(np.int32)
  k = ids_BTW.shape[-1]
  ids = ids_BTW.reshape(-1, k)[where].astype(np.int32)
  logp = logp_BTW.reshape(-1, k)[where].astype(np.float32)
  head = np.array([where.size, k], np.int32)
  return head.tobytes() + where.tobytes() + ids.tobytes() + logp.tobytes()


def decode(record: bytes, rows: int, seq_len: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
  """(ids [B, T, top_k], log-probabilities [B, T, top_k]) of a record; zeros where nothing is
  scored (the loss mask drops those positions)."""
  n, k = np.frombuffer(record, np.int32, 2)
  at = 8
  where = np.frombuffer(record, np.int32, n, at)
  at += 4 * n
  ids = np.frombuffer(record, np.int32, n * k, at).reshape(n, k)
  logp = np.frombuffer(record, np.float32, n * k, at + 4 * n * k).reshape(n, k)
  out_ids = np.zeros((rows * seq_len, top_k), np.int32)
  out_logp = np.zeros((rows * seq_len, top_k), np.float32)
  out_ids[where], out_logp[where] = ids[:, :top_k], logp[:, :top_k]
  return out_ids.reshape(rows, seq_len, top_k), out_logp.reshape(rows, seq_len, top_k)


class WithTeacherLogits:
  """The training iterator with each step's cached teacher logits added to its batch (through
  grain's ArrayRecord source, read by step: `step` is the step of the next batch, set on a
  resume). Everything else is the wrapped iterator's."""

  def __init__(self, inner, directory: str, saved: dict, process: int, top_k: int):

    self.inner, self.top_k, self.step = inner, top_k, 0
    self.per_shard = saved['steps_per_shard']
    shards = -(-saved['train.steps'] // self.per_shard)
    paths = [shard_path(directory, process, i) for i in range(shards)]
    missing = [p for p in paths if not storage.exists(p)]
    if missing:
      raise FileNotFoundError(
        f'{missing[0]} does not exist: distill.teacher_logits={directory!r} is incomplete '
        '(rerun python -m moetrain.tools.teacher_logits to finish it)'
      )
    self.source = grain.sources.ArrayRecordDataSource(paths)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = next(self.inner)
    rows, seq_len = batch['inputs'].shape
    ids, logp = decode(self.source[self.step], rows, seq_len, self.top_k)
    self.step += 1
    return {**batch, 'teacher_ids': ids, 'teacher_logprobs': logp}

  def __getattr__(self, name):
    return getattr(self.inner, name)


def attach(setup, train_iter, process: int, process_count: int):
  """The training iterator, reading the cached logits when distill.teacher_logits names them
  (their manifest checked first)."""
  d = setup.distill
  if not d.enabled or not d.teacher_logits or setup.step.distill is None:
    return train_iter
  saved = check(setup, d.teacher_logits, process_count)
  return WithTeacherLogits(train_iter, d.teacher_logits, saved, process, d.top_k)

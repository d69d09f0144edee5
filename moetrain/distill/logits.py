"""The teacher's cached top-k logits (tools/teacher_logits.py writes them, a run with
distill.teacher_logits reads them): per host, ArrayRecord shards of STEPS_PER_SHARD records, one
record per training step holding that host's rows of the step's batch, in the order the trainer
reads them; each scored position's k token ids (int32) and log-probabilities (float32, at
temperature 1). manifest.json, written once every shard is, says what they were written from; a
run whose teacher, tokenizer, data (settings or content), k or steps differ is refused, naming
the field or the file."""

import dataclasses
import hashlib
import json
import os

import grain
import numpy as np

from moetrain.convert import safetensors_io as stio
from moetrain.core import fields, storage
from moetrain.data import loader
from moetrain.data import tokenizer as tokenizer_lib
from moetrain.run import integrity, rundir

MANIFEST = 'manifest.json'
PENDING = 'manifest.pending.json'  # the manifest of a write under way, until every shard is
VERSION = 2
IGNORED = ('stamps', 'steps_per_shard')  # not what the logits are of
INPUTS = ('data.files', 'distill.teacher')  # contents: changed in place, the logits are stale
STALE = 'written from other inputs'  # (difference's words for that)


def shard_path(directory: str, process: int, shard: int, done: bool = False) -> str:
  """A shard's ArrayRecord file, or (done) the file written once it is whole: the data
  position after it, which a resumed writer continues from."""
  name = f'shard-{shard:05d}.' + ('json' if done else 'array_record')
  return storage.join(directory, f'host{process:03d}', name)


def _digest(path: str) -> str:
  with storage.open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def _teacher_files(teacher: str) -> tuple[list[str], dict]:
  """(the files whose content is the teacher, what else names it): a Hugging Face checkpoint's
  weights and config; a run directory's config.json and the step of its latest checkpoint."""
  if rundir.run_config(teacher) is None:
    names = [n for n in storage.listdir(teacher) if stio.is_model_file(n) or n == 'config.json']
    return [storage.join(teacher, n) for n in sorted(names)], {}
  steps = rundir.saved_steps(teacher)
  return [storage.join(rundir.run_dir(teacher), 'config.json')], {
    'step': steps[-1] if steps else None
  }


def _known(saved: dict) -> dict:
  """The fingerprints a manifest recorded (integrity.fingerprints' `known`: files whose stamp is
  unchanged are not read again)."""
  stamps = saved.get('stamps') or {}
  teacher = saved.get('distill.teacher') or {}
  sha = dict(saved.get('data.files') or {})
  sha |= {storage.join(teacher.get('path', ''), n): h for n, h in teacher.get('files', {}).items()}
  return {p: {'stamp': stamps[p], 'sha256': h} for p, h in sha.items() if p in stamps}


def manifest(setup, top_k: int, steps_per_shard: int, process_count: int, known=None) -> dict:
  """What the logits are of: the teacher (its path and content), the tokenizer (its content), the
  data stream (its settings and its training files' content), k, the steps and hosts, the shard
  size. `known`: a manifest whose fingerprints of unchanged files are taken as they are."""
  teacher = setup.distill.teacher
  data_files = rundir.data_files(dataclasses.replace(setup.data, eval_split=''))
  teacher_files, teacher_more = _teacher_files(teacher)
  prints = integrity.fingerprints(data_files + teacher_files, _known(known or {}))
  tokenizer = str(tokenizer_lib.tokenizer_file(setup.data.tokenizer) or setup.data.tokenizer)
  stream = {k: getattr(setup.data, k) for k in fields.with_role(loader.DataConfig, 'stream')}
  files = {os.path.basename(p): prints[p]['sha256'] for p in teacher_files}
  return json.loads(
    json.dumps(
      {
        'version': VERSION,
        'distill.teacher': {'path': teacher, 'files': files, **teacher_more},
        'data.tokenizer': _digest(tokenizer),
        **{f'data.{k}': v for k, v in stream.items() if k != 'tokenizer'},
        'data.files': {p: prints[p]['sha256'] for p in data_files},
        'distill.top_k': top_k,
        'train.steps': setup.train.steps,
        'processes': process_count,
        'steps_per_shard': steps_per_shard,
        'stamps': {p: e['stamp'] for p, e in prints.items()},
      }
    )
  )


def rebuild(directory: str, top_k) -> str:
  return (
    "rebuild it: python -m moetrain.tools.teacher_logits --config=<this run's config and "
    f'overrides> --out={directory} --top_k={top_k}'
  )


def check(setup, directory: str, process_count: int) -> dict:
  """The manifest of `directory`, refused (one line, naming the field or the file) unless it was
  written for this run's teacher, tokenizer, data, at least its k and steps, and its host count."""
  where = f'distill.teacher_logits={directory!r}'
  path = storage.join(directory, MANIFEST)
  if not storage.isfile(path):
    if storage.isfile(storage.join(directory, PENDING)):
      raise FileNotFoundError(
        f'{where} is incomplete (its writer stopped before the last shard): rerun python -m '
        f'moetrain.tools.teacher_logits with the same --config and --out={directory} to finish it'
      )
    raise FileNotFoundError(
      f'{where} holds no {MANIFEST}: write it with python -m moetrain.tools.teacher_logits'
    )
  saved = json.loads(storage.read_text(path))
  now = manifest(setup, setup.distill.top_k, saved.get('steps_per_shard', 1), process_count, saved)
  if problem := difference(saved, now, at_least=True):
    raise ValueError(f'{where} was {problem}: {rebuild(directory, saved.get("distill.top_k"))}')
  return saved


def difference(saved: dict, now: dict, at_least: bool = False) -> str:
  """What makes the logits of manifest `saved` other than those `now` describes, in words ('' if
  nothing). at_least: a larger k or more steps serve too."""
  for key, want in now.items():
    have = saved.get(key)
    if key in IGNORED or have == want:
      continue
    if at_least and key in ('distill.top_k', 'train.steps') and have is not None and have >= want:
      continue
    if key in INPUTS and isinstance(have, dict) and have.get('path') == want.get('path'):
      return f'{STALE}: {_changed(key, have, want)}'
    return f'written for {key}={_said(have)}, this run has {_said(want)}'
  return ''


def _changed(key: str, have: dict, want: dict) -> str:
  """The input whose content differs between two manifests' `key` (INPUTS), in words."""
  if key == 'data.files':
    path = next(p for p in sorted(set(have) | set(want)) if have.get(p) != want.get(p))
    if path not in want or path not in have:
      return f'the data file {path} is {"no longer" if path in have else "now"} read'
    return f'the data file {path} changed (its content differs)'
  teacher = f'distill.teacher={want["path"]!r}'
  if (then := have.get('step')) != (now := want.get('step')):
    return f'{teacher} is at checkpoint step {now}, the logits are of step {then}'
  files, now = have.get('files', {}), want['files']
  name = next(n for n in sorted(set(files) | set(now)) if files.get(n) != now.get(n))
  return f'{teacher}: its {name} changed (its content differs)'


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


def damaged(path: str, e: Exception, what: str = '') -> str:
  said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  return (
    f'{path} cannot be read{what} ({said}): the cached teacher logits are damaged; delete it '
    'and its .json marker and rerun python -m moetrain.tools.teacher_logits to write it (and the '
    'shards after it) again'
  )


def shards(directory: str, process: int, steps: int, per_shard: int) -> list[str]:
  """This host's shard files, each whole by its done marker and holding its steps' records
  (opening a reader reads its index alone); refused naming the first that is not."""
  from array_record.python.array_record_module import ArrayRecordReader

  paths = []
  for i in range(-(-steps // per_shard)):
    path = shard_path(directory, process, i)
    if not storage.isfile(shard_path(directory, process, i, done=True)):
      raise FileNotFoundError(
        f'{path} was not finished: distill.teacher_logits={directory!r} is incomplete (rerun '
        'python -m moetrain.tools.teacher_logits with the same --config and --out to finish it)'
      )
    want = min(per_shard, steps - i * per_shard)
    try:
      reader = ArrayRecordReader(path)
      have = reader.num_records()
      reader.close()
    except (RuntimeError, ValueError, OSError) as e:
      raise ValueError(damaged(path, e)) from e
    if have < want:
      raise ValueError(damaged(path, ValueError(f'{have} records of {want}')))
    paths.append(path)
  return paths


class WithTeacherLogits:
  """The training iterator with each step's cached teacher logits added to its batch (through
  grain's ArrayRecord source, read by step: `step` is the step of the next batch, set on a
  resume). Everything else is the wrapped iterator's."""

  def __init__(self, inner, directory: str, saved: dict, process: int, top_k: int):
    self.inner, self.top_k, self.step = inner, top_k, 0
    self.per_shard = saved['steps_per_shard']
    self.paths = shards(directory, process, saved['train.steps'], self.per_shard)
    self.source = grain.sources.ArrayRecordDataSource(self.paths)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch = next(self.inner)
    rows, seq_len = batch['inputs'].shape
    try:
      ids, logp = decode(self.source[self.step], rows, seq_len, self.top_k)
    except (RuntimeError, ValueError, OSError) as e:
      path = self.paths[self.step // self.per_shard]
      raise ValueError(damaged(path, e, f" (step {self.step + 1}'s record)")) from e
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

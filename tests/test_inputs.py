"""A run's inputs checked by content: the tokenizer's and the data files' fingerprints recorded in
the run directory, and what a resume says when they changed."""

import logging
import os

import pytest

from moetrain.data import loader
from moetrain.data import tokenizer as tokenizer_lib
from moetrain.run import integrity, rundir
from tests.test_data import numbered_records, write_jsonl


def _tokenizer(path, words):
  texts = [f'{w} {i} {w}' for w in words for i in range(50)]
  return tokenizer_lib.train_sentencepiece(texts, 300, path)


@pytest.fixture
def run(tmp_path):
  """(workdir, DataConfig) of a run on two jsonl files with its own tokenizer, its inputs
  recorded as a start records them."""
  _tokenizer(tmp_path / 'tok' / 'tokenizer.model', ['alpha', 'beta'])
  for split in ('train', 'eval'):
    write_jsonl(tmp_path / f'{split}.jsonl', numbered_records(20))
  data = loader.DataConfig(
    source='jsonl',
    path=str(tmp_path / '{split}.jsonl'),
    tokenizer=str(tmp_path / 'tok' / 'tokenizer.model'),
  )
  workdir = str(tmp_path / 'run')
  os.makedirs(workdir)
  rundir.record_inputs(workdir, rundir.check_inputs(workdir, data, resuming=False))
  return workdir, data


def _hashed(monkeypatch) -> list[str]:
  read = []

  def counting(path):
    read.append(os.path.basename(path))
    return hash_file(path)

  hash_file = integrity.content_hash
  monkeypatch.setattr(integrity, 'content_hash', counting)
  return read


def test_a_data_file_rewritten_with_its_size_and_mtime_is_named(run, tmp_path, caplog, monkeypatch):
  """Unchanged files are not read again; a rewrite that keeps the size and restores the
  modification time still changes the inode's ctime, so it is hashed and named."""
  workdir, data = run
  read = _hashed(monkeypatch)
  rundir.check_inputs(workdir, data, resuming=True)
  assert read == [] and 'other data files' not in caplog.text
  path = tmp_path / 'train.jsonl'
  st = os.stat(path)
  text = path.read_text()
  path.write_text(text.replace('answer 1', 'answer 7'))  # the same size
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
  assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
  with caplog.at_level(logging.WARNING):
    record = rundir.check_inputs(workdir, data, resuming=True)
  assert read == ['train.jsonl']
  assert f'{path} (content changed)' in caplog.text
  assert str(tmp_path / 'eval.jsonl') not in caplog.text
  # Recorded anew, the next resume says nothing (and reads nothing).
  rundir.record_inputs(workdir, record)
  caplog.clear()
  rundir.check_inputs(workdir, data, resuming=True)
  assert read == ['train.jsonl'] and 'other data files' not in caplog.text


def test_a_resume_with_another_tokenizer_stops_naming_it(run, tmp_path):
  workdir, data = run
  before = open(os.path.join(workdir, rundir.INPUTS)).read()
  path = tmp_path / 'tok' / 'tokenizer.model'
  _tokenizer(tmp_path / 'other.model', ['gamma', 'delta'])
  os.replace(tmp_path / 'other.model', path)
  with pytest.raises(ValueError) as e:
    rundir.check_inputs(workdir, data, resuming=True)
  assert str(e.value).startswith(f'{path}: the tokenizer is not the one the checkpointed run')
  assert '\n' not in str(e.value)
  assert open(os.path.join(workdir, rundir.INPUTS)).read() == before
  # A tool reading the run's weights refuses it too; a fresh start records it.
  with pytest.raises(ValueError, match='tokenizer.model: the tokenizer is not the one the run'):
    rundir.check_tokenizer_content(workdir, data.tokenizer)
  rundir.check_inputs(workdir, data, resuming=False)


def test_the_same_tokenizer_at_another_path_is_the_same(run, tmp_path):
  workdir, data = run
  os.rename(tmp_path / 'tok', tmp_path / 'moved')
  moved = loader.DataConfig(**{**data.__dict__, 'tokenizer': str(tmp_path / 'moved')})
  rundir.check_inputs(workdir, moved, resuming=True)


def test_demo_data_has_no_files_to_fingerprint():
  assert rundir.data_files(loader.DataConfig(source='demo')) == []  # (generated, not read)

"""Saves that finish: a checkpoint in flight when the run stops on an error is completed first,
a save that fails stops the run at once naming it, and a full disk under metrics.jsonl names
the file."""

import errno
import os
import threading
import time

import pytest

from moetrain.core import storage
from moetrain.run import checkpoint, integrity, rundir, train
from tests.test_train import losses, small_config


def _config(**overrides):
  """Without evaluation (no eval step to compile), and the compiled step cached for the next."""
  config = small_config(**overrides)
  config.data.eval_split = ''
  return config


def _full(step_dir):
  raise OSError(errno.ENOSPC, 'No space left on device', os.path.join(step_dir, 'x'))


def test_a_failed_save_stops_the_run_at_once_naming_it(tmp_path, monkeypatch):
  """The save of step 3 fails in the background (its writer finds the disk full): the run stops
  at the next step, not at the next checkpoint (6), with one line naming the checkpoint and the
  cause; no step counts as saved. A rerun starts over and saves step 3 over the debris."""
  monkeypatch.setattr(integrity, 'write_manifest', _full)
  check = checkpoint.Checkpointer.check_saves

  def at_step_5_the_save_has_ended(ckpt, step):  # (however slow the background save)
    for _ in range(200):
      if step < 5 or not ckpt.manager.is_saving_in_progress():
        break
      time.sleep(0.05)
    check(ckpt, step)

  monkeypatch.setattr(checkpoint.Checkpointer, 'check_saves', at_step_5_the_save_has_ended)
  workdir = str(tmp_path)
  with pytest.raises(checkpoint.SaveFailed) as e:
    train.run(_config(steps=9), workdir)
  message = str(e.value)
  assert '\n' not in message
  assert message.startswith(f'checkpoint {tmp_path}/checkpoints/3 could not be saved (OSError: ')
  assert '[Errno 28] No space left on device' in message
  assert 'The newest checkpoint is none (a rerun starts over)' in message
  assert 3 <= max(losses(workdir)) < 6
  assert rundir.saved_steps(workdir) == []


@pytest.mark.slow  # ~14 s; sibling: test_a_failed_save_stops_the_run_at_once_naming_it
def test_a_save_in_flight_ends_before_the_run_stops_on_an_error(tmp_path, monkeypatch):
  """The run stops on an error (a data file replaced under it, say) right after step 3's save
  began: the save completes before the error is raised, so a rerun resumes from step 3."""
  finishing = threading.Event()
  write = integrity.write_manifest

  def slow(step_dir):
    finishing.wait(5)  # (the error below comes while this save is in flight)
    write(step_dir)

  def next_batch(train_iter, data_ended, step):
    if step == 4:
      finishing.set()
      raise ValueError('data/train.jsonl changed while the run read it')
    return real(train_iter, data_ended, step)

  real = train.next_batch
  monkeypatch.setattr(integrity, 'write_manifest', slow)
  monkeypatch.setattr(train, 'next_batch', next_batch)
  with pytest.raises(ValueError, match='changed while the run read it'):
    train.run(_config(steps=9), str(tmp_path))
  assert rundir.saved_steps(str(tmp_path)) == [3]
  assert os.listdir(tmp_path / 'checkpoints') == ['3']
  assert integrity.MANIFEST in os.listdir(tmp_path / 'checkpoints' / '3')


def test_a_full_disk_under_the_metrics_names_the_file(tmp_path):
  os.symlink('/dev/full', tmp_path / 'metrics.jsonl')  # (every write: ENOSPC)
  log = storage.AppendLog(str(tmp_path / 'metrics.jsonl'))
  with pytest.raises(OSError) as e:
    log.write('{"step": 1}\n')
    log.flush()
  assert e.value.errno == errno.ENOSPC
  assert str(e.value) == f"[Errno 28] No space left on device: '{tmp_path}/metrics.jsonl'"

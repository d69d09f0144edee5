"""A process of a job that dies makes the others stop within a minute, with one line naming it
(multihost's peer watch, --peer_timeout), and the rerun resumes."""

import os
import time

import pytest

from tests.test_preemption import Job, _no_leftover_processes, records, train_losses  # noqa: F401


def _exit_of(job: Job, process: int, within: float) -> tuple[int, str]:
  """(exit code, log) of one process, which must exit within `within` seconds."""
  deadline = time.monotonic() + within
  while job.procs[process].poll() is None:
    if time.monotonic() > deadline:
      job.kill()
      pytest.fail(f'process {process} still runs after {within} s:\n{job.log(process)[-3000:]}')
    time.sleep(0.2)
  return job.procs[process].poll(), job.log(process)


def _errors(log: str) -> list[str]:
  return [line for line in log.splitlines() if line.startswith('Error:')]


@pytest.mark.slow  # ~2.5 minutes: two jobs of two processes, and the 45 s of silence
def test_a_peer_killed_mid_training_stops_the_other_naming_it_and_the_rerun_resumes(tmp_path):
  workdir = str(tmp_path / 'run')
  job = Job(workdir, '--config.train.checkpoint_every=2', processes=2)
  deadline = time.monotonic() + 400  # (a loaded machine compiles slowly)
  while len(train_losses(workdir)) < 3:
    assert job.procs[0].poll() is None and time.monotonic() < deadline, job.log(0)[-3000:]
    time.sleep(0.2)
  job.procs[1].kill()
  code, log = _exit_of(job, 0, within=60)
  assert code == 1, log[-3000:]
  assert _errors(log) == [
    'Error: process 1 of 2 stopped responding (no heartbeat for 45 s: it died, or its host '
    'did); this process stops too. Rerun the job to resume from its last checkpoint.'
  ]
  assert 'Fatal Python error' not in log and 'Traceback' not in log
  saved = max(int(d) for d in os.listdir(os.path.join(workdir, 'checkpoints')) if d.isdigit())
  tokenizer = f'--config.data.tokenizer={os.path.join(workdir, "tokenizer.model")}'
  Job(workdir, tokenizer, f'--config.train.stop_at_step={saved + 1}', processes=2).wait()
  resumed = [r for r in records(workdir) if r['kind'] == 'resume']
  assert resumed[-1]['step'] == saved and max(train_losses(workdir)) == saved + 1


@pytest.mark.slow  # ~20 s
def test_a_peer_that_dies_before_joining_stops_the_other(tmp_path):
  job = Job(str(tmp_path / 'run'), '--peer_timeout=10', processes=2)
  time.sleep(0.5)
  job.procs[1].kill()
  code, log = _exit_of(job, 0, within=40)
  assert code == 1, log[-3000:]
  assert _errors(log) == [
    'Error: not every process of the job joined within 10 s (process 0 of 2): one died at '
    'start-up or has not started (--peer_timeout gives them longer); this process stops too. '
    'Rerun the job to resume from its last checkpoint.'
  ]
  assert not os.path.exists(tmp_path / 'run')

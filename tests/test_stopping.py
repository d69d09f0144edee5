"""Ctrl-C at start-up: before the run's handler is installed it ends the process at once,
leaving nothing written (the shell reports 130); after, it saves and stops as SIGTERM does
(tests/test_preemption.py). At 0.5 s the interpreter is past its own start-up (a Ctrl-C there
prints Python's traceback, which no code of ours can prevent) and in the imports; at 1.5 s a loaded
machine is still starting and a quiet one may have the handler in place: either outcome is checked
for what it must leave."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT


@pytest.mark.parametrize('after', [0.5, 1.5])
def test_ctrl_c_before_the_handler_ends_the_run_with_nothing_written(tmp_path, after):
  workdir = tmp_path / 'run'
  proc = subprocess.Popen(
    [
      sys.executable,
      '-m',
      'moetrain.main',
      '--config=configs/longcat_lora.py',
      f'--workdir={workdir}',
    ],
    cwd=ROOT,
    env={**os.environ, 'MOETRAIN_NO_REEXEC': '1', 'PYTHONPATH': ROOT},
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  time.sleep(after)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=60)
  assert 'Traceback' not in err, (out, err)
  if proc.returncode == 0:
    # On a fast start the handler is in place by then: Ctrl-C is SIGTERM's stop, a resumable save.
    assert 'Preempted: saved step' in out and (workdir / 'checkpoints').is_dir(), (out, err)
    return
  assert proc.returncode == -signal.SIGINT, (out, err)  # (a shell: 128 + 2)
  assert not workdir.exists(), (out, err)


def test_ctrl_c_with_stdout_piped_to_a_reader_that_ends_saves_and_says_so(tmp_path):
  """`python -m moetrain.main ... | tee train.log`, then Ctrl-C, which ends tee as well: the
  handler's own line and every later one meet a closed pipe. The run still saves and stops,
  and metrics.jsonl records that stdout closed and what the run would have printed."""
  import json

  from tests.test_preemption import SETTINGS, TIMEOUT, train_losses

  workdir = tmp_path / 'run'
  with open(tmp_path / 'stderr.log', 'w') as err:
    proc = subprocess.Popen(
      [
        sys.executable,
        '-m',
        'moetrain.main',
        '--config=configs/longcat_lora.py:variant=tiny',
        f'--workdir={workdir}',
        *(f'--config.{k}={v}' for k, v in SETTINGS.items()),
        f'--config.train.compilation_cache={os.path.join(ROOT, ".jax_cache")}',
      ],
      cwd=ROOT,
      env={**os.environ, 'MOETRAIN_NO_REEXEC': '1', 'PYTHONPATH': ROOT, 'JAX_PLATFORMS': 'cpu'},
      stdout=subprocess.PIPE,
      stderr=err,
    )
    try:
      deadline = time.monotonic() + TIMEOUT
      while not train_losses(workdir):
        assert proc.poll() is None and time.monotonic() < deadline, open(err.name).read()[-3000:]
        time.sleep(0.2)
      proc.stdout.close()  # tee is gone
      proc.send_signal(signal.SIGINT)
      code = proc.wait(timeout=TIMEOUT)
    finally:
      if proc.poll() is None:
        proc.kill()
  log = (tmp_path / 'stderr.log').read_text()
  assert code == 0 and 'Traceback' not in log and 'Broken pipe' not in log, log[-3000:]
  saved = max(int(d) for d in os.listdir(workdir / 'checkpoints') if d.isdigit())
  with open(workdir / 'metrics.jsonl') as f:
    records = [json.loads(line) for line in f]
  kinds = [r['kind'] for r in records]
  assert 'stdout_closed' in kinds, records
  said = [r['text'] for r in records[kinds.index('stdout_closed') :] if r['kind'] == 'message']
  assert f'Preempted: saved step {saved}; rerun the same command to resume.' in said, records
  assert max(train_losses(workdir)) == saved

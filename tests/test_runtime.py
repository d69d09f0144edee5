"""The entry points' huge-page malloc re-exec (moetrain/core/runtime.py)."""

import os
import subprocess
import sys

import pytest

from moetrain.core import runtime
from moetrain.run import rundir
from tests.helpers import ROOT, run_command


@pytest.fixture
def capable(monkeypatch):
  monkeypatch.setattr(runtime, '_glibc_supports_hugetlb', lambda: True)
  monkeypatch.setattr(runtime, '_thp_allowed', lambda: True)
  monkeypatch.setattr(runtime.sys, 'platform', 'linux')


def test_tunable_is_added_once_and_keeps_others(capable):
  env = runtime.hugepage_environment({'PATH': '/bin', 'GLIBC_TUNABLES': 'glibc.malloc.arena_max=2'})
  assert env['GLIBC_TUNABLES'] == 'glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1'
  assert env['PATH'] == '/bin'
  assert runtime.hugepage_environment(env) is None  # already set: no second exec
  assert runtime.hugepage_environment({})['GLIBC_TUNABLES'] == 'glibc.malloc.hugetlb=1'


def test_opt_out_and_unsupported_systems(capable, monkeypatch):
  assert runtime.hugepage_environment({'MOETRAIN_NO_REEXEC': '1'}) is None
  assert runtime.hugepage_environment({'MOETRAIN_NO_REEXEC': 'True'}) is None
  assert runtime.hugepage_environment({'MOETRAIN_NO_REEXEC': '0'}) is not None  # "0" is no
  monkeypatch.setattr(runtime, '_thp_allowed', lambda: False)
  assert runtime.hugepage_environment({}) is None


def test_reexec_runs_the_same_command_with_the_tunable():
  code = (
    'import os, sys; from moetrain.core import runtime; runtime.reexec_with_hugepages(); '
    'print(os.environ.get("GLIBC_TUNABLES", ""), sys.argv[1:])'
  )
  env = {k: v for k, v in os.environ.items() if k != 'GLIBC_TUNABLES'}
  out = subprocess.run(
    [sys.executable, '-c', code, 'a', 'b'], capture_output=True, text=True, env=env, check=True
  ).stdout
  want = 'glibc.malloc.hugetlb=1' if runtime.hugepage_environment(env) is not None else ''
  assert out.strip() == f"{want} ['a', 'b']"


def test_library_info_lines_are_dropped_but_not_their_warnings():
  import logging

  quiet = runtime._QuietBelowWarning('orbax')
  where = os.path.join('', 'site-packages', 'orbax', 'checkpoint', 'checkpoint_manager.py')

  def record(level, path):
    return logging.LogRecord('absl', level, path, 1, 'msg', None, None)

  assert not quiet.filter(record(logging.INFO, where))
  assert quiet.filter(record(logging.WARNING, where))
  assert quiet.filter(record(logging.INFO, os.path.join('', 'moetrain', 'train.py')))


def test_run_directories_are_paths_or_reachable_urls(tmp_path):
  """A local run directory is made absolute; gs:// is kept as it is (moetrain/core/storage.py, tested
  against an emulator in tests/test_gcs.py); a URL this installation cannot reach is refused by
  name before anything starts, not turned into a local './s3:/...' directory."""
  assert rundir.run_dir(str(tmp_path / 'run')) == str(tmp_path / 'run')
  assert rundir.saved_steps(str(tmp_path / 'run')) == []
  assert rundir.run_dir('gs://bucket/runs/lora/') == 'gs://bucket/runs/lora'
  for url, message in (('s3://bucket/run', 'Install s3fs'), ('nope://b/run', 'Protocol not known')):
    with pytest.raises(runtime.UserError, match=f'--workdir={url}: {url}: .*{message}'):
      rundir.saved_steps(url)


def test_process_flags_without_num_processes_are_refused():
  """--process_id alone would run a separate one-process job writing the same run directory."""
  out = run_command('moetrain.tools.evaluate', '--workdir=/nonexistent', '--process_id=1')
  assert out.returncode != 0
  assert '--process_id and --coordinator_address need --num_processes' in out.stderr


def test_an_unknown_config_key_is_named():
  """`--config.model.nonexistent=3` stops with the key's name, not a traceback from inside
  ml_collections (the flags are parsed before anything heavy is imported)."""
  cases = (
    ('model.nonexistent', 'nonexistent'),
    ('nosection.steps', 'nosection'),
    ('lora.rnak', 'rnak'),
  )
  for bad, name in cases:
    config = '--config=configs/longcat_lora.py'
    out = run_command('moetrain.main', config, f'--config.{bad}=3', '--dry_run')
    assert out.returncode != 0
    assert f"Error: --config.{bad}: no such config key ('{name}'" in out.stderr
    assert 'Traceback' not in out.stderr
    assert '\\' not in out.stderr  # the key as written, not ml_collections' escaped message
  assert 'Did you mean "rank" instead of "rnak"?' in out.stderr


def test_user_errors_are_one_line_naming_the_flag_or_path(tmp_path):
  """A --workdir that is a file, a tool pointed at a directory with no run, and a config file
  whose imports fail: one `Error:` line naming the flag or path, nothing written."""
  afile = tmp_path / 'afile'
  afile.write_text('')
  bad_config = tmp_path / 'bad.py'
  bad_config.write_text('from nowhere import get_config\n')
  cases = (
    (('moetrain.main', '--config=configs/longcat_lora.py', f'--workdir={afile}'),
     f'Error: --workdir={afile} is a file, not a run directory'),
    (('moetrain.tools.expert_load', f'--workdir={tmp_path}'),
     f"Error: {tmp_path}/metrics.jsonl not found: is '{tmp_path}' a moetrain run directory?"),
    (('moetrain.main', f'--config={bad_config}', '--dry_run'),
     f"Error: --config={bad_config}: No module named 'nowhere'"),
  )  # fmt: skip
  for args, line in cases:
    out = run_command(*args)
    assert out.returncode != 0 and out.stderr.strip().splitlines()[-1] == line, out.stderr
    assert 'Traceback' not in out.stderr
  assert sorted(p.name for p in tmp_path.iterdir()) == ['afile', 'bad.py']


def test_a_config_file_finds_its_package_from_any_directory(tmp_path):
  """configs/*.py import `configs.base`: a command run outside the repository still reads them."""
  config = os.path.join(ROOT, 'configs', 'longcat_lora.py')
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}  # moetrain installed only
  done = subprocess.run(
    [sys.executable, '-m', 'moetrain.main', f'--config={config}', '--dry_run'],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    env={**env, 'MOETRAIN_NO_REEXEC': '1'},
  )
  assert done.returncode == 0, done.stderr
  assert 'parameters: total' in done.stdout


def test_a_flag_error_is_a_usage_line_not_a_traceback():
  """A missing --config or a misspelled flag (--dryrun) gets absl's usage error, as app.run's own
  parser gives it, not a traceback from inside absl."""
  for args, message in (
    ([], 'flag --config=None: Flag --config must have a value other than None'),
    (['--config=configs/longcat_lora.py', '--dryrun'], "Unknown command line flag 'dryrun'"),
  ):
    out = run_command('moetrain.main', *args)
    assert out.returncode == 1
    assert f'FATAL Flags parsing error: {message}' in out.stderr, out.stderr
    assert 'Traceback' not in out.stderr


def test_a_command_without_accelerators_does_not_start_libtpu():
  """libtpu comes with the test extra (the planner needs it). On a host with no TPU chip and no
  NVIDIA GPU a command runs on the CPU without starting libtpu's plugin, whose missing-TPU
  warnings would otherwise open every command's output."""
  from jax._src import hardware_utils

  if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
    pytest.skip('this host has TPU chips')
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  args = ['-m', 'moetrain.main', '--config=configs/longcat_lora.py', '--dry_run']
  done = subprocess.run(
    [sys.executable, *args],
    cwd=root,
    capture_output=True,
    text=True,
    env={**env, 'MOETRAIN_NO_REEXEC': '1', 'PYTHONPATH': root},
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert 'parameters' in done.stdout.lower()
  assert 'TPU' not in done.stderr and 'libtpu' not in done.stderr, done.stderr[-2000:]


@pytest.mark.slow  # a full TPU compile in a subprocess (27 s): make test-slow
def test_the_planner_compiles_for_a_tpu_without_libtpu_noise(tmp_path):
  """On a host without TPUs the planner keeps libtpu's host discovery quiet (its E0000 lines
  read like a failed plan) and says what it compiles as it goes."""
  pytest.importorskip('libtpu')
  from tests.helpers import run_command

  done = run_command(
    'moetrain.tools.plan',
    '--config=configs/longcat_lora.py:variant=tiny',
    '--topology=v5e-1',
    '--config.data.eval_split=',
    MOETRAIN_PLAN_CACHE=str(tmp_path / 'plans.json'),
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.startswith('[v5e-1] compiling the train step for 1 TPU v5 lite devices')
  assert 'needs' in done.stdout and 'fits' in done.stdout
  assert 'E0000' not in done.stderr and 'host bounds' not in done.stderr, done.stderr[-2000:]


def test_emulated_devices_get_one_collective_order(monkeypatch):
  """Several emulated CPU devices run XLA:CPU's default scheduler (its concurrency-optimised one
  let them enter collectives in different orders: the rendezvous aborted), wait 15 minutes at a
  collective for each other and get 8 worker threads each (NPROC: with one each, collectives
  waiting for a late device held every worker); one device, a flag XLA_FLAGS already sets and
  an NPROC already set are left alone."""
  both = f'{runtime.CPU_ONE_COLLECTIVE_ORDER} {runtime.CPU_COLLECTIVE_PATIENCE}'
  patience = '--xla_cpu_collective_call_terminate_timeout_seconds=60'
  cases = {
    '--xla_force_host_platform_device_count=8': f'--xla_force_host_platform_device_count=8 {both}',
    '--xla_force_host_platform_device_count=1': '--xla_force_host_platform_device_count=1',
    '': '',
    '--xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=true': '--xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=true'
    f' {runtime.CPU_COLLECTIVE_PATIENCE}',
    f'--xla_force_host_platform_device_count=8 {patience}': f'--xla_force_host_platform_device_count=8 {patience} {runtime.CPU_ONE_COLLECTIVE_ORDER}',
  }
  for flags, want in cases.items():
    monkeypatch.setenv('XLA_FLAGS', flags)
    monkeypatch.delenv('NPROC', raising=False)
    runtime.cpu_collective_schedule()
    assert os.environ['XLA_FLAGS'] == want
    assert os.environ.get('NPROC') == ('64' if 'count=8' in flags else None)
  monkeypatch.setenv('NPROC', '12')
  runtime.cpu_collective_schedule()
  assert os.environ['NPROC'] == '12'

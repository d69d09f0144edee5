"""Run directories on Cloud Storage (--workdir=gs://...), against a local emulator selected by
STORAGE_EMULATOR_HOST (tests/gcs_emulator.py): training, a stop signal that saves, a kill, exact
resumes, evaluate and export; and the storage layer's pieces (moetrain/core/storage.py) on their own."""

import json
import os
import signal
import time

import pytest

from tests.test_preemption import TIMEOUT, Job, records, train_losses

pytest.importorskip('gcp_storage_emulator')


@pytest.fixture(scope='module')
def gcs():
  """The emulator's URL, with a bucket 'runs'; this process and the commands it starts use it."""
  from tests import gcs_emulator

  server, url = gcs_emulator.serve(buckets=['runs'])
  before = {k: os.environ.get(k) for k in (gcs_emulator.EMULATOR, 'TENSORSTORE_GCS_HTTP_URL')}
  os.environ[gcs_emulator.EMULATOR] = url
  os.environ.pop('TENSORSTORE_GCS_HTTP_URL', None)
  from moetrain.core import storage

  storage.use_emulator()
  yield url
  server.stop()
  for k, v in before.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v


def test_storage_on_the_emulator(gcs):
  """Whole-object writes, listing, the append log (an object rewritten whole, keeping what it
  held), exclusive creation and moves."""
  from moetrain.core import storage
  from moetrain.run import lease

  d = 'gs://runs/pieces'
  storage.makedirs(d)
  storage.write_atomic(storage.join(d, 'a.json'), '{"x": 1}')
  storage.write_atomic(storage.join(d, 'a.json'), '{"x": 2}')
  assert json.loads(storage.read_text(f'{d}/a.json')) == {'x': 2}
  assert storage.listdir(d) == ['a.json'] and storage.listdir(f'{d}/none') == []
  log = storage.AppendLog(f'{d}/log.jsonl', every=3600)
  log.write('1\n')
  log.flush()  # the first flush writes
  log.write('2\n')
  log.flush()  # throttled
  assert storage.read_text(f'{d}/log.jsonl') == '1\n'
  log.close()
  again = storage.AppendLog(f'{d}/log.jsonl')
  again.write('3\n')
  again.close()
  assert storage.read_text(f'{d}/log.jsonl') == '1\n2\n3\n'
  assert storage.create_exclusive(f'{d}/x', 'mine') and not storage.create_exclusive(f'{d}/x', '')
  storage.move(f'{d}/x', f'{d}/sub/y')
  assert storage.walk_files(d) == ['a.json', 'log.jsonl', 'sub/y']
  # The run lease: a live holder on another host keeps it.
  held = lease.Lease(d).acquire()
  other = lease.Lease(d)
  other.me = {**other.me, 'host': 'another-host'}
  with pytest.raises(lease.LeaseHeld, match='in use by another run'):
    other.acquire()
  held.release()
  assert not storage.exists(f'{d}/{lease.LEASE}')


def _wait_for_step(job: Job, step: int) -> None:
  """Until process 0's progress lines reach `step` (metrics.jsonl on a bucket is written every
  30 s, so its log is what says how far a run got)."""
  deadline = time.monotonic() + TIMEOUT
  while f'step {step} ' not in job.log(0):
    if job.procs[0].poll() is not None or time.monotonic() > deadline:
      job.kill()
      pytest.fail(f'training never reached step {step}:\n{job.log(0)[-3000:]}')
    time.sleep(0.2)


def _records(workdir: str) -> list[dict]:
  from moetrain.core import storage

  path = storage.join(workdir, 'metrics.jsonl')
  return [json.loads(line) for line in storage.read_text(path).splitlines()]


@pytest.mark.slow  # (minutes on 2 cores: `make test-slow`)
def test_a_run_in_a_bucket_stops_resumes_exactly_evaluates_and_exports(gcs, tmp_path):
  """SIGTERM saves and stops a gs:// run; SIGKILL later loses only what was not yet saved; the
  resumed run's losses equal those of an uninterrupted local run step for step. The tools then
  read the run from the bucket and export into it."""
  from moetrain.core import storage
  from moetrain.run import rundir

  workdir, local = 'gs://runs/lora', str(tmp_path / 'local')
  stop = '--config.train.stop_at_step=8'
  Job(local, stop, '--config.data.eval_split=eval', '--config.train.eval_every=8').wait()
  want = train_losses(local)
  (local_eval,) = [r for r in records(local) if r['kind'] == 'eval' and r['step'] == 8]
  assert sorted(want) == list(range(1, 9))

  logs = str(tmp_path / 'gs')
  job = Job(workdir, log_prefix=logs)
  _wait_for_step(job, 2)
  job.procs[0].send_signal(signal.SIGTERM)
  (log,) = job.wait()
  (saved,) = rundir.saved_steps(workdir)
  assert f'Preempted: saved step {saved};' in log and saved >= 2
  assert storage.exists(f'{workdir}/checkpoints/{saved}/moetrain_manifest.json')

  # A kill with checkpoints written every step: the rerun goes on from a complete one.
  job = Job(workdir, '--config.train.checkpoint_every=1', log_prefix=logs)
  deadline = time.monotonic() + TIMEOUT
  while max(rundir.saved_steps(workdir)) <= saved:  # a newer one committed (and more in flight)
    assert job.procs[0].poll() is None and time.monotonic() < deadline, job.log(0)[-3000:]
    time.sleep(0.05)
  job.kill()
  job.procs[0].wait()
  complete = max(rundir.saved_steps(workdir))
  assert complete > saved
  Job(workdir, stop, log_prefix=logs).wait()
  got = {}
  for r in _records(workdir):  # the last record of each step: resumes redo steps
    if r['kind'] == 'train':
      got[r['step']] = r['loss']
  assert sorted(got) == list(range(1, 9))
  for step in range(1, 9):
    assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step
  resumes = [r['step'] for r in _records(workdir) if r['kind'] == 'resume']
  assert resumes[0] == saved and resumes[-1] == complete

  # The tools, reading the run from the bucket; the export written into it.
  from tests.helpers import run_command

  env = {'STORAGE_EMULATOR_HOST': gcs, 'JAX_PLATFORMS': 'cpu'}
  ev = ('--max_batches=1', '--split=eval')
  out = run_command('moetrain.tools.evaluate', f'--workdir={workdir}', *ev, **env)
  assert out.returncode == 0, out.stderr[-3000:]
  # The bucket run's last checkpoint scores as the uninterrupted run's last eval did (the
  # tool's eval program is another compile: equal to float rounding).
  words = out.stdout.splitlines()[-1].split()
  assert words[:2] == ['step', '8:'], words
  assert float(words[3]) == pytest.approx(local_eval['loss'], rel=1e-5)
  assert float(words[7]) == pytest.approx(local_eval['accuracy'], abs=5e-5)  # (printed to 4)
  export = f'{workdir}-export'
  out = run_command(
    'moetrain.tools.export', f'--workdir={workdir}', f'--out={export}', '--adapter_only', **env
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert {'adapter_config.json', 'adapter_model.safetensors'} <= set(storage.listdir(export))


def test_inputs_from_a_bucket(gcs, tmp_path):
  """A Hugging Face checkpoint read in place from gs:// (by byte ranges: a row slice reads those
  rows), its tokenizer, and data files (copied once into a local cache, again when changed)."""
  import numpy as np

  from moetrain.convert import hf
  from moetrain.convert import safetensors_io as stio
  from moetrain.core import storage
  from moetrain.data import sources
  from moetrain.data import tokenizer as tokenizer_lib
  from moetrain.data.demo_task import DEMO_DIR

  base = str(DEMO_DIR / 'base')
  for name in os.listdir(base):
    storage.copy(os.path.join(base, name), f'gs://runs/base/{name}')
  assert hf.read_config('gs://runs/base') == hf.read_config(base)
  local, remote = stio.Reader(base), stio.Reader('gs://runs/base')
  assert remote.keys() == local.keys()
  for name in local.keys():
    assert remote.shape(name) == local.shape(name) and remote.dtype(name) == local.dtype(name)
    np.testing.assert_array_equal(remote.read(name), local.read(name))
    if len(local.shape(name)) > 1 and local.shape(name)[0] > 2:
      rows = (slice(1, 3), slice(None, 2))
      np.testing.assert_array_equal(remote.read(name, rows), local.read(name, rows))
  text = 'reverse: red fox cup ='
  want = tokenizer_lib.load_tokenizer(base).encode(text)
  assert tokenizer_lib.load_tokenizer('gs://runs/base').encode(text) == want

  cache = str(tmp_path / 'cache')
  storage.copy(str(DEMO_DIR / 'eval.jsonl'), 'gs://runs/data/eval.jsonl')
  (path,) = [storage.local_copy(p, cache) for p in storage.glob('gs://runs/data/*.jsonl')]
  with open(path, 'rb') as f, open(DEMO_DIR / 'eval.jsonl', 'rb') as g:
    assert f.read() == g.read()
  assert sources.expand_paths('gs://runs/data/{split}.jsonl', 'eval')[0].startswith(
    os.path.expanduser(storage.CACHE)
  )
  mtime = os.path.getmtime(path)
  assert storage.local_copy('gs://runs/data/eval.jsonl', cache) == path
  assert os.path.getmtime(path) == mtime  # not downloaded again
  storage.write_atomic('gs://runs/data/eval.jsonl', '{"text": "changed"}\n')
  with open(storage.local_copy('gs://runs/data/eval.jsonl', cache)) as f:
    assert f.read() == '{"text": "changed"}\n'


@pytest.mark.slow  # ~4 minutes: three RL runs
def test_an_rl_run_in_a_bucket_resumes_exactly(gcs, tmp_path):
  """An RL run in a gs:// directory, stopped after step 2 and resumed there, samples and trains
  what an uninterrupted local run does: the prompts and the sampler's keys follow from the
  rollout's index, the checkpoints from the bucket."""
  from tests.test_rl import RL_JOB, assert_same_run, rl_steps

  local, workdir = str(tmp_path / 'local'), 'gs://runs/grpo'
  # An expert axis, as in test_rl's two-process run: on 4 emulated devices with FSDP alone, the
  # first update once stalled in XLA:CPU's collective rendezvous (the devices in two all-gathers
  # at once, one device in neither; 1 of 2 runs, the VM busy).
  mesh, rl = '--config.mesh.shape=(1,-1,2,1)', {'config': 'configs/grpo.py', 'settings': RL_JOB}
  logs = str(tmp_path / 'gs')
  Job(local, mesh, **rl).wait(timeout=900)
  Job(workdir, mesh, '--config.train.stop_at_step=2', log_prefix=logs, **rl).wait(timeout=900)
  Job(workdir, mesh, log_prefix=logs, **rl).wait(timeout=900)
  resumes = [r['step'] for r in _records(workdir) if r['kind'] == 'resume']
  assert resumes == [2]
  assert_same_run(rl_steps(_records(workdir)), rl_steps(records(local)))

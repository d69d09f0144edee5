"""Several processes and preemption end to end: `python -m moetrain.main` processes get
SIGTERM mid-run, save, exit and resume exactly. One process, and two processes forming one CPU
job (jax.distributed over gloo, experts sharded across the processes), where the signal reaches a
host other than process 0; the two-process job's checkpoint then evaluates the same in one
process on another mesh, and the tools (evaluate, export, generate) run over two processes as
well. Also QLoRA from a Hugging Face checkpoint over two processes, and resuming on another
number of processes."""

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 240
# Overrides of configs/longcat_lora.py (tiny) shared by the commands and the in-process check.
SETTINGS = {
  'data.seq_len': 64,
  'data.global_batch_size': 8,
  'data.eval_split': '',
  'data.eval_batch_size': 8,
  'train.steps': 100000,  # preemption, not the end, stops the first run
  'train.log_every': 1,
  'train.checkpoint_every': 100000,
  'train.eval_every': 0,
  'train.eval_batches': 1,
}


JOBS = []  # started by the running test


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict:
  env = dict(os.environ)
  env.update(
    PYTHONPATH=ROOT,
    JAX_PLATFORMS='cpu',
    XLA_FLAGS=f'--xla_force_host_platform_device_count={devices} '
    '--xla_backend_optimization_level=0',
  )
  return env


class Job:
  """A command (by default training) as one OS process per JAX process; its output goes to files
  (a full pipe would block a process, and the other would wait on it in a collective)."""

  def __init__(
    self,
    workdir,
    *overrides,
    processes: int = 1,
    devices: int = 4,
    module='moetrain.main',
    hf: str | None = None,
    log_prefix: str | None = None,
    config: str = 'configs/longcat_lora.py:variant=tiny',
    settings: dict | None = None,
  ):
    """log_prefix: where the processes' logs go (default beside `workdir`; a URL's need one).
    settings: the overrides every command gets (default SETTINGS)."""
    args = [sys.executable, '-m', module]
    if hf:  # a tool reading a Hugging Face directory instead of a run (logs go next to workdir)
      args.append(f'--hf_checkpoint={hf}')
    else:
      args += [
        f'--config={config}',
        f'--workdir={workdir}',
        *(f'--config.{k}={v}' for k, v in (SETTINGS if settings is None else settings).items()),
        f'--config.train.compilation_cache={os.path.join(ROOT, ".jax_cache")}',
      ]
      if not any(o.startswith('--config.mesh.shape=') for o in overrides):  # a flag given once
        args.append(f'--config.mesh.shape=(1,-1,{2 if processes > 1 else 1},1)')  # experts across
    args += overrides
    port = _free_port()
    self.logs, self.procs = [], []
    JOBS.append(self)
    for i in range(processes):
      multi = [
        f'--num_processes={processes}',
        f'--process_id={i}',
        f'--coordinator_address=localhost:{port}',
      ]
      self.logs.append(f'{log_prefix or workdir}.job{len(JOBS)}.process{i}.log')  # one per launch
      with open(self.logs[-1], 'w') as err:
        self.procs.append(
          subprocess.Popen(
            args + (multi if processes > 1 else []),
            cwd=ROOT,
            env=_env(devices // processes),
            stdout=err,
            stderr=err,
          )
        )

  def log(self, i: int) -> str:
    with open(self.logs[i], newline='') as f:  # as written: keep any \r
      return f.read()

  def kill(self):
    for p in self.procs:
      if p.poll() is None:
        p.kill()

  def wait(self, code: int = 0, timeout: float = TIMEOUT) -> list[str]:
    """Each process's log; fails on a hang (a host waiting on another) or an exit other than
    `code` (every process must exit with it)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in self.procs):
      if any(p.poll() not in (None, code) for p in self.procs):
        break  # one failed: the others would wait for it in a collective
      if time.monotonic() > deadline:
        self.kill()
        pytest.fail(f'a process did not exit within {timeout} s:\n{self.log(0)[-3000:]}')
      time.sleep(0.1)
    codes = [p.poll() for p in self.procs]  # None: still running after another failed
    self.kill()
    logs = [self.log(i) for i in range(len(self.procs))]
    for i, (got, log) in enumerate(zip(codes, logs)):
      assert got in (code, None), f'process {i} exited {got} (all: {codes}):\n{log[-3000:]}'
    assert None not in codes, f'exit codes {codes}'
    return logs


@pytest.fixture(autouse=True)
def _no_leftover_processes():
  """Kills what a failing test left running."""
  yield
  while JOBS:
    JOBS.pop().kill()


def records(workdir) -> list[dict]:
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.endswith('\n')]


def preempt(workdir, *overrides, target, processes: int, after: int = 1, sig=signal.SIGTERM) -> int:
  """Runs until process 0 has logged `after` steps, sends `sig` to process `target` (an int, or
  a tuple of them); returns the saved step."""
  job = Job(workdir, *overrides, processes=processes)
  deadline = time.monotonic() + TIMEOUT
  while len(train_losses(workdir)) < after:
    if any(p.poll() is not None for p in job.procs) or time.monotonic() > deadline:
      job.kill()
      pytest.fail(f'training never logged a step:\n{job.log(0)[-3000:]}')
    time.sleep(0.2)
  for t in target if isinstance(target, tuple) else (target,):
    job.procs[t].send_signal(sig)
  logs = job.wait()
  saved = max(int(d) for d in os.listdir(os.path.join(workdir, 'checkpoints')) if d.isdigit())
  assert f'Preempted: saved step {saved};' in logs[0]
  assert not any('Traceback' in log for log in logs), logs
  assert max(train_losses(workdir)) == saved  # it stopped at the step it saved
  return saved


EVAL = {'data.eval_split': 'eval'}  # the demo's eval split, one batch of 8 rows


def without_gloo(log: str) -> str:
  """`log` without the lines gloo writes to stderr when a collective first runs over a group of
  devices ("[Gloo] Rank 0 is connected to 3 peer ranks. ..."; the notices of a process's two
  devices can break into each other's lines), so that what a command printed reads as printed."""
  lines = log.splitlines(keepends=True)
  return ''.join(x for x in lines if not x.startswith('[Gloo]') and 'peer ranks' not in x)


def command_config(tokenizer_run: str):
  """In this process, the config the commands run (SETTINGS and EVAL), with the tokenizer that
  the run in `tokenizer_run` trained."""
  from tests.test_configs import load

  config = load(os.path.join(ROOT, 'configs', 'longcat_lora.py'), 'variant=tiny')
  for key, value in {**SETTINGS, **EVAL}.items():
    section, name = key.split('.')
    config[section][name] = value
  config.data.tokenizer = os.path.join(tokenizer_run, 'tokenizer.model')
  return config


def train_losses(workdir) -> dict[int, float]:
  return {r['step']: r['loss'] for r in records(workdir) if r['kind'] == 'train'}


def test_sigterm_saves_and_a_kill_loses_only_the_unfinished_checkpoint(tmp_path):
  """One process. SIGTERM: the run saves, exits and resumes at the next step. Then SIGKILL (no
  chance to save) while checkpoints are written every step, asynchronously, aimed at a moment
  when one is half-written: the rerun restores the newest complete one."""
  workdir = str(tmp_path / 'run')
  ckpts = os.path.join(workdir, 'checkpoints')
  step = preempt(workdir, target=0, processes=1)
  before = len(records(workdir))
  job = Job(workdir, '--config.train.checkpoint_every=1')
  deadline = time.monotonic() + 90  # then kill it wherever it is
  while job.procs[0].poll() is None and time.monotonic() < deadline:
    names = os.listdir(ckpts)
    done = [int(n) for n in names if n.isdigit()]
    if max(done, default=0) > step and any('tmp' in n for n in names):
      break  # a save in flight, and a newer one than the resumed step complete
    time.sleep(0.005)
  job.procs[0].kill()
  job.procs[0].wait()
  again = records(workdir)[before:]
  assert (again[0]['kind'], again[0]['step']) == ('resume', step)
  assert (again[1]['kind'], again[1]['step']) == ('train', step + 1)
  complete = max(int(d) for d in os.listdir(ckpts) if d.isdigit())
  assert complete > step
  before = len(records(workdir))
  Job(workdir, f'--config.train.stop_at_step={complete + 1}').wait()
  # The rerun trained exactly one step, the one after the newest complete checkpoint.
  assert [(r['kind'], r['step']) for r in records(workdir)[before:]] == [
    ('resume', complete),
    ('train', complete + 1),
  ]
  # (tests/test_train.py checks in-process that a resumed run equals an uninterrupted one.)


@pytest.mark.slow  # (minutes on 2 cores: `make test-slow`)
def test_sigterm_to_one_host_stops_all_and_resumes_exactly(tmp_path):
  # Two processes, the signal to process 1: it must neither stop alone (process 0 would wait in
  # its collectives forever) nor be ignored. Each host's data position is saved and restored:
  # with the two newest checkpoints removed, the resumed job recomputes two steps that the first
  # job ran uninterrupted, and they equal (float32 on CPU is deterministic for one program).
  workdir = str(tmp_path / 'run')
  step = preempt(workdir, '--config.train.checkpoint_every=1', target=1, processes=2, after=3)
  first = train_losses(workdir)
  for s in (step, step - 1):
    shutil.rmtree(os.path.join(workdir, 'checkpoints', str(s)))
  tokenizer = f'--config.data.tokenizer={os.path.join(workdir, "tokenizer.model")}'
  evals = [f'--config.{k}={v}' for k, v in {**EVAL, 'train.eval_every': step}.items()]
  stop = f'--config.train.stop_at_step={step}'
  Job(workdir, tokenizer, stop, *evals, processes=2).wait()
  resume = [i for i, r in enumerate(records(workdir)) if r['kind'] == 'resume'][-1]
  again = records(workdir)[resume:]
  assert again[0]['step'] == step - 2
  resumed = {r['step']: r['loss'] for r in again if r['kind'] == 'train'}
  assert sorted(resumed) == [step - 1, step]
  for s in resumed:
    np.testing.assert_allclose(resumed[s], first[s], rtol=1e-6, err_msg=f'step {s}')

  # The two-host checkpoint, restored in this one process on another mesh (8 devices, no expert
  # axis), evaluates to what the two hosts measured at that step.
  from moetrain.run import train
  from moetrain.tools import evaluate

  (measured,) = [r for r in again if r['kind'] == 'eval']
  assert measured['step'] == step
  config = command_config(workdir)
  ev = evaluate.evaluate_checkpoint(config, workdir, max_batches=SETTINGS['train.eval_batches'])
  assert ev['step'] == step
  np.testing.assert_allclose(ev['loss'], measured['loss'], rtol=1e-5)
  np.testing.assert_allclose(ev['tokens'], measured['tokens'])

  # The job resumed on one host: refused before the slow start-up (the weights are not loaded,
  # nothing is written), naming the ways on. (test_tools_over_two_processes goes on with
  # data.reslice_on_resume.)
  written = os.stat(os.path.join(workdir, 'config.json')).st_mtime_ns
  config.train.stop_at_step = step + 1
  config.train.compilation_cache = ''  # keep this process's (tests/conftest.py)
  with pytest.raises(ValueError, match='data positions of 2 processes, this run has 1') as err:
    train.run(config, workdir)
  assert 'reslice_on_resume' in str(err.value)
  assert os.stat(os.path.join(workdir, 'config.json')).st_mtime_ns == written
  assert max(r['step'] for r in records(workdir) if r['kind'] == 'train') == step

  # Each host wrote its own array files, and process 0 checksummed them all once both had. One
  # of process 1's damaged: each host checks its share of the files, and both stop, naming it.
  from moetrain.run import integrity

  step_dir = os.path.join(workdir, 'checkpoints', str(step))
  manifest = integrity.read_manifest(step_dir)
  ones = sorted(f for f in manifest if f.startswith('state/ocdbt.process_1/d/'))
  assert ones and integrity.problems(step_dir, manifest) == []
  with open(os.path.join(step_dir, ones[0]), 'r+b') as f:
    byte = f.read(1)
    f.seek(0)
    f.write(bytes([byte[0] ^ 0xFF]))
  logs = Job(workdir, tokenizer, f'--config.train.stop_at_step={step + 1}', processes=2).wait(1)
  for log in logs:
    assert f'checkpoints/{step} is damaged ({ones[0]}: checksum' in log, log[-2000:]


@pytest.mark.slow  # ~65 s on a fresh clone; the one-process mesh load is in test_hf_parity.py
def test_qlora_from_a_hugging_face_checkpoint_over_two_processes(tmp_path):
  """The flagship path on several hosts: the frozen base read from safetensors and quantised to
  int8 on device, each process reading only the blocks its devices hold (experts split across
  the processes). The adapters trained there, evaluated in this one process (which rebuilds the
  base from the checkpoint on another mesh), give the loss the two processes measured."""
  from tests.test_hf_finetune import hf_config, hf_dir_with_tokenizer

  hf_dir = hf_dir_with_tokenizer(tmp_path)
  workdir = str(tmp_path / 'run')
  extra = {
    'init.hf_checkpoint': hf_dir,
    'engine.quant': 'int8',
    'engine.dtype': 'float32',
    'data.seq_len': 32,
    'train.steps': 3,
    'train.eval_every': 3,
    'optim.warmup_steps': 1,
    'optim.learning_rate': 1e-2,  # three steps must show the adapters learning
    **EVAL,
  }
  Job(workdir, *(f'--config.{k}={v}' for k, v in extra.items()), processes=2).wait()
  measured = {r['step']: r for r in records(workdir) if r['kind'] == 'eval'}
  assert sorted(measured) == [0, 3] and sorted(train_losses(workdir)) == [1, 2, 3]

  from moetrain.tools import evaluate

  config = hf_config(hf_dir, steps=3, eval_batches=SETTINGS['train.eval_batches'])
  config.engine.quant = 'int8'
  config.data.eval_split = EVAL['data.eval_split']
  # Step 0 is the base as loaded (no workdir: the config's initial weights), step 3 the adapters.
  for step, run in ((0, None), (3, workdir)):
    ev = evaluate.evaluate_checkpoint(config, run, max_batches=1)
    assert ev['step'] == step
    np.testing.assert_allclose(ev['loss'], measured[step]['loss'], rtol=1e-5)
    np.testing.assert_allclose(ev['tokens'], measured[step]['tokens'])
  assert measured[3]['loss'] < measured[0]['loss'] - 0.1  # and the adapters learned


@pytest.mark.slow
def test_tools_over_two_processes(tmp_path):
  """evaluate, export (merged and adapters) and generate (from a run and from a Hugging Face
  directory) as one job over two processes: process 0 prints and writes what one process gives.
  Then the two-process run resumes on one process with data.reslice_on_resume."""
  from tests.test_hf_finetune import hf_dir_with_tokenizer

  reference, step = str(tmp_path / 'run'), 2
  evals = [f'--config.{k}={v}' for k, v in {**EVAL, 'train.eval_every': step}.items()]
  Job(reference, f'--config.train.stop_at_step={step}', *evals, processes=2).wait()
  tokenizer = f'--config.data.tokenizer={os.path.join(reference, "tokenizer.model")}'
  (measured,) = [r for r in records(reference) if r['kind'] == 'eval' and r['step'] == step]
  config = command_config(reference)
  tool = functools.partial(Job, reference, tokenizer, *evals, processes=2)
  # Evaluation prints once (process 0) what training measured; the exports hold the tensors a
  # one-process export of the checkpoint has.
  tool = functools.partial(Job, reference, tokenizer, *evals, processes=2)
  logs = tool('--max_batches=1', module='moetrain.tools.evaluate').wait()
  (line,) = [x for x in logs[0].splitlines() if x.startswith(f'step {step}: loss ')]
  np.testing.assert_allclose(float(line.split()[3]), measured['loss'], rtol=1e-5)
  assert not any(x.startswith('step ') for x in logs[1].splitlines())
  from moetrain.convert import peft_adapter
  from moetrain.convert.safetensors_io import Reader
  from moetrain.tools import export

  files = {False: {}, True: {'single': peft_adapter.ADAPTER_FILE, 'index': None}}
  for adapter, file in files.items():
    flags = ['--adapter_only'] if adapter else []
    exported = str(tmp_path / f'exported{len(flags)}')
    tool(f'--out={exported}', *flags, module='moetrain.tools.export').wait()
    alone = export.export(config, reference, str(tmp_path / f'alone{len(flags)}'), adapter)
    two, one = Reader(exported, **file), Reader(alone, **file)
    assert sorted(two.keys()) == sorted(one.keys()) and len(one.keys()) > 20
    for name in one.keys():  # merged LoRA: the products ran on other meshes, so ~1 ulp apart
      a, b = two.read(name), one.read(name)
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max(), err_msg=name)

  # Sampling (greedy would stop at eos at once this early in training): the two processes print
  # what one process draws from the checkpoint with the same seed, one that draws 3+ tokens.
  import jax

  from moetrain.tools import generate

  # In float32: the two processes reduce in another order than one, and a bfloat16 ulp of the
  # logits is enough to flip a draw at this temperature.
  prompt, f32 = '12 + 7 =', '--config.engine.dtype=float32'
  config.engine.dtype = 'float32'
  model, tok, at = generate.load_run(config, reference)
  ids = [tok.bos_id, *tok.encode(prompt)] if tok.bos_id is not None else tok.encode(prompt)
  for seed in range(20):
    out = generate.generate(
      model,
      [ids],
      6,
      temperature=1.5,
      rng=jax.random.key(seed),
      eos_id=tok.eos_id,
      vocab_size=tok.vocab_size,
    )
    new = generate.new_tokens(out, len(ids), tok.eos_id)
    if len(new) >= 3:
      break
  assert len(new) >= 3
  flags = ['--max_new_tokens=6', '--temperature=1.5', f'--seed={seed}']
  logs = tool(f'--prompt={prompt}', f32, *flags, module='moetrain.tools.generate').wait()
  logs = [without_gloo(log) for log in logs]  # (decoding's first collectives follow the header)
  text = prompt + generate.continuation(tok, ids, new)  # (may hold line breaks of any kind)
  ended = ' and eos' if tok.eos_id in [int(i) for i in out[0, len(ids) :]] else ''
  assert f'# {reference} at step {at}\n{text}\n# {len(new)} new tokens{ended};' in logs[0]
  assert f'# {reference}' not in logs[1]

  # Generation straight from the Hugging Face directory: each process loads a whole copy onto its
  # first local device; process 0 prints what one process generates.
  hf_dir = hf_dir_with_tokenizer(tmp_path)
  prompt = 'reverse: a b c ='
  logs = Job(
    str(tmp_path / 'hf_generate'),
    f'--prompt={prompt}',
    '--max_new_tokens=8',
    processes=2,
    module='moetrain.tools.generate',
    hf=hf_dir,
  ).wait()
  model, tok = generate.load_hf(hf_dir)
  ids = [tok.bos_id, *tok.encode(prompt)]
  out = generate.generate(model, [ids], 8, eos_id=tok.eos_id, vocab_size=tok.vocab_size)
  new = generate.new_tokens(out, len(ids), tok.eos_id)
  assert len(new) > 2
  text = prompt + generate.continuation(tok, ids, new)
  assert f'# {hf_dir}\n{text}\n# {len(new)} new tokens;' in logs[0]
  assert f'# {hf_dir}' not in logs[1]

  # On one process: goes on from the two hosts' weights and optimizer state, data re-sliced.
  (log,) = Job(
    reference,
    tokenizer,
    f'--config.train.stop_at_step={step + 1}',
    '--config.data.reslice_on_resume=true',
  ).wait()
  assert f'Step {step} was saved by 2 processes, this run has 1' in log
  assert max(train_losses(reference)) == step + 1


@pytest.mark.slow
def test_hosts_whose_data_ends_apart_stop_together(tmp_path):
  """data.num_epochs=1 over two hosts whose slices pack into different numbers of batches (host 0
  reads the even, long examples): both stop at host 0's last batch, save it and exit."""
  long, short = 'word ' * 30, 'w'
  records = [
    {'prompt': f'{long if i % 2 == 0 else short} {i} =', 'completion': f' {i}'} for i in range(160)
  ]
  for split in ('train', 'eval'):
    with open(tmp_path / f'{split}.jsonl', 'w') as f:
      f.writelines(json.dumps(r) + '\n' for r in records)
  workdir = str(tmp_path / 'run')
  Job(
    workdir,
    '--config.data.source=jsonl',
    f'--config.data.path={tmp_path}/{{split}}.jsonl',
    '--config.data.vocab_size=300',
    '--config.data.num_epochs=1',
    processes=2,
  ).wait()
  saved = max(int(d) for d in os.listdir(os.path.join(workdir, 'checkpoints')) if d.isdigit())
  assert saved == max(train_losses(workdir)) >= 2


def test_data_positions_per_process():
  from moetrain.core import multihost
  from moetrain.run import checkpoint

  assert multihost.Exchange('x').json({'a': 1}, 1) == [{'a': 1}]  # one process: no exchange
  assert checkpoint.process_data_state({'processes': [{'a': 1}]}) == {'a': 1}
  # A checkpoint written before positions were per process holds the one state itself.
  assert checkpoint.process_data_state({'grain': 'x', 'num_truncated': 0})['grain'] == 'x'
  with pytest.raises(ValueError, match='data positions of 2 processes, this run has 1'):
    checkpoint.process_data_state({'processes': [{}, {}]})
  assert checkpoint.process_data_state({'processes': [{}, {}]}, reslice=True) is None


@pytest.mark.slow
@pytest.mark.parametrize('target', [1, (0, 1)], ids=['one_host', 'both_hosts'])
def test_ctrl_c_stops_a_job_of_two_processes_saved(tmp_path, target):
  """Ctrl-C (SIGINT) to one host of a two-process job, or to both (a terminal's Ctrl-C reaches
  every process it started): all hosts stop at one step, saved, without a traceback; a stop of
  the signalled host alone would leave the other waiting in the step's collectives."""
  preempt(str(tmp_path / 'run'), target=target, processes=2, sig=signal.SIGINT)


@pytest.mark.slow
@pytest.mark.parametrize(
  'after',
  ['joined the job', '[Gloo]'],
  ids=['as_soon_as_it_joined', 'while_it_restores'],
)
def test_sigterm_during_a_resumed_start_up_stops_at_the_first_step(tmp_path, after):
  """Two processes resume from step S; process 1 gets SIGTERM as soon as it has joined the job,
  or while the job restores and compiles (after its first cross-process collective). JAX's
  preemption service stops at the step after the highest one reported, so S must have been
  reported before: the job then stops at S + 1, saved, instead of training on with the notice
  lost. (Here JAX's SIGTERM notifier acts ~1 s after the signal, by when the training loop has
  reported S itself, so the first case passes with or without the report made on joining.)"""
  workdir = str(tmp_path / 'run')
  step = preempt(workdir, target=1, processes=2)
  job = Job(workdir, processes=2)
  deadline = time.monotonic() + TIMEOUT
  while after not in job.log(1):
    assert time.monotonic() < deadline and job.procs[1].poll() is None, job.log(1)[-3000:]
    time.sleep(0.05)
  job.procs[1].send_signal(signal.SIGTERM)
  logs = job.wait()
  assert f'Preempted: saved step {step + 1};' in logs[0]
  assert max(train_losses(workdir)) == step + 1


def test_one_run_per_directory_ctrl_c_saves_and_a_failed_rerun_changes_nothing(tmp_path):
  """A second run in a directory a run holds is refused in one line naming the holder; Ctrl-C
  (SIGINT) then saves and stops the first like SIGTERM; a rerun whose data is refused exits
  with one line and leaves config.json and metrics.jsonl as they were."""
  workdir = str(tmp_path / 'run')
  first = Job(workdir)
  deadline = time.monotonic() + TIMEOUT
  while not train_losses(workdir):
    assert first.procs[0].poll() is None and time.monotonic() < deadline, first.log(0)[-3000:]
    time.sleep(0.2)
  (log,) = Job(workdir).wait(code=1)
  pid = first.procs[0].pid
  assert f'is in use by another run (process {pid} on host' in log
  assert 'Traceback' not in log
  first.procs[0].send_signal(signal.SIGINT)
  (log,) = first.wait()
  saved = max(int(d) for d in os.listdir(os.path.join(workdir, 'checkpoints')) if d.isdigit())
  assert f'Preempted: saved step {saved};' in log and 'Traceback' not in log
  assert not os.path.exists(os.path.join(workdir, 'lease.json'))  # released
  before = {
    n: open(os.path.join(workdir, n), 'rb').read() for n in ('config.json', 'metrics.jsonl')
  }
  (log,) = Job(
    workdir, '--config.data.source=jsonl', f'--config.data.path={tmp_path}/missing.jsonl'
  ).wait(code=1)
  assert 'Error:' in log and 'missing.jsonl' in log and 'Traceback' not in log
  after = {n: open(os.path.join(workdir, n), 'rb').read() for n in before}
  assert after == before

"""End to end: a few steps of configs/longcat_lora.py (tiny) on 8 devices, with save/restore."""

import dataclasses
import json
import os
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import pytest

from moetrain.run import checkpoint, integrity, rundir, train, train_log
from tests.helpers import run_command
from tests.test_configs import ROOT, load
from tests.test_data import numbered_records, write_jsonl


def small_config(**train_overrides):
  config = load(os.path.join(ROOT, 'configs', 'longcat_lora.py'), 'variant=tiny')
  config.data.seq_len = 64
  config.data.global_batch_size = 8
  config.data.eval_batch_size = 8
  config.train.update(
    dict(
      steps=6,
      log_every=1,
      checkpoint_every=3,
      eval_every=0,
      eval_batches=1,
      async_checkpoint=True,
      compilation_cache='',
    )
  )
  config.train.update(train_overrides)
  config.optim.warmup_steps = 2
  return config


def losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    recs = [json.loads(line) for line in f]
  return {r['step']: r['loss'] for r in recs if r['kind'] == 'train'}


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('full'))
  out = train.run(small_config(), workdir)
  return workdir, out


def test_run_logs_checkpoints_and_evaluates(uninterrupted):
  workdir, out = uninterrupted
  assert sorted(losses(workdir)) == [1, 2, 3, 4, 5, 6]
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    recs = [json.loads(line) for line in f]
  assert recs[0]['kind'] == 'eval' and recs[0]['step'] == 0  # the pre-training baseline
  first = next(r for r in recs if r['kind'] == 'train')
  for key in (
    'loss',
    'tokens_per_sec',
    'learning_rate',
    'grad_norm',
    'moe/load',
    'moe/ffn_experts_mean',
    'moe/router_entropy',
    'moe/shard_imbalance',
    'data/truncated_examples',
  ):
    assert key in first, key
  # Every routing statistic per layer too; the plain key is their mean over layers.
  for key in ('ffn_experts_mean', 'dropped_frac', 'router_entropy', 'shard_imbalance'):
    layers = [first[f'moe/layer{i}/{key}'] for i in range(small_config().model.num_layers)]
    assert abs(first[f'moe/{key}'] - sum(layers) / len(layers)) < 1e-6, key
  assert any(r['kind'] == 'eval' for r in recs)
  assert 'eval_accuracy' in out
  assert os.listdir(os.path.join(workdir, 'tb'))
  # Every checkpoint_every steps and at the end; no unrequested one at step 1.
  steps = sorted(int(d) for d in os.listdir(os.path.join(workdir, 'checkpoints')) if d.isdigit())
  assert steps == [3, 6], steps
  # LoRA checkpoints hold adapters, optimizer state and router biases, never the frozen base.
  with open(os.path.join(workdir, 'checkpoints', '6', 'state', '_METADATA')) as f:
    saved = f.read()
  assert 'params.layers.moe.experts.gate_lora_a' in saved and 'frozen' not in saved
  assert 'experts.gate.value' not in saved  # the base expert weights
  # a second invocation finds the finished run and does nothing (it logs nothing either)
  assert train.run(small_config(), workdir) == {'step': 6, 'finished': True}
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    assert [json.loads(line) for line in f] == recs


def test_resume_continues_bit_for_bit(uninterrupted, tmp_path, capsys):
  full, _ = uninterrupted
  workdir = str(tmp_path)
  train.run(small_config(stop_at_step=3), workdir)
  assert sorted(losses(workdir)) == [1, 2, 3]
  # the same time-boxed command again has nothing to do and says why
  assert train.run(small_config(stop_at_step=3), workdir) == {'step': 3, 'finished': False}
  assert 'already past train.stop_at_step=3' in capsys.readouterr().out
  train.run(small_config(), workdir)
  want, got = losses(full), losses(workdir)
  assert [got[s] for s in range(1, 7)] == [want[s] for s in range(1, 7)]
  # The resumed run ends as a fresh one does: measured against the first start's baseline.
  assert re.search(
    r'eval accuracy [\d.]+ before training -> [\d.]+ at step 6', capsys.readouterr().out
  )


@pytest.mark.parametrize(
  'key, value, message',
  [
    ('lora.rank', 16, r'lora\.rank: 8 in the checkpointed run, now 16'),
    ('optim.grad_clip', 0.0, r'optim\.grad_clip: 1\.0 in the checkpointed run, now 0\.0'),
    ('seed', 1, r"frozen base .*'seed 0, .*' in the checkpointed run, now 'seed 1, "),
    (
      'engine.init_std',
      0.2,
      r"'seed 0, init_std 0\.02' in the checkpointed run, now 'seed 0, init_std 0\.2'",
    ),
  ],
)
def test_resume_with_other_settings_names_them(uninterrupted, key, value, message):
  """Settings that shape the saved state, or (LoRA) the frozen base the adapters were trained
  on, stop the resume before the restore, by name."""
  workdir, _ = uninterrupted
  config = small_config()
  section, _, name = key.rpartition('.')
  (config[section] if section else config)[name] = value
  with pytest.raises(ValueError, match=message):
    train.run(config, workdir)


def _copy(workdir, tmp_path):
  copy = tmp_path / 'run'
  shutil.copytree(workdir, copy)
  return copy


def _files(path) -> dict:
  return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob('*')) if p.is_file()}


def _largest_array_file(step_dir):
  return max(
    (step_dir / 'state' / 'ocdbt.process_0' / 'd').iterdir(), key=lambda p: p.stat().st_size
  )


def _zero_bytes(step_dir):
  path = _largest_array_file(step_dir)
  data = bytearray(path.read_bytes())
  data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
  path.write_bytes(bytes(data))


def _truncate(step_dir):
  path = _largest_array_file(step_dir)
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _damage_metadata(step_dir):  # (the same size: only the checksum can tell)
  path = step_dir / 'state' / '_METADATA'
  path.write_bytes(b'[' + path.read_bytes()[1:])


DAMAGE = {
  'zeroed': (_zero_bytes, r'ocdbt\.process_0/d/\w+: checksum \w+, \w+ was written'),
  'truncated': (_truncate, r'ocdbt\.process_0/d/\w+: \d+ bytes, \d+ were written'),
  'deleted': (lambda d: _largest_array_file(d).unlink(), r'ocdbt\.process_0/d/\w+: missing'),
  'metadata': (_damage_metadata, r'state/_METADATA: checksum'),
  'manifest': (lambda d: (d / integrity.MANIFEST).write_text('{'), r'unreadable'),
}


@pytest.mark.parametrize('damage', DAMAGE)
def test_a_damaged_checkpoint_is_named_with_the_step_to_resume_from(
  uninterrupted, tmp_path, damage
):
  """The newest checkpoint damaged after it was written (zeroed bytes, cut short, a file lost,
  its metadata or checksums changed): its checksums say so before anything is restored, with
  the checkpoint to fall back to and the flag that does; nothing is deleted or changed."""
  workdir, _ = uninterrupted
  copy = _copy(workdir, tmp_path)
  spoil, what = DAMAGE[damage]
  spoil(copy / 'checkpoints' / '6')
  before = _files(copy)
  message = rf'checkpoints/6 is damaged \(.*{what}.*resume from step 3 .*resume_step=3'
  with pytest.raises(checkpoint.DamagedCheckpoint, match=message):
    train.run(small_config(steps=8), str(copy))
  assert _files(copy) == before


def test_every_checkpoint_holds_the_checksums_of_its_files(uninterrupted):
  workdir, _ = uninterrupted
  step_dir = os.path.join(workdir, 'checkpoints', '6')
  manifest = integrity.read_manifest(step_dir)
  assert sorted(manifest) == integrity.item_files(step_dir)
  assert any(f.startswith('state/ocdbt.process_0/d/') for f in manifest)
  assert integrity.problems(step_dir, manifest) == []


def test_a_checkpoint_without_checksums_is_restored_with_a_warning(uninterrupted, tmp_path, caplog):
  """One saved before checksums (or with train.verify_checkpoints=False) is read unchecked."""
  copy = _copy(uninterrupted[0], tmp_path)
  (copy / 'checkpoints' / '6' / integrity.MANIFEST).unlink()
  assert train.run(small_config(), str(copy)) == {'step': 6, 'finished': True}
  assert 'checkpoints/6 has no checksums' in caplog.text


def test_resume_step_goes_back_past_a_damaged_checkpoint(uninterrupted, tmp_path):
  """train.resume_step=3 sets the damaged step 6 aside (not deleted) and trains 4-6 again, as the
  uninterrupted run did; a step without a checkpoint is refused by name."""
  full, _ = uninterrupted
  copy = _copy(full, tmp_path)
  _zero_bytes(copy / 'checkpoints' / '6')
  with pytest.raises(ValueError, match=r'resume_step=4: .* holds no checkpoint .*steps \[3, 6\]'):
    train.run(small_config(resume_step=4), str(copy))
  train.run(small_config(resume_step=3), str(copy))
  assert os.listdir(copy / checkpoint.SET_ASIDE) == ['6']
  assert sorted(os.listdir(copy / 'checkpoints')) == ['3', '6']
  want, got = losses(full), losses(str(copy))
  assert [got[s] for s in range(4, 7)] == [want[s] for s in range(4, 7)]


def test_a_damaged_checkpoint_is_named_from_the_main_entry_point(uninterrupted, tmp_path):
  """`python -m moetrain.main` prints the message alone (no traceback) and exits with 1."""
  copy = _copy(uninterrupted[0], tmp_path)
  _truncate(copy / 'checkpoints' / '6')
  args = ['--config=configs/longcat_lora.py:variant=tiny', f'--workdir={copy}']
  done = run_command('moetrain.main', *args, JAX_PLATFORMS='cpu')
  assert done.returncode == 1, done.stderr[-2000:]
  last = done.stderr.strip().splitlines()[-1]
  assert re.match(r'Error: checkpoint .*checkpoints/6 is damaged .*resume_step=3', last), last
  assert 'Traceback' not in done.stderr


@pytest.mark.slow  # ~15 s; sibling: test_resume_step_goes_back_past_a_damaged_checkpoint
def test_a_checkpoint_without_checksums_that_cannot_be_read_is_named(uninterrupted, tmp_path):
  """train.verify_checkpoints=False (or a checkpoint from before checksums): a read that fails
  names the checkpoint and the step to fall back to, and deletes nothing. train.run() leaves the
  caller's SIGTERM handler alone (only the entry point installs one)."""
  import signal

  workdir, _ = uninterrupted
  copy = _copy(workdir, tmp_path)
  shutil.rmtree(copy / 'checkpoints' / '6' / 'state')
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(ValueError, match=r'checkpoints/6 cannot be read .*resume from step 3'):
    train.run(small_config(steps=8, verify_checkpoints=False), str(copy))
  assert (copy / 'checkpoints' / '6').is_dir()
  assert signal.getsignal(signal.SIGTERM) is before


def test_a_nonfinite_streak_stops_the_run_and_keeps_the_last_finite_checkpoint(tmp_path):
  """A learning rate of 1e30: step 1's update makes every later loss non-finite. The run saves
  no step of the streak (keep_checkpoints=2 would otherwise rotate step 1 out by step 3) and
  stops after max_nonfinite_steps of them, naming the checkpoint before it."""
  config = small_config(steps=20, checkpoint_every=1, keep_checkpoints=2, max_nonfinite_steps=3)
  config.optim.learning_rate = 1e30
  with pytest.raises(train_log.NonFiniteStreak, match=r'3 steps in a row up to step 4 .*step 1\.'):
    train.run(config, str(tmp_path))
  with open(tmp_path / 'metrics.jsonl') as f:
    skipped = {r['step']: r['skipped'] for r in map(json.loads, f) if r['kind'] == 'train'}
  assert skipped == {1: 0, 2: 1, 3: 2, 4: 3}
  assert os.listdir(tmp_path / 'checkpoints') == ['1']


def test_an_update_that_overflows_is_never_saved(tmp_path, monkeypatch):
  """Finite gradients can still give an update that overflows a weight or an Adam moment; the
  step's skip guard (a non-finite loss or gradient) does not see it. The state is checked at the
  save: the run stops there, unsaved, naming the newest (finite) checkpoint. The overflow is
  injected after step 4's update (a real one needs a learning rate near float32's maximum)."""
  from moetrain.training import aot

  real = aot.precompile_train_step

  def overflowing(*args, **kwargs):
    compiled = real(*args, **kwargs)
    step_fn = compiled.executable

    def run(state, batch):
      state, metrics = step_fn(state, batch)
      if int(state.step) == 4:
        poison = lambda x: x * jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else x
        opt_state = jax.jit(lambda t: jax.tree.map(poison, t))(state.opt_state)
        state = dataclasses.replace(state, opt_state=opt_state)
      return state, metrics

    return dataclasses.replace(compiled, executable=run)

  monkeypatch.setattr(aot, 'precompile_train_step', overflowing)
  config = small_config(steps=8, checkpoint_every=2, keep_checkpoints=1)
  with pytest.raises(train_log.NonFiniteStreak, match=r'Step 4 not saved: .*overflow.*step 2\.'):
    train.run(config, str(tmp_path))
  assert os.listdir(tmp_path / 'checkpoints') == ['2']


def test_a_damaged_checkpoint_is_not_buried_under_closed_loop_callbacks(tmp_path, monkeypatch):
  """A checkpoint whose array files are missing fails one read while Orbax's others are in
  flight: each then calls back into the closed event loop, an unraisable 'Event loop is closed'
  traceback (155 of them for the demo) printed around the message naming the checkpoint. A
  command drops those (runtime.start_command); other unraisable errors still show."""
  import gc

  from moetrain.core import runtime
  from moetrain.run import checkpoint

  seen = []
  monkeypatch.setattr(sys, 'unraisablehook', seen.append)
  runtime.quiet_closed_loop_errors()  # (monkeypatch restores the hook after the test)

  class Callback:  # a read completing into a closed loop
    def __init__(self, message):
      self.message = message

    def __del__(self):
      raise RuntimeError(self.message)

  ckpt = checkpoint.Checkpointer(str(tmp_path), every=1, keep=1, async_save=False)
  with pytest.raises(ValueError, match=r'checkpoints/6 cannot be read .*resume from the start'):
    with ckpt._naming_damage(6):
      Callback('Event loop is closed')
      raise ValueError('NOT_FOUND: Error reading "step/.zarray"')
  Callback('Event loop is closed')
  Callback('something else')
  gc.collect()
  assert [str(u.exc_value) for u in seen] == ['something else']


def test_resume_with_other_data_settings_warns_by_name(uninterrupted, caplog):
  """A changed batch, sequence length or order is allowed on resume, but the data position no
  longer continues the same stream: the run says which settings changed."""
  workdir, _ = uninterrupted
  config = small_config()
  rundir.check_resumable(config, workdir)
  assert 'other data settings' not in caplog.text
  config.data.seq_len = 32
  config.data.seed = 7
  rundir.check_resumable(config, workdir)
  assert 'data.seq_len: 64 in the checkpointed run, now 32' in caplog.text
  assert 'data.seed: 0 in the checkpointed run, now 7' in caplog.text


def test_resume_with_another_schedule_warns_by_name(uninterrupted, caplog):
  """A longer train.steps (or another peak rate or warmup) changes the learning rate from the
  resumed step on: the resume names the settings and the rate before and after."""
  workdir, _ = uninterrupted
  config = small_config(steps=12)
  config.optim.learning_rate = 1e-3
  rundir.check_resumable(config, workdir)
  assert 'train.steps: 6 in the checkpointed run, now 12' in caplog.text
  assert 'optim.learning_rate: 0.003 in the checkpointed run, now 0.001' in caplog.text
  assert re.search(r'at step 6 with .*rate there moves from 0\.0003 to 0\.00055', caplog.text, re.S)


def test_a_changed_or_empty_tokenizer_stops_a_resume_and_the_tools(uninterrupted, tmp_path):
  """The run directory records its tokenizer's content: another valid tokenizer.model copied
  in stops a resume and the tools naming it, with nothing changed; an empty one is named as
  such, and an export refuses to take it along."""
  from moetrain.data import tokenizer as tokenizer_lib
  from moetrain.tools import export

  workdir = _copy(uninterrupted[0], tmp_path)
  path = workdir / 'tokenizer.model'
  texts = [f'other words {i} here' for i in range(200)]
  tokenizer_lib.train_sentencepiece(texts, 300, tmp_path / 'other.model')
  os.replace(tmp_path / 'other.model', path)
  before = _files(workdir)
  changed = rf'^{re.escape(str(path))}: the tokenizer is not the one the (checkpointed )?run'
  with pytest.raises(ValueError, match=changed):
    train.run(small_config(steps=7), str(workdir))
  assert _files(workdir) == before
  with pytest.raises(ValueError, match=changed):
    export.export(None, str(workdir), str(tmp_path / 'out'))
  path.write_bytes(b'')
  with pytest.raises(ValueError, match=rf'^{re.escape(str(path))} is empty'):
    train.run(small_config(steps=7), str(workdir))
  (workdir / rundir.INPUTS).unlink()  # (a run from before the record: the export's own check)
  with pytest.raises(ValueError, match=rf'^{re.escape(str(path))} is empty'):
    export.export(None, str(workdir), str(tmp_path / 'out'))
  assert not (tmp_path / 'out').exists()


@pytest.mark.slow  # ~30 s: a run to the end of its data
def test_data_running_out_saves_evaluates_and_stops(tmp_path):
  """data.num_epochs = 1 with more train.steps than the epoch holds: the run saves its last
  step, evaluates and returns; a rerun finds the data spent and stops at once, cleanly."""
  # Evaluating every step: the step the data ends at was evaluated already, and only once.
  config = small_config(steps=100_000, log_every=50, checkpoint_every=1000, eval_every=1)
  config.data.num_epochs = 1
  # 200 short examples: a few steps of small_config's shapes (compiled already by other tests).
  write_jsonl(tmp_path / 'train.jsonl', numbered_records(200))
  write_jsonl(tmp_path / 'eval.jsonl', numbered_records(8))
  config.data.source = 'jsonl'
  config.data.path = str(tmp_path / '{split}.jsonl')
  config.data.vocab_size = 300
  workdir = str(tmp_path / 'run')
  out = train.run(config, workdir)
  steps = [int(d) for d in os.listdir(os.path.join(workdir, 'checkpoints')) if d.isdigit()]
  spent = max(steps)
  assert 2 <= spent < 100_000 and sorted(losses(workdir))[-1] == spent
  assert 'eval_loss' in out, out
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    eval_steps = [r['step'] for r in map(json.loads, f) if r['kind'] == 'eval']
  assert eval_steps == list(range(spent + 1)), eval_steps
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    logged = f.read()
  again = train.run(config, workdir)  # nothing to do, and nothing logged twice
  assert again == {'step': spent, 'finished': False, 'data_ended': True}, again
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    assert f.read() == logged
  assert (
    max(int(d) for d in os.listdir(os.path.join(workdir, 'checkpoints')) if d.isdigit()) == spent
  )
  config.data.num_epochs = 2  # more data: the run goes on from where it stopped
  config.train.steps = spent + 2
  more = train.run(config, workdir)
  assert 'eval_loss' in more and 'data_ended' not in more, more
  assert sorted(losses(workdir))[-1] == spent + 2


@pytest.mark.slow  # ~17 s; sibling: test_a_preempted_run_logs_the_steps_it_saved
def test_a_checkpoint_comes_after_its_steps_records(tmp_path, monkeypatch):
  """A run killed while it evaluates a checkpoint step (here: an error at the eval of step 2)
  must not have saved that step yet: a rerun would go on after it, and its train and eval records
  would never be written."""
  config = small_config(steps=3, checkpoint_every=2, eval_every=2, async_checkpoint=False)
  workdir = str(tmp_path)
  run_eval = train.run_eval

  def killed_at_2(step, *args):
    if step == 2:
      raise KeyboardInterrupt
    return run_eval(step, *args)

  monkeypatch.setattr(train, 'run_eval', killed_at_2)
  with pytest.raises(KeyboardInterrupt):
    train.run(config, workdir)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    logged = [(r['kind'], r['step']) for r in map(json.loads, f)]
  assert logged == [('eval', 0), ('train', 1), ('train', 2)]
  assert not os.path.exists(os.path.join(workdir, 'checkpoints', '2'))


@pytest.mark.slow  # ~15 s; the record order is also checked by the resume tests
def test_a_steps_record_comes_before_its_eval(tmp_path):
  """An eval at a step that saves no checkpoint follows that step's train record, as at a save
  step (the record is fetched a step late; the progress lines came out as 'eval step 2', 'step
  2')."""
  train.run(small_config(steps=3, checkpoint_every=3, eval_every=2), str(tmp_path))
  with open(os.path.join(tmp_path, 'metrics.jsonl')) as f:
    logged = [(r['kind'], r['step']) for r in map(json.loads, f)]
  expected = [('eval', 0), ('train', 1), ('train', 2), ('eval', 2), ('train', 3), ('eval', 3)]
  assert logged == expected


def test_a_preempted_run_logs_the_steps_it_saved(tmp_path, monkeypatch):
  """Preempted at step 2 of a run logging every 4: its record sums up steps 1-2, which the
  resumed run (logging from step 3 on) would otherwise leave out."""
  monkeypatch.setattr(train.Checkpointer, 'preempted', lambda self, step: step == 2)
  train.run(small_config(log_every=4, eval_every=0), str(tmp_path))
  assert sorted(losses(str(tmp_path))) == [2]
  assert os.listdir(os.path.join(tmp_path, 'checkpoints')) == ['2']
  # The record says it is a partial window: its means are over 2 steps, not train.log_every.
  with open(os.path.join(tmp_path, 'metrics.jsonl')) as f:
    (record,) = [r for r in map(json.loads, f) if r['kind'] == 'train']
  assert record['window_steps'] == 2


def test_a_fresh_run_that_fails_at_start_up_leaves_no_run_directory(tmp_path, monkeypatch):
  """A run that fails before its first step (after its start wrote config.json, inputs.json
  and its tokenizer) removes the directory it created; one that existed before stays."""
  from moetrain.training import aot

  def fails(*args, **kwargs):
    raise ValueError('a setting refused at start-up')

  monkeypatch.setattr(aot, 'precompile_train_step', fails)
  workdir = tmp_path / 'run'
  with pytest.raises(ValueError, match='refused at start-up'):
    train.run(small_config(), str(workdir))
  assert not workdir.exists()
  workdir.mkdir()
  with pytest.raises(ValueError, match='refused at start-up'):
    train.run(small_config(), str(workdir))
  assert (workdir / 'config.json').exists()


@pytest.mark.slow  # ~3 minutes: the LoRA demo's 200 steps
def test_the_lora_demo_learns_to_reverse(tmp_path):
  """README's claim: `make train` takes eval accuracy from ~0.20 (the base copies) to ~0.83
  (0.1991 -> 0.8391, perplexity 5489.14 -> 1.65, when measured)."""
  from tests.helpers import run_command

  out = run_command('moetrain.main', '--config=configs/longcat_lora.py', f'--workdir={tmp_path}')
  assert out.returncode == 0, out.stderr[-3000:]
  evals = [r for r in map(json.loads, open(tmp_path / 'metrics.jsonl')) if r['kind'] == 'eval']
  assert evals[0]['accuracy'] < 0.25 and evals[-1]['step'] == 200
  assert evals[-1]['accuracy'] >= 0.8 and evals[-1]['perplexity'] < 2.0, evals[-1]

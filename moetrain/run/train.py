"""The training run: `run` holds the run directory, builds what the loop needs (data, the step
compiled before any weight is read, the state) and runs `loop`: step, log, evaluate, save."""

import dataclasses
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import logging

from moetrain.core import multihost, runtime, sharding, storage
from moetrain.data import loader
from moetrain.distill import logits as distill_logits
from moetrain.model import stages
from moetrain.run import lease, rundir, train_log
from moetrain.run import metrics as metrics_lib
from moetrain.run import rollouts as rollouts_lib
from moetrain.run.checkpoint import Checkpointer, process_data_state
from moetrain.run.evaluation import evaluate, to_global
from moetrain.run.startup import (
  Setup,
  build,
  check_tokenizer_fits,
  compilation_cache_dir,
  enable_compilation_cache,
  restore_or_init,
)
from moetrain.training import aot, optim
from moetrain.training.train_state import TrainState


@dataclasses.dataclass(frozen=True)
class Job:
  """What the loop runs with."""

  setup: Setup
  step_fn: Callable  # (state, batch) -> (state, metrics), compiled
  eval_fn: Callable  # (state, batch) -> sums
  train_iter: loader.DataIterator
  eval_batches: list
  ckpt: Checkpointer
  writer: metrics_lib.Writer
  batch_sharding: jax.sharding.NamedSharding  # of the batches' rows over the mesh
  rollouts: rollouts_lib.Rollouts | None = None  # reinforcement learning's batches

  @property
  def evaluates(self) -> bool:
    return bool(self.eval_batches) or (
      self.rollouts is not None and self.rollouts.eval_prompts is not None
    )


@dataclasses.dataclass(frozen=True)
class Stop:
  """Why the loop stopped before train.steps: the note it prints, and whether the data ran out."""

  note: str = ''
  data_ended: bool = False


def run(config, workdir: str) -> dict:
  """Trains (or resumes) the run in `workdir`; returns the last step's metrics."""
  config = rundir.with_absolute_paths(config)  # config.json must not depend on the cwd
  setup = build(config)
  enable_compilation_cache(
    compilation_cache_dir(setup.train.compilation_cache, rundir.run_dir(workdir))
  )
  mesh = setup.make_mesh()
  rundir.check_resumable(config, workdir)
  created = rundir.created_here(workdir) and jax.process_count() == 1
  # One run per directory: nothing below writes into it before the lease is held (by process
  # 0 for the job; the others learn whether it got it and stop with it when it did not).
  held, refused = None, ''
  if runtime.is_primary():
    try:
      held = lease.Lease(rundir.run_dir(workdir)).acquire()
    except lease.LeaseHeld as e:
      refused = str(e)
  refused = multihost.Exchange('run_lease')(refused, 0)[0]
  if refused:
    raise lease.LeaseHeld(refused)
  try:
    try:
      return _run(config, workdir, setup, mesh)
    finally:
      if held is not None:
        held.release()
  except Exception:
    if created:  # a fresh run that failed before writing anything a rerun needs leaves nothing
      rundir.remove_unused(workdir)
    raise


def _run(config, workdir: str, setup: Setup, mesh) -> dict:
  t = setup.train
  ckpt = Checkpointer(
    workdir,
    every=t.checkpoint_every,
    keep=t.keep_checkpoints,
    async_save=t.async_checkpoint,
    verify=t.verify_checkpoints,
    layers=stages.layout(setup.model),
  )
  if t.resume_step:  # back to an earlier checkpoint: the newer ones are set aside
    ckpt.resume_from(t.resume_step)
  ckpt.watch_preemption()  # before the slow start-up (tokenizer, restore, compilation)
  job = None
  try:
    if (done := finished_already(workdir, setup, ckpt)) is not None:
      ckpt.close()
      return done
    with jax.set_mesh(mesh):  # (the eval step is traced at its first call, in the loop)
      job, state = start(config, workdir, setup, mesh, ckpt)
      state, last = loop(job, state)
    ckpt.close()
    job.writer.close()
  except train_log.NonFiniteStreak as e:
    raise stopped(e, ckpt, job.writer) from None
  except Exception:
    ckpt.settle()  # a save in flight ends before the error is reported: a rerun resumes from it
    raise
  if last.get('data_ended') and runtime.is_primary():  # saved and evaluated: a rerun has no work
    rundir.mark_data_ended(workdir, int(state.step), setup.data)
  return last


def finished_already(workdir: str, setup: Setup, ckpt: Checkpointer) -> dict | None:
  """The result of a run that has nothing left to do (its last step, or its data, reached), said
  before its files are touched; None otherwise. A resume onto another host count fails here."""
  if (latest := ckpt.latest_step()) is None:
    return None
  t = setup.train
  process_data_state(ckpt.restore_data(latest), setup.data.reslice_on_resume)
  ended = rundir.data_ended_at(workdir, setup.data) == latest
  if latest < t.last_step and not ended:
    return None
  if runtime.is_primary():
    print(rundir.nothing_to_do(workdir, latest, t, ended and setup.data.num_epochs), flush=True)
  return {'step': latest, 'finished': latest >= t.steps} | ({'data_ended': True} if ended else {})


def start(config, workdir: str, setup: Setup, mesh, ckpt: Checkpointer) -> tuple[Job, TrainState]:
  """The tokenizer and the data first: a run they refuse leaves metrics.jsonl, tb/ and
  config.json as they were (config.json is rewritten only by a run that gets as far as this).
  Then the step, compiled before any weight is read, and the state (restored, or initial)."""
  t = setup.train
  with runtime.phase('Tokenizer') as said:
    tokenizer = loader.make_tokenizer(setup.data, workdir)
    said['note'] = f' (a vocabulary of {tokenizer.vocab_size})'
  check_tokenizer_fits(tokenizer, setup, workdir)
  loader.warn_if_tokenizer_is_foreign(setup.data, tokenizer, setup.hf_checkpoint)
  hosts = {'process_index': jax.process_index(), 'process_count': jax.process_count()}
  if setup.step.rl is None:
    train_iter = loader.make_train_iterator(setup.data, tokenizer, **hosts)
    train_iter = distill_logits.attach(setup, train_iter, *hosts.values())  # (cached logits)
    with runtime.phase('Evaluation data') as said:
      eval_batches = loader.make_eval_batches(
        setup.data, tokenizer, max_batches=t.eval_batches, **hosts
      )
      said['note'] = f' ({len(eval_batches)} batches)'
  else:  # the batches are sampled (the rollouts' prompts, made below)
    train_iter, eval_batches = rollouts_lib.Stream(), []
  inputs = rundir.check_inputs(workdir, setup.data, resuming=ckpt.latest_step() is not None)

  saved_config = rundir.config_json(config, setup)
  wandb = {'project': t.wandb_project, 'entity': t.wandb_entity, 'config': json.loads(saved_config)}
  writer = metrics_lib.Writer(
    workdir, resume_step=ckpt.latest_step(), moe_layers=setup.model.moe_layer_indices, wandb=wandb
  )
  writer.save_config(saved_config)
  rundir.record_inputs(workdir, inputs)
  batch_sharding = sharding.batch_sharding(mesh)
  sharding.check_hosts_own_rows(batch_sharding, setup.data.global_batch_size)
  abstract, shardings = aot.abstract_state(setup, mesh)
  jitted = aot.train_step_fn(setup, mesh, shardings)
  # The loop runs this executable (no second compile).
  compiled = aot.precompile_train_step(setup, mesh, jitted, abstract, writer.progress)
  optimizer = optim.make_optimizer(setup.optim, t.steps)
  state = restore_or_init(setup, ckpt, optimizer, mesh, train_iter)
  # The frozen base into the layouts the step takes (engine.frozen_layout), once.
  state = aot.place_frozen(state, compiled.formats)
  eval_fn = aot.eval_step_fn(setup, mesh, compiled.formats)
  step_fn = compiled.executable
  rollouts = None
  if setup.step.rl is not None:
    fmt = loader.chat_format(setup.data, tokenizer)
    rollouts = rollouts_lib.Rollouts(setup, tokenizer, fmt, batch_sharding, writer)
  job = Job(setup, step_fn, eval_fn, train_iter, eval_batches, ckpt, writer, batch_sharding)
  return dataclasses.replace(job, rollouts=rollouts), state


def stopped(e: Exception, ckpt: Checkpointer, writer) -> Exception:
  """The run stopped on a non-finite streak: the save in flight (of a step before the streak)
  completes, and the error names the newest checkpoint."""
  ckpt.close()
  writer.close()
  newest = ckpt.latest_step()
  newest = 'none (a rerun starts over)' if newest is None else f'step {newest}'
  return type(e)(f'{e} Newest checkpoint: {newest}.')


class Evals:
  """The evaluations of a run, their time kept out of tokens/s; the latest is kept (the end of
  the run reuses an evaluation of its last step)."""

  def __init__(self, job: Job, meter: metrics_lib.Throughput):
    self.job, self.meter = job, meter
    self.latest = (None, {})  # (step, results)

  def __call__(self, state, step: int, recurring: bool = True) -> dict:
    with self.meter.excluded(recurring=recurring):
      self.latest = (step, run_eval(step, state, self.job))
    return self.latest[1]

  def at(self, state, step: int) -> dict:
    return self.latest[1] if self.latest[0] == step else self(state, step)


def run_eval(step: int, state, job: Job) -> dict:
  if job.rollouts is not None:  # the rewards of greedy completions of the eval prompts
    ev = job.rollouts.evaluate(state, step)
    job.writer.write(step, ev, kind='eval')
    job.writer.progress(
      f'eval  step {step}: rl/reward_mean {ev["rl/reward_mean"]:.4f}  '
      + '  '.join(f'{k} {v:.4f}' for k, v in ev.items() if k.startswith('rl/reward/'))
      + f'  response_length {ev["rl/response_length"]:.1f}  ({ev["rl/prompts"]} prompts)'
    )
    return ev
  ev = evaluate(state, job.eval_batches, job.eval_fn, job.batch_sharding)
  job.writer.write(step, ev, kind='eval')
  job.writer.progress(
    f'eval  step {step}: loss {ev["loss"]:.4f}  ppl {ev["perplexity"]:.2f}  '
    f'accuracy {ev["accuracy"]:.4f}  ({int(ev["tokens"])} tokens)'
    + (
      f'  pref: accuracy {ev["pref/accuracy"]:.4f}  margin {ev["pref/margin"]:.3f}  '
      f'loss {ev["pref/loss"]:.4f}'
      if 'pref/accuracy' in ev
      else ''
    )
  )
  return ev


def loop(job: Job, state: TrainState) -> tuple[TrainState, dict]:
  """Steps from the state's step to train.last_step (or until preempted, or the data ends):
  returns the state and the last metrics (with the final evaluation's at train.steps)."""
  t = job.setup.train
  start_step = int(state.step)
  meter = metrics_lib.Throughput(start_step, t.steps)
  log = train_log.TrainLog.create(job.setup, meter, job.writer)
  evals = Evals(job, meter)
  baseline = None
  if start_step == 0 and job.evaluates:  # the baseline that fine-tuning is measured against
    baseline = evals(state, 0, recurring=False)
  elif job.evaluates:  # a resumed run: the baseline its first start logged
    baseline = logged_baseline(job.writer)
  finite = jax.process_count() > 1 and job.setup.data.num_epochs is not None
  data_ended = multihost.Exchange('data_ended') if finite else None
  stop, saved = Stop(), False
  for step in range(start_step + 1, t.last_step + 1):
    if job.rollouts is not None:  # sampled with the state's weights
      batch, position = job.rollouts.batch_for(state, step), None
    else:
      batch, position = next_batch(job.train_iter, data_ended, step)
    if batch is None:  # a finite data.num_epochs ran out before train.steps
      stop = save_at_data_end(job, step - 1, start_step, saved, state, position, log)
      break
    state = train_one(job, state, batch, step == start_step + 1, meter, log)
    saved, stop = log_eval_save(job, state, step, log, evals, meter)
    if stop.note:
      break
  log.flush()
  if stop.note:  # the run stops early: its last checkpoint must be complete; said after the log
    job.ckpt.wait()
    job.writer.progress(stop.note)
  last = log.last
  if (int(state.step) == t.steps or stop.data_ended) and job.evaluates:
    ev = evals.at(state, int(state.step))  # (this step's already, when it was an eval step)
    last = {**last, **{f'eval_{k}': v for k, v in ev.items()}}
    if baseline is not None and 'rl/reward_mean' in ev:
      job.writer.progress(
        f'eval rl/reward_mean {baseline["rl/reward_mean"]:.4f} before training -> '
        f'{ev["rl/reward_mean"]:.4f} at step {int(state.step)}'
      )
    elif baseline is not None:
      job.writer.progress(
        f'eval accuracy {baseline["accuracy"]:.4f} before training -> {ev["accuracy"]:.4f} at '
        f'step {int(state.step)} (perplexity {baseline["perplexity"]:.2f} -> '
        f'{ev["perplexity"]:.2f})'
      )
    if baseline is not None and 'pref/accuracy' in ev:
      job.writer.progress(
        f'eval pref/accuracy {baseline["pref/accuracy"]:.4f} before training -> '
        f'{ev["pref/accuracy"]:.4f} at step {int(state.step)} (margin '
        f'{baseline["pref/margin"]:.3f} -> {ev["pref/margin"]:.3f})'
      )
  return state, {**last, 'data_ended': True} if stop.data_ended else last


def logged_baseline(writer: metrics_lib.Writer) -> dict | None:
  """The step-0 evaluation in <workdir>/metrics.jsonl (None where there is none, or on the
  processes that print nothing)."""
  path = storage.join(writer.workdir, 'metrics.jsonl')
  if not writer.enabled or not storage.isfile(path):
    return None
  with storage.open(path) as f:
    for line in f:
      try:
        r = json.loads(line)
      except ValueError:
        continue
      baseline = r.get('perplexity', r.get('rl/reward_mean'))
      if r.get('kind') == 'eval' and r.get('step') == 0 and baseline is not None:
        return r
  return None


def train_one(job: Job, state, batch: dict, first: bool, meter, log) -> TrainState:
  """One step. The step itself must not move data implicitly. The first call's time (and its
  compute, which overlaps loading the executable) stays out of tokens/s and the ETA."""
  inputs = to_global(batch, job.batch_sharding)  # explicit host-to-device, outside the guard
  with jax.transfer_guard('disallow'), meter.excluded(when=first):
    state, m = job.step_fn(state, inputs)
    log.add(m)  # (the first compiles the log window's sums)
    if first:
      jax.block_until_ready(m)
      meter.skip_step()
  # Throughput (and MFU) count every token the model reads, not only the scored ones.
  if not first:
    read = batch['segment_ids'] > 0  # (a rollout batch's is global already)
    hosts = 1 if isinstance(batch['segment_ids'], jax.Array) else jax.process_count()
    meter.add_tokens(float(read.sum()) * hosts)
  log.flush()  # the previous log step's metrics, fetched after this step's dispatch
  return state


def log_eval_save(job: Job, state, step: int, log, evals: Evals, meter) -> tuple[bool, Stop]:
  """After a step: its record, evaluation and checkpoint when due. Returns (saved, Stop with a
  note when preempted)."""
  t, ckpt = job.setup.train, job.ckpt
  ckpt.check_saves(step)  # a save that failed in the background stops the run now
  preempted = ckpt.preempted(step) and step != t.last_step  # every host, every step
  if step % t.log_every == 0 or step == t.last_step or preempted:  # (the resumed run logs after)
    log.mark(step, job.train_iter.num_truncated)
  due = step == t.last_step or preempted or ckpt.due(step)
  eval_due = job.evaluates and (step == t.steps or bool(t.eval_every) and step % t.eval_every == 0)
  if due or eval_due:
    # The step's own time stays in tokens/s, the save's and the eval's do not; its record is
    # written first, so that a kill during either loses nothing.
    jax.block_until_ready(state)
    log.flush()
  # A step's eval comes before its checkpoint, so that a kill during the eval leaves the
  # checkpoint before, which redoes it; a preemption saves first (its grace period is short).
  if eval_due and not preempted:
    evals(state, step)
  with meter.excluded(when=due, recurring=True):
    if due:  # the records up to the step, persisted with its checkpoint (a bucket's at least)
      job.writer.flush()
    saved = due and save_if_finite(ckpt, log, step, state, job.train_iter.get_state())
  if not preempted:
    return saved, Stop()
  if eval_due:
    evals(state, step)
  done = f'saved step {step}' if saved else f'step {step} not saved (non-finite)'
  return saved, Stop(f'Preempted: {done}; rerun the same command to resume.')


def save_at_data_end(job: Job, done: int, start_step: int, saved: bool, state, position, log):
  """A finite data.num_epochs ran out after step `done`: its record is written and it is saved,
  as at the last step (unless it was saved already, or no step ran), before the position
  `position` the hosts agreed on."""
  setup = job.setup
  if done > start_step:
    if done % setup.train.log_every:
      log.mark(done, job.train_iter.num_truncated)
    if not saved:
      log.flush()  # (as at a save step)
      job.writer.flush()
      save_if_finite(job.ckpt, log, done, state, position or job.train_iter.get_state())
  what = 'saved, evaluating' if done > start_step else 'no step to save; evaluating'
  note = (
    f'The training data ended after step {done} (data.num_epochs={setup.data.num_epochs}) '
    f'before train.steps={setup.train.steps}: {what} and stopping.'
  )
  return Stop(note, data_ended=True)


@jax.jit
def is_finite(tree) -> jax.Array:
  """Whether every floating-point number in `tree` is finite (one device scalar)."""
  floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in floats]))


def save_if_finite(ckpt, log, step: int, state, position: dict) -> bool:
  """Saves `step` unless the update of that step (and of those just before it) was skipped for
  a non-finite loss or gradient: checkpoints of a diverged run would rotate the newest one before
  it out (train.keep_checkpoints). What is saved is checked too (one pass over it per save): an
  update computed from finite gradients that still left a weight or an optimizer moment
  non-finite (an overflow) stops the run unsaved, as a non-finite streak does."""
  if streak := log.nonfinite_streak(step):
    newest = ckpt.latest_step()
    logging.warning(
      'Step %d not saved: it ends %d skipped steps in a row (non-finite loss or gradients); the '
      'newest checkpoint stays %s.',
      step,
      streak,
      'none' if newest is None else f'step {newest}',
    )
    return False
  if not is_finite(state.saved()):
    raise train_log.NonFiniteStreak(
      f'Step {step} not saved: its update left weights or optimizer state non-finite (an '
      'overflow; lower optim.learning_rate, or resume from the checkpoint before it with '
      'train.resume_step).'
    )
  return ckpt.save(step, state, position, {'step': step})


def next_batch(train_iter, data_ended, step: int) -> tuple[dict | None, dict | None]:
  """(the next host-local batch, or None once the data has ended; the data position before it).

  With `data_ended` (a multihost.Exchange; None when the data cannot end, or with one process):
  None on every host as soon as one host's data ends. With a finite data.num_epochs hosts can run
  out a batch apart, and a host stepping alone would wait forever in the step's collectives. The
  hosts that still had a batch drop it; the position returned is from before it, to save."""
  position = train_iter.get_state() if data_ended else None
  try:
    batch = next(train_iter)
  except StopIteration:
    batch = None
  if data_ended and data_ended.any(batch is None, step):
    return None, position
  return batch, position

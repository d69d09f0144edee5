"""run(): validate config -> mesh -> data -> state (or restore) -> jitted step -> loop."""

import dataclasses
import functools
import json
import os
import re

import jax
import numpy as np
from absl import logging
from flax import nnx

from moetrain import aot, lease, multihost, optim, run_config, runtime, sharding, train_log
from moetrain import metrics as metrics_lib
from moetrain.checkpoint import Checkpointer, data_positions, process_data_state
from moetrain.data import pipeline
from moetrain.model.config import LoraConfig, ModelConfig
from moetrain.model.transformer import Transformer
from moetrain.train_state import (
  TrainState,
  create_sharded,
  graphdef_of,
  initial_loss_scale,
  merge_model,
  split_model,
  state_from_weights,
  trainable_filter,
)
from moetrain.train_step import StepConfig


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """The `config.train` section."""

  steps: int = 200
  stop_at_step: int = 0
  log_every: int = 10
  eval_every: int = 100
  eval_batches: int = 8
  checkpoint_every: int = 50
  keep_checkpoints: int = 3
  async_checkpoint: bool = True
  verify_checkpoints: bool = True
  resume_step: int = 0
  max_nonfinite_steps: int = 20
  compilation_cache: str = ''

  @property
  def last_step(self) -> int:
    """Where this invocation stops: stop_at_step (a time-boxed session) or steps."""
    return min(self.stop_at_step or self.steps, self.steps)

  def validate(self) -> None:
    for key in ('steps', 'log_every', 'checkpoint_every', 'keep_checkpoints'):
      if getattr(self, key) <= 0:
        raise ValueError(f'train.{key}={getattr(self, key)} must be positive')
    if self.eval_batches <= 0:
      raise ValueError(
        f'train.eval_batches={self.eval_batches} must be positive; to train without evaluations '
        "set data.eval_split=''"
      )
    for key in ('eval_every', 'stop_at_step', 'resume_step', 'max_nonfinite_steps'):
      if getattr(self, key) < 0:
        raise ValueError(f'train.{key}={getattr(self, key)} must be >= 0')


@dataclasses.dataclass(frozen=True)
class Setup:
  """The ConfigDict turned into the frozen dataclasses the library takes."""

  model: ModelConfig
  data: pipeline.DataConfig
  optim: optim.OptimConfig
  step: StepConfig
  mesh_shape: tuple[int, ...]
  seed: int
  train: LoopConfig
  hf_checkpoint: str = ''
  peft_adapter: str = ''


# loss.bias_update_decay_steps = -1: decay over train.steps (the value, not a reference to the
# field: a shared reference would make setting either one set both).
FOLLOW_STEPS = -1


def model_config(config) -> ModelConfig:
  rules = sharding.Rules.preset(config.mesh.rules)
  lora = LoraConfig(**config.lora.to_dict())
  path = config.init.hf_checkpoint
  if not path:
    return ModelConfig(**config.model.to_dict(), lora=lora, rules=rules)
  from moetrain.convert import hf_longcat

  engine = {k: config.model[k] for k in run_config.ENGINE_FIELDS}
  return hf_longcat.config_from_hf(hf_longcat.read_config(path), **engine, lora=lora, rules=rules)


def build(
  config,
  num_devices: int | None = None,
  process_count: int | None = None,
  training: bool = True,
  platform: str | None = None,
) -> Setup:
  """Converts and validates everything before any compilation; errors name the field. A tool
  (training=False) reading an older run's settings skips the checks only training needs.
  platform: what the step is compiled for (default: this process's backend); it picks the MoE
  engine, so that a plan compiled on a CPU host for a TPU measures the TPU engine."""
  num_devices = num_devices or jax.device_count()
  process_count = process_count or jax.process_count()
  mesh_shape = sharding.resolve_mesh_shape(config.mesh.shape, num_devices)
  model = model_config(config)  # (checks mesh.rules)
  model = dataclasses.replace(model, platform=platform or jax.default_backend())
  sharding.check_axes_used(mesh_shape, config.mesh.rules)
  model.validate()
  data = pipeline.DataConfig(**config.data.to_dict())
  if config.init.hf_checkpoint and not data.tokenizer:  # the checkpoint's own tokenizer
    data = dataclasses.replace(data, tokenizer=config.init.hf_checkpoint)
  pipeline.validate(data, process_count)
  if training:
    pipeline.check_training_data(data)
  opt = optim.OptimConfig(**config.optim.to_dict())
  train = LoopConfig(**config.train.to_dict())
  train.validate()
  opt.validate(train.steps)
  sizes = dict(zip(sharding.MESH_AXES, mesh_shape))
  if model.n_routed_experts % sizes['expert']:
    raise ValueError(
      f"model.n_routed_experts={model.n_routed_experts} is not divisible by the 'expert' mesh axis "
      f'({sizes["expert"]}); change mesh.shape or the expert count'
    )
  per_host = num_devices // process_count
  if per_host % sizes['tensor']:
    raise ValueError(
      f"mesh.shape={mesh_shape}: the 'tensor' axis ({sizes['tensor']}) must divide the "
      f'{per_host} devices of each process: across hosts it would replicate the batch, which '
      'each host loads its own slice of'
    )
  batch_shards = sizes['data'] * sizes['fsdp'] * sizes['expert']
  per_micro = data.global_batch_size // opt.grad_accum_steps
  if data.global_batch_size % opt.grad_accum_steps or per_micro % batch_shards:
    raise ValueError(
      f'data.global_batch_size={data.global_batch_size} must split into optim.grad_accum_steps='
      f'{opt.grad_accum_steps} micro-batches each divisible by the {batch_shards} batch shards '
      f'(data*fsdp*expert of mesh.shape={mesh_shape})'
    )
  if data.eval_split and data.eval_batch_size % batch_shards:
    raise ValueError(
      f'data.eval_batch_size={data.eval_batch_size} must be divisible by the '
      f'{batch_shards} batch shards of mesh.shape={mesh_shape}'
    )
  loss = config.loss.to_dict()
  if loss.get('bias_update_decay_steps') == FOLLOW_STEPS:  # over the whole run
    loss['bias_update_decay_steps'] = config.train.steps
  step = StepConfig(model=model, grad_accum_steps=opt.grad_accum_steps, **loss)
  step.validate()
  check_regexes(model, opt)
  if config.init.peft_adapter and not model.lora.enabled:
    raise ValueError('init.peft_adapter needs lora.rank > 0 (the rank of the adapter)')
  return Setup(
    model,
    data,
    opt,
    step,
    mesh_shape,
    config.seed,
    train,
    config.init.hf_checkpoint,
    config.init.peft_adapter,
  )


HOST_CACHE = '~/.cache/moetrain/jax'


def compilation_cache_dir(setting: str, workdir: str) -> str:
  """train.compilation_cache: a directory, '' for none, or 'auto': HOST_CACHE on one process; on
  several, <workdir>/jax_cache. JAX writes cache entries from process 0 only, so the other hosts
  find them only in a directory they all share, and the run directory is one."""
  if setting != 'auto':
    return setting
  return HOST_CACHE if jax.process_count() == 1 else os.path.join(workdir, 'jax_cache')


def check_regexes(model: ModelConfig, opt: optim.OptimConfig) -> None:
  """lora.targets must adapt at least one module (unless only the router trains), and a set
  optim.weight_decay_exclude must spare at least one trainable parameter: a regex that matches
  none would change nothing, silently."""
  abstract = functools.cache(  # shapes only (no memory), built only if a check needs them
    lambda: nnx.eval_shape(lambda: Transformer(model, nnx.Rngs(0)))
  )
  if model.lora.enabled and not model.lora.train_router:
    if not jax.tree.leaves(nnx.state(abstract(), nnx.LoRAParam)):
      raise ValueError(
        f'lora.targets={model.lora.targets!r} matches no module, so nothing would train; module '
        "paths look like 'layers.attn_0.q_a', 'layers.mlp_1.down', 'layers.moe.experts.up', "
        "'lm_head'"
      )
  if opt.weight_decay and opt.weight_decay_exclude:
    trainable = nnx.state(abstract(), trainable_filter(model))
    paths = ['.'.join(map(str, p)) for p, _ in nnx.to_flat_state(trainable)]
    if not any(re.search(opt.weight_decay_exclude, p) for p in paths):
      raise ValueError(
        f'optim.weight_decay_exclude={opt.weight_decay_exclude!r} matches no trainable '
        f'parameter; their paths look like {paths[:3]}'
      )


def enable_compilation_cache(path: str) -> None:
  if path:
    jax.config.update('jax_compilation_cache_dir', os.path.expanduser(path))
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


def to_global(batch: dict, sharding_) -> dict:
  return {k: jax.make_array_from_process_local_data(sharding_, v) for k, v in batch.items()}


def evaluate(state, batches, eval_fn, batch_sharding) -> dict:
  totals = {'nll_sum': 0.0, 'correct': 0.0, 'tokens': 0.0}
  outs = [eval_fn(state, to_global(b, batch_sharding)) for b in batches]
  for out in jax.device_get(outs):
    for k in totals:
      totals[k] += float(out[k])
  if totals['tokens'] == 0:
    raise ValueError(
      'the eval batches hold no scored tokens: every example was cut before its completion '
      '(raise data.seq_len) or the eval split is empty'
    )
  n = totals['tokens']
  loss = totals['nll_sum'] / n
  return {
    'loss': loss,
    'perplexity': float(np.exp(min(loss, 50.0))),
    'accuracy': totals['correct'] / n,
    'tokens': totals['tokens'],
  }


def initial_state(setup: Setup, optimizer, mesh) -> TrainState:
  """The state a fresh run starts from: the Hugging Face checkpoint in init.hf_checkpoint
  (streamed into its shardings), else random init from the seed. A LoRA run's frozen base is
  rebuilt this way on every start; checkpoints hold only what trains."""
  rules = setup.model.rules
  if not setup.hf_checkpoint and not setup.peft_adapter:
    return create_sharded(setup.model, optimizer, setup.seed, mesh, rules)
  from moetrain.convert import hf_longcat, peft_adapter

  if setup.hf_checkpoint:
    w = hf_longcat.load_params(
      setup.hf_checkpoint, setup.model, mesh=mesh, rules=rules, seed=setup.seed
    )
    params, moe_bias, frozen = w.params, w.moe_bias, w.frozen
  else:
    state = create_sharded(setup.model, optimizer, setup.seed, mesh, rules)
    params, moe_bias, frozen = state.params, state.moe_bias, state.frozen
  if setup.peft_adapter:  # continue from (or evaluate) an exported adapter
    model = merge_model(graphdef_of(setup.model), params, moe_bias, frozen)
    peft_adapter.load(model, setup.model, setup.peft_adapter)
    _, params, moe_bias, frozen = split_model(model, setup.model)  # adapters and routers
  return state_from_weights(
    params, moe_bias, frozen, optimizer, setup.seed, mesh, rules, initial_loss_scale(setup.model)
  )


def restore_or_init(setup: Setup, ckpt: Checkpointer, optimizer, mesh, train_iter):
  state = initial_state(setup, optimizer, mesh)
  step = ckpt.latest_step()
  if step is None:
    return state
  saved, data_states, _ = ckpt.restore(step, state)
  position = process_data_state(data_states, setup.data.reslice_on_resume)
  if position is not None:
    train_iter.set_state(position)
  else:  # another number of hosts, and data.reslice_on_resume: the data starts over
    positions = data_positions(data_states)
    logging.warning(
      'Step %d was saved by %d processes, this run has %d (data.reslice_on_resume): the training '
      'data restarts from its first example, re-sliced over %d processes (data.num_epochs counts '
      'again).',
      step,
      len(positions),
      jax.process_count(),
      jax.process_count(),
    )
    if jax.process_index() == 0:  # the run's count of truncated examples goes on
      train_iter.num_truncated = sum(p['num_truncated'] for p in positions)
  logging.info('Resumed from step %d', step)
  return dataclasses.replace(state, **saved)


def check_tokenizer_fits(tokenizer, setup: Setup, cached_in: str | None = None) -> None:
  """Every id of the tokenizer needs a row of the embedding and the lm head: past them, training
  and evaluation read NaN losses and generation garbage, silently. cached_in: the run directory
  a trained tokenizer is cached in (training; a tool must not advise deleting a run's)."""
  if tokenizer.vocab_size <= setup.model.vocab_size:
    return
  if setup.data.tokenizer:
    hint = f' to a tokenizer of that size instead of data.tokenizer={setup.data.tokenizer!r}'
  elif cached_in:  # a trained tokenizer is cached in the run directory and reused
    hint = f' and delete {os.path.join(cached_in, "tokenizer.model")}'
  else:
    hint = ''
  raise ValueError(
    f'model.vocab_size={setup.model.vocab_size} is smaller than the tokenizer '
    f'vocabulary ({tokenizer.vocab_size}); raise it, or set data.vocab_size{hint}'
  )


def tool_setup(config, workdir: str | None) -> Setup:
  """The Setup a tool (evaluate, export, generate) reads --workdir's run with: from its own
  <workdir>/config.json when `config` (--config) is None, else from `config`, which must match
  the run's model, LoRA and frozen base as a resume must (check_resumable)."""
  return build(run_config.tool_config(config, workdir), training=False)


def load_latest(setup: Setup, workdir: str | None, mesh) -> TrainState:
  """The run's latest checkpoint (its initial state without a workdir), for tools; check the
  config with tool_setup first."""
  optimizer = optim.make_optimizer(setup.optim, setup.train.steps)
  state = initial_state(setup, optimizer, mesh)
  if workdir:
    t = setup.train
    ckpt = Checkpointer(
      workdir, every=1, keep=t.keep_checkpoints, async_save=False, verify=t.verify_checkpoints
    )
    saved, _, _ = ckpt.restore(ckpt.latest_step(), state)
    state = dataclasses.replace(state, **saved)
    ckpt.close()
  return state


def run(config, workdir: str) -> dict:
  config = run_config.with_absolute_paths(config)  # config.json must not depend on the cwd
  setup = build(config)
  t = setup.train
  enable_compilation_cache(compilation_cache_dir(t.compilation_cache, runtime.run_dir(workdir)))
  mesh = sharding.make_mesh(setup.mesh_shape)
  run_config.check_resumable(config, workdir)
  # One run per directory: nothing below writes into it before the lease is held (by process
  # 0 for the job; the others learn whether it got it and stop with it when it did not).
  held, refused = None, ''
  if runtime.is_primary():
    try:
      held = lease.Lease(runtime.run_dir(workdir)).acquire()
    except lease.LeaseHeld as e:
      refused = str(e)
  refused = multihost.Exchange('run_lease')(refused, 0)[0]
  if refused:
    raise lease.LeaseHeld(refused)
  try:
    return _run(config, workdir, setup, mesh)
  finally:
    if held is not None:
      held.release()


def _run(config, workdir: str, setup: Setup, mesh) -> dict:
  t = setup.train
  ckpt = Checkpointer(
    workdir,
    every=t.checkpoint_every,
    keep=t.keep_checkpoints,
    async_save=t.async_checkpoint,
    verify=t.verify_checkpoints,
  )
  if t.resume_step:  # back to an earlier checkpoint: the newer ones are set aside
    ckpt.resume_from(t.resume_step)
  ckpt.watch_preemption()  # before the slow start-up (tokenizer, restore, compilation)
  try:
    if (latest := ckpt.latest_step()) is not None:  # a resume on another host count: fail now
      process_data_state(ckpt.restore_data(latest), setup.data.reslice_on_resume)
      ended = data_ended_at(workdir, setup.data) == latest
      if latest >= t.last_step or ended:  # before the run's files are touched: nothing to log
        if runtime.is_primary():
          print(nothing_to_do(workdir, latest, t, ended and setup.data.num_epochs), flush=True)
        ckpt.close()
        return {'step': latest, 'finished': latest >= t.steps} | (
          {'data_ended': True} if ended else {}
        )
    # The tokenizer and data first: a run they refuse leaves metrics.jsonl, tb/ and config.json
    # as they were (config.json is rewritten only by a run that gets as far as training).
    tokenizer = pipeline.make_tokenizer(setup.data, workdir)
    check_tokenizer_fits(tokenizer, setup, workdir)
    pi, pc = jax.process_index(), jax.process_count()
    train_iter = pipeline.make_train_iterator(
      setup.data, tokenizer, process_index=pi, process_count=pc
    )
    eval_batches = pipeline.make_eval_batches(
      setup.data, tokenizer, max_batches=t.eval_batches, process_index=pi, process_count=pc
    )
    writer = metrics_lib.Writer(workdir, resume_step=latest)
    writer.save_config(config_json(config, setup))
    optimizer = optim.make_optimizer(setup.optim, t.steps)
    batch_sharding = sharding.batch_sharding(mesh)
    sharding.check_hosts_own_rows(batch_sharding, setup.data.global_batch_size)
    with jax.set_mesh(mesh):
      abstract, shardings = aot.abstract_state(setup, mesh)
      jitted = aot.train_step_fn(setup, mesh, shardings)
      # Compiled before any weight is read; the loop runs this executable (no second compile).
      step_fn = aot.precompile_train_step(setup, mesh, jitted, abstract, writer.progress).executable
      state = restore_or_init(setup, ckpt, optimizer, mesh, train_iter)
      eval_fn = aot.eval_step_fn(setup)
      state, last = loop(
        setup, state, step_fn, eval_fn, train_iter, eval_batches, ckpt, writer, batch_sharding, mesh
      )
    ckpt.close()
    writer.close()
  except train_log.NonFiniteStreak as e:
    raise stopped(e, ckpt, writer) from None
  finally:  # an error on the way must not leave the caller's process deaf to SIGTERM
    ckpt.release_signal()
  if last.get('data_ended') and runtime.is_primary():  # saved and evaluated: a rerun has no work
    mark_data_ended(workdir, int(state.step), setup.data)
  return last


def stopped(e: Exception, ckpt: Checkpointer, writer) -> Exception:
  """The run stopped on a non-finite streak: the save in flight (of a step before the streak)
  completes, and the error names the newest checkpoint."""
  ckpt.close()
  writer.close()
  newest = ckpt.latest_step()
  newest = 'none (a rerun starts over)' if newest is None else f'step {newest}'
  return type(e)(f'{e} Newest checkpoint: {newest}.')


def config_json(config, setup: Setup) -> str:
  """The run's config.json: its settings, and with init.hf_checkpoint the model the checkpoint
  gave (`model_from_checkpoint`: its shapes replace those of the `model` section, which a resume
  is still checked against)."""
  saved = json.loads(config.to_json_best_effort())
  if setup.hf_checkpoint:
    model = dataclasses.asdict(setup.model)
    skip = ('lora', 'rules', 'platform')
    saved['model_from_checkpoint'] = {k: v for k, v in model.items() if k not in skip}
  return json.dumps(saved, indent=1)


DATA_ENDED = 'data_ended.json'


def _data_stream(data) -> dict:
  return {k: getattr(data, k) for k in run_config.DATA_STREAM_FIELDS}


def mark_data_ended(workdir: str, step: int, data) -> None:
  """Records in the run directory that the training data ran out at `step` (saved and evaluated
  by then), with the data settings it ran out under."""
  path = os.path.join(runtime.run_dir(workdir), DATA_ENDED)
  with open(path + '.tmp', 'w') as f:
    json.dump({'step': step, 'data': _data_stream(data)}, f, indent=1)
  os.replace(path + '.tmp', path)


def data_ended_at(workdir: str, data) -> int | None:
  """The step at which this run's training data ran out, when the data settings are still the
  ones it ran out under (a resume with more data.num_epochs, say, goes on)."""
  path = os.path.join(runtime.run_dir(workdir), DATA_ENDED)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    marked = json.load(f)
  return marked['step'] if marked['data'] == _data_stream(data) else None


def nothing_to_do(workdir: str, step: int, t, data_ended_epochs=None) -> str:
  if data_ended_epochs:
    return (
      f'Run in {workdir} stopped at step {step} when its training data ran out '
      f'(data.num_epochs={data_ended_epochs}, train.steps={t.steps}); nothing to do. Raise '
      'data.num_epochs to go on, or use a new --workdir to train again.'
    )
  if step >= t.steps:
    return (
      f'Run in {workdir} already finished at step {step} (train.steps={t.steps}); nothing to '
      'do. Use a new --workdir to train again.'
    )
  return (
    f'Run in {workdir} is at step {step}, already past train.stop_at_step={t.stop_at_step}; '
    f'nothing to do. Raise it (or set 0 to run to train.steps={t.steps}).'
  )


def loop(
  setup,
  state: TrainState,
  step_fn,
  eval_fn,
  train_iter,
  eval_batches,
  ckpt,
  writer,
  batch_sharding,
  mesh,
):
  t = setup.train
  total, start = t.steps, int(state.step)
  stop = t.last_step
  meter = metrics_lib.Throughput(start, total)
  log = train_log.TrainLog.create(setup, meter, writer, mesh)
  exhausted, saved, why = False, False, ''

  def evaluate(step, recurring=True):  # (step, results), its time out of tokens/s
    with meter.excluded(recurring=recurring):
      return step, run_eval(step, state, eval_batches, eval_fn, batch_sharding, writer)

  evaluated = (None, {})  # the latest eval: (step, results)
  if start == 0 and eval_batches:  # the baseline that fine-tuning is measured against
    evaluated = evaluate(0, recurring=False)
  finite = jax.process_count() > 1 and setup.data.num_epochs is not None
  data_ended = multihost.Exchange('data_ended') if finite else None
  for step in range(start + 1, stop + 1):
    batch, position = next_batch(train_iter, data_ended, step)
    if batch is None:  # a finite data.num_epochs ran out before train.steps
      exhausted = True
      why = save_at_data_end(setup, step - 1, start, saved, state, position, train_iter, log, ckpt)
      break
    inputs = to_global(batch, batch_sharding)  # explicit host-to-device, outside the guard
    # The step itself must not move data implicitly. The first call compiles, and its compute
    # overlaps that: the whole step, its time and its tokens, stays out of tokens/s and the ETA.
    first = step == start + 1
    with jax.transfer_guard('disallow'), meter.excluded(when=first):
      state, m = step_fn(state, inputs)
      log.add(m)  # (the first compiles the log window's sums)
      if first:
        jax.block_until_ready(m)
        meter.skip_step()
    # Throughput (and MFU) count every token the model reads, not only the scored ones.
    if not first:
      meter.add_tokens(float((batch['segment_ids'] > 0).sum()) * jax.process_count())
    log.flush()  # the previous log step's metrics, fetched after this step's dispatch
    preempted = ckpt.preempted(step) and step != stop  # every host, every step
    if step % t.log_every == 0 or step == stop or preempted:  # (the resumed run logs after it)
      log.mark(step, train_iter.num_truncated)
    due = step == stop or preempted or ckpt.due(step)
    eval_due = eval_batches and (step == total or t.eval_every and step % t.eval_every == 0)
    if due or eval_due:
      # The step's own time stays in tokens/s, the save's and the eval's do not; its record is
      # written first, so that a kill during either loses nothing.
      jax.block_until_ready(state)
      log.flush()
    # A step's eval comes before its checkpoint, so that a kill during the eval leaves the
    # checkpoint before, which redoes it; a preemption saves first (its grace period is short).
    if eval_due and not preempted:
      evaluated = evaluate(step)
    with meter.excluded(when=due, recurring=True):
      saved = due and save_if_finite(ckpt, log, step, state, train_iter.get_state())
    if eval_due and preempted:
      evaluated = evaluate(step)
    if preempted:
      done = f'saved step {step}' if saved else f'step {step} not saved (non-finite)'
      why = f'Preempted: {done}; rerun the same command to resume.'
      break
  log.flush()
  if why:  # the run stops early: its last checkpoint must be complete; said after the last log
    ckpt.wait()
    writer.progress(why)
  last = log.last
  if (int(state.step) == total or exhausted) and eval_batches:
    # (this step's already, when the data ended on an eval step)
    _, ev = evaluated if evaluated[0] == int(state.step) else evaluate(int(state.step))
    last = {**last, **{f'eval_{k}': v for k, v in ev.items()}}
  return state, {**last, 'data_ended': True} if exhausted else last


def save_at_data_end(setup, done, start, saved, state, position, train_iter, log, ckpt) -> str:
  """A finite data.num_epochs ran out after step `done`: its record is written and it is saved,
  as at the last step (unless it was saved already, or no step ran), before the position
  `position` the hosts agreed on. Returns the note that says so."""
  if done > start:
    if done % setup.train.log_every:
      log.mark(done, train_iter.num_truncated)
    if not saved:
      log.flush()  # (as at a save step)
      save_if_finite(ckpt, log, done, state, position or train_iter.get_state())
  return data_ended_note(done, done > start, setup.data.num_epochs, setup.train.steps)


def save_if_finite(ckpt, log, step: int, state, position: dict) -> bool:
  """Saves `step` unless the update of that step (and of those just before it) was skipped for
  a non-finite loss or gradient: checkpoints of a diverged run would rotate the newest one before
  it out (train.keep_checkpoints)."""
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
  return ckpt.save(step, state, position, {'step': step})


def data_ended_note(done: int, saved: bool, num_epochs, total: int) -> str:
  what = 'saved, evaluating' if saved else 'no step to save; evaluating'
  return (
    f'The training data ended after step {done} (data.num_epochs={num_epochs}) before '
    f'train.steps={total}: {what} and stopping.'
  )


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


def run_eval(step, state, eval_batches, eval_fn, batch_sharding, writer) -> dict:
  ev = evaluate(state, eval_batches, eval_fn, batch_sharding)
  writer.write(step, ev, kind='eval')
  writer.progress(
    f'eval  step {step}: loss {ev["loss"]:.4f}  ppl {ev["perplexity"]:.2f}  '
    f'accuracy {ev["accuracy"]:.4f}  ({int(ev["tokens"])} tokens)'
  )
  return ev

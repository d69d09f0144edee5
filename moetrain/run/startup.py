"""From a config to a validated Setup, and the state a run or a tool starts from: `build`
converts and checks a config before anything compiles; `initial_state`, `restore_or_init` and
`load_latest` give the weights. The tools import this module, never the training loop."""

import dataclasses
import functools
import math
import os
import re

import jax
import ml_collections
from absl import logging
from flax import nnx

from moetrain.convert import hf, peft_adapter
from moetrain.core import axes, runtime, sharding, storage
from moetrain.core.engine import EngineConfig, LoraConfig, split_engine_keys
from moetrain.data import loader
from moetrain.distill import logits as distill_logits
from moetrain.distill import student
from moetrain.distill import teacher as teacher_lib
from moetrain.distill.config import DistillConfig
from moetrain.model import dispatch, stages
from moetrain.model.config import ModelConfig
from moetrain.model.transformer import Transformer
from moetrain.run import base_cache, rundir, sections
from moetrain.run.checkpoint import Checkpointer, data_positions, process_data_state
from moetrain.run.sections import InitConfig, LoopConfig
from moetrain.training import optim
from moetrain.training.preference import PreferenceConfig
from moetrain.training.rl import RLConfig
from moetrain.training.train_state import (
  TrainState,
  abstract_teacher,
  create_sharded,
  graphdef_of,
  initial_loss_scale,
  merge_model,
  split_model,
  state_from_weights,
  state_shardings,
  trainable_filter,
)
from moetrain.training.train_step import StepConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
  """The ConfigDict turned into the frozen dataclasses the library takes (built by keyword)."""

  model: ModelConfig
  data: loader.DataConfig
  optim: optim.OptimConfig
  step: StepConfig
  mesh_shape: tuple[int, ...]
  seed: int
  train: LoopConfig
  hf_checkpoint: str = ''
  peft_adapter: str = ''
  mesh_dcn: tuple[int, ...] = ()  # mesh.dcn_shape: slices per mesh axis (multislice)
  base_cache: str = ''  # init.base_cache
  distill: DistillConfig = DistillConfig()

  def make_mesh(self, devices=None):
    return sharding.make_mesh(self.mesh_shape, devices, dcn=self.mesh_dcn)


# loss.bias_update_decay_steps = -1: decay over train.steps (the value, not a reference to the
# field: a shared reference would make setting either one set both).
FOLLOW_STEPS = -1


def model_config(config) -> ModelConfig:
  """The network of the `model` section (or of init.hf_checkpoint's config.json), its `lora`
  adapters, the `engine` section with the mesh's sharding rules, and whether the loss section
  trains the sparse attention indexer."""
  rules = sharding.Rules.preset(config.mesh.rules)
  model, moved = split_engine_keys(config.model.to_dict())
  if moved:  # a config file written before the engine section
    logging.warning('config.model.%s: now config.engine.<key>', ', config.model.'.join(moved))
  engine = EngineConfig(**(config.engine.to_dict() | moved), rules=rules)
  lora = LoraConfig(**config.lora.to_dict())
  derived = dict(lora=lora, engine=engine, train_indexer=config.loss.indexer_kl > 0)
  path = config.init.hf_checkpoint
  if not path:
    return ModelConfig(**model, **derived)
  return hf.config_from_hf(hf.read_config(path), **derived)


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
  mesh_dcn = sharding.check_dcn_shape(config.mesh.get('dcn_shape', ()), mesh_shape)
  model = model_config(config)  # (checks mesh.rules)
  model = model.laid_out(platform or jax.default_backend(), mesh_shape)
  if (warning := dispatch.gpu_engine_warning(model)) and runtime.is_primary():
    logging.warning(warning)
  sharding.check_axes_used(mesh_shape, config.mesh.rules)
  model.validate()
  stages.check(model)
  if config.init.hf_checkpoint:  # the weights' shapes, from the headers, before any compile
    hf.check_checkpoint(config.init.hf_checkpoint, model)
  data = loader.DataConfig(**config.data.to_dict())
  if config.init.hf_checkpoint and not data.tokenizer:  # the checkpoint's own tokenizer
    data = dataclasses.replace(data, tokenizer=config.init.hf_checkpoint)
  distill, data, teacher = distill_setup(config, model, data, training)
  pref, data, reference = preference_setup(config, model, data, distill)
  rl, rl_reference = rl_setup(config, model, data, distill, pref, process_count)
  loader.validate(data, process_count)
  if training and rl is None:  # (RL reads prompts: run/rollouts.py checks them)
    loader.check_training_data(data)
  opt = optim.OptimConfig(**config.optim.to_dict())
  train = LoopConfig(**config.train.to_dict())
  train.validate()
  opt.validate(train.steps)
  check_mesh_fits(model, data, opt, mesh_shape, num_devices // process_count)
  step = step_config(config, model, opt, teacher | reference | rl_reference, pref, rl)
  check_regexes(model, opt)
  check_lora_rank(model)
  if config.init.peft_adapter and not model.lora.enabled:
    raise ValueError('init.peft_adapter needs lora.rank > 0 (the rank of the adapter)')
  init = InitConfig(**config.init.to_dict())
  return Setup(
    model=model,
    data=data,
    optim=opt,
    step=step,
    mesh_shape=mesh_shape,
    mesh_dcn=mesh_dcn,
    seed=config.seed,
    train=train,
    hf_checkpoint=init.hf_checkpoint,
    peft_adapter=init.peft_adapter,
    base_cache=init.base_cache if init.hf_checkpoint else '',
    distill=distill,
  )


def step_config(config, model: ModelConfig, opt, teacher: dict, pref, rl=None) -> StepConfig:
  """The step's config: the loss section, the micro-batches, the teacher (or reference) and
  the preference or RL objective."""
  loss = config.loss.to_dict()
  if loss.get('bias_update_decay_steps') == FOLLOW_STEPS:  # over the whole run
    loss['bias_update_decay_steps'] = config.train.steps
  accum = opt.grad_accum_steps
  step = StepConfig(model=model, grad_accum_steps=accum, **loss, **teacher, preference=pref, rl=rl)
  step.validate()
  return step


def preference_setup(config, model: ModelConfig, data, distill):
  """(the preference section, or None when off; the data section reading its records;
  StepConfig's teacher field for a full fine-tuning's frozen reference)."""
  pref = PreferenceConfig(**config.get('preference', {}))
  pref.validate()
  if not pref.enabled:
    if data.records != 'examples':
      raise ValueError(
        f'data.records={data.records!r} holds preference records: set preference.loss to train '
        "on them, or data.records='examples'"
      )
    return None, data, {}
  where = f'preference.loss={pref.loss!r}'
  if distill.enabled:
    raise ValueError(f'{where} and distill.teacher: a run does one or the other')
  reference = {}
  if pref.needs_reference:
    alternative = "a reference-free loss ('simpo', 'orpo')"
    reference = reference_setup(config, model, where, alternative)
  return pref, dataclasses.replace(data, records=pref.records), reference


def reference_setup(config, model: ModelConfig, where: str, alternative: str) -> dict:
  """StepConfig's teacher field for an objective that compares with the start: under LoRA none
  (the reference is the adapters off; a trained router would leak into it), in full
  fine-tuning a frozen copy of init.hf_checkpoint, which must be given (`alternative`: the
  setting that needs none)."""
  if model.lora.enabled and model.lora.train_router:
    raise ValueError(
      f'{where} with lora.train_router: the reference (the adapters off) would use the trained '
      'router; train the adapters only (lora.train_router=False)'
    )
  if model.lora.enabled:
    return {}
  if not config.init.hf_checkpoint:
    raise ValueError(
      f'{where} in full fine-tuning compares with a frozen copy of the start, '
      'init.hf_checkpoint, which is empty: give the checkpoint to start from, use LoRA '
      f'(lora.rank > 0; the reference is the adapters off), or {alternative}'
    )
  # A frozen copy, forward only (no recompute, no gradients), in the policy's engine.
  return {'teacher': model.with_engine(remat='none', cast_weights_once=False)}


def rl_setup(config, model: ModelConfig, data, distill, pref, process_count: int):
  """(the rl section, or None when off; StepConfig's teacher field for a full fine-tuning's
  frozen reference of the KL term)."""
  rl = RLConfig(**config.get('rl', {}))
  rl.validate()
  if not rl.enabled:
    return None, {}
  where = f'rl.algorithm={rl.algorithm!r}'
  if distill.enabled or pref is not None:
    raise ValueError(f'{where} with distill or preference tuning: a run does one of them')
  if data.source not in ('demo', 'jsonl') or data.records != 'examples':
    raise ValueError(f"{where} reads prompts: data.source='demo' or 'jsonl' (records 'examples')")
  rows = data.global_batch_size // process_count
  if rows % rl.group_size:
    raise ValueError(
      f'{where}: data.global_batch_size={data.global_batch_size} over {process_count} '
      f'process(es) is {rows} rows each, not a multiple of rl.group_size={rl.group_size} (a '
      "group's completions share a host)"
    )
  if rl.prompts_per_step and rl.prompts_per_step * rl.group_size != data.global_batch_size:
    raise ValueError(
      f'rl.prompts_per_step={rl.prompts_per_step} x rl.group_size={rl.group_size} must equal '
      f'data.global_batch_size={data.global_batch_size} (a row a completion)'
    )
  if rl.max_new_tokens >= data.seq_len:
    raise ValueError(
      f'rl.max_new_tokens={rl.max_new_tokens} leaves no room for a prompt in '
      f'data.seq_len={data.seq_len}'
    )
  if model.engine.pipeline_stages > 1:
    raise ValueError(f'{where} under pipeline stages (engine.pipeline_stages > 1): not supported')
  reference = {}
  if rl.kl_coef:
    reference = reference_setup(config, model, f'rl.kl_coef={rl.kl_coef}', 'rl.kl_coef=0')
  return rl, reference


def distill_setup(config, model: ModelConfig, data, training: bool):
  """(the distill section, the data section with the teacher's tokenizer when it names none,
  StepConfig's distillation fields). The teacher's config and vocabulary are checked for
  training only: a tool reads the student alone."""
  distill = DistillConfig(**config.distill.to_dict())
  distill.validate()
  if not distill.enabled:
    return distill, data, {}
  if not data.tokenizer:  # the teacher's own
    data = dataclasses.replace(data, tokenizer=rundir.checkpoint_tokenizer(distill.teacher))
  if not training:
    return distill, data, {}
  teacher = teacher_lib.model_config(distill, model)
  teacher_lib.check_vocabulary(distill, teacher, model, data.tokenizer)
  step = {'distill': distill.divergence(), 'teacher': teacher if distill.online else None}
  return distill, data, step


def check_mesh_fits(model, data, opt, mesh_shape, per_host: int) -> None:
  """The experts, the tensor axis and the batches must divide over the mesh."""
  sizes = dict(zip(sharding.MESH_AXES, mesh_shape))
  if model.n_routed_experts % sizes['expert']:
    raise ValueError(
      f"model.n_routed_experts={model.n_routed_experts} is not divisible by the 'expert' mesh axis "
      f'({sizes["expert"]}); change mesh.shape or the expert count'
    )
  if per_host % sizes['tensor']:
    raise ValueError(
      f"mesh.shape={mesh_shape}: the 'tensor' axis ({sizes['tensor']}) must divide the "
      f'{per_host} devices of each process: across hosts it would replicate the batch, which '
      'each host loads its own slice of'
    )
  batch_shards = sizes['data'] * sizes['fsdp'] * sizes['expert']
  row_shards = sizes['stage'] * batch_shards  # outside the pipelined layers, stages split rows
  per_micro = data.global_batch_size // opt.grad_accum_steps
  if data.global_batch_size % opt.grad_accum_steps or per_micro % row_shards:
    raise ValueError(
      f'data.global_batch_size={data.global_batch_size} must split into optim.grad_accum_steps='
      f'{opt.grad_accum_steps} micro-batches each divisible by the {row_shards} batch shards '
      f'(stage*data*fsdp*expert of mesh.shape={mesh_shape})'
    )
  m = model.engine.pipeline_microbatches
  pipelined = sizes['stage'] > 1 or m > 1
  if pipelined and per_micro % m:
    raise ValueError(
      f'data.global_batch_size={data.global_batch_size} must split into optim.grad_accum_steps='
      f'{opt.grad_accum_steps} x engine.pipeline_microbatches={m} micro-batches'
    )
  if pipelined and model.splash_attention(data.seq_len) and (per_micro // m) % batch_shards:
    # The splash kernel runs in a shard_map over the batch shards, which must split the rows.
    raise ValueError(
      f'data.global_batch_size={data.global_batch_size}: a pipeline micro-batch of '
      f'{per_micro // m} rows (over optim.grad_accum_steps={opt.grad_accum_steps} x '
      f'engine.pipeline_microbatches={m}) does not split over the {batch_shards} batch shards '
      f'(data*fsdp*expert of mesh.shape={mesh_shape}) that the splash attention kernel runs '
      'on; raise the batch or lower the micro-batch count'
    )
  if data.eval_split and data.eval_batch_size % row_shards:
    raise ValueError(
      f'data.eval_batch_size={data.eval_batch_size} must be divisible by the '
      f'{row_shards} batch shards (stage*data*fsdp*expert) of mesh.shape={mesh_shape}'
    )


@functools.lru_cache(maxsize=4)
def abstract_model(model: ModelConfig) -> Transformer:
  """The model's shapes only (no memory), for the checks that need them."""
  return nnx.eval_shape(lambda: Transformer(model, nnx.Rngs(0)))


def check_lora_rank(model: ModelConfig) -> None:
  """An adapter whose rank exceeds the smaller side of the matrix it adapts has more parameters
  than that matrix and no low-rank saving: refused, naming the layers and the largest rank
  that fits them all."""
  if not model.lora.enabled:
    return
  flat = dict(nnx.to_flat_state(nnx.state(abstract_model(model), nnx.LoRAParam)))
  stacked = {axes.LETTERS[c].name for c in 'LEJ'}  # layers, experts, the rank itself

  def width(v) -> int:
    names = v.get_metadata().get('axes', ())
    return math.prod(n for n, a in zip(v.get_value().shape, names) if a not in stacked)

  sides = {}  # 'layers.attn_0.q_a', 'layers.moe.experts.gate': the smaller side
  for path, a in flat.items():
    if str(path[-1]).endswith('lora_a'):
      b = flat[(*path[:-1], str(path[-1]).replace('lora_a', 'lora_b'))]
      name = '.'.join(map(str, path)).removesuffix('lora_a').rstrip('._')
      sides[name] = min(width(a), width(b))
  too_wide = {k: v for k, v in sides.items() if v < model.lora.rank}
  if too_wide:
    named = ', '.join(f'{k} ({v})' for k, v in list(too_wide.items())[:4])
    raise ValueError(
      f'lora.rank={model.lora.rank} is larger than the smaller side of {len(too_wide)} adapted '
      f'matrices: {named}{", ..." if len(too_wide) > 4 else ""}; such an adapter costs more '
      f'than the matrix. Use lora.rank <= {min(sides.values())}, or leave those out of '
      'lora.targets'
    )


def check_regexes(model: ModelConfig, opt: optim.OptimConfig) -> None:
  """lora.targets must adapt at least one module (unless only the router trains), and a set
  optim.weight_decay_exclude must spare at least one trainable parameter: a regex that matches
  none would change nothing, silently."""
  abstract = functools.partial(abstract_model, model)
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


def check_tokenizer_fits(tokenizer, setup: Setup, cached_in: str | None = None) -> None:
  """Every id of the tokenizer needs a row of the embedding and the lm head: past them, training
  and evaluation read NaN losses and generation garbage, silently. cached_in: the run directory
  a trained tokenizer is cached in (training; a tool must not advise deleting a run's)."""
  if tokenizer.vocab_size <= setup.model.vocab_size:
    return
  if setup.data.tokenizer:
    hint = f' to a tokenizer of that size instead of data.tokenizer={setup.data.tokenizer!r}'
  elif cached_in:  # a trained tokenizer is cached in the run directory and reused
    hint = f' and delete {storage.join(cached_in, "tokenizer.model")}'
  else:
    hint = ''
  raise ValueError(
    f'model.vocab_size={setup.model.vocab_size} is smaller than the tokenizer '
    f'vocabulary ({tokenizer.vocab_size}); raise it, or set data.vocab_size{hint}'
  )


HOST_CACHE = '~/.cache/moetrain/jax'


def compilation_cache_dir(setting: str, workdir: str) -> str:
  """train.compilation_cache: a directory, '' for none, or 'auto': HOST_CACHE on one process; on
  several, <workdir>/jax_cache. JAX writes cache entries from process 0 only, so the other hosts
  find them only in a directory they all share, and the run directory is one."""
  if setting != 'auto':
    return setting
  return HOST_CACHE if jax.process_count() == 1 else storage.join(workdir, 'jax_cache')


def enable_compilation_cache(path: str) -> None:
  if path:
    jax.config.update('jax_compilation_cache_dir', os.path.expanduser(path))
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


def initial_state(setup: Setup, optimizer, mesh) -> TrainState:
  """The state a fresh run starts from: the Hugging Face checkpoint in init.hf_checkpoint
  (streamed into its shardings), else random init from the seed. A LoRA run's frozen base is
  rebuilt this way on every start; checkpoints hold only what trains."""
  rules = setup.model.engine.rules
  if not setup.hf_checkpoint and not setup.peft_adapter:
    return create_sharded(setup.model, optimizer, setup.seed, mesh, rules)

  if setup.hf_checkpoint:
    where = base_cache.entry(setup) if setup.base_cache else None
    cached = base_cache.restore(setup, mesh, where) if where else None
    if cached is not None:
      params, moe_bias, frozen = cached
    else:
      w = hf.load_params(setup.hf_checkpoint, setup.model, mesh=mesh, rules=rules, seed=setup.seed)
      params, moe_bias, frozen = w.params, w.moe_bias, w.frozen
      if where:
        base_cache.save(where, params, moe_bias, frozen)
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
  """The latest checkpoint's state, and the training data moved to its position; else the
  initial state."""
  step = ckpt.latest_step()
  base = f'Importing {setup.hf_checkpoint}' if setup.hf_checkpoint else 'Initialising the model'
  if setup.base_cache:
    base += f' (converted once into init.base_cache={setup.base_cache})'
  with runtime.phase(base):
    state = initial_state(setup, optimizer, mesh)
  state = stored(setup, from_teacher(setup, state, mesh, fresh=step is None))
  if step is None:
    return state
  with runtime.phase(f'Restoring step {step}'):
    saved, data_states, _ = ckpt.restore(step, state)
  position = process_data_state(data_states, setup.data.reslice_on_resume)
  if position is not None:
    train_iter.set_state(position)
    if isinstance(train_iter, distill_logits.WithTeacherLogits):  # read from the next step on
      train_iter.step = step
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
  return dataclasses.replace(state, **saved)


def stored(setup: Setup, state: TrainState) -> TrainState:
  """The state, assembled in layer order, in the order its step reads the stacked layers: a
  circular pipeline's (model.pipeline.layout); the teacher's by its own config."""
  teacher = state.teacher
  state = stages.store(dataclasses.replace(state, teacher=None), setup.model)
  if teacher is None:
    return state
  return dataclasses.replace(state, teacher=stages.store(teacher, setup.step.teacher))


def from_teacher(setup: Setup, state: TrainState, mesh, fresh: bool) -> TrainState:
  """Distillation: the state with the online teacher's weights, and a fresh student (or a LoRA
  student's frozen base, rebuilt on every start) initialised from the teacher when
  distill.init_from_teacher asks."""
  d = setup.distill
  init = d.init_from_teacher and (fresh or setup.model.lora.enabled)
  if (setup.step.preference or setup.step.rl) is not None and setup.step.teacher is not None:
    return with_reference(setup, state, mesh)
  if not d.enabled or not (setup.step.teacher or init):
    return state
  cfg = setup.step.teacher or teacher_lib.model_config(d, setup.model)
  with runtime.phase(f'Loading the teacher {d.teacher}'):
    shardings = state_shardings(abstract_teacher(cfg), mesh, cfg.engine.rules)
    weights = load_teacher(d, cfg, mesh, shardings)
  if init:
    # (the teacher's weights are in layer order until `stored`)
    state = student.init_from_teacher(setup, state, without_repeats(cfg), weights, mesh)
  return dataclasses.replace(state, teacher=weights) if setup.step.teacher else state


def with_reference(setup: Setup, state: TrainState, mesh) -> TrainState:
  """Preference tuning (or RL's KL term) in full fine-tuning: the state with its frozen
  reference, the start (init.hf_checkpoint) read again on every start as an online teacher is."""
  cfg = setup.step.teacher
  with runtime.phase(f'Loading the reference {setup.hf_checkpoint}'):
    shardings = state_shardings(abstract_teacher(cfg), mesh, cfg.engine.rules)
    ref = DistillConfig(teacher=setup.hf_checkpoint)
    return dataclasses.replace(state, teacher=load_teacher(ref, cfg, mesh, shardings))


def load_teacher(d: DistillConfig, teacher: ModelConfig, mesh, shardings) -> nnx.State:
  """The teacher's weights (every variable) in `shardings` (TrainState.teacher's): a Hugging
  Face checkpoint's, or a moetrain run's latest checkpoint (read as its tools read it)."""
  saved = rundir.run_config(d.teacher)
  if saved is None:
    w = hf.load_params(d.teacher, teacher, mesh=mesh, rules=teacher.engine.rules)
    params, moe_bias, frozen = w.params, w.moe_bias, w.frozen
  else:
    config = ml_collections.ConfigDict(sections.with_defaults(saved))
    tsetup = build(rundir.tool_config(config, d.teacher), training=False)
    state = load_latest(
      dataclasses.replace(tsetup, model=without_repeats(teacher)), d.teacher, mesh
    )
    params, moe_bias, frozen = state.params, state.moe_bias, state.frozen
  graphdef = split_model(nnx.eval_shape(lambda: Transformer(teacher, nnx.Rngs(0))), teacher)[0]
  return jax.device_put(nnx.state(merge_model(graphdef, params, moe_bias, frozen)), shardings)


def without_repeats(cfg: ModelConfig) -> ModelConfig:
  """cfg reading its stacked layers in layer order (no circular repeats), for weights that leave
  the step: exported, decoded, or copied into a student by layer."""
  return cfg.with_engine(pipeline_repeats=1)


def tool_setup(config, workdir: str | None) -> Setup:
  """The Setup a tool (evaluate, export, generate) reads --workdir's run with: from its own
  <workdir>/config.json when `config` (--config) is None, else from `config`, which must match
  the run's model, LoRA and frozen base as a resume must (rundir.check_resumable). The tool
  reads and writes the run's compilation cache (train.compilation_cache), so that its programs
  (a random base's initialiser, the eval step) compile once across calls."""
  setup = build(rundir.tool_config(config, workdir), training=False)
  if workdir and not has_compilation_cache():  # (a process with its own cache keeps it)
    enable_compilation_cache(compilation_cache_dir(setup.train.compilation_cache, workdir))
  return setup


def has_compilation_cache() -> bool:
  return bool(jax.config.jax_compilation_cache_dir)


def load_latest(setup: Setup, workdir: str | None, mesh) -> TrainState:
  """The run's latest checkpoint (its initial state without a workdir), for tools; check the
  config with tool_setup first. A LoRA student's frozen base comes from its teacher, as on every
  start of its training (distill.init_from_teacher)."""
  optimizer = optim.make_optimizer(setup.optim, setup.train.steps)
  state = initial_state(setup, optimizer, mesh)
  state = stored(setup, from_teacher(setup, state, mesh, fresh=not workdir))
  if workdir:
    t = setup.train
    ckpt = Checkpointer(
      workdir,
      every=1,
      keep=t.keep_checkpoints,
      async_save=False,
      verify=t.verify_checkpoints,
      layers=stages.layout(setup.model),
    )
    saved, _, _ = ckpt.restore(ckpt.latest_step(), state)
    state = dataclasses.replace(state, **saved)
    ckpt.close()
  return state

"""Ahead-of-time compilation of the run's real train and eval steps for any set of devices (a
TPU slice described by libtpu, or this host's), from shapes alone: no weights, no TPU."""

import dataclasses
import functools
import math
import os
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache
from jax.experimental.layout import Format, Layout

from moetrain.core import hlo_cost, sharding
from moetrain.data import packing
from moetrain.model import sampler
from moetrain.training import optim
from moetrain.training import rl as rl_lib
from moetrain.training.train_state import abstract_teacher, graphdef_of, init_state, state_shardings
from moetrain.training.train_step import compiler_options, eval_step, jit_train_step


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def abstract_state(setup, mesh):
  """(the train state as ShapeDtypeStructs carrying their shardings, the shardings)."""
  optimizer = optim.make_optimizer(setup.optim, setup.train.steps)
  abstract = jax.eval_shape(lambda: init_state(setup.model, optimizer, setup.seed))
  if setup.step.teacher is not None:  # online distillation: the teacher's weights come along
    abstract = dataclasses.replace(abstract, teacher=abstract_teacher(setup.step.teacher))
  shardings = state_shardings(abstract, mesh, setup.model.engine.rules)

  def sds(a, s):
    if _is_var(a):
      return a.replace(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s.get_value()))
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)

  return jax.tree.map(sds, abstract, shardings, is_leaf=_is_var), shardings


def abstract_batch(rows: int, seq_len: int, mesh, top_k: int = 0, extra=None) -> dict:
  """The packed batch moetrain.data.packing makes: int32 rows and a float32 loss mask; with
  top_k (distillation from cached logits) the teacher's top-k ids and log-probabilities; extra:
  more fields per row, {name: (shape after the row axis, dtype)} (a rollout batch's)."""
  s = sharding.batch_sharding(mesh)
  out = {
    k: jax.ShapeDtypeStruct((rows, seq_len), dt, sharding=s) for k, dt in packing.ROW_DTYPES.items()
  }
  if top_k:
    shape = (rows, seq_len, top_k)
    out['teacher_ids'] = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=s)
    out['teacher_logprobs'] = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s)
  for name, (shape, dt) in (extra or {}).items():
    rank = sharding.batch_sharding(mesh, 1 + len(shape))
    out[name] = jax.ShapeDtypeStruct((rows, *shape), dt, sharding=rank)
  return out


def train_batch(setup, mesh) -> dict:
  """The train step's abstract batch: the packed rows, with a distillation's cached logits or a
  rollout batch's fields (training/rl.py)."""
  d, rl = setup.data, setup.step.rl
  extra = None if rl is None else rl_lib.batch_fields(rl, setup.model, d.seq_len)
  return abstract_batch(d.global_batch_size, d.seq_len, mesh, cached_top_k(setup), extra)


def sampler_inputs(setup, mesh) -> tuple:
  """The sampler's abstract inputs for a rollout of data.global_batch_size rows: the prompts,
  their lengths, the key and the options."""
  rows, s = setup.data.global_batch_size, setup.data.seq_len
  prompt = jax.ShapeDtypeStruct((rows, s + 1), jnp.int32, sharding=sharding.batch_sharding(mesh))
  lengths = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sharding.batch_sharding(mesh, 1))
  rng = jax.eval_shape(lambda: jax.random.key(0))
  opts = jax.eval_shape(lambda: sampler.sample_opts(1.0, vocab=setup.model.vocab_size))
  return prompt, lengths, rng, opts


def cached_top_k(setup) -> int:
  """The k of the teacher's cached logits the train step's batch carries (0: none)."""
  d = setup.step.distill
  return d.top_k if d is not None and setup.step.teacher is None else 0


def compiler_layouts(setup) -> bool:
  """Whether the train step takes the frozen base in layouts the compiler chooses
  (engine.frozen_layout; 'auto': on TPU, with micro-batches)."""
  m = setup.model
  auto = m.engine.platform == 'tpu' and setup.optim.grad_accum_steps > 1
  return m.engine.frozen_layout == 'compiler' or (m.engine.frozen_layout == 'auto' and auto)


def train_step_fn(setup, mesh, shardings):
  """The jitted train step the loop runs (moetrain.run.train.run) and the planner compiles. Where
  compiler_layouts, the frozen base's layouts are Layout.AUTO: XLA picks them (with the
  defaults, XLA:TPU relayouts the frozen base into its micro-batch loop's layout inside every
  step), the compiled step's input_formats say which (state_formats), and the run moves the
  base there once (place_frozen). Its outputs keep them, so the donated base stays put."""
  if compiler_layouts(setup):
    auto = jax.tree.map(lambda s: Format(Layout.AUTO, s), shardings.frozen)
    shardings = dataclasses.replace(shardings, frozen=auto)
  optimizer = optim.make_optimizer(setup.optim, setup.train.steps)
  lr_fn = optim.schedule(setup.optim, setup.train.steps)
  batch = sharding.batch_sharding(mesh)
  if setup.step.rl is not None:  # fields of other ranks: a sharding each
    batch = {k: v.sharding for k, v in train_batch(setup, mesh).items()}
  return jit_train_step(setup.step, optimizer, lr_fn, shardings, batch)


def state_formats(executable):
  """The layouts and shardings of the train state that a compiled train step takes. The frozen
  base must come back in the layouts it went in (the next step takes it as it is)."""
  formats = executable.input_formats[0][0]
  given = executable.output_formats[0].frozen
  if jax.tree.leaves(given) != jax.tree.leaves(formats.frozen):
    raise ValueError(
      'the compiled train step returns the frozen base in other layouts than it takes, so the '
      "next step could not take it: set engine.frozen_layout='default'"
    )
  return formats


def place_frozen(state, formats):
  """`state` with its frozen base in `formats` (state_formats'). Each leaf whose layout the
  compiler chose otherwise is copied and its old buffer freed before the next leaf moves, so
  the move needs at most one leaf's bytes more (before the first step: the step's temporaries
  are not allocated yet). Nothing moves where the formats are the arrays' own."""
  leaves, tree = jax.tree.flatten(state.frozen)
  moved = False
  for i, f in enumerate(jax.tree.leaves(formats.frozen)):
    if leaves[i].format != f:
      old, leaves[i] = leaves[i], jax.device_put(leaves[i], f).block_until_ready()
      old.delete()
      moved = True
  return dataclasses.replace(state, frozen=jax.tree.unflatten(tree, leaves)) if moved else state


def eval_step_fn(setup, mesh=None, formats=None):
  """The jitted eval step, in forward passes of the train step's micro-batch rows; with
  `formats` (the train step's state_formats) it takes the state as the train step leaves it,
  the frozen base in the layouts the compiler chose for training."""
  micro = setup.data.global_batch_size // setup.optim.grad_accum_steps
  graphdef = graphdef_of(setup.model)
  fn = functools.partial(eval_step, graphdef=graphdef, micro_rows=micro, cfg=setup.step)
  options = compiler_options(setup.model)
  if formats is None:
    return jax.jit(fn, compiler_options=options)
  placed = (formats, sharding.batch_sharding(mesh))
  whole = sharding.replicated(mesh)  # the sums every process fetches
  return jax.jit(fn, in_shardings=placed, out_shardings=whole, compiler_options=options)


@dataclasses.dataclass
class Compiled:
  """One compiled program's per-device figures."""

  name: str
  memory: dict  # bytes per device: arguments, temporaries, outputs, aliased, code, host, total
  seconds: float  # compile time
  cost: hlo_cost.Cost | None
  xla_flops: float  # cost_analysis' flops (loop bodies once)
  executable: object = None
  formats: object = None  # a train step's: the state's layouts and shardings (state_formats)


def memory_of(compiled) -> dict:
  """Per-device bytes of a compiled program. total = arguments + outputs - aliased (donated
  state updated in place) + temporaries + generated code: what must fit in the device's memory."""
  m = compiled.memory_analysis()
  out = {
    'arguments': m.argument_size_in_bytes,
    'temporaries': m.temp_size_in_bytes,
    'outputs': m.output_size_in_bytes,
    'aliased': m.alias_size_in_bytes,
    'code': m.generated_code_size_in_bytes,
    'host': (m.host_argument_size_in_bytes + m.host_temp_size_in_bytes)
    + (m.host_output_size_in_bytes - m.host_alias_size_in_bytes),
  }
  out['total'] = (
    out['arguments'] + out['outputs'] - out['aliased'] + out['temporaries'] + out['code']
  )
  return out


class OutOfMemory(Exception):
  """XLA refused the program: it does not fit the device memory."""

  def __init__(self, name: str, message: str, seconds: float):
    self.name, self.message, self.seconds = name, message, seconds
    super().__init__(f'{name}: {message}')

  @property
  def required_bytes(self) -> float | None:
    m = re.search(r'(?:temporaries|requirement) \(?([\d.]+)([GMK])', self.message)
    return float(m.group(1)) * {'G': 2**30, 'M': 2**20, 'K': 2**10}[m.group(2)] if m else None


def oom_message(error: str) -> str:
  """The line of a compiler's RESOURCE_EXHAUSTED error that says what ran out. A scoped VMEM
  overflow (XLA:TPU's per-fusion scratch, not HBM) says how much the fusion asked, which op it
  was, and the key that raises the limit."""
  lines = error.splitlines()
  msg = next((ln for ln in lines if 'RESOURCE_EXHAUSTED' in ln), error)
  msg = msg.split('RESOURCE_EXHAUSTED: ')[-1]
  if 'ScopedVmemOom' not in msg:
    return msg
  size = re.search(r'size ([\d.]+)M and limit ([\d.]+)M', error)
  op = re.search(r'op_name="([^"]+)"', error)
  asked, twice = 'a fusion asked more scoped VMEM than its limit', 32768
  if size:
    asked = f'a fusion asked {size.group(1)} MiB of scoped VMEM, over its {size.group(2)} MiB'
    twice = 2 * 1024 * round(float(size.group(2)))
  where = f' ({op.group(1).split("/")[-1]})' if op else ''
  return f'{msg.rstrip(": ")}: {asked}{where}; raise engine.tpu_scoped_vmem_kib (e.g. {twice})'


def compile_fn(name: str, fn, args, analyse: bool = True, cache: bool = True) -> Compiled:
  """cache=False keeps the persistent compilation cache out of it: compile-only (topology)
  executables cannot be read back from it, and one read back lacks its HLO's loops."""

  t = time.perf_counter()
  enabled = jax.config.jax_enable_compilation_cache
  toggled = enabled and not cache
  try:
    if toggled:  # jax 0.12 decides once whether the cache is used: make it decide again
      jax.config.update('jax_enable_compilation_cache', False)
      compilation_cache.reset_cache()
    compiled = fn.lower(*args).compile()
  except jax.errors.JaxRuntimeError as e:
    if 'RESOURCE_EXHAUSTED' not in str(e):
      raise
    raise OutOfMemory(name, oom_message(str(e)), time.perf_counter() - t) from None
  finally:
    if toggled:
      jax.config.update('jax_enable_compilation_cache', enabled)
      compilation_cache.reset_cache()
  seconds = time.perf_counter() - t
  ca = compiled.cost_analysis() or {}
  ca = ca[0] if isinstance(ca, list) else ca
  cost = hlo_cost.analyse(compiled.as_text(), unknown_trips=0) if analyse else None
  return Compiled(name, memory_of(compiled), seconds, cost, ca.get('flops', 0.0), compiled)


def compile_steps(setup, mesh, evaluate: bool = True, progress=None) -> dict:
  """{'train': Compiled, 'eval': Compiled}: the steps the training loop runs, for `mesh`'s
  devices (the engine chosen for setup.model.platform). Raises OutOfMemory. progress: called
  with a line before each compile and after it (None: silent)."""
  say = progress or (lambda line: None)
  state, shardings = abstract_state(setup, mesh)
  d = setup.data
  out = {}
  where = f'{mesh.devices.size} {mesh.devices.flat[0].device_kind} devices'
  with jax.set_mesh(mesh):
    train = train_step_fn(setup, mesh, shardings)
    say(f'compiling the train step for {where} (minutes at full scale)...')
    start = time.time()
    out['train'] = compile_fn(
      'train step',
      train,
      (state, train_batch(setup, mesh)),
      cache=False,
    )
    say(f'compiled the train step in {time.time() - start:.0f} s')
    train_c = out['train']
    train_c.formats = state_formats(train_c.executable)
    if setup.step.rl is not None:  # the rollouts' sampler: the weights and its KV cache
      say('compiling the sampler...')
      start = time.time()
      out['sampler'] = compile_fn(
        'sampler',
        rl_lib.jit_sampler(setup.step.rl, setup.model),
        (*(state.params, state.moe_bias, state.frozen), *sampler_inputs(setup, mesh)),
        analyse=False,
        cache=False,
      )
      say(f'compiled the sampler in {time.time() - start:.0f} s')
    if evaluate and d.eval_split and setup.step.rl is None:
      batch = abstract_batch(d.eval_batch_size, d.seq_len, mesh)
      fn = eval_step_fn(setup, mesh, train_c.formats)
      say('compiling the eval step...')
      start = time.time()
      out['eval'] = compile_fn('eval step', fn, (state, batch), cache=False)
      say(f'compiled the eval step in {time.time() - start:.0f} s')
  return out


def device_memory_limit(device) -> int | None:
  """Bytes a program may use on `device` (None where the backend does not say, e.g. CPU)."""
  try:
    stats = device.memory_stats() or {}
  except Exception:  # compile-only devices, backends without allocator statistics
    return None
  return stats.get('bytes_limit')


def host_memory() -> int:
  """This host's RAM in bytes."""
  return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


def memory_budget(mesh) -> tuple[int, str]:
  """(bytes one device of `mesh` may hold, what they are): the device's memory, or on a backend
  that does not say (CPU) this host's RAM shared by its devices of the mesh."""
  device = mesh.devices.flat[0]
  if limit := device_memory_limit(device):
    return limit, f'the {limit / 2**30:.2f} GiB of a {device.device_kind} device'
  n = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  ram = host_memory()
  return ram // n, f"this host's {ram / 2**30:.2f} GiB of RAM shared by its {n} devices"


def state_bytes(state) -> int:
  """Bytes of one device's shards of an abstract state (ShapeDtypeStructs with shardings)."""
  total = 0
  for x in jax.tree.leaves(state):
    bits = jnp.iinfo(x.dtype).bits if jnp.issubdtype(x.dtype, jnp.integer) else None
    bits = bits or jnp.dtype(x.dtype).itemsize * 8
    total += math.prod(x.sharding.shard_shape(x.shape)) * bits // 8
  return total


def check_fits(what: str, need: int, mesh) -> None:
  """Refuses, in one line, a plan of `need` bytes per device that no device of `mesh` holds."""
  limit, where = memory_budget(mesh)
  if need > limit:
    raise ValueError(
      f'{what} needs {need / 2**30:.2f} GiB per device, more than {where}: it cannot run; '
      'shrink the model or the batch, or plan a setting that fits: python -m '
      'moetrain.tools.plan --config=... --topology=<slice> --search'
    )


def precompile_train_step(setup, mesh, step_fn, state, progress=print) -> Compiled:
  """Compiles the loop's jitted step from shapes before any weight is read, so that a step that
  does not fit the devices stops the run in seconds with the compiler's numbers, not after a
  checkpoint import. The loop runs the returned executable. state: abstract_state's. A state
  larger than a device's memory (or on CPU, its share of the host's RAM) stops before the
  compile; a compiled step larger, after it."""
  check_fits('the train state', state_bytes(state), mesh)
  progress(
    f'Compiling the train step for {mesh.devices.size} {mesh.devices.flat[0].platform} devices...'
  )
  try:
    c = compile_fn(
      'train step',
      step_fn,
      (state, train_batch(setup, mesh)),
      analyse=False,
    )
  except OutOfMemory as e:
    raise ValueError(
      f'the train step does not fit the devices: {e.message} Plan a setting that fits without '
      'the devices: python -m moetrain.tools.plan --config=... --topology=<slice> --search'
    ) from None
  c.formats = state_formats(c.executable)
  limit = device_memory_limit(mesh.devices.flat[0])
  of = f' of {limit / 2**30:.2f} GiB' if limit else ''
  progress(f'Compiled in {c.seconds:.0f} s: {c.memory["total"] / 2**30:.2f} GiB per device{of}.')
  check_fits('the compiled train step', c.memory['total'], mesh)
  return c

"""The frozen base in layouts the compiler chose (engine.frozen_layout): XLA:TPU's choice for a
QLoRA step with micro-batches, and the run's path on CPU (the base moved into the compiled
step's layouts, the eval step compiled for them, the same numbers)."""

import dataclasses
import re
import types

import jax
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout

from configs import longcat_lora
from moetrain.core import sharding
from moetrain.planner import topology, tpu_plan
from moetrain.run import train
from moetrain.run.startup import build, create_sharded
from moetrain.training import aot, optim
from tests.helpers import tpu_proxy
from tests.test_train import losses, small_config

SMALL_QLORA = tpu_proxy(2) | {
  'engine.quant': 'int4',
  'optim.grad_accum_steps': 2,
  'data.global_batch_size': 8,
  'data.eval_batch_size': 4,
  'mesh.shape': (1, -1, 4, 1),
}


@pytest.mark.slow  # (~80 s: two compiles of the step and a lowering)
def test_the_tpu_compiler_keeps_quantised_experts_in_its_own_layout():
  """With the frozen base in the default layouts, XLA:TPU of libtpu 0.0.42 copied the int4 expert
  codes into its micro-batch loop's layout inside the step (bench/RESULTS.md, "The frozen base in
  layouts the compiler chooses"). Asked for the frozen inputs' layouts (every one reaches XLA as
  'auto'), it takes the quantised experts (codes and scales) in layouts of its choice, gives them
  back in the same ones (the donated base stays in place from step to step) and holds them in no
  other outside its fusions: no copy of them in another layout is alive in the step. The choice
  is the compiler's: libtpu 0.0.42 chose the loop's layout for the codes, 0.0.52 keeps their
  default one (its dequantising fusions read them as they are) and chooses another only for the
  scales, which it copies in the default step. Its layouts cost no more temporaries than the
  defaults. (Every plan's eval step compiles for the chosen layouts: test_plan.)"""
  pytest.importorskip('libtpu', reason="TPU compiles need libtpu: pip install -e '.[tpu]'")
  config = longcat_lora.get_config('variant=tiny')
  devices = topology.parse('v5e-4').devices()
  steps = {}
  for layout in ('default', 'auto'):
    c = tpu_plan.with_overrides(config, SMALL_QLORA | {'engine.frozen_layout': layout})
    setup = build(c, num_devices=4, process_count=1, platform='tpu')
    steps[layout] = aot.compile_steps(setup, setup.make_mesh(devices), evaluate=False)['train']
  mesh = setup.make_mesh(devices)  # (setup: the 'auto' one)
  state = aot.abstract_state(setup, mesh)[0]
  assert _auto_layouts(setup, mesh) == 2 * len(jax.tree.leaves(state.frozen))  # in and out
  chosen = steps['auto'].executable
  ins = aot.state_formats(chosen).frozen
  assert jax.tree.leaves(ins) == jax.tree.leaves(chosen.output_formats[0].frozen)
  experts = ins['layers']['moe']['experts']
  shapes = state.frozen['layers']['moe']['experts']
  layouts = {}  # HLO array type -> the layouts chosen for the experts' arrays of that type
  for w in ('gate', 'up', 'down'):
    for name in ('q', 'scale'):
      f, x = experts[w][name], shapes[w][name]
      dims = ','.join(map(str, f.sharding.shard_shape(x.shape)))
      layouts.setdefault(f'{HLO_TYPES[x.dtype.name]}[{dims}]', set()).add(_hlo_layout(f.layout))
  hlo = chosen.as_text()
  for array_type, want in layouts.items():
    assert _unfused_layouts(hlo, array_type) == want, array_type
  saved = steps['default'].memory['temporaries'] - steps['auto'].memory['temporaries']
  assert saved >= 0, saved


HLO_TYPES = {'uint8': 'u8', 'int8': 's8', 'float32': 'f32', 'bfloat16': 'bf16'}


def _auto_layouts(setup, mesh) -> int:
  """How many of the lowered train step's inputs and outputs leave their layout to XLA."""
  state = aot.abstract_state(setup, mesh)
  batch = aot.abstract_batch(setup.data.global_batch_size, setup.data.seq_len, mesh)
  with jax.set_mesh(mesh):
    text = aot.train_step_fn(setup, mesh, state[1]).lower(state[0], batch).as_text()
  return text.count('mhlo.layout_mode = "auto"')


def _unfused_layouts(hlo: str, array_type: str) -> set[str]:
  """The layouts (memory spaces aside) in which the instructions of an optimised HLO module
  outside its fusions hold arrays of `array_type` (e.g. 'u8[2,8,8,32,512]'): each is a buffer,
  where a relayout inside a fusion is not."""
  fused = set(re.findall(r' fusion\(.*?calls=%([\w.\-]+)', hlo))
  found, inside = set(), False
  for line in hlo.splitlines():
    head = re.match(r'(?:ENTRY )?%([\w.\-]+) ', line)
    if head:
      inside = head.group(1) in fused
    elif not inside:
      found.update(re.findall(re.escape(array_type) + r'(\{[^}]*\})', line))
  return {re.sub(r'S\(\d+\)', '', f) for f in found}


def _hlo_layout(layout: Layout) -> str:
  """A device-local layout as HLO text writes it, e.g. {4,3,2,1,0:T(32,128)(4,1)}."""
  order = ','.join(map(str, reversed(layout.major_to_minor)))
  tiles = ''.join(f'({",".join(map(str, t))})' for t in layout.tiling or ())
  return f'{{{order}:T{tiles}}}' if tiles else f'{{{order}}}'


def _transposed(f: Format) -> Format:
  """f with its two minor dimensions swapped (a layout XLA:CPU keeps as asked)."""
  order = list(f.layout.major_to_minor)
  if len(order) < 2:
    return f
  order[-2:] = order[-1], order[-2]
  return Format(Layout(tuple(order), f.layout.tiling), f.sharding)


@pytest.mark.slow  # ~20 s
def test_the_base_moves_into_the_steps_layouts_and_evaluates_the_same():
  """place_frozen copies the base into the formats a compiled step takes (here: layouts other
  than the default, as XLA:TPU may choose), and the eval step compiled for those formats gives
  what the default one gives on the base as it was."""
  config = tpu_plan.with_overrides(
    small_config(), {'mesh.shape': (1, 1, 1, 1), 'engine.quant': 'int8'}
  )
  setup = build(config, num_devices=1, process_count=1)
  mesh = setup.make_mesh(jax.devices()[:1])
  optimizer = optim.make_optimizer(setup.optim, setup.train.steps)
  with jax.set_mesh(mesh):
    state = create_sharded(setup.model, optimizer, setup.seed, mesh, setup.model.engine.rules)
    formats = dataclasses.replace(
      jax.tree.map(lambda a: a.format, state),
      frozen=jax.tree.map(lambda a: _transposed(a.format), state.frozen),
    )
    rng = np.random.default_rng(0)
    shape = (setup.data.eval_batch_size, setup.data.seq_len)
    batch = {
      'inputs': rng.integers(0, 256, shape, dtype=np.int32),
      'targets': rng.integers(0, 256, shape, dtype=np.int32),
      'positions': np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape),
      'segment_ids': np.ones(shape, np.int32),
      'loss_mask': np.ones(shape, np.float32),
    }
    batch = jax.device_put(batch, sharding.batch_sharding(mesh))
    want = jax.device_get(aot.eval_step_fn(setup)(state, batch))
    before = jax.tree.leaves(state.frozen)
    values = [np.asarray(a) for a in before]
    placed = aot.place_frozen(state, formats)
    after = jax.tree.leaves(placed.frozen)
    moved = [a.format.layout != b.format.layout for a, b in zip(before, after, strict=True)]
    assert any(moved) and all(a.is_deleted() for a, m in zip(before, moved) if m)
    for a, v, f in zip(after, values, jax.tree.leaves(formats.frozen), strict=True):
      assert a.format == f
      np.testing.assert_array_equal(np.asarray(a), v)
    assert aot.place_frozen(placed, formats) is placed  # already there: nothing moves
    got = jax.device_get(aot.eval_step_fn(setup, mesh, formats)(placed, batch))
  assert got == want, (got, want)


@pytest.mark.slow  # ~35 s: two training runs
def test_a_run_with_compiler_layouts_trains_as_one_without(tmp_path):
  """The run loop with engine.frozen_layout='compiler' on this host (where XLA:CPU chooses the
  default layouts): its losses and evaluation bit for bit those of the default run."""
  runs = {}
  for layout in ('compiler', 'default'):
    config = small_config(steps=2, checkpoint_every=2)
    config.engine.frozen_layout = layout
    workdir = str(tmp_path / layout)
    out = train.run(config, workdir)
    runs[layout] = (losses(workdir), out['eval_loss'], out['eval_accuracy'])
  assert runs['compiler'] == runs['default'], runs


def test_a_step_that_would_move_the_base_between_steps_is_refused():
  """The compiled step must give the frozen base back in the layouts it takes it in; a step
  that does not is refused at compile time, naming the setting that avoids it."""
  sharding_ = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  row, col = (Format(Layout(order, ()), sharding_) for order in ((0, 1), (1, 0)))
  state = lambda f: types.SimpleNamespace(frozen={'w': f})
  same = types.SimpleNamespace(input_formats=((state(row),), {}), output_formats=(state(row),))
  assert aot.state_formats(same).frozen == {'w': row}
  moved = types.SimpleNamespace(input_formats=((state(row),), {}), output_formats=(state(col),))
  with pytest.raises(ValueError, match="engine.frozen_layout='default'"):
    aot.state_formats(moved)


@pytest.mark.parametrize(
  'layout,platform,accum,want',
  [
    ('auto', 'tpu', 2, True),  # micro-batches on TPU: the copies this avoids
    (
      'auto',
      'tpu',
      1,
      False,
    ),  # none: the defaults cost as much or less (RESULTS.md, "The frozen base in layouts...")
    ('auto', 'cpu', 2, False),
    ('compiler', 'cpu', 1, True),
    ('default', 'tpu', 2, False),
  ],
)
def test_when_the_compiler_chooses_the_layouts(layout, platform, accum, want):
  over = {'engine.frozen_layout': layout, 'optim.grad_accum_steps': accum}
  config = tpu_plan.with_overrides(small_config(), over | {'mesh.shape': (1, 1, 1, 1)})
  setup = build(config, num_devices=1, process_count=1, platform=platform)
  assert aot.compiler_layouts(setup) is want

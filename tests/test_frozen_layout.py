"""The frozen base in layouts the compiler chose (model.frozen_layout): XLA:TPU's choice for a
QLoRA step with micro-batches, and the run's path on CPU (the base moved into the compiled
step's layouts, the eval step compiled for them, the same numbers)."""

import dataclasses
import types

import jax
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout

from configs import longcat_lora
from moetrain import aot, optim, sharding, topology, train
from moetrain.setup import build, create_sharded
from moetrain.tools import tpu_plan
from tests.helpers import tpu_proxy
from tests.test_train import losses, small_config

SMALL_QLORA = tpu_proxy(2) | {
  'model.quant': 'int4',
  'optim.grad_accum_steps': 2,
  'data.global_batch_size': 8,
  'data.eval_batch_size': 4,
  'mesh.shape': (1, -1, 4, 1),
}


@pytest.mark.slow  # (~75 s: two compiles of the step)
def test_the_tpu_compiler_keeps_quantised_experts_in_its_own_layout():
  """With the frozen base in the default layouts, XLA:TPU copies the int4 expert codes into its
  micro-batch loop's layout inside the step (bench/RESULTS.md, "The frozen base in layouts the compiler chooses"). Choosing the inputs'
  layouts itself, it takes them in a layout other than the default, gives them back in the same
  one (the donated base stays in place from step to step), and the copies are gone: at least
  the codes' bytes fewer temporaries. (Every plan's eval step compiles for the chosen layouts:
  test_plan.)"""
  pytest.importorskip('libtpu', reason="TPU compiles need libtpu: pip install -e '.[tpu]'")
  config = longcat_lora.get_config('variant=tiny')
  devices = topology.parse('v5e-4').devices()
  steps = {}
  for layout in ('auto', 'default'):
    c = tpu_plan.with_overrides(config, SMALL_QLORA | {'model.frozen_layout': layout})
    setup = build(c, num_devices=4, process_count=1, platform='tpu')
    steps[layout] = aot.compile_steps(setup, setup.make_mesh(devices), evaluate=False)['train']
  chosen = steps['auto'].executable
  ins = aot.state_formats(chosen).frozen
  assert jax.tree.leaves(ins) == jax.tree.leaves(chosen.output_formats[0].frozen)
  default = aot.state_formats(steps['default'].executable).frozen
  mesh = setup.make_mesh(devices)
  abstract = aot.abstract_state(setup, mesh)[0].frozen['layers']['moe']['experts']
  packed = 0  # bytes of the expert codes per chip, two int4 codes a byte
  for w in ('gate', 'up', 'down'):
    chosen_codes = ins['layers']['moe']['experts'][w]['q']
    assert chosen_codes.layout != default['layers']['moe']['experts'][w]['q'].layout, w
    packed += np.prod(chosen_codes.sharding.shard_shape(abstract[w]['q'].shape)) / 2
  saved = steps['default'].memory['temporaries'] - steps['auto'].memory['temporaries']
  assert saved >= packed, (saved, packed)


def _transposed(f: Format) -> Format:
  """f with its two minor dimensions swapped (a layout XLA:CPU keeps as asked)."""
  order = list(f.layout.major_to_minor)
  if len(order) < 2:
    return f
  order[-2:] = order[-1], order[-2]
  return Format(Layout(tuple(order), f.layout.tiling), f.sharding)


def test_the_base_moves_into_the_steps_layouts_and_evaluates_the_same():
  """place_frozen copies the base into the formats a compiled step takes (here: layouts other
  than the default, as XLA:TPU may choose), and the eval step compiled for those formats gives
  what the default one gives on the base as it was."""
  config = tpu_plan.with_overrides(
    small_config(), {'mesh.shape': (1, 1, 1, 1), 'model.quant': 'int8'}
  )
  setup = build(config, num_devices=1, process_count=1)
  mesh = setup.make_mesh(jax.devices()[:1])
  optimizer = optim.make_optimizer(setup.optim, setup.train.steps)
  with jax.set_mesh(mesh):
    state = create_sharded(setup.model, optimizer, setup.seed, mesh, setup.model.rules)
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


def test_a_run_with_compiler_layouts_trains_as_one_without(tmp_path):
  """The run loop with model.frozen_layout='compiler' on this host (where XLA:CPU chooses the
  default layouts): its losses and evaluation bit for bit those of the default run."""
  runs = {}
  for layout in ('compiler', 'default'):
    config = small_config(steps=2, checkpoint_every=2)
    config.model.frozen_layout = layout
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
  with pytest.raises(ValueError, match="model.frozen_layout='default'"):
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
  over = {'model.frozen_layout': layout, 'optim.grad_accum_steps': accum}
  config = tpu_plan.with_overrides(small_config(), over | {'mesh.shape': (1, 1, 1, 1)})
  setup = build(config, num_devices=1, process_count=1, platform=platform)
  assert aot.compiler_layouts(setup) is want

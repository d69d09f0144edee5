"""Pipeline parallelism: the stage axis of the mesh, and pipelined steps (stages 2 and 4, experts
over 2 inside a stage, GPipe and circular) equal to no pipeline in float32."""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from moetrain.core import sharding
from moetrain.model import stages
from moetrain.model.families import MODEL_PRESETS
from moetrain.run.checkpoint import Checkpointer
from moetrain.training.train_state import create_sharded, graphdef_of
from moetrain.training.train_step import StepConfig, bias_update, loss_fn, token_counts
from tests.helpers import tiny, with_lora
from tests.test_sharding import batch

LONGCAT = tiny(num_layers=4)
# Dense layers first: two runs of layers, each pipelined over the stages on its own.
DEEPSEEK = dataclasses.replace(
  MODEL_PRESETS['deepseek_tiny'], num_layers=4, first_k_dense_replace=2
).with_engine(dtype='float32', remat='none')
QWEN3 = dataclasses.replace(
  MODEL_PRESETS['qwen3_tiny'], num_layers=4, hidden_size=32, head_dim=8
).with_engine(dtype='float32', remat='none')


def test_four_entry_mesh_shapes_mean_stage_one():
  """(Five entries, without 'context', mean context 1: tests/test_context.py.)"""
  assert sharding.resolve_mesh_shape((1, -1, 1, 1), 8) == (1, 1, 8, 1, 1, 1)
  assert sharding.resolve_mesh_shape((2, 1, -1, 2, 1), 8) == (2, 1, 2, 2, 1, 1)
  assert sharding.check_dcn_shape((2, 1, 1, 1), (1, 2, 4, 1, 1)) == (1, 2, 1, 1, 1, 1)
  assert sharding.check_dcn_shape((2, 1, 1, 1, 1), (2, 1, 4, 1, 1)) == (2, 1, 1, 1, 1, 1)
  assert tiny().laid_out('cpu', (1, 2, 4, 1)).engine.mesh_shape == (1, 1, 2, 4, 1, 1)
  mesh = sharding.make_mesh((2, 1, -1, 2, 1))
  want = {'stage': 2, 'data': 1, 'fsdp': 2, 'expert': 2, 'context': 1, 'tensor': 1}
  assert dict(mesh.shape) == want


def test_a_layer_count_the_stages_do_not_divide_is_refused():
  cfg = tiny(num_layers=3, pipeline_microbatches=2).laid_out('cpu', (2, 1, 4, 1, 1))
  with pytest.raises(ValueError, match=r'model.num_layers=3.*2 pipeline stages'):
    stages.check(cfg)
  for m in (1, 3):  # fewer micro-batches than stages, or a count they do not share equally
    cfg = tiny(num_layers=4, pipeline_microbatches=m).laid_out('cpu', (2, 1, 4, 1, 1))
    with pytest.raises(ValueError, match=rf'pipeline_microbatches={m} must be a multiple of the 2'):
      stages.check(cfg)
  cfg = tiny(num_layers=4, pipeline_microbatches=4, pipeline_repeats=2)
  assert stages.bubble(cfg.laid_out('cpu', (2, 1, 4, 1, 1))) == pytest.approx(1 / 9)


def loss_and_grads(cfg, mesh_shape, m=1, r=1, state=None):
  """(loss, gradients, state) of `cfg` on the test batch over a mesh of mesh_shape."""
  mesh = sharding.make_mesh(mesh_shape)
  rules = sharding.Rules.preset('fsdp_ep_tp')
  cfg = cfg.with_engine(pipeline_microbatches=m, pipeline_repeats=r, rules=rules)
  cfg = cfg.laid_out('cpu', mesh)
  with jax.set_mesh(mesh):
    if state is None:
      state = stages.store(create_sharded(cfg, optax.sgd(1.0), 0, mesh, cfg.engine.rules), cfg)
    b = {k: jax.device_put(v, sharding.batch_sharding(mesh)) for k, v in batch().items()}
    step = StepConfig(model=cfg, router_z_loss=1e-3, hidden_z_loss=1e-4)

    def loss(params):
      args = (state.moe_bias, state.frozen, graphdef_of(cfg), b, None, token_counts(b), step)
      return loss_fn(params, *args)

    (value, stats), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state.params)
    grads = stages.reorder(grads, stages.layout(cfg), (1, 1))  # layer order, to compare
    return float(value), jax.tree.map(np.asarray, grads), stats, state


def assert_same(got, want):
  assert got[0] == pytest.approx(want[0], rel=1e-5)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1])):
    scale = np.max(np.abs(w)) + 1e-30
    assert np.max(np.abs(g - w)) / scale < 1e-5, jax.tree_util.keystr(path)
  for key in ('load', 'ffn_experts_mean', 'router_z_loss'):
    np.testing.assert_allclose(got[2]['moe'][key], want[2]['moe'][key], rtol=1e-5, atol=1e-6)


def test_two_stages_equal_no_pipeline():
  cfg = tiny(num_layers=2)
  assert_same(loss_and_grads(cfg, (2, 1, -1, 2, 1), m=2), loss_and_grads(cfg, (1, 1, -1, 2, 1)))


@pytest.mark.slow
@pytest.mark.parametrize(
  'cfg', [LONGCAT, QWEN3, with_lora(LONGCAT)], ids=['longcat', 'qwen3', 'lora']
)
@pytest.mark.parametrize(
  'mesh_shape,m,r', [((2, 1, -1, 2, 1), 4, 1), ((4, 1, -1, 2, 1), 4, 1), ((2, 1, -1, 2, 1), 2, 2)]
)
def test_pipelines_equal_no_pipeline(cfg, mesh_shape, m, r):
  assert_same(loss_and_grads(cfg, mesh_shape, m, r), unpipelined(cfg))


@pytest.mark.slow
@pytest.mark.parametrize('quant', ['int8', 'int4'])
def test_a_quantised_base_pipelines_equal_no_pipeline(quant):
  """QLoRA: the int8/int4 frozen base is stacked over the layers like the float one, so each
  stage holds its own layers' codes and scales; the adapters' gradients are those of no
  pipeline."""
  cfg = with_lora(LONGCAT).with_engine(quant=quant, quant_group_size=16)
  assert_same(loss_and_grads(cfg, (2, 1, -1, 2, 1), m=4), unpipelined(cfg))


@functools.cache
def unpipelined(cfg):
  return loss_and_grads(cfg, (1, 1, -1, 2, 1))


@pytest.mark.slow
def test_a_two_stage_checkpoint_restores_without_stages(tmp_path):
  _, _, _, state = loss_and_grads(LONGCAT, (2, 1, -1, 2, 1), m=2)
  ckpt = Checkpointer(str(tmp_path), every=1, keep=1, async_save=False)
  ckpt.save(1, state, {'position': 0}, {'step': 1})
  ckpt.wait()
  mesh = sharding.make_mesh((1, 1, -1, 2, 1))
  cfg = LONGCAT.with_engine(rules=sharding.Rules.preset('fsdp_ep_tp')).laid_out('cpu', mesh)
  with jax.set_mesh(mesh):
    target = create_sharded(cfg, optax.sgd(1.0), 1, mesh, cfg.engine.rules)
  saved, _, _ = ckpt.restore(1, target)
  restored = dataclasses.replace(target, **saved)
  got = loss_and_grads(LONGCAT, (1, 1, -1, 2, 1), state=restored)
  assert_same(got, loss_and_grads(LONGCAT, (2, 1, -1, 2, 1), m=2, state=state))


def circular(mesh):
  """The 4-layer LongCat over 2 stages x 2 repeats of `mesh`, 2 micro-batches."""
  cfg = LONGCAT.with_engine(pipeline_microbatches=2, pipeline_repeats=2)
  return cfg.with_engine(rules=sharding.Rules.preset('fsdp_ep_tp')).laid_out('cpu', mesh)


def test_a_circular_schedule_stores_each_stages_runs_and_checkpoints_in_any_order(tmp_path):
  """With R = 2 over 2 stages, stage s's block of the stored 'layers' axis holds layers
  (r * 2 + s) * Lc + j: its own runs, so no weight moves between stages in a step. Saved so, a
  checkpoint names its order, and a run without repeats restores it in layer order."""
  assert list(stages.layer_order(8, (2, 2))) == [0, 1, 4, 5, 2, 3, 6, 7]
  assert list(stages.layer_order(4, (1, 1))) == [0, 1, 2, 3]
  mesh = sharding.make_mesh((2, 1, -1, 2, 1))
  cfg = circular(mesh)
  assert stages.layout(cfg) == (2, 2)
  with jax.set_mesh(mesh):
    state = create_sharded(cfg, optax.adam(1e-3), 0, mesh, cfg.engine.rules)
    want = jax.tree.map(np.asarray, state.saved())
    stored = stages.store(state, cfg)
  flat = jax.tree_util.tree_leaves_with_path(stored.saved())
  moved = 0
  for (path, got), w in zip(flat, jax.tree.leaves(want)):
    if 'layers' in jax.tree_util.keystr(path) and got.ndim and got.shape[0] == 4:
      np.testing.assert_array_equal(np.asarray(got), w[[0, 2, 1, 3]], jax.tree_util.keystr(path))
      stage0 = {s.index[0] for s in got.addressable_shards if s.device in mesh.devices[0].flat}
      assert stage0 == {slice(0, 2)}  # layers 0 and 2: stage 0's runs of both repeats
      moved += 1
    else:
      np.testing.assert_array_equal(np.asarray(got), w)
  assert moved > 20  # weights, Adam's two moments, router biases
  with jax.set_mesh(mesh):
    circular_ckpt = Checkpointer(str(tmp_path), every=1, keep=1, async_save=False, layers=(2, 2))
    circular_ckpt.save(1, stored, {'position': 0}, {'step': 1})
    circular_ckpt.close()
    target = create_sharded(cfg, optax.adam(1e-3), 1, mesh, cfg.engine.rules)
    ckpt = Checkpointer(str(tmp_path), every=1, keep=1, async_save=False)
    saved, _, meta = ckpt.restore(1, target)
  assert meta['layer_order'] == [2, 2]
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, saved), want)


def test_a_teacher_is_stored_in_its_own_configs_order():
  """Online distillation: the student's and the teacher's stacked layers each in the order of
  their own config (here 4 and 8 layers over 2 stages x 2 repeats)."""
  import types

  from moetrain.run.startup import stored

  mesh = sharding.make_mesh((2, 1, -1, 2, 1))
  cfg = circular(mesh)
  teacher_cfg = dataclasses.replace(cfg, num_layers=8)
  with jax.set_mesh(mesh):
    state = create_sharded(cfg, optax.sgd(1.0), 0, mesh, cfg.engine.rules)
    teacher = create_sharded(teacher_cfg, optax.sgd(1.0), 1, mesh, cfg.engine.rules).params
    state = dataclasses.replace(state, teacher=teacher)
    want = jax.tree.map(np.asarray, state)
    setup = types.SimpleNamespace(model=cfg, step=types.SimpleNamespace(teacher=teacher_cfg))
    got = jax.tree.map(np.asarray, stored(setup, state))
  path = ('layers', 'attn_0', 'q_a', 'kernel')
  flat = lambda tree: dict(nnx.to_flat_state(tree))
  for part, order in (('params', [0, 2, 1, 3]), ('teacher', [0, 1, 4, 5, 2, 3, 6, 7])):
    g, w = flat(getattr(got, part))[path], flat(getattr(want, part))[path]
    np.testing.assert_array_equal(g.get_value(), w.get_value()[order])


def test_the_bias_controller_updates_each_stored_layer_by_its_own_load():
  mesh = sharding.make_mesh((2, 1, -1, 2, 1))
  cfg = circular(mesh)
  flat = cfg.with_engine(pipeline_repeats=1)
  with jax.set_mesh(mesh):
    bias = create_sharded(cfg, optax.sgd(1.0), 0, mesh, cfg.engine.rules).moe_bias
    load_LX = jax.random.uniform(jax.random.key(0), (4, cfg.num_experts_total)) * 100
    want = bias_update(bias, load_LX, 0, StepConfig(model=flat))
    before = jax.tree.map(np.asarray, bias)
    got = bias_update(stages.store(bias, cfg), load_LX, 0, StepConfig(model=cfg))  # (donated)
    got = stages.reorder(got, (2, 2), (1, 1))
  jax.tree.map(np.testing.assert_allclose, got, want)
  assert not jax.tree.all(jax.tree.map(lambda a, b: np.allclose(a, b), want, before))


@pytest.mark.slow
def test_dense_first_layers_pipeline_run_by_run():
  got = loss_and_grads(DEEPSEEK, (2, 1, -1, 2, 1), m=4)
  assert_same(got, unpipelined(DEEPSEEK))


PIPELINED = {
  'mesh.shape': (2, 1, 2, 2, 1),
  'mesh.dcn_shape': (2, 1, 1, 1, 1),  # the stages across two slices
  'engine.pipeline_microbatches': 4,
  'model.num_layers': 4,
  'data.global_batch_size': 16,
}


def test_the_planner_counts_the_bubble_and_the_activations_over_the_network():
  from configs import longcat_pretrain
  from moetrain.planner import sizes, tpu_plan
  from moetrain.run.startup import build

  config = tpu_plan.with_overrides(longcat_pretrain.get_config('variant=tiny'), PIPELINED)
  setup = build(config, num_devices=8, process_count=1, platform='tpu')
  p = sizes.pipeline_traffic(setup)
  act = 16 // 4 * setup.data.seq_len * setup.model.hidden_size * 2  # bfloat16 rows of a micro
  assert p['micro_activation_bytes'] == act
  assert p['bubble'] == pytest.approx(1 / 5)
  # 5 iterations, forward and backward, each way over a boundary; both of the ring's two
  # boundaries cross the slices.
  assert p['boundary_bytes_per_step'] == 2 * 2 * 5 * act
  assert p['dcn_bytes_per_step'] == 2 * 2 * 2 * 5 * act


def test_micro_batches_the_splash_kernel_cannot_split_are_refused():
  """On TPU the splash kernel runs over the batch shards: a pipeline micro-batch of fewer rows
  than shards (16 rows / 8 micro-batches = 2 over 4 shards) is refused before any compile."""
  from configs import longcat_pretrain
  from moetrain.planner import tpu_plan
  from moetrain.run.startup import build

  over = PIPELINED | {'engine.pipeline_microbatches': 8}
  config = tpu_plan.with_overrides(longcat_pretrain.get_config('variant=tiny'), over)
  assert config.data.seq_len % 128 == 0  # the splash kernel's blocks
  with pytest.raises(ValueError, match=r'micro-batch of 2 rows .* 4 batch shards'):
    build(config, num_devices=8, process_count=1, platform='tpu')
  build(config, num_devices=8, process_count=1, platform='cpu')  # the XLA path takes it


@pytest.mark.slow
def test_a_pipelined_step_compiles_for_two_tpu_slices():
  from configs import longcat_pretrain
  from moetrain.planner import tpu_plan

  r = tpu_plan.plan(longcat_pretrain.get_config('variant=tiny'), '2xv5e-4', PIPELINED)
  assert r['fits'] and r['mesh']['stage'] == 2 and r['pipeline']['stages'] == 2


LOGGED_FLAGS = [
  '--config.model.num_layers=4',
  '--config.engine.dtype=float32',
  '--config.engine.param_dtype=float32',
  '--config.train.steps=12',
  '--config.optim.warmup_steps=2',
  '--config.data.global_batch_size=8',
  '--config.engine.pipeline_microbatches=4',
]


def logged_losses(workdir, mesh_shape: str, extra=()) -> list[str]:
  """The training losses `python -m moetrain.main` logs for the tiny LongCat in float32 (extra:
  further flags, later ones winning)."""
  from tests.helpers import run_command

  args = [
    '--config=configs/longcat_pretrain.py',
    *LOGGED_FLAGS,
    f'--config.mesh.shape={mesh_shape}',
    f'--workdir={workdir}',
    *extra,
  ]
  out = run_command('moetrain.main', *args)
  assert out.returncode == 0, out.stderr[-3000:]
  text = out.stdout + out.stderr
  return [line.split('lr')[0] for line in text.splitlines() if line.startswith('step ')]


@pytest.mark.slow
def test_gradient_accumulation_over_a_pipeline_logs_the_losses_of_no_pipeline(tmp_path):
  """Two accumulated micro-batches, each run through the stages' own micro-batches."""
  accum = [
    '--config.optim.grad_accum_steps=2',
    '--config.data.global_batch_size=16',  # micro-batches of the other test's 8 rows
    '--config.train.steps=4',
    '--config.train.log_every=1',
  ]
  one = logged_losses(tmp_path / 'one', '(1,1,-1,2,1)', accum)
  assert len(one) >= 2 and one == logged_losses(tmp_path / 'two', '(2,1,-1,2,1)', accum)


@pytest.mark.slow
def test_the_pipelined_command_logs_the_losses_of_no_pipeline(tmp_path):
  one = logged_losses(tmp_path / 'one', '(1,1,-1,2,1)')
  assert one and one == logged_losses(tmp_path / 'two', '(2,1,-1,2,1)')
  assert one == logged_losses(tmp_path / 'circular', '(2,1,-1,2,1)', CIRCULAR)


CIRCULAR = ['--config.engine.pipeline_repeats=2']  # 4 layers over 2 stages: 2 runs each


@pytest.mark.slow
@pytest.mark.parametrize('extra', [[], CIRCULAR], ids=['gpipe', 'circular'])
def test_the_tools_read_a_pipelined_runs_checkpoint(tmp_path, extra):
  """evaluate, generate and export on a stage-2 run's directory (8 emulated devices, the run's
  own mesh): evaluate scores the last checkpoint as the run's own end-of-run evaluation did;
  export writes the layers a run without stages writes from the same checkpoint."""
  import json

  from tests.helpers import run_command

  workdir = tmp_path / 'run'
  assert logged_losses(workdir, '(2,1,-1,2,1)', extra)
  with open(workdir / 'metrics.jsonl') as f:
    last_eval = [r for r in map(json.loads, f) if r['kind'] == 'eval'][-1]
  out = run_command('moetrain.tools.evaluate', f'--workdir={workdir}')
  assert out.returncode == 0, out.stderr[-3000:]
  words = out.stdout.splitlines()[-1].split()
  assert words[:2] == ['step', '12:'], words
  assert float(words[3]) == pytest.approx(last_eval['loss'], rel=1e-5)
  out = run_command(
    'moetrain.tools.generate', f'--workdir={workdir}', '--prompt=the', '--max_new_tokens=4'
  )
  assert out.returncode == 0, out.stderr[-3000:]
  export = tmp_path / 'export'
  out = run_command('moetrain.tools.export', f'--workdir={workdir}', f'--out={export}')
  assert out.returncode == 0, out.stderr[-3000:]
  assert (export / 'config.json').exists() and any(export.glob('*.safetensors'))
  if extra:  # the same checkpoint exported by a tool run without stages: the same tensors
    from safetensors.numpy import load_file

    unstaged = tmp_path / 'unstaged'
    with open(workdir / 'config.json') as f:
      saved = json.load(f)
    assert saved['engine']['pipeline_repeats'] == 2
    out = run_command(
      'moetrain.tools.export',
      f'--workdir={workdir}',
      f'--out={unstaged}',
      '--config=configs/longcat_pretrain.py',
      *LOGGED_FLAGS,
      '--config.mesh.shape=(1,1,-1,2,1)',
    )
    assert out.returncode == 0, out.stderr[-3000:]
    tensors = lambda d: {
      k: v for f in sorted(d.glob('*.safetensors')) for k, v in load_file(f).items()
    }
    got, want = tensors(export), tensors(unstaged)
    assert got.keys() == want.keys()
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], k)


@pytest.mark.slow
@pytest.mark.parametrize('extra', [[], CIRCULAR], ids=['gpipe', 'circular'])
def test_a_run_resumes_without_stages_after_a_stage_change(tmp_path, extra):
  """A stage-2 run checkpoints at step 6; the same run directory resumed from there with no
  pipeline (train.resume_step=6, mesh.shape without stages) logs steps 7-12 as the pipelined run
  did: a checkpoint restores with any stage count (a circular one's stored order moved back to
  layer order)."""
  every = ['--config.train.checkpoint_every=6', '--config.train.log_every=1']
  staged = logged_losses(tmp_path / 'run', '(2,1,-1,2,1)', [*every, *extra])
  resumed = logged_losses(
    tmp_path / 'run', '(1,1,-1,2,1)', [*every, '--config.train.resume_step=6']
  )
  later = [line for line in staged if int(line.split()[1]) > 6]
  assert len(later) == 6 and resumed[-6:] == later


@pytest.mark.slow  # ~1 minute: two jobs of two processes
@pytest.mark.parametrize('repeats', [1, 2], ids=['gpipe', 'circular'])
def test_a_stage_axis_across_two_processes_logs_the_losses_of_none(tmp_path, repeats):
  """A batch's rows split over 'stage' too, so each host loads the rows of its own stage: a
  stage axis spanning two processes (one stage each) trains, and logs the losses of the same
  two processes without a pipeline (circular: each process stores its own stage's runs)."""
  from tests.test_preemption import Job, train_losses

  common = [
    '--config.train.steps=3',
    '--config.optim.warmup_steps=1',
    '--config.engine.dtype=float32',
    '--config.model.num_layers=4',
  ]
  common.append('--config.engine.param_dtype=float32')
  staged = [
    '--config.mesh.shape=(2,1,-1,1,1)',
    '--config.engine.pipeline_microbatches=2',
    f'--config.engine.pipeline_repeats={repeats}',
  ]
  Job(str(tmp_path / 'staged'), *common, *staged, processes=2, devices=8).wait()
  Job(str(tmp_path / 'none'), *common, processes=2, devices=8).wait()
  got, want = train_losses(str(tmp_path / 'staged')), train_losses(str(tmp_path / 'none'))
  assert sorted(got) == sorted(want) == [1, 2, 3]
  for step in want:
    assert got[step] == pytest.approx(want[step], rel=1e-5)

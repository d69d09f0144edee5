"""The TPU planner: topology names, the compiler's HBM limits, the train step compiled for a TPU
slice from this CPU host (fits on one side of a boundary, not on the other), the TPU-only paths
(megablox, the ragged exchange, host offload) compiled, and loop-aware FLOP counting."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import longcat_lora, longcat_pretrain
from moetrain.planner import topology, tpu_plan
from moetrain.training import aot
from tests.helpers import tpu_proxy

pytest.importorskip('libtpu', reason="the planner needs libtpu: pip install -e '.[tpu]'")


@pytest.mark.parametrize(
  'name,libtpu_name,chips,devices',
  [
    ('v5p-128', 'v5p:4x4x4', 64, 64),
    ('v5p-8', 'v5p:2x2x1', 4, 4),
    ('v5p-64', 'v5p:2x4x4', 32, 32),
    ('v4-32', 'v4:2x2x4', 16, 32),
    ('v5litepod-16', 'v5e:4x4', 16, 16),
    ('v6e-256', 'v6e:16x16', 256, 256),
    ('v6e-1', 'v6e:1x1', 1, 1),
    ('v5p:4x4x8', 'v5p:4x4x8', 128, 128),
  ],
)
def test_topology_names(name, libtpu_name, chips, devices):
  t = topology.parse(name)
  assert (t.topology_name, t.chips, t.num_devices) == (libtpu_name, chips, devices)


@pytest.mark.parametrize('bad', ['v9-8', 'v5p', 'v5p-6', 'v5p:4x4', 'tpu7x-8'])
def test_bad_topology_names_are_refused(bad):
  with pytest.raises(ValueError, match='--topology'):
    topology.parse(bad)


@pytest.mark.parametrize('gen', sorted(topology.CHIPS))
def test_hbm_table_is_the_compilers_limit(gen):
  """Each generation's per-device HBM is what XLA's TPU compiler refuses a program above."""
  chip = topology.CHIPS[gen]
  sides = '2x2x1' if chip.dims == 3 else '2x2'
  dev = topology.topology_devices(f'{gen}:{sides}')[0]
  assert dev.device_kind == chip.device_kind
  s = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([dev]), ('x',)), jax.P())
  n = 2**31 - 16  # 8 GiB float32 operands, whose cumulative sums must all be live
  f = jax.jit(lambda *a: sum(jnp.cumsum(x * y)[::2] for x, y in zip(a[:-1], a[1:])))
  args = [jax.ShapeDtypeStruct((n,), jnp.float32, sharding=s)] * 14
  with pytest.raises(jax.errors.JaxRuntimeError, match='RESOURCE_EXHAUSTED') as e:
    f.lower(*args).compile()
  limit = re.search(r'available HBM \(([\d.]+)G\)', str(e.value)).group(1)
  assert float(limit) == pytest.approx(chip.hbm_bytes / 2**30, abs=0.006)


TINY_EP = {'mesh.shape': (1, 2, 2, 1)}


@pytest.fixture(scope='module')
def tiny_plan():
  """Tiny LoRA planned for a v5e-4 with experts over 2 chips, and what the planner said."""
  compiler = {'engine.frozen_layout': 'compiler'}  # (the eval step compiled for XLA's choice)
  said = []
  r = tpu_plan.plan(
    longcat_lora.get_config('variant=tiny'), 'v5e-4', TINY_EP | compiler, said.append
  )
  return r, said


def test_plan_compiles_the_train_and_eval_steps_for_a_slice(tiny_plan, tmp_path, capsys):
  """The TPU engine is chosen (not this host's), both steps compile, and the report has every
  per-chip figure and a labelled estimate."""
  r, said = tiny_plan
  # The planner talks while it compiles (a full-scale compile takes minutes).
  assert said[0].startswith('compiling the train step for 4 TPU v5 lite devices'), said
  assert said[-1].startswith('compiled the eval step in '), said
  assert r['engine']['moe_backend'] == 'ragged_dot' and r['engine']['moe_ep_comm'] == 'ragged'
  assert r['engine']['frozen_layout'] == 'compiler'
  assert r['fits'] and 0.9 < r['headroom'] < 1
  m = r['per_chip_bytes']
  assert m['total'] == m['arguments'] + m['outputs'] - m['aliased'] + m['temporaries'] + m['code']
  ev = r['eval_per_chip_bytes']['total']
  assert ev > 0 and r['need_bytes'] == max(m['total'], ev)  # what must fit: the larger step
  assert r['need_step'] == ('train step' if m['total'] >= ev else 'eval step')
  assert r['hbm_bytes'] == topology.CHIPS['v5e'].hbm_bytes
  # Two layers under scan: the compiled FLOPs count them twice, XLA's cost analysis once.
  # Loop trips counted (cost_analysis counts each body once, but prices ragged_dot's convolution
  # once per expert group, which hlo_cost does not: the two differ less than the loops alone).
  assert 2 in r['loops'] and r['hlo_flops_per_chip'] > r['xla_cost_analysis_flops_per_chip']
  assert 0 < r['est_mfu'] < 1 and r['est_step_seconds'] > 0
  path = tmp_path / 'plan.json'
  tpu_plan._write(str(path), r)
  saved = json.loads(path.read_text())
  for key in ('topology', 'chips', 'mesh', 'per_chip_bytes', 'hbm_bytes', 'fits',
              'compile_seconds', 'est_step_seconds', 'est_mfu', 'overrides', 'buffers',
              'peak_buffers'):  # fmt: skip
    assert key in saved
  # What is alive at the peak: at most the reported temporaries, the layer loop's share first.
  peak = saved['peak_buffers']
  assert 0 < peak['bytes'] <= m['temporaries'] and peak['live'][0]['op'] == 'while'
  tpu_plan.print_plan(r)
  out = capsys.readouterr().out
  assert 'ESTIMATE' in out and 'fits' in out and "the compiler's temporaries are" in out
  assert f'needs {tpu_plan._gib(r["need_bytes"])} ({r["need_step"]}, the larger)' in out
  assert 'alive at the peak' in out and 'transpose(jvp())/while' in out


def test_a_second_identical_plan_is_answered_from_the_cache(
  tiny_plan, tmp_path, capsys, monkeypatch
):
  """A plain plan is cached by its inputs (the key that --search's plans use): the same
  command again compiles nothing and prints the same plan; other settings miss the cache."""
  compiled = []
  monkeypatch.setattr(tpu_plan, 'plan', lambda *a, **k: compiled.append(a[2:]) or tiny_plan[0])
  config = tpu_plan.with_overrides(longcat_lora.get_config('variant=tiny'), TINY_EP)
  cache = str(tmp_path / 'plans.json')
  run = lambda c: tpu_plan.main(c, 'v5e-4', False, False, '', 1, cache=cache)
  run(config)
  first = capsys.readouterr().out
  run(config)
  second = capsys.readouterr().out
  assert len(compiled) == 1 and 'answered from the plan cache' in second
  strip = lambda out: [ln for ln in out.splitlines() if not ln.startswith('[v5e-4]')]
  assert strip(first) == strip(second) and 'ESTIMATE' in first
  run(tpu_plan.with_overrides(config, {'data.seq_len': 64}))
  assert len(compiled) == 2


@pytest.mark.slow  # two full TPU compiles (40 s): make test-slow
def test_a_batch_that_fits_and_one_that_does_not():
  """One side of the boundary and the other, on one v5e chip (15.75 GiB): without loss blocks
  (engine.loss_chunk=0) the step holds whole float32 [B, T, V] logits, 256 MiB per row at 512
  positions and a 131072-token vocabulary: 8 rows fit, 64 do not."""
  over = {
    'mesh.shape': (1, 1, 1, 1),
    'data.seq_len': 512,
    'model.vocab_size': 131072,
    'engine.loss_chunk': 0,
    'data.eval_split': '',
  }
  config = longcat_lora.get_config('variant=tiny')
  hbm = topology.CHIPS['v5e'].hbm_bytes
  fits = tpu_plan.plan(config, 'v5e-1', over | {'data.global_batch_size': 8})
  assert fits['fits'] and fits['per_chip_bytes']['total'] < hbm
  assert fits['per_chip_bytes']['temporaries'] > 8 * 512 * 131072 * 4  # the logits
  over = tpu_plan.plan(config, 'v5e-1', over | {'data.global_batch_size': 64})
  assert not over['fits'] and 'HBM' in over['error']
  assert over['per_chip_bytes']['total'] > hbm


@pytest.mark.slow  # (minutes on 2 cores: `make test-slow`)
def test_tpu_only_paths_compile():
  """The megablox Pallas kernel (Mosaic, not interpreted), the ragged all-to-all exchange and
  host offload of the MoE output, compiled by XLA's TPU compiler in one step."""
  from moetrain.core import sharding
  from moetrain.run.startup import build
  from moetrain.training import aot

  config = tpu_plan.with_overrides(
    longcat_lora.get_config('variant=tiny'),
    TINY_EP
    | {
      'engine.moe_backend': 'megablox',
      'engine.remat': 'offload',
      'model.hidden_size': 256,
      'model.expert_ffn_hidden_size': 128,
    },  # fmt: skip
  )
  devices = topology.parse('v5e-4').devices()
  setup = build(config, num_devices=4, process_count=1, platform='tpu')
  mesh = sharding.make_mesh(setup.mesh_shape, devices)
  steps = aot.compile_steps(setup, mesh, evaluate=False)
  text = steps['train'].executable.as_text()
  assert 'tpu_custom_call' in text and 'gmm' in text  # the kernel, compiled
  assert 'ragged-all-to-all' in text or 'ragged_all_to_all' in text


@pytest.mark.slow  # ~16 s; tests/test_accelerator_lowering.py lowers megablox
def test_megablox_without_expert_parallelism_compiles_for_tpu():
  """Full training on TPU picks megablox; on a mesh without an expert axis its Mosaic kernel must
  run inside a shard_map (XLA refused: "Mosaic kernels cannot be automatically partitioned")."""
  lanes = {'model.hidden_size': 256, 'model.expert_ffn_hidden_size': 128, 'data.eval_split': ''}
  r = tpu_plan.plan(longcat_pretrain.get_config(), 'v5e-4', lanes)
  assert r['engine']['moe_backend'] == 'megablox' and r['mesh']['expert'] == 1
  assert r['fits'], r


@pytest.mark.slow
def test_remat_table_compiles_every_policy(tmp_path, capsys):
  """`--remat`: each policy compiled for the slice; full remat keeps less than none and pays
  for it in recomputed FLOPs; the table prints a row per policy."""
  config = tpu_plan.with_overrides(longcat_lora.get_config('variant=tiny'), TINY_EP)
  config.data.global_batch_size, config.data.seq_len = 8, 512
  rows = tpu_plan.remat_table(config, 'v5e-4', workers=1, cache=str(tmp_path / 'plans.json'))
  by = {r['remat']: r for r in rows}
  assert set(by) == {'none', 'full', 'save_dots', 'save_moe', 'offload'}
  assert all(r['plan']['fits'] for r in rows), rows
  full, none = by['full']['plan'], by['none']['plan']
  assert full['per_chip_bytes']['temporaries'] < none['per_chip_bytes']['temporaries']
  assert by['full']['flops_vs_none'] > 1.1 and by['none']['flops_vs_none'] == 1
  tpu_plan.print_remat_table(rows, 'full')
  out = capsys.readouterr().out
  assert all(f' {p} ' in out for p in by) and '* full' in out


def test_loop_trip_counts_are_counted():
  """A scan of 5 matmuls: 5x the FLOPs of its body, which XLA's cost analysis counts once."""

  def f(x, w):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0]

  x, w = jnp.ones((64, 128)), jnp.ones((5, 128, 128))
  compiled = aot.compile_fn('scan', jax.jit(f), (x, w), cache=False)
  cost = compiled.cost
  assert cost.flops == 5 * 2 * 64 * 128 * 128
  assert cost.flops_once == 2 * 64 * 128 * 128
  assert cost.flops_once <= compiled.xla_flops < cost.flops


@pytest.mark.parametrize('variant', ['', 'variant=flash'])
def test_model_flops_are_the_training_logs(variant):
  """The planner's MFU numerator is the training log's: 6 x the active weights plus causal
  attention counted once per block (an earlier planner counted attention twice: 10% of the
  tiny model's FLOPs, 13% of flash's at 8192 tokens)."""
  from moetrain.run import metrics
  from moetrain.run.startup import build

  setup = build(longcat_pretrain.get_config(variant), num_devices=16, process_count=1)
  cfg, t = setup.model, setup.data.seq_len
  flops, _ = tpu_plan.model_flops(setup)
  want = metrics.flops_per_token(cfg, t, cfg.expected_ffn_experts)
  # The planner also counts the norms' scales as active weights (a few K per layer).
  np.testing.assert_allclose(flops / (setup.data.global_batch_size * t), want, rtol=2e-3)


def test_every_planned_command_builds_on_its_slice():
  """bench/tpu_plans.py's commands (the README's TPU rows): each config with its overrides makes
  a valid run on its slice's devices (mesh, batch shards, micro-batches), without compiling."""
  from bench import tpu_plans
  from moetrain.run.startup import build

  for _, module, arg, topo, over in tpu_plans.PLANS.values():
    config = tpu_plan.with_overrides(module.get_config(arg), over)
    devices = topology.parse(topo).num_devices
    build(config, num_devices=devices, process_count=1, platform='tpu')


@pytest.mark.slow
def test_search_and_smallest_compile_for_real(tmp_path, capsys):
  """--search and --smallest on the tiny model with real TPU compiles in two spawned worker
  processes: the search ends on a plan with headroom and the flags it prints; each method's
  smallest v5e slice fits and the one below it does not."""
  cache = str(tmp_path / 'plans.json')
  config = longcat_lora.get_config('variant=tiny')
  best = tpu_plan.search(config, 'v5e-4', workers=2, rounds=1, cache=cache)
  assert tpu_plan._ok(best)
  rows = tpu_plan.smallest(config, ['v5e'], workers=2, max_chips=16, cache=cache)
  assert [r['method'] for r in rows] == list(tpu_plan.METHODS)
  for row in rows:
    r = row['plan']
    assert r and tpu_plan._ok(r), row
    if r['chips'] > 1:
      smaller = topology.CHIPS['v5e']
      half = f'v5e:{topology._torus(r["chips"] // 2, smaller.dims)}'
      over = tpu_plan.METHODS[row['method']] | tpu_plan.slice_overrides(config, r['chips'] // 2)
      (below,) = tpu_plan.plan_many(config, [(half, over)], 1, cache)
      assert not tpu_plan._ok(below)


def test_a_mesh_whose_axes_split_the_torus_sides():
  """v5p-512 is a 4x8x8 torus: the flash mesh (1, 16, 16, 1) needs sides split between fsdp and
  expert, which jax.make_mesh refuses; the mesh is built all the same, every device once."""
  from moetrain.core import sharding

  devices = topology.parse('v5p-512').devices()
  mesh = sharding.make_mesh((1, -1, 16, 1), devices)
  assert dict(mesh.shape) == {
    'stage': 1,
    'data': 1,
    'fsdp': 16,
    'expert': 16,
    'context': 1,
    'tensor': 1,
  }
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


@pytest.mark.slow  # (minutes on 2 cores: `make test-slow`)
def test_multislice_puts_the_dcn_axis_across_slices():
  """'2xv5e-4' is two v5e-4 slices: mesh.dcn_shape=(2, 1, 1, 1) puts each half of the data axis
  in one slice (only its gradients cross the data-center network), and the step compiles; a
  dcn_shape that asks for slices the devices are not of is an error saying how to get them."""
  from moetrain.core import sharding

  topo = topology.parse('2xv5e-4')
  assert (topo.chips, topo.num_devices, topo.cloud_name, topo.slices) == (8, 8, '2xv5e-4', 2)
  devices = topo.devices()
  mesh = sharding.make_mesh((2, 2, 2, 1), devices, dcn=(2, 1, 1, 1))
  for half in range(2):  # the data axis (after a stage axis of 1)
    assert {d.slice_index for d in mesh.devices[0, half].flat} == {half}
  over = {'mesh.shape': (2, 2, 2, 1), 'mesh.dcn_shape': (2, 1, 1, 1)}
  r = tpu_plan.plan(longcat_lora.get_config('variant=tiny'), '2xv5e-4', over)
  assert r['fits'] and r['chips'] == 8
  # Data across the slices: the adapters' float32 gradients, all-reduced over 2 slices (once
  # each way: 2 (d - 1) / d = 1 of a chip's share), are what crosses. FSDP across them moves
  # the frozen base's gathers as well.
  from moetrain.planner import sizes
  from moetrain.run.startup import build

  config = tpu_plan.with_overrides(longcat_lora.get_config('variant=tiny'), over)
  model = build(config, num_devices=8, process_count=1, platform='tpu').model
  assert 0 < r['dcn_bytes_per_chip'] <= 4 * sizes.param_counts(model)['adapters']
  # The estimate prices those bytes at the slice's DCN bandwidth (v5e: 25 Gbps per chip).
  dcn_s = r['est_seconds_by_part']['dcn']
  assert dcn_s == pytest.approx(r['dcn_bytes_per_chip'] / (25e9 / 8))
  assert r['est_step_seconds'] >= dcn_s
  fsdp = {'mesh.shape': (1, 4, 2, 1), 'mesh.dcn_shape': (1, 2, 1, 1)}
  r2 = tpu_plan.plan(longcat_lora.get_config('variant=tiny'), '2xv5e-4', fsdp)
  assert r2['dcn_bytes_per_chip'] > r['dcn_bytes_per_chip']
  with pytest.raises(ValueError, match=r'asks for 2 slices, but the 4 devices are of 1'):
    sharding.make_mesh((2, 2, 1, 1), topology.parse('v5e-4').devices(), dcn=(2, 1, 1, 1))
  with pytest.raises(ValueError, match=r'mesh.dcn_shape=\(4, 1, 1, 1\) must divide'):
    sharding.make_mesh((2, 2, 2, 1), devices, dcn=(4, 1, 1, 1))


def test_auto_picks_megablox_where_tpu_expert_weights_train():
  from moetrain.core.engine import LoraConfig
  from moetrain.model import dispatch
  from moetrain.model.config import ModelConfig

  tpu = ModelConfig().with_engine(platform='tpu')
  assert dispatch.resolve_backend(tpu) == 'megablox'
  assert dispatch.resolve_backend(
    ModelConfig(lora=LoraConfig(rank=4)).with_engine(platform='tpu')
  ) == ('ragged_dot')
  assert (
    dispatch.resolve_backend(ModelConfig().with_engine(platform='gpu')) == 'tokamax'
  )  # (installed)
  assert dispatch.resolve_backend(ModelConfig().with_engine(platform='cpu')) in (
    'grouped',
    'gathered',
  )


@pytest.mark.slow
def test_full_training_on_tpu_uses_megablox_for_the_expert_weight_gradients():
  """XLA's TPU compiler lowers ragged_dot's weight gradient as a dense matmul over every row for
  each local expert; full training ('auto') therefore picks megablox on TPU, whose compiled
  program does less matmul work (experts of 256 x 128, 4 local experts per shard)."""
  from configs import longcat_pretrain

  shapes = {
    'model.hidden_size': 256,
    'model.expert_ffn_hidden_size': 128,
    'mesh.shape': (1, 2, 2, 1),
  }
  config = longcat_pretrain.get_config()
  auto = tpu_plan.plan(config, 'v5e-4', shapes)
  ragged = tpu_plan.plan(config, 'v5e-4', shapes | {'engine.moe_backend': 'ragged_dot'})
  assert auto['engine']['moe_backend'] == 'megablox'
  assert auto['fits'] and ragged['fits']
  assert auto['hlo_flops_per_chip'] < 0.95 * ragged['hlo_flops_per_chip']


@pytest.mark.slow
def test_expert_adapters_add_little_to_the_tpu_step():
  """The routed experts' LoRA adapters on TPU run through the megablox kernel, their weight
  gradient through its transposed kernel (per expert over its own rows), their A factors with the
  rank off the 128 lanes. Through XLA's ragged_dot that gradient was a dense product over every
  local expert, and the rank-minor layouts padded 16x: on 4 layers of 64 experts of 1024 x 1024,
  1.41e12 compiled FLOPs against 1.09e12 without the adapters, and 2.00 GiB of temporaries
  against 0.72 (bench/RESULTS.md, "Expert LoRA adapters on TPU"). Here 32 experts of 512 x 512, 4 layers, v5e-1:
  169 MiB of temporaries against 105 without them (the code before: 388)."""
  over = tpu_proxy(4)
  config = longcat_lora.get_config('variant=tiny')
  no_experts = config.lora.targets.replace(r'|experts\.(gate|up|down)$', '')
  assert no_experts != config.lora.targets
  both = [
    tpu_plan.plan(config, 'v5e-1', over | extra) for extra in ({}, {'lora.targets': no_experts})
  ]
  (flops, without_flops), (temp, without_temp) = (
    [r[key] for r in both] for key in ('hlo_flops_per_chip', 'per_chip_bytes')
  )
  assert flops < 1.05 * without_flops, (flops, without_flops)
  assert temp['temporaries'] < 1.75 * without_temp['temporaries'], (temp, without_temp)


GPT_OSS_VMEM = (
  'RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\nRan out of memory in memory space vmem '
  'while allocating on stack for %fusion.1850 = bf16[32768,2880]{1,0:T(8,128)(2,1)} fusion(...), '
  'metadata={op_type="eval_jaxpr" op_name="jit(train_step)/jvp()/while/body/ragged_dot_general"}. '
  'Scoped allocation with size 16.94M and limit 16.00M exceeded scoped vmem limit by 965.0K.'
)


def _vmem_case():
  from moetrain.model.config import ModelConfig

  devices = topology.parse('v5e-1').devices()
  spec = jax.sharding.NamedSharding(
    jax.sharding.Mesh(devices, ('x',)), jax.sharding.PartitionSpec()
  )
  x = jax.ShapeDtypeStruct((2048, 2880), jnp.bfloat16, sharding=spec)
  w = jax.ShapeDtypeStruct((2880, 2880), jnp.bfloat16, sharding=spec)
  fn = lambda x, w: jnp.tanh(x @ w) @ w
  return fn, (x, w), lambda kib: ModelConfig().with_engine(platform='tpu', tpu_scoped_vmem_kib=kib)


def test_the_scoped_vmem_limit_reaches_libtpu_and_its_overflow_names_the_key():
  """XLA:TPU gives each fusion a scoped VMEM limit; a fusion that asks more stops the compile
  (gpt-oss-20b's int4 experts on a v5e did: the error, as libtpu printed it, names
  engine.tpu_scoped_vmem_kib with what was asked). The step's compiler options
  (train_step.compiler_options) carry that key to libtpu, which takes it."""
  from moetrain.model.config import ModelConfig
  from moetrain.training.train_step import compiler_options

  assert aot.oom_message(GPT_OSS_VMEM) == (
    'E1001: CompileTimeScopedVmemOom: a fusion asked 16.94 MiB of scoped VMEM, over its 16.00 '
    'MiB (ragged_dot_general); raise engine.tpu_scoped_vmem_kib (e.g. 32768)'
  )
  fn, args, cfg = _vmem_case()
  assert compiler_options(cfg(32768)) == {'xla_tpu_scoped_vmem_limit_kib': 32768}
  assert (
    compiler_options(ModelConfig().with_engine(platform='cpu', tpu_scoped_vmem_kib=32768)) is None
  )
  jitted = jax.jit(fn, compiler_options=compiler_options(cfg(32768)))
  aot.compile_fn('f', jitted, args, analyse=False, cache=False)


@pytest.mark.slow  # (a compile libtpu stops: kept out of the default suite's shared workers)
def test_a_fusion_over_a_small_scoped_vmem_limit_stops_the_compile_naming_the_key():
  from moetrain.training.train_step import compiler_options

  fn, args, cfg = _vmem_case()
  with pytest.raises(aot.OutOfMemory, match=r'scoped VMEM.*model\.tpu_scoped_vmem_kib'):
    aot.compile_fn('f', jax.jit(fn, compiler_options=compiler_options(cfg(64))), args, cache=False)


def test_a_ragged_dot_on_tpu_is_priced_by_its_rows_not_its_groups():
  """XLA:TPU writes lax.ragged_dot as a convolution over every (group, row) pair that skips the
  pairs its group mask leaves empty: 2 * M * K * N FLOPs, not G times that (the forward and the
  input gradient here: the loss is a sum, so the forward's values are not needed)."""
  from moetrain.core import hlo_cost

  dev = topology.parse('v5e-1').devices()
  s = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(dev), ('x',)), jax.P())
  shapes = [((512, 256), jnp.bfloat16), ((8, 256, 384), jnp.bfloat16), ((8,), jnp.int32)]
  args = [jax.ShapeDtypeStruct(shape, dt, sharding=s) for shape, dt in shapes]
  fwd = jax.jit(jax.lax.ragged_dot).lower(*args).compile().as_text()
  loss = lambda x, w, g: jax.lax.ragged_dot(x, w, g).astype(jnp.float32).sum()
  grad = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
  one = 2 * 512 * 256 * 384
  assert hlo_cost.analyse(fwd).flops == one
  assert hlo_cost.analyse(grad).flops == 2 * one


EP_LANES = {
  'model.hidden_size': 256,
  'model.expert_ffn_hidden_size': 128,
  'model.num_layers': 1,
  'data.seq_len': 256,
  'data.eval_split': '',
}


def test_grouped_matmuls_are_priced_by_the_rows_routing_sends():
  """Full training with experts over 2 of 4 chips and a receive buffer of twice the balanced
  rows (engine.moe_ep_recv_factor=2): every megablox call runs over that buffer, and the plan
  prices it by the rows a balanced routing sends (each device's tokens x the FFN experts per
  token, LongCat's zero experts taking none), the rest reported apart."""
  from moetrain.core import hlo_cost

  seen = []
  reprice = hlo_cost.routed_rows
  over = EP_LANES | {'mesh.shape': (1, 2, 2, 1), 'engine.moe_ep_recv_factor': 2}
  config = tpu_plan.with_overrides(longcat_pretrain.get_config(), over)
  try:
    hlo_cost.routed_rows = lambda cost, rows: seen.append(cost) or reprice(cost, rows)
    r = tpu_plan.plan(config, 'v5e-4')
  finally:
    hlo_cost.routed_rows = reprice
  (cost,) = seen
  m = config.model
  b = config.data.global_batch_size // 4  # rows per device: the batch over fsdp x expert
  local = b * config.data.seq_len * m.moe_topk  # assignments each shard sends
  routed = (
    b
    * config.data.seq_len
    * m.moe_topk
    * m.n_routed_experts
    / (m.n_routed_experts + m.zero_expert_num)
  )
  assert r['routed_rows_per_device'] == routed
  assert {rows for _, rows in cost.grouped} == {2 * local}  # the receive buffer
  grouped = sum(f for f, _ in cost.grouped)
  assert r['grouped_padding_flops_per_chip'] == pytest.approx(grouped * (1 - routed / (2 * local)))
  assert r['hlo_flops_per_chip'] == pytest.approx(cost.flops - r['grouped_padding_flops_per_chip'])


@pytest.mark.slow
def test_expert_parallelism_priced_by_routed_rows_costs_what_fsdp_does():
  """The same work with the experts over 2 chips (a receive buffer twice the balanced rows) and
  without an expert axis: priced by routed rows, the two steps count the same FLOPs."""
  ep = tpu_plan.plan(
    longcat_pretrain.get_config(),
    'v5e-4',
    EP_LANES | {'mesh.shape': (1, 2, 2, 1), 'engine.moe_ep_recv_factor': 2},
  )
  fsdp = tpu_plan.plan(
    longcat_pretrain.get_config(), 'v5e-4', EP_LANES | {'mesh.shape': (1, 4, 1, 1)}
  )
  assert ep['grouped_padding_flops_per_chip'] > 0
  assert ep['hlo_flops_per_chip'] == pytest.approx(fsdp['hlo_flops_per_chip'], rel=1e-6)

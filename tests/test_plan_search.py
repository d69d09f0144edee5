"""--search and --smallest over a planner whose memory and speed follow known formulas (the real
compiles are in tests/test_plan.py and, for these searches on a tiny model, in a slow test):
what they pick, the flags they print, the cache that spares a second run its compiles."""

import math

import pytest

from configs import longcat_lora, longcat_pretrain
from moetrain.core.sharding import full_shape
from moetrain.planner import topology, tpu_plan

GIB = 2**30


class FakePlanner:
  """plan() by formula. Per device: the weights' `need` / devices (halved by int8, quartered by
  int4, x3 for full training with its moments) plus 1 GiB of activations per row of a
  micro-batch (x1.5 under save_* remat, x2 without). The step time falls with the expert axis
  and rises with micro-batches and with the recomputation remat does."""

  def __init__(self, need_gib: float):
    self.need, self.calls = need_gib * GIB, []

  def __call__(self, config, topo, overrides=None):
    overrides = dict(overrides or {})
    self.calls.append((topo, overrides))
    c = tpu_plan.with_overrides(config, overrides)
    t = topology.parse(topo)
    weights = self.need / t.num_devices * {'none': 1, 'int8': 0.5, 'int4': 0.25}[c.engine.quant]
    weights *= 1 if c.lora.rank else 3
    rows = c.data.global_batch_size // c.optim.grad_accum_steps / t.num_devices
    remat = {'none': 2, 'full': 1, 'save_moe': 1.5, 'save_dots': 1.5, 'offload': 1}
    shape = full_shape(c.mesh.shape)  # a row split over 'context' shares its activations
    need = weights + rows * GIB * remat[c.engine.remat] / shape[4]
    report = {'topology': t.cloud_name, 'chips': t.chips, 'overrides': overrides}
    if need > t.chip.hbm_bytes:
      return report | {'fits': False, 'error': 'Ran out of memory on HBM', 'per_chip_bytes': {}}
    step = 10 / shape[3] + c.optim.grad_accum_steps + 0.5 * (shape[4] - 1)
    step *= {'none': 1, 'full': 1.3, 'save_moe': 1.1, 'save_dots': 1.2, 'offload': 1.3}[
      c.engine.remat
    ]
    return report | {
      'fits': True,
      'headroom': 1 - need / t.chip.hbm_bytes,
      'per_chip_bytes': {'total': need},
      'need_bytes': need,
      'need_step': 'train step',
      'est_step_seconds': step,
      'est_mfu': 0.1,
    }


@pytest.fixture
def fake(monkeypatch):
  def install(need_gib):
    planner = FakePlanner(need_gib)
    monkeypatch.setattr(tpu_plan, 'plan', planner)
    return planner

  return install


def test_search_keeps_the_fastest_plan_with_headroom_and_caches(fake, tmp_path, capsys):
  # v5e-4: 4 devices of 15.75 GiB. 44 GiB of weights and 16 rows (4 GiB per device) leave
  # under 10% free as configured; the tiny model's 16 experts allow an expert axis of 4, the
  # fastest; a quantised base then leaves room to recompute nothing (remat none).
  planner = fake(44)
  cache = str(tmp_path / 'plans.json')
  config = longcat_lora.get_config('variant=tiny')
  assert not tpu_plan._ok(planner(config, 'v5e-4'))  # as configured
  best = tpu_plan.search(config, 'v5e-4', workers=1, cache=cache)
  assert best['fits'] and best['headroom'] >= tpu_plan.HEADROOM
  o = best['overrides']
  assert tuple(o['mesh.shape']) == (1, -1, 4, 1)
  assert o['engine.quant'] in ('int8', 'int4') and o['engine.remat'] == 'none'
  # Every setting one change away from the winner is slower or short of headroom.
  for n in tpu_plan.neighbours(config, 4, o):
    r = planner(config, 'v5e-4', n)
    assert not tpu_plan._ok(r) or r['est_step_seconds'] >= best['est_step_seconds']
  compiled = len(planner.calls)
  again = tpu_plan.search(config, 'v5e-4', workers=1, cache=cache)
  assert len(planner.calls) == compiled  # all from the cache
  assert tpu_plan._flags(again['overrides']) == tpu_plan._flags(o)
  assert 'cached' in capsys.readouterr().out


def test_neighbours_leave_out_what_is_already_set():
  config = longcat_lora.get_config('variant=tiny')
  for n in tpu_plan.neighbours(config, 4, {}):
    c = tpu_plan.with_overrides(config, n)
    assert any(
      (tuple(c[k]) if isinstance(c[k], tuple) else c[k])
      != (tuple(config[k]) if isinstance(config[k], tuple) else config[k])
      for k in n
    ), n
  names = [tuple(sorted(n)) for n in tpu_plan.neighbours(config, 4, {})]
  assert ('engine.quant',) in names  # QLoRA storage is searched under LoRA only
  # Under LoRA 'auto' runs ragged_dot on TPU: megablox (each batch shard's own rows) is one
  # change away, and from it ragged_dot.
  assert {'engine.moe_backend': 'megablox'} in tpu_plan.neighbours(config, 4, {})
  back = tpu_plan.neighbours(config, 4, {'engine.moe_backend': 'megablox'})
  assert {'engine.moe_backend': 'ragged_dot'} in back
  pretrain = longcat_pretrain.get_config()
  assert all('engine.quant' not in n for n in tpu_plan.neighbours(pretrain, 4, {}))


def test_across_slices_the_search_proposes_a_stage_per_slice():
  config = longcat_pretrain.get_config()  # 16 rows a step
  assert not any('engine.pipeline_microbatches' in n for n in tpu_plan.neighbours(config, 8, {}))
  staged = [
    n for n in tpu_plan.neighbours(config, 8, {}, slices=2) if 'engine.pipeline_microbatches' in n
  ]
  assert {n['engine.pipeline_microbatches'] for n in staged} == {2, 4, 8}
  for n in staged:  # the stage axis across the two slices, everything else inside each
    assert n['mesh.dcn_shape'] == (2, 1, 1, 1, 1) and n['mesh.shape'][0] == 2
  # From a pipelined setting: the expert axis moves within each stage, the circular schedule,
  # and the way back.
  later = tpu_plan.neighbours(config, 8, staged[0], slices=2)
  assert all(n['mesh.shape'][0] == 2 for n in later if 'mesh.rules' in n)
  assert all(n.get('engine.pipeline_repeats', 1) == 1 for n in later)  # 2 layers: no 2 runs
  config.model.num_layers = 4
  assert staged[0] | {'engine.pipeline_repeats': 2} in tpu_plan.neighbours(config, 8, staged[0], 2)
  (back,) = [n for n in later if n.get('engine.pipeline_microbatches') == 1]
  assert back['mesh.shape'][0] == 1 and back['mesh.dcn_shape'] == tuple(config.mesh.dcn_shape)
  assert back['engine.pipeline_repeats'] == 1


def test_smallest_bisects_each_method_to_its_smallest_slice(fake, tmp_path):
  # 1000 GiB of weights on v5p (95.73 GiB per chip, 10% kept free) plus 1 GiB for the one row per
  # device of each micro-batch: LoRA 16 chips, int8 8, int4 4, full (x3) 64.
  fake(1000)
  config = longcat_lora.get_config('variant=tiny')
  rows = tpu_plan.smallest(config, ['v5p'], workers=1, cache=str(tmp_path / 'p.json'))
  chips = {r['method']: r['plan']['chips'] for r in rows}
  usable = topology.CHIPS['v5p'].hbm_bytes * (1 - tpu_plan.HEADROOM) / GIB - 1
  expect = {
    m: 2 ** math.ceil(math.log2(need / usable))
    for m, need in {'lora': 1000, 'qlora-int8': 500, 'qlora-int4': 250, 'full': 3000}.items()
  }
  assert chips == expect == {'lora': 16, 'qlora-int8': 8, 'qlora-int4': 4, 'full': 64}
  o = rows[0]['plan']['overrides']  # LoRA on 16 chips: the 16 rows in one micro-batch
  assert o['data.global_batch_size'] % 16 == 0
  assert o['data.global_batch_size'] // o['optim.grad_accum_steps'] == 16


def test_smallest_takes_generations_or_slices():
  assert tpu_plan.generations('v5p,v6e') == ['v5p', 'v6e']
  assert tpu_plan.generations('v5litepod-16,v4-8') == ['v5e', 'v4']
  with pytest.raises(ValueError, match='--topology'):
    tpu_plan.generations('v9')


def test_flags_paste_back_as_the_same_settings():
  """The printed flags, given to the config flag parser as a user pastes them, set the same
  values (a tuple cached as a JSON list prints as the tuple)."""
  flags = tpu_plan._flags({'mesh.shape': [1, -1, 4, 1], 'engine.remat': 'save_moe'})
  assert flags == "--config.mesh.shape='(1, -1, 4, 1)' --config.engine.remat=save_moe"


def test_step_buffer_arithmetic_of_the_flash_lora_step():
  """The planner's buffer arithmetic for the README's flash LoRA step on v5p-128 (mesh 1x4x16x1,
  one row of 8192 tokens per device): 98304 local assignments, a receive buffer of twice that
  (engine.moe_ep_recv_factor=2; overflow in rounds), 6144 x 2048 experts, 32 of them per shard
  gathered over fsdp."""
  from moetrain.planner import sizes
  from moetrain.run.startup import build

  setup = build(longcat_lora.get_config('variant=flash'), num_devices=64, platform='tpu')
  b = sizes.step_buffers(setup.model, setup.mesh_shape, 8192, 64)
  assert (b['local_rows'], b['recv_rows']) == (98304, 196608)
  moe = list(b['moe_layer'].values())
  assert moe[0] == 3 * 196608 * 6144 * 2 and moe[1] == 6 * 196608 * 2048 * 2
  assert moe[2] == 4 * 98304 * 6144 * 2 and moe[3] == 32 * 3 * 6144 * 2048 * 2
  # Dropless with the bounded buffer: an overflow round's rows beside the first round's.
  assert moe[4] == moe[0] + moe[1]
  assert b['layer_inputs_bytes'] == 28 * 8192 * 6144 * 2


def test_the_search_splits_rows_over_context_keeping_the_other_axes():
  """The context axis in 2, 4, ... shards where the devices left by the stage and expert axes
  allow it and the row cuts into the load balance's 2C chunks; the expert axis moves with the
  context axis kept; from a split row, the way back to whole ones and the ring."""
  config = longcat_lora.get_config('variant=tiny')  # rows of 128 tokens
  shapes = lambda ns: {tuple(n['mesh.shape']) for n in ns if list(n) == ['mesh.shape']}
  assert shapes(tpu_plan.neighbours(config, 8, {})) == {
    (1, 1, -1, 1, 2, 1),
    (1, 1, -1, 1, 4, 1),
    (1, 1, -1, 1, 8, 1),
  }
  split = {'mesh.shape': (1, 1, -1, 2, 2, 1)}  # expert 2 x context 2
  later = tpu_plan.neighbours(config, 8, split)
  assert shapes(later) == {(1, -1, 2, 1), (1, 1, -1, 2, 4, 1)}
  experts = [n['mesh.shape'] for n in later if 'mesh.rules' in n]
  assert experts and all(s[4] == 2 and s[3] * s[4] <= 8 for s in experts)
  # A split row's keys also by the ring; a whole row has none to choose.
  assert split | {'engine.context_attention': 'ring'} in later
  assert not any('engine.context_attention' in n for n in tpu_plan.neighbours(config, 8, {}))
  config.data.seq_len = 20  # 2C chunks: 4 and 8 shards do not cut it
  assert shapes(tpu_plan.neighbours(config, 8, {})) == {(1, 1, -1, 1, 2, 1)}


def test_a_row_too_long_for_a_chip_gets_a_context_axis(fake, tmp_path):
  """When the activations of a device's rows do not fit (the fake planner: 16 GiB of them under
  full remat on a v5e chip of 15.75), splitting each row over 'context' fits sooner than
  micro-batches here (the fake prices a context shard at 0.5 of a step, a micro-batch at 1)."""
  fake(4)
  config = longcat_lora.get_config('variant=tiny')
  config.data.global_batch_size = 64
  best = tpu_plan.search(config, 'v5e-4', workers=1, cache=str(tmp_path / 'plans.json'))
  o = best['overrides']
  assert tpu_plan._ok(best) and full_shape(o['mesh.shape'])[4] == 2
  assert o.get('optim.grad_accum_steps', 1) == 1

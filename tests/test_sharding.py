"""Sharding: the same loss on 1 device and on 8-device meshes; golden per-preset spec tables."""

import json
import os

import jax
import numpy as np
import optax
import pytest

from moetrain.core import sharding
from moetrain.kernels import quant
from moetrain.run.checkpoint import flatten
from moetrain.training.train_state import create_sharded, graphdef_of, state_shardings
from moetrain.training.train_step import StepConfig, loss_fn, token_counts
from tests.helpers import tiny, with_lora

GOLDEN = os.path.join(os.path.dirname(__file__), 'golden')
CFG = with_lora(tiny(init_std=0.05))


def batch(b=8, t=16, vocab=64):
  rng = np.random.default_rng(0)
  ids = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
  seg = np.ones((b, t), np.int32)
  seg[:, t // 2 :] = 2  # two packed segments per row
  pos = (
    np.concatenate([np.arange(t // 2), np.arange(t - t // 2)])[None].repeat(b, 0).astype(np.int32)
  )
  return {
    'inputs': ids[:, :-1],
    'targets': ids[:, 1:],
    'segment_ids': seg,
    'positions': pos,
    'loss_mask': np.ones((b, t), np.float32),
  }


def loss_on(mesh_shape, devices=None, preset='fsdp_ep_tp'):
  mesh = sharding.make_mesh(mesh_shape, devices)
  cfg = CFG.with_engine(rules=sharding.Rules.preset(preset)).laid_out('cpu', mesh)
  opt = optax.adamw(1e-3)
  with jax.set_mesh(mesh):
    state = create_sharded(cfg, opt, 0, mesh, cfg.engine.rules)
    b = {k: jax.device_put(v, sharding.batch_sharding(mesh)) for k, v in batch().items()}
    f = jax.jit(
      lambda s, b: loss_fn(
        s.params,
        s.moe_bias,
        s.frozen,
        graphdef_of(cfg),
        b,
        None,
        token_counts(b),
        StepConfig(model=cfg),
      )[0]
    )
    return float(f(state, b))


@pytest.fixture(scope='module')
def single_device_loss():
  return loss_on((1, 1, 1, 1), jax.devices()[:1])


@pytest.mark.parametrize('mesh_shape', [(1, 8, 1, 1), (2, 2, 2, 1), (1, 2, 2, 2), (1, 1, 8, 1)])
def test_sharded_loss_equals_single_device(single_device_loss, mesh_shape, capfd):
  np.testing.assert_allclose(loss_on(mesh_shape), single_device_loss, rtol=1e-6)
  # No layout XLA can only reach by replicating a tensor (it warns on stderr): e.g. embedding
  # rows sharded on D where the batch sharding is wanted.
  assert 'Involuntary full rematerialization' not in capfd.readouterr().err


def spec_table(preset: str) -> dict:
  cfg = CFG.with_engine(rules=sharding.Rules.preset(preset))
  mesh = sharding.make_mesh((1, 2, 2, 2))
  abstract = jax.eval_shape(
    lambda: __import__('moetrain.training.train_state', fromlist=['x']).init_state(
      cfg, optax.sgd(1e-3), 0
    )
  )
  shard = state_shardings(abstract, mesh, cfg.engine.rules)
  tree = {'params': shard.params, 'frozen': shard.frozen, 'moe_bias': shard.moe_bias}
  return {k: str(v.spec) for k, v in flatten(tree).items()}


@pytest.mark.parametrize('preset', sorted(sharding.RULE_PRESETS))
def test_golden_sharding_table(preset):
  path = os.path.join(GOLDEN, f'sharding_{preset}.json')
  table = spec_table(preset)
  if os.environ.get('MOETRAIN_REGEN_GOLDEN'):
    with open(path, 'w') as f:
      json.dump(table, f, indent=1, sort_keys=True)
  with open(path) as f:
    assert table == json.load(f)


def test_int4_codes_shard_where_groups_do_not_divide_the_mesh():
  """int4 codes [.., K/g, g/2, ..]: where fsdp does not divide the K/g groups (hidden 32 in
  groups of 16: 2 groups on fsdp=8), the rows within a group take fsdp instead, as int8 and
  float weights shard their K; they decode to the same weight."""
  cfg = CFG.with_engine(quant='int4', quant_group_size=16, rules=sharding.Rules.preset('fsdp'))
  init = lambda: __import__('moetrain.training.train_state', fromlist=['x']).init_state(
    cfg, optax.sgd(1e-3), 0
  )
  mesh = sharding.make_mesh((1, 8, 1, 1))
  specs = flatten(state_shardings(jax.eval_shape(init), mesh, cfg.engine.rules))
  for name in ('frozen.layers.mlp_0.gate.kernel.q.value', 'frozen.layers.moe.experts.up.q.value'):
    assert 'fsdp' in specs[name].spec, (name, specs[name].spec)
  param = quant.make_param(
    np.random.default_rng(0).normal(size=(32, 48)), ('embed', 'mlp'), cfg.engine
  )
  t = param.tensor()
  spec = lambda v: sharding.logical_to_spec(
    v.axes, v.shape, cfg.engine.rules.weights, dict(mesh.shape)
  )
  placed = quant.QTensor(
    jax.device_put(t.q, jax.sharding.NamedSharding(mesh, spec(param.q))),
    jax.device_put(t.scale, jax.sharding.NamedSharding(mesh, spec(param.scale))),
    t.bits,
    t.axis,
  )
  assert placed.q.sharding.spec == jax.sharding.PartitionSpec(None, 'fsdp', None)
  want = quant.dequant(t, np.float32)
  np.testing.assert_array_equal(jax.jit(quant.dequant, static_argnums=1)(placed, np.float32), want)


def test_projections_take_their_weights_gathered_over_the_batch_axes():
  """engine.gather_weights: a projection's FSDP-sharded weight is constrained whole over the
  batch axes before its matmul (one all-gather rather than XLA:TPU's loop over the shards),
  still split over 'tensor'; the lm head is left to XLA."""
  from flax import nnx

  from moetrain.model.layers import Linear
  from tests.helpers import tiny

  mesh = sharding.make_mesh((1, 4, 1, 2))
  rules = sharding.Rules.preset('fsdp_ep_tp')
  specs = {}
  for gather in (True, False):
    cfg = tiny(hidden_size=64, rules=rules, gather_weights=gather).laid_out('cpu', mesh)
    q = Linear('BTD,DNH->BTNH', (64, 4, 16), cfg, 'q', nnx.Rngs(0))
    with jax.set_mesh(mesh):
      jaxpr = jax.make_jaxpr(q)(np.ones((8, 4, 64), np.float32))
    specs[gather] = [
      str(e.params['sharding'].spec)
      for e in jaxpr.eqns
      if e.primitive.name == 'sharding_constraint'
    ]
  # embed (D) is on fsdp in storage; gathered, only heads (N) stay split, over tensor.
  assert specs[True] == [str(jax.P(None, 'tensor', None))], specs
  assert specs[False] == [], specs

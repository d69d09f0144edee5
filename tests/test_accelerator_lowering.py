"""Lowering for TPU and GPU without one: jax.export lowers for another platform, which runs the
Pallas TPU (Mosaic) lowering with its block-shape rules and emits the collectives XLA:CPU cannot
compile. This checks the megablox backend and the ragged expert-parallel exchange as far as they
can be checked here; it does not run them."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from moetrain.core import sharding
from moetrain.model.moe import MoE
from moetrain.training.train_state import init_state, state_shardings
from moetrain.training.train_step import StepConfig, jit_train_step
from tests.helpers import ALL_TARGETS, tiny, with_lora

RAGGED_A2A = jax.export.DisabledSafetyCheck.custom_call('ragged_all_to_all')


def _export_moe_grad(cfg, platform, mesh_shape=None):
  if mesh_shape is not None:
    cfg = cfg.laid_out(cfg.engine.platform, mesh_shape)
  moe = MoE(cfg, 'layers.moe', nnx.Rngs(0))
  gd, st = nnx.split(moe)
  x = jax.ShapeDtypeStruct((8, 64, cfg.hidden_size), jnp.bfloat16)
  valid = jnp.ones(x.shape[:2], bool)
  loss = lambda st, x: jnp.sum(nnx.merge(gd, st)(x, valid)[0].astype(jnp.float32) ** 2)
  export = jax.export.export(
    jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=[platform], disabled_checks=[RAGGED_A2A]
  )
  if mesh_shape is None:
    return export(st, x).mlir_module()
  mesh = sharding.make_mesh(mesh_shape)
  with jax.set_mesh(mesh):
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(('data', 'fsdp', 'expert')))
    return export(st, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec)).mlir_module()


# TPU-shaped experts (D and F multiples of 128) with LoRA adapters of rank 8 on them; the engine
# chosen for a TPU (the real kernel and collective, not their CPU stand-ins).
CFG = with_lora(
  tiny(hidden_size=256, expert_ffn_hidden_size=128, dtype='bfloat16', platform='tpu'),
  rank=8,
  targets=r'experts\.(gate|up|down)$',
  alpha=16.0,
)
EP = dict(rules=sharding.Rules.preset('fsdp_ep_tp'), moe_ep_comm='ragged')


def test_megablox_lowers_for_tpu():
  """Block shapes pass Mosaic's rules in the forward and in megablox's own VJP (which reuses the
  forward tiling for the transposed products); the thin LoRA products use ragged_dot."""
  text = _export_moe_grad(CFG.with_engine(moe_backend='megablox'), 'tpu')
  assert text.count('tpu_custom_call') >= 3


def test_ragged_expert_parallel_lowers_for_tpu():
  cfg = CFG.with_engine(**EP, moe_backend='megablox')
  text = _export_moe_grad(cfg, 'tpu', (1, 2, 4, 1))
  assert 'ragged_all_to_all' in text and 'tpu_custom_call' in text


def test_expert_adapters_lower_for_tpu_with_the_experts_partitioned_by_xla():
  """LoRA on the experts through ragged_dot over an FSDP mesh without an expert axis: XLA
  partitions the experts, so their adapters cannot take the Mosaic kernel (which lowers only
  inside a shard_map); they take ragged_dot too."""
  cfg = CFG.with_engine(moe_backend='ragged_dot')
  text = _export_moe_grad(cfg, 'tpu', (1, 8, 1, 1))
  assert 'tpu_custom_call' not in text and 'ragged_dot' in text


def test_ragged_expert_parallel_lowers_for_gpu():
  cfg = CFG.with_engine(**EP, moe_backend='ragged_dot', platform='gpu')
  text = _export_moe_grad(cfg, 'cuda', (1, 2, 4, 1))
  # Tokens out and results back, then the gradient's two reverse exchanges.
  calls = [line for line in text.splitlines() if 'custom_call @ragged_all_to_all(' in line]
  assert len(calls) == 4, calls


@pytest.mark.parametrize('platform,backend', [('tpu', 'megablox'), ('cuda', 'ragged_dot')])
def test_sharded_train_step_lowers(platform, backend):
  """The whole LoRA training step (attention, MoE with ragged expert parallelism, loss, AdamW),
  jitted with the state and batch shardings the training loop uses on a (1,2,4,1) mesh."""
  target = {'cuda': 'gpu'}.get(platform, platform)
  cfg = CFG.with_engine(**EP, moe_backend=backend, platform=target)
  mesh = sharding.make_mesh((1, 2, 4, 1))
  cfg = with_lora(cfg, rank=8, targets=ALL_TARGETS).laid_out(target, mesh)
  opt = optax.adamw(1e-4)
  with jax.set_mesh(mesh):
    abstract = jax.eval_shape(lambda: init_state(cfg, opt, 0))
    shardings = state_shardings(abstract, mesh, cfg.engine.rules)
    batch_sharding = sharding.batch_sharding(mesh)
    step = jit_train_step(StepConfig(model=cfg), opt, lambda s: 1e-4, shardings, batch_sharding)
    spec = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    state = jax.tree.map(spec, abstract, shardings)
    fields = dict(inputs=jnp.int32, targets=jnp.int32, segment_ids=jnp.int32, positions=jnp.int32)
    batch = {
      k: jax.ShapeDtypeStruct((8, 64), t, sharding=batch_sharding) for k, t in fields.items()
    }
    batch['loss_mask'] = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=batch_sharding)
    export = jax.export.export(step, platforms=[platform], disabled_checks=[RAGGED_A2A])
    text = export(state, batch).mlir_module()
  assert 'ragged_all_to_all(' in text
  assert (backend == 'megablox') == ('tpu_custom_call' in text)

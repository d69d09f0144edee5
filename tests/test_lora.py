"""LoRA and QLoRA: merge, only adapters train, quantisation error bounds, storage bytes."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moetrain.kernels import quant
from moetrain.kernels.lora import lora_product
from moetrain.model import lora
from moetrain.model.transformer import Transformer
from moetrain.training.train_state import init_state, split_model
from moetrain.training.train_step import StepConfig, jit_train_step
from tests.helpers import forward, model_and_ids, nonzero_bias, randomize, tiny, with_lora
from tests.test_sharding import batch


@pytest.mark.parametrize('mode', ['none', pytest.param('int8', marks=pytest.mark.slow), 'int4'])
def test_merged_model_equals_adapted_model(mode):
  cfg = with_lora(tiny(quant=mode, quant_group_size=8))
  model, ids = model_and_ids(cfg)
  randomize(model, 3, nnx.LoRAParam, 0.05)
  nonzero_bias(model)
  want, _ = forward(model, ids)
  got, _ = forward(lora.merged(model), ids)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('lead', [(48,), (4, 12)])
def test_lora_product_gradients_equal_autodiff(dtype, lead):
  """The adapters' product with its hand-written backward (transposed thin factors; one
  contraction over the leading axes where they stay apart, as under a context split) against
  autodiff of (x a) b: outputs and all three gradients, in the inputs' dtypes."""
  keys = jax.random.split(jax.random.key(0), 4)
  dt = jnp.dtype(dtype)
  x = jax.random.normal(keys[0], (*lead, 24)).astype(dt)
  a = jax.random.normal(keys[1], (24, 4)).astype(dt)
  b = jax.random.normal(keys[2], (4, 40)).astype(dt)
  g = jax.random.normal(keys[3], (*lead, 40)).astype(dt)
  y, pull = jax.vjp(lora_product, x, a, b)
  want_y, want_pull = jax.vjp(lambda x, a, b: (x @ a) @ b, x, a, b)
  tol = 1e-5 if dtype == 'float32' else 2e-2
  f32 = lambda t: np.asarray(t, np.float32)
  np.testing.assert_allclose(f32(y), f32(want_y), rtol=tol, atol=tol)
  for got, want in zip(jax.jit(pull)(g), want_pull(g)):
    assert got.dtype == dt
    scale = float(jnp.abs(f32(want)).max())
    np.testing.assert_allclose(f32(got), f32(want), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize('lead', [(48,), (4, 12)])
def test_float32_adapters_get_float32_gradients_of_a_bfloat16_product(lead):
  """float32 adapters (lora.param_dtype's default) on bfloat16 tokens: the product runs in
  bfloat16, and the adapters' gradients are summed over the tokens in float32, never rounded to
  bfloat16 (a mesh's sum over its devices then runs in float32 too): the float32 autodiff of
  the same bfloat16 product, to float32's precision."""
  keys = jax.random.split(jax.random.key(1), 4)
  x = jax.random.normal(keys[0], (*lead, 24)).astype(jnp.bfloat16)
  a = jax.random.normal(keys[1], (24, 4))
  b = jax.random.normal(keys[2], (4, 40))
  g = jax.random.normal(keys[3], (*lead, 40)).astype(jnp.bfloat16)
  _, pull = jax.vjp(lora_product, x, a, b)
  dx, da, db = jax.jit(pull)(g)
  assert (dx.dtype, da.dtype, db.dtype) == (jnp.bfloat16, jnp.float32, jnp.float32)
  bf = lambda t: t.astype(jnp.bfloat16).astype(jnp.float32)
  x32, g32 = x.astype(jnp.float32).reshape(-1, 24), g.astype(jnp.float32).reshape(-1, 40)
  h32 = bf(x32 @ bf(a))  # the forward's bfloat16 h
  dh32 = bf(g32 @ bf(b).T)
  np.testing.assert_allclose(da, x32.T @ dh32, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(db, h32.T @ g32, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize('kernel', ['ragged_dot', 'megablox'])
def test_float32_expert_adapters_get_float32_gradients_of_a_bfloat16_product(kernel):
  """The routed experts' LoRA factors [E, I, O] (float32) on bfloat16 rows, through ragged_dot
  (kernels/experts.ragged_adapter) and the Pallas TPU kernel (interpreted here): each expert's
  gradient summed over its own rows in float32, the float32 autodiff of the same bfloat16
  product to float32's precision; the rows' gradient in bfloat16."""
  from moetrain.kernels import experts, megablox

  keys = jax.random.split(jax.random.key(2), 3)
  sizes = jnp.array([5, 0, 40, 19], jnp.int32)
  x = jax.random.normal(keys[0], (64, 128)).astype(jnp.bfloat16)
  w = jax.random.normal(keys[1], (4, 128, 8))
  g = jax.random.normal(keys[2], (64, 8)).astype(jnp.bfloat16)
  if kernel == 'ragged_dot':
    fn = lambda x, w: experts.ragged_adapter(x, w, sizes, jnp.dtype(jnp.bfloat16))
  else:
    fn = lambda x, w: megablox.grouped_matmul(x, w, sizes, False, True)
  y, pull = jax.vjp(fn, x, w)
  dx, dw = jax.jit(pull)(g)
  assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
  x32, g32 = x.astype(jnp.float32), g.astype(jnp.float32)
  ends = np.cumsum(np.asarray(sizes))
  for e, (start, end) in enumerate(zip(ends - np.asarray(sizes), ends)):
    want = x32[start:end].T @ g32[start:end]
    np.testing.assert_allclose(dw[e], want, rtol=1e-5, atol=1e-4)
  assert not np.any(np.asarray(dw[1]))  # no rows: no gradient


def test_gradients_reach_only_adapters():
  cfg = with_lora(tiny())
  opt = optax.adamw(1e-2)
  state = init_state(cfg, opt, 0)
  assert all(
    isinstance(v, nnx.LoRAParam)
    for v in jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  )
  # Optimizer state exists for adapters only: its size matches the adapters.
  n_adapters = sum(x.size for x in jax.tree.leaves(state.params))
  n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
  assert n_opt == 2 * n_adapters + 1  # mu, nu and the step count
  step = jit_train_step(StepConfig(model=cfg), opt, lambda s: 1e-2, donate=False)
  new, _ = step(state, batch())
  chex.assert_trees_all_equal(new.frozen, state.frozen)
  changed = [
    not np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params))
  ]
  assert all(changed)


@pytest.mark.parametrize('mode', ['none', pytest.param('int4', marks=pytest.mark.slow)])
def test_adapters_and_their_moments_are_float32_over_a_bfloat16_base(mode, tmp_path):
  """lora.param_dtype (float32 by default) stores the adapters, so their Adam moments are
  float32 too, whatever the frozen base's storage; a PEFT export keeps the base's dtype."""
  from moetrain.convert import peft_adapter

  cfg = with_lora(tiny(param_dtype='bfloat16', quant=mode, quant_group_size=8))
  state = init_state(cfg, optax.adamw(1e-2), 0)
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype('float32')}
  assert {x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim} == {jnp.dtype('float32')}
  assert jnp.dtype('bfloat16') in {x.dtype for x in jax.tree.leaves(state.frozen)}
  step = jit_train_step(StepConfig(model=cfg), optax.adamw(1e-2), lambda s: 1e-2, donate=False)
  new, _ = step(state, batch())
  assert {x.dtype for x in jax.tree.leaves(new.params)} == {jnp.dtype('float32')}
  bf16 = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, param_dtype='bfloat16'))
  assert {x.dtype for x in jax.tree.leaves(init_state(bf16, optax.adamw(1e-2), 0).params)} == {
    jnp.dtype('bfloat16')
  }
  if mode == 'none':
    from safetensors.numpy import load_file

    peft_adapter.save(Transformer(cfg, nnx.Rngs(0)), cfg, str(tmp_path))
    saved = load_file(str(tmp_path / peft_adapter.ADAPTER_FILE))
    assert {str(x.dtype) for x in saved.values()} == {'bfloat16'}


def test_train_router_option_adds_only_the_router():
  cfg = with_lora(tiny(), train_router=True)
  _, params, _, _ = split_model(Transformer(cfg, nnx.Rngs(0)), cfg)
  names = {'/'.join(map(str, p)) for p, _ in nnx.to_flat_state(params)}
  assert 'layers/moe/router' in names
  assert all('lora' in n or n == 'layers/moe/router' for n in names)


@pytest.mark.parametrize('bits', [8, 4])
def test_quantisation_error_within_bound(bits):
  w = jax.random.normal(jax.random.key(0), (3, 64, 40)) * jnp.linspace(0.1, 2.0, 40)[None, None]
  t = quant.quantize(w, bits, n_batch=1, n_in=1, group=16)
  err = jnp.abs(quant.dequant(t, jnp.float32) - w)
  if bits == 8:  # half a step of max|w| / 127 per output channel
    bound = jnp.max(jnp.abs(w), axis=1, keepdims=True) / 127 / 2
  else:  # half a step of max|w| / 7 per group of 16 input rows and output channel
    g = jnp.abs(w).reshape(3, 4, 16, 40).max(2, keepdims=True) / 7 / 2
    bound = jnp.broadcast_to(g, (3, 4, 16, 40)).reshape(w.shape)
  assert bool(jnp.all(err <= bound * (1 + 1e-5)))
  assert float(err.max()) > 0


@pytest.mark.parametrize('mode, limit', [('int8', 1.05), ('int4', 0.6)])
def test_frozen_base_bytes_per_parameter(mode, limit):
  """Bytes per frozen base parameter (bf16 would be 2.0), from the shapes and dtypes that
  construction gives the arrays (eval_shape: the same code, without running the eager init;
  bench/qlora_memory.py measures live device memory)."""
  cfg = with_lora(
    tiny(
      quant=mode,
      hidden_size=128,
      ffn_hidden_size=256,
      expert_ffn_hidden_size=128,
      vocab_size=256,
      q_lora_rank=64,
      kv_lora_rank=64,
      quant_group_size=64,
    )
  )
  build = lambda c: split_model(nnx.eval_shape(lambda: Transformer(c, nnx.Rngs(0))), c)[3]
  frozen = build(cfg)
  ref = build(cfg.with_engine(quant='none'))
  n_params = sum(x.size for x in jax.tree.leaves(ref))
  n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(frozen))
  assert n_bytes / n_params <= limit, n_bytes / n_params


def test_qlora_computes_the_float_model_of_its_dequantised_weights():
  cfg = with_lora(tiny(init_std=0.05))
  model, ids = model_and_ids(cfg)
  want, _ = forward(model, ids)
  for mode in ('int8', 'int4'):
    q_model = Transformer(cfg.with_engine(quant=mode, quant_group_size=16), nnx.Rngs(0))
    got, _ = forward(q_model, ids)
    exact, _ = forward(lora.merged(q_model), ids)  # float weights equal to the dequantised codes
    np.testing.assert_allclose(got, exact, atol=1e-5, rtol=1e-5)
    if mode == 'int8':  # and int8 stays close to the original float weights
      assert float(jnp.abs(got - want).max() / jnp.abs(want).max()) < 0.02


def test_expert_adapters_draw_their_own_dropout_masks():
  """Each projection's LoRA dropout has its own key: 'gate' and 'down' (names of one length)
  drew the same mask once, identical when the expert's D == F."""
  from moetrain.kernels.lora import with_lora as expert_mm

  eye = jnp.eye(16)
  weights = {n: jnp.zeros((16, 16)) for n in ('gate', 'up', 'down')}
  weights.update({f'{n}_{ab}': eye for n in ('gate', 'up', 'down') for ab in ('lora_a', 'lora_b')})
  cfg = with_lora(tiny(), rank=16, alpha=16.0, dropout=0.5)  # scale 1
  mm = expert_mm(lambda x, w: x @ w, weights, cfg, jax.random.key(0))
  x = jnp.ones((8, 16))
  masks = [np.asarray(mm(x, n)) != 0 for n in ('gate', 'up', 'down')]  # y = dropout(x) here
  for i in range(3):
    assert 0.3 < masks[i].mean() < 0.7
    for j in range(i):
      assert (masks[i] != masks[j]).any(), (i, j)

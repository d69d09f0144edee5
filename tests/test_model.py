"""Model properties: shapes, causality, packing isolation, LoRA identity, backends agree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moetrain.kernels.attention import attention_core
from moetrain.model.attention import attention_probs
from moetrain.model.config import ModelConfig
from moetrain.model.layers import matmul_dims, rope
from moetrain.model.masks import attention_mask
from moetrain.model.transformer import Transformer
from tests.helpers import (
  forward,
  jit_call,
  model_and_ids,
  nonzero_bias,
  randomize,
  tiny,
  with_lora,
)


def test_shapes_and_aux():
  cfg = tiny()
  model, ids = model_and_ids(cfg)
  logits, aux = forward(model, ids)
  assert logits.shape == (2, 10, cfg.vocab_size) and logits.dtype == jnp.float32
  assert aux['moe']['load'].shape == (cfg.num_layers, cfg.num_experts_total)
  # every token picks exactly top-k experts
  np.testing.assert_allclose(aux['moe']['load'].sum(-1), 2 * 10 * cfg.moe_topk)


def test_causal():
  model, ids = model_and_ids(tiny())
  nonzero_bias(model)
  logits, _ = forward(model, ids)
  ids2 = ids.at[:, 6:].set((ids[:, 6:] + 7) % 64)
  logits2, _ = forward(model, ids2)
  np.testing.assert_allclose(logits[:, :6], logits2[:, :6], atol=1e-6)
  assert np.abs(logits[:, 6:] - logits2[:, 6:]).max() > 1e-3


def test_packed_segments_do_not_attend_to_each_other():
  model, ids = model_and_ids(tiny(), t=12)
  seg = jnp.array([[1] * 5 + [2] * 7] * 2)
  pos = jnp.array([list(range(5)) + list(range(7))] * 2)
  packed, _ = forward(model, ids, pos, seg)
  alone, _ = forward(model, ids[:, 5:])
  np.testing.assert_allclose(packed[:, 5:], alone, atol=2e-5)


def _loss_and_lora_grads(model, ids, pos, seg):
  def loss(m):
    logits, _ = m(ids, pos, seg)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  return nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)


@pytest.mark.slow  # ~25 s; tests/test_kernels.py checks attention_core's blocks against autodiff
@pytest.mark.parametrize('chunk', [5, 4])
def test_chunked_causal_attention_equals_the_full_square(chunk):
  """Query blocks that skip the keys after them give the full-square result (packed segments,
  a ragged last block), in outputs and in gradients."""
  cfg = with_lora(tiny(attention_chunk=0, num_layers=1))
  model, ids = model_and_ids(cfg, t=12)
  randomize(model, 5, nnx.LoRAParam)
  seg = jnp.array([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3])
  pos = jnp.array([list(range(5)) + list(range(7)), list(range(9)) + [0] * 3])
  chunked = nnx.merge(
    nnx.graphdef(Transformer(cfg.with_engine(attention_chunk=chunk), nnx.Rngs(0))),
    nnx.state(model),
  )
  ref_logits, _ = forward(model, ids, pos, seg)
  logits, _ = forward(chunked, ids, pos, seg)
  np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
  (ref_loss, ref_grads) = jit_call(_loss_and_lora_grads, model, ids, pos, seg)
  (loss, grads) = jit_call(_loss_and_lora_grads, chunked, ids, pos, seg)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
    np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize('recompute', [False, True], ids=['saved_probs', 'recomputed'])
@pytest.mark.parametrize(
  'blocks',
  [
    ((0, 4, 4), (4, 8, 8), (8, 11, 11)),
    ((0, 11, 11),),
    ((0, 3, 7), (3, 6, 7)),
    ((0, 2, 9), (2, 4, 9), (4, 6, 9)),
  ],
  ids=['causal_blocks', 'one_block', 'queries_shorter_than_keys', 'even_blocks_as_a_loop'],
)
def test_attention_core_gradients_equal_autodiff(blocks, recompute):
  """attention_core's hand-written backward (transposed key/value gradients; saved
  probabilities or scores recomputed from the log-sum-exp) equals autodiff of the plain masked
  softmax attention, float32, for causal query blocks with a ragged last block and for T queries
  against S > T keys (decoding), and for a query that sees no key at all; even blocks over all
  the keys (a context shard's) run as a lax.scan."""
  t, s = blocks[-1][1], blocks[-1][2]
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (2, 3, t, 6))
  k = jax.random.normal(ks[1], (2, 3, s, 6))
  v = jax.random.normal(ks[2], (2, 3, s, 5))
  g = jax.random.normal(ks[3], (2, 3, t, 5))
  seg = jnp.array([[1] * 5 + [2] * (s - 5), [1] * (s - 2) + [0] * 2])
  pos = jnp.array([list(range(5)) + list(range(s - 5)), list(range(s - 2)) + [0] * 2])
  mask = attention_mask(pos[:, s - t :], seg[:, s - t :], pos, seg)
  mask &= jnp.tril(jnp.ones((1, t, s), jnp.bool_), s - t)
  mask = mask.at[1, t - 1].set(False)  # a query that sees no key (uniform weights)

  def plain(q, k, v):
    p = attention_probs(jnp.einsum('BNTH,BNSH->BNTS', q, k), mask, 0.3)
    return jnp.einsum('BNTS,BNSH->BNTH', p, v)

  def core(q, k, v):
    return attention_core(q, k, v, mask, 0.3, blocks, recompute)

  out, pull = jax.vjp(jax.jit(core), q, k, v)
  ref, ref_pull = jax.vjp(plain, q, k, v)
  np.testing.assert_allclose(out, ref, atol=1e-6, rtol=1e-5)
  for got, want in zip(pull(g), ref_pull(g), strict=True):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_attention_core_in_bfloat16():
  """bfloat16 inputs: outputs and gradients come back in bfloat16, close to the float32 values
  (the probabilities stay float32 for the backward pass)."""
  blocks = ((0, 4, 4), (4, 8, 8))
  ks = jax.random.split(jax.random.key(1), 4)
  q, k = (jax.random.normal(key, (1, 2, 8, 16)) for key in ks[:2])
  v, g = (jax.random.normal(key, (1, 2, 8, 8)) for key in ks[2:])
  mask = jnp.tril(jnp.ones((1, 8, 8), jnp.bool_))
  core = lambda *a: attention_core(*a, mask, 0.25, blocks)
  out, pull = jax.vjp(core, q, k, v)
  low = [x.astype(jnp.bfloat16) for x in (q, k, v, g)]
  out16, pull16 = jax.vjp(core, *low[:3])
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_allclose(out16.astype(jnp.float32), out, atol=3e-2, rtol=3e-2)
  for got, want in zip(pull16(low[3]), pull(g), strict=True):
    assert got.dtype == jnp.bfloat16
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=3e-2 * scale, rtol=0)


def same_model_as(model, cfg):
  """`model`'s state under another config of the same shapes (another layer loop or remat)."""
  return nnx.merge(nnx.graphdef(Transformer(cfg, nnx.Rngs(0))), nnx.state(model))


def assert_same_loss_and_grads(model, ref, ids, atol, rtol):
  pos, seg = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape), jnp.ones_like(ids)
  ref_loss, ref_grads = jit_call(_loss_and_lora_grads, ref, ids, pos, seg)
  loss, grads = jit_call(_loss_and_lora_grads, model, ids, pos, seg)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
    np.testing.assert_allclose(g, r, atol=atol, rtol=rtol)


@pytest.mark.parametrize('remat', ['save_moe', pytest.param('save_dots', marks=pytest.mark.slow)])
def test_remat_policies_change_no_gradient(remat):
  """A policy only chooses what the backward recomputes: save_moe (which keeps the experts'
  input rows and gate/up projections, named in kernels/experts.swiglu; the ragged_dot engine
  goes through it) gives the loss and LoRA gradients of no remat."""
  cfg = with_lora(tiny(remat='none', moe_backend='ragged_dot'))
  model, ids = model_and_ids(cfg)
  randomize(model, 6, nnx.LoRAParam)
  other = same_model_as(model, cfg.with_engine(remat=remat))
  assert_same_loss_and_grads(other, model, ids, atol=1e-6, rtol=1e-5)


def test_save_moe_spares_the_grouped_engine_its_second_forward():
  """The grouped engine's forward is one loop over all three projections (a custom VJP). Its
  residuals and outputs carry save_moe's names, so under save_moe the backward pass reruns no
  loop: the lowered gradient has as many loops as without remat, and fewer than under full."""

  def loops(remat):
    cfg = with_lora(tiny(remat=remat, moe_backend='grouped'))
    model, ids = model_and_ids(cfg)
    pos, seg = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape), jnp.ones_like(ids)
    graphdef, state = nnx.split(model)
    grads = lambda st: _loss_and_lora_grads(nnx.merge(graphdef, st), ids, pos, seg)
    return jax.jit(grads).lower(state).as_text().count('stablehlo.while')

  assert loops('save_moe') == loops('none') < loops('full')


@pytest.mark.parametrize('remat', ['none', pytest.param('full', marks=pytest.mark.slow)])
def test_unrolled_layers_equal_the_scan(remat):
  """scan_layers=False runs the same stacked layer state layer by layer: same logits, routing
  stats, loss and gradients."""
  cfg = with_lora(tiny(remat=remat))
  model, ids = model_and_ids(cfg)
  randomize(model, 6, nnx.LoRAParam)
  unrolled = same_model_as(model, cfg.with_engine(scan_layers=False))
  (ref_logits, ref_aux), (logits, aux) = forward(model, ids), forward(unrolled, ids)
  np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
  for a, r in zip(jax.tree.leaves(aux), jax.tree.leaves(ref_aux), strict=True):
    assert a.shape == r.shape
    np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-5)
  assert_same_loss_and_grads(unrolled, model, ids, atol=1e-5, rtol=1e-4)


def test_lora_with_zero_b_equals_base():
  base_cfg = tiny()
  model, ids = model_and_ids(base_cfg)
  lora_model = Transformer(with_lora(base_cfg), nnx.Rngs(0))
  # Same base weights: copy them over (adapters stay A random, B zero).
  nnx.update(lora_model, nnx.state(model, nnx.Param))
  assert len(jax.tree.leaves(nnx.state(lora_model, nnx.LoRAParam))) > 0
  a, _ = forward(model, ids)
  b, _ = forward(lora_model, ids)
  np.testing.assert_array_equal(a, b)
  randomize(lora_model, 3, nnx.LoRAParam)  # nonzero B changes the output
  c, _ = forward(lora_model, ids)
  assert np.abs(a - c).max() > 1e-3


@pytest.mark.slow  # ~18 s each; tests/test_moe.py checks every engine against a per-expert loop
@pytest.mark.parametrize('backend', ['blocked', 'ragged_dot'])
def test_moe_backends_match_dense_reference(backend):
  cfg = with_lora(tiny(moe_backend='dense'))
  model, ids = model_and_ids(cfg)
  randomize(model, 5, nnx.LoRAParam)
  nonzero_bias(model)
  ref, _ = forward(model, ids)
  other = nnx.merge(
    nnx.graphdef(Transformer(cfg.with_engine(moe_backend=backend), nnx.Rngs(0))),
    nnx.state(model),
  )
  out, _ = forward(other, ids)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('interleaved', [True, False])
def test_rope_rotates_pairs_or_halves(interleaved):
  x = jnp.arange(8.0).reshape(1, 1, 1, 8)
  cfg = ModelConfig(rope_theta=10.0, rope_interleaved=interleaved)
  out = rope(x, jnp.array([[3]]), cfg)
  ang = 3 * 10.0 ** (-np.arange(0, 8, 2) / 8)
  if interleaved:  # (x0, x1), (x2, x3), ...
    x0, x1 = np.arange(0, 8, 2.0), np.arange(1, 8, 2.0)
  else:  # (x0, x4), (x1, x5), ...
    x0, x1 = np.arange(0, 4.0), np.arange(4, 8.0)
  y0, y1 = x0 * np.cos(ang) - x1 * np.sin(ang), x1 * np.cos(ang) + x0 * np.sin(ang)
  want = np.stack([y0, y1], -1) if interleaved else np.concatenate([y0, y1])
  np.testing.assert_allclose(out.reshape(-1), want.reshape(-1), rtol=1e-5)


def test_projection_equations_are_token_matmuls():
  assert matmul_dims('BTD,DNH->BTNH') == 1
  assert matmul_dims('BTNH,NHD->BTD') == 2
  with pytest.raises(ValueError, match='not of the form'):
    matmul_dims('BTD,ND->BTN')  # the kernel must be [in..., out...]


def test_bad_model_configs_name_the_field():
  with pytest.raises(ValueError, match='model.moe_topk'):
    ModelConfig(moe_topk=13).validate()
  with pytest.raises(ValueError, match='engine.remat'):
    ModelConfig().with_engine(remat='sometimes').validate()
  with pytest.raises(ValueError, match='model.qk_rope_head_dim'):
    ModelConfig(qk_rope_head_dim=7).validate()

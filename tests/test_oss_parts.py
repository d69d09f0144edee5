"""gpt-oss's decoder parts against plain formulas: attention sinks (values and the kernel's
gradients), sliding windows (full forward vs the cached decode), the clamped SwiGLU, expert
biases (every expert backend alike) and the top-k-then-softmax router with a logit bias."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moetrain.kernels import experts
from moetrain.kernels.attention import attention_core
from moetrain.model import decode
from moetrain.model.families import MODEL_PRESETS
from moetrain.model.transformer import Transformer
from tests.helpers import configured

PARTS = dict(
  num_layers=2,
  sliding_window=3,
  layer_types=('sliding_attention', 'full_attention'),
  attention_sinks=True,
  qkv_bias=True,
  o_bias=True,
  qk_norm=False,
  router_score='topk_softmax',
  router_linear_bias=True,
  norm_topk_prob=False,
  expert_bias=True,
  swiglu_limit=7.0,
  dtype='float32',
  remat='none',
)
BIASES = ('sinks', 'bias', 'router_linear_bias', 'gate_bias', 'up_bias', 'down_bias')


def oss_model(**kw):
  """A tiny model with every gpt-oss part, its biases and sinks drawn at random."""
  cfg = configured(MODEL_PRESETS['qwen3_tiny'], **{**PARTS, **kw})
  cfg.validate()
  model = Transformer(cfg, nnx.Rngs(0))
  for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
    if path[-1] in BIASES:
      scale = 2.0 if path[-1] == 'gate_bias' else 0.5
      var.set_value(scale * jax.random.normal(jax.random.key(i), var.shape))
  return model, cfg


def _sink_reference(q, k, v, sinks, mask, scale):
  z = jnp.where(mask[:, None], jnp.einsum('bnth,bnsh->bnts', q, k) * scale, -jnp.inf)
  sink = jnp.broadcast_to(sinks[None, :, None, None], (*z.shape[:3], 1))
  p = jax.nn.softmax(jnp.concatenate([z, sink], -1), -1)[..., :-1]
  return jnp.einsum('bnts,bnsh->bnth', p, v)


@pytest.mark.parametrize('recompute', [True, False])
@pytest.mark.parametrize('blocks', [((0, 10, 10),), ((0, 4, 4), (4, 8, 8), (8, 10, 10))])
def test_attention_sinks_values_and_gradients(blocks, recompute):
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 3, 10, 8)), jnp.float32) for _ in range(3))
  sinks = jnp.asarray(rng.standard_normal(3), jnp.float32)
  mask = jnp.asarray(np.tril(np.ones((10, 10), bool))[None].repeat(2, 0))
  fast = lambda *a: attention_core(*a[:3], mask, 0.3, blocks, recompute, a[3])
  want = lambda *a: _sink_reference(*a, mask, 0.3)
  np.testing.assert_allclose(fast(q, k, v, sinks), want(q, k, v, sinks), atol=1e-6)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  got = jax.grad(loss(fast), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  ref = jax.grad(loss(want), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, atol=2e-6)


@pytest.mark.slow
def test_sliding_layers_decode_as_the_full_forward_and_see_only_their_window():
  model, cfg = oss_model()
  # one scan of both layers, each layer's window its own
  assert [(g.name, g.count) for g in cfg.layer_groups()] == [('layers', 2)]
  assert cfg.layer_windows() == (3, 0)
  ids = jax.random.randint(jax.random.key(1), (2, 10), 0, cfg.vocab_size)
  full = jax.jit(lambda m, x: m(x)[0])(model, ids)
  logits, cache = decode.prefill(model, ids[:, :4], 10)
  np.testing.assert_allclose(logits, full[:, 3], atol=1e-5)
  for pos in range(4, 10):
    logits, cache = decode.decode_step(model, cache, ids[:, pos], pos)
    np.testing.assert_allclose(logits, full[:, pos], atol=1e-5)
  # Changing the first token moves position 9 only through the full layer's keys.
  wide, _ = oss_model(sliding_window=100)
  wide_full = jax.jit(lambda m, x: m(x)[0])(wide, ids)
  np.testing.assert_allclose(wide_full[:, :3], full[:, :3], atol=1e-6)
  assert np.abs(wide_full[:, 5:] - full[:, 5:]).max() > 1e-2


def test_clamped_swiglu_by_hand():
  cfg = dataclasses.replace(MODEL_PRESETS['qwen3_tiny'], swiglu_limit=7.0)
  g = jnp.asarray([-9.0, -1.0, 0.5, 6.0, 12.0])
  u = jnp.asarray([-8.0, 0.3, -0.2, 7.5, 1.0])
  gc, uc = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
  want = gc / (1 + np.exp(-1.702 * gc)) * (uc + 1)
  np.testing.assert_allclose(experts.activation(g, u, cfg), want, rtol=1e-6)


@pytest.mark.slow
def test_expert_biases_and_router_alike_on_every_backend():
  """The dense backend (each row against its own expert's weights) is the reference."""
  ids = jax.random.randint(jax.random.key(1), (2, 10), 0, 512)
  out = {}
  for backend in ('dense', 'gathered', 'blocked', 'grouped', 'ragged_dot'):
    model, _ = oss_model(moe_backend=backend)
    logits = jax.jit(lambda m, x: m(x)[0])(model, ids)
    grads = jax.jit(jax.grad(lambda m: jnp.sum(jnp.sin(m(ids)[0]))))(model)
    flat = nnx.to_flat_state(nnx.state(grads, nnx.Param))
    out[backend] = (logits, {p: v.get_value() for p, v in flat if p[-1] in BIASES})
  ref_logits, ref_grads = out.pop('dense')
  # 9 biases, each stacked over the two layers of the one scan group
  assert len(ref_grads) == 9 and all(np.abs(g).max() > 0 for g in ref_grads.values())
  for backend, (logits, grads) in out.items():
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5, err_msg=backend)
    for p, g in grads.items():
      np.testing.assert_allclose(g, ref_grads[p], atol=1e-5, err_msg=f'{backend} {p}')


def test_topk_softmax_router_by_hand():
  from moetrain.model.moe import route

  _, cfg = oss_model()
  rng = np.random.default_rng(2)
  x, w, b = rng.standard_normal((6, 128)), rng.standard_normal((128, 8)), rng.standard_normal(8)
  _, _, idx, gates, _ = route(jnp.asarray(x), jnp.asarray(w), None, cfg, jnp.asarray(b))
  logits = x @ w + b
  want_idx = np.argsort(-logits, -1)[:, :2]
  np.testing.assert_array_equal(idx, want_idx)
  top = np.take_along_axis(logits, want_idx, -1)
  want = np.exp(top) / np.exp(top).sum(-1, keepdims=True)
  np.testing.assert_allclose(gates, want, rtol=1e-5)

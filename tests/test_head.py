"""The chunked, fused lm-head cross entropy equals the loss of the whole logits, in values and in
gradients (hidden states, LoRA adapters, the full head), for any block size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moetrain.kernels.cross_entropy import head_cross_entropy
from moetrain.model.layers import Linear
from tests.helpers import randomize, tiny, with_lora

B, T = 3, 10


def reference(logits_BTV, targets_BT, mask_BT):
  """The textbook masked NLL sum and correct count from whole logits."""
  logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
  gold_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
  nll = -jnp.sum(jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0] * mask_BT)
  correct = jnp.sum((gold_BT >= logits_BTV.max(-1)) * mask_BT)
  return nll, correct


def setup(lora: bool):
  cfg = tiny()
  cfg = with_lora(cfg, targets=r'lm_head$') if lora else cfg
  head = Linear(
    'BTD,DV->BTV',
    (cfg.hidden_size, cfg.vocab_size),
    cfg,
    'lm_head',
    nnx.Rngs(0),
  )
  if lora:
    randomize(head, 1, nnx.LoRAParam)
  k = jax.random.split(jax.random.key(2), 3)
  h = jax.random.normal(k[0], (B, T, cfg.hidden_size))
  targets = jax.random.randint(k[1], (B, T), 0, cfg.vocab_size)
  # Every other target is the top logit, so the "correct" count is neither 0 nor all.
  targets = jnp.where(jnp.arange(T) % 2 == 0, jnp.argmax(head(h), -1), targets)
  mask = (jax.random.uniform(k[2], (B, T)) < 0.8).astype(jnp.float32)
  return head, h, targets, mask


@pytest.mark.parametrize('lora', [False, True])
@pytest.mark.parametrize('chunk', [0, 1, 3, 5, 10, 16])
def test_chunked_head_loss_equals_whole_logits(lora, chunk):
  head, h, targets, mask = setup(lora)
  wrt = nnx.LoRAParam if lora else nnx.Param
  graphdef, trained, rest = nnx.split(head, wrt, ...)

  def loss(fn, trained, h):
    m = nnx.merge(graphdef, trained, rest)
    nll, correct = fn(m, h)
    return 2.0 * nll, correct  # a cotangent other than 1 reaches the backward rule

  chunked = lambda m, h: head_cross_entropy(m, h, targets, mask, chunk)
  whole = lambda m, h: reference(m(h), targets, mask)
  grad = lambda fn: jax.jit(jax.value_and_grad(lambda w, x: loss(fn, w, x), (0, 1), has_aux=True))
  (got, got_correct), got_g = grad(chunked)(trained, h)
  (want, want_correct), want_g = grad(whole)(trained, h)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert float(got_correct) == float(want_correct)
  assert 0 < float(want_correct) < float(mask.sum())  # the count is not trivially 0 or all
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
    assert float(jnp.abs(b).max()) > 0
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  # The frozen base under LoRA gets no gradient (it is not an input of the differentiation).
  if lora:
    assert {k for k, _ in nnx.to_flat_state(trained)} == {('lora_a',), ('lora_b',)}


def test_forward_only_matches_and_no_whole_logits():
  """Without differentiation the primal runs (no gradient work); under jit no [B, T, V] buffer
  exists when chunked."""
  head, h, targets, mask = setup(lora=False)
  want = reference(head(h), targets, mask)
  got = jax.jit(lambda h: head_cross_entropy(head, h, targets, mask, 4))(h)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  assert float(got[1]) == float(want[1])
  v = head.kernel.shape[-1]
  hlo = jax.jit(jax.grad(lambda h: head_cross_entropy(head, h, targets, mask, 4)[0]))
  text = hlo.lower(h).compile().as_text()
  assert f'f32[{B},{T},{v}]' not in text and f'f32[{B},4,{v}]' in text
  # Under a mesh without sharding rules (a tool calling it directly): the same numbers.
  from moetrain.core import sharding

  with jax.set_mesh(sharding.make_mesh((1, -1, 1, 1))):
    on_mesh = head_cross_entropy(head, h, targets, mask, 4)
  np.testing.assert_allclose(on_mesh[0], want[0], rtol=1e-6)

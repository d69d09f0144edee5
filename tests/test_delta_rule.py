"""The gated delta rule (kernels/delta_rule.py): the chunked form against the token-by-token
recurrence, values and gradients, with packed rows, padding to whole chunks, an initial state
and grouped heads' shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moetrain.kernels import delta_rule


def inputs(b=2, t=37, h=3, dk=8, dv=6, seed=0):
  ks = jax.random.split(jax.random.key(seed), 6)
  q = delta_rule.l2norm(jax.random.normal(ks[0], (b, t, h, dk))) * dk**-0.5
  k = delta_rule.l2norm(jax.random.normal(ks[1], (b, t, h, dk)))
  v = jax.random.normal(ks[2], (b, t, h, dv))
  g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h)))  # log decays <= 0
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
  state = 0.3 * jax.random.normal(ks[5], (b, h, dk, dv))
  return q, k, v, g, beta, state


def packed(b=2, t=37):
  """Segment ids of packed rows: segments of uneven lengths, trailing padding (0)."""
  seg = np.zeros((b, t), np.int32)
  seg[0, :9], seg[0, 9:24], seg[0, 24:33] = 1, 2, 3  # padding after 33
  seg[1, :20], seg[1, 20:] = 1, 2
  return jnp.asarray(seg)


@pytest.mark.parametrize('chunk', [4, 16])
@pytest.mark.parametrize('with_segments', [False, True])
def test_chunked_equals_the_recurrence(chunk, with_segments):
  q, k, v, g, beta, state = inputs()
  seg = packed() if with_segments else None
  want, want_s = delta_rule.recurrent(q, k, v, g, beta, state, seg)
  got, got_s = delta_rule.chunked(q, k, v, g, beta, chunk, state, seg)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(got_s, want_s, atol=2e-5, rtol=1e-5)


def test_chunked_gradients_equal_the_recurrences():
  q, k, v, g, beta, state = inputs(t=29)
  seg = packed(t=29)
  w = jax.random.normal(jax.random.key(7), (2, 29, 3, 6))

  def loss(form, *args):
    out, s = form(*args)
    return jnp.sum(out * w) + jnp.sum(s**2)

  rec = jax.grad(lambda *a: loss(lambda *x: delta_rule.recurrent(*x, seg), *a), range(6))
  chk = jax.grad(lambda *a: loss(lambda *x: delta_rule.chunked(*x[:5], 8, x[5], seg), *a), range(6))
  for name, want, got in zip(
    'q k v g beta state'.split(), rec(q, k, v, g, beta, state), chk(q, k, v, g, beta, state)
  ):
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(got, want, atol=2e-5 * max(scale, 1.0), err_msg=name)


def test_a_segment_start_forgets_what_came_before():
  """With packing, a segment's outputs are those of the segment alone (the state reset)."""
  q, k, v, g, beta, _ = inputs(b=1, t=20)
  seg = jnp.asarray([[1] * 8 + [2] * 12])
  got, _ = delta_rule.chunked(q, k, v, g, beta, 4, None, seg)
  alone, _ = delta_rule.recurrent(*(x[:, 8:] for x in (q, k, v, g, beta)))
  np.testing.assert_allclose(got[:, 8:], alone, atol=2e-6)


def test_decoding_token_by_token_continues_the_chunked_state():
  q, k, v, g, beta, _ = inputs(b=2, t=24)
  whole, _ = delta_rule.chunked(q, k, v, g, beta, 8)
  _, s = delta_rule.chunked(*(x[:, :19] for x in (q, k, v, g, beta)), 8)
  for i in range(19, 24):
    out, s = delta_rule.recurrent(*(x[:, i : i + 1] for x in (q, k, v, g, beta)), s)
    np.testing.assert_allclose(out[:, 0], whole[:, i], atol=2e-5)

"""The splash attention kernel (moetrain/kernels/splash.py) against the chunked XLA attention:
values and gradients in Pallas' interpreter on CPU, sharded over a mesh, in whole models, and
lowered for a TPU by XLA's TPU compiler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moetrain.core import sharding
from moetrain.kernels import splash
from moetrain.model import attention, masks
from tests.helpers import TINY, forward, model_and_ids, tiny


def _inputs(b=2, n=4, g=2, t=256, hqk=24, hv=16, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, n, t, hqk))
  k = jax.random.normal(ks[1], (b, g, t, hqk))
  v = jax.random.normal(ks[2], (b, g, t, hv))
  # Packed rows: two examples and padding (segment 0) in row 0, one example across row 1.
  seg = np.zeros((b, t), np.int32)
  seg[0, :100], seg[0, 100:220] = 1, 2
  seg[1:] = 1
  return q, k, v, jnp.asarray(seg)


def _xla(q_BNTH, k_BNTH, v_BNTH, seg_BT, scale, chunk=128, window=0, sinks_N=None):
  """The XLA path of model/attention.py on the same operands: its GQA repeat, self mask (with
  a sliding window), causal query blocks and sinks."""
  groups = q_BNTH.shape[1] // k_BNTH.shape[1]
  k_BNTH, v_BNTH = (jnp.repeat(x, groups, axis=1) for x in (k_BNTH, v_BNTH))
  t = seg_BT.shape[1]
  mask = masks.self_mask(jnp.broadcast_to(jnp.arange(t), seg_BT.shape), seg_BT, window)
  blocks = tuple((i, i + chunk, i + chunk) for i in range(0, t, chunk))
  return attention.attention_core(q_BNTH, k_BNTH, v_BNTH, mask, scale, blocks, True, sinks_N)


def _loss(fn):
  def f(q, k, v):
    out = fn(q, k, v)
    return (out * jnp.cos(jnp.arange(out.size).reshape(out.shape))).sum()

  return f


def test_splash_equals_the_xla_attention_in_values_and_gradients():
  """GQA (4 query heads over 2 kv heads) with MLA-like widths (q/k 24, v 16), causal within
  packed segments and padding, forward and backward, in the interpreter."""
  q, k, v, seg = _inputs()
  scale = 0.2
  ours = lambda q, k, v: splash.splash_attention(q, k, v, seg, scale, interpret=True)
  xla = lambda q, k, v: _xla(q, k, v, seg, scale)
  np.testing.assert_allclose(ours(q, k, v), xla(q, k, v), atol=2e-5, rtol=1e-5)
  g_ours = jax.grad(_loss(ours), argnums=(0, 1, 2))(q, k, v)
  g_xla = jax.grad(_loss(xla), argnums=(0, 1, 2))(q, k, v)
  for name, a, b in zip('qkv', g_ours, g_xla):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=name)


def test_splash_with_a_sliding_window_and_sinks_equals_the_xla_attention():
  """gpt-oss's attention: each query sees its last 100 positions (not a multiple of the kernel's
  blocks) within its segment, and each head's softmax has a learned sink logit; values and
  gradients (sinks included) against the XLA path, in the interpreter."""
  q, k, v, seg = _inputs()
  sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0])
  scale, window = 0.2, 100
  ours = lambda q, k, v, s: splash.splash_attention(
    q, k, v, seg, scale, interpret=True, window=window, sinks_N=s
  )
  xla = lambda q, k, v, s: _xla(q, k, v, seg, scale, window=window, sinks_N=s)
  np.testing.assert_allclose(ours(q, k, v, sinks), xla(q, k, v, sinks), atol=2e-5, rtol=1e-5)
  assert float(jnp.abs(xla(q, k, v, sinks) - _xla(q, k, v, seg, scale)).max()) > 0.1
  args = (q, k, v, sinks)
  g_ours = jax.grad(lambda *a: _loss(lambda q, k, v: ours(q, k, v, a[3]))(*a[:3]), (0, 1, 2, 3))
  g_xla = jax.grad(lambda *a: _loss(lambda q, k, v: xla(q, k, v, a[3]))(*a[:3]), (0, 1, 2, 3))
  for name, a, b in zip(['q', 'k', 'v', 'sinks'], g_ours(*args), g_xla(*args)):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=name)


def test_splash_under_a_mesh_equals_one_device():
  """In a shard_map over the batch axes (rows) and 'tensor' (heads), as the model runs it."""
  q, k, v, seg = _inputs(b=4)
  whole = splash.splash_attention(q, k, v, seg, 0.3, interpret=True)
  mesh = sharding.make_mesh((1, 2, 2, 2))
  with jax.set_mesh(mesh):
    fn = jax.jit(
      lambda q, k, v, s: splash.splash_attention(
        q, k, v, s, 0.3, interpret=True, mesh_shape=(1, 2, 2, 2), head_axis='tensor'
      )
    )
    out = fn(q, k, v, seg)
  np.testing.assert_allclose(out, whole, atol=1e-6)


_SLIDING_THEN_FULL = ('sliding_attention', 'full_attention')


@pytest.mark.parametrize('kind', ['mla', 'gqa', 'gpt_oss'])
def test_a_model_with_splash_attention_gives_the_xla_paths_logits(kind):
  """Two packed examples per row; the same weights (same seed) under either kernel."""
  gqa = dict(attention='gqa', layer_layout='standard', num_heads=4, num_kv_heads=2, head_dim=8)
  # gpt-oss's attention: sinks, a sliding window of 40 (past the first example's 70 positions
  # in layer 0), full attention in layer 1.
  windowed = dict(attention_sinks=True, sliding_window=40, layer_types=_SLIDING_THEN_FULL)
  kw = {'mla': {}, 'gqa': gqa, 'gpt_oss': gqa | windowed}[kind]
  logits = []
  for kernel in ('xla', 'splash'):
    model, ids = model_and_ids(tiny(attention_kernel=kernel, **kw), t=128)
    seg = jnp.ones_like(ids).at[:, 70:].set(2)
    pos = jnp.where(seg == 1, jnp.arange(128), jnp.arange(128) - 70)
    logits.append(forward(model, ids, pos, seg)[0])
  np.testing.assert_allclose(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_auto_picks_splash_only_for_tpu_and_whole_blocks():
  tpu = TINY.with_engine(platform='tpu')
  assert tpu.splash_attention(4096) and not tpu.splash_attention(100)
  assert not TINY.splash_attention(4096)
  assert TINY.with_engine(attention_kernel='splash').splash_attention(100)

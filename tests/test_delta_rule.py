"""The gated delta rule (kernels/delta_rule.py): the chunked form against the token-by-token
recurrence, values and gradients, with packed rows, padding to whole chunks, an initial state
and grouped heads' shapes."""

import dataclasses

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


# tokamax's Pallas TPU kernel (kernels/delta_rule_tokamax.py), in Pallas' interpreter on this
# CPU: each case one program of the outputs, the final state and the gradients.
def _with_gradients(form, args, w):
  """(outputs, final state, gradients of sum(outputs * w) + sum(state^2) w.r.t. args)."""

  def run(*args):
    (out, s), back = jax.vjp(form, *args)
    return out, s, back((w, 2 * s))

  return jax.jit(run)(*args)


@pytest.mark.parametrize('with_segments', [False, True])
def test_tokamax_kernel_equals_the_recurrence_and_chunked(with_segments):
  """Fixed-length rows from an initial state, and packed rows (3 segments and padding in one
  row: 4 of the kernel's segments) from none: values and gradients in float32."""
  pytest.importorskip('tokamax')
  from moetrain.kernels import delta_rule_tokamax

  q, k, v, g, beta, state = inputs(t=37, h=2, dk=16, dv=8)
  seg = packed(t=37) if with_segments else None
  w = jax.random.normal(jax.random.key(7), v.shape)
  args = (q, k, v, g, beta) + (() if with_segments else (state,))
  st = lambda a: a[5] if len(a) > 5 else None
  kernel = lambda *a: delta_rule_tokamax.chunked(*a[:5], st(a), seg, max_segments=4, interpret=True)
  got = _with_gradients(kernel, args, w)
  for want in (
    _with_gradients(lambda *a: delta_rule.recurrent(*a[:5], st(a), seg), args, w),
    _with_gradients(lambda *a: delta_rule.chunked(*a[:5], 16, st(a), seg), args, w),
  ):
    np.testing.assert_allclose(got[0], want[0], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], atol=2e-5, rtol=1e-5)
    for name, a, b in zip('q k v g beta state'.split(), got[2], want[2]):
      scale = float(jnp.max(jnp.abs(b)))
      np.testing.assert_allclose(a, b, atol=2e-5 * max(scale, 1.0), err_msg=name)


def test_tokamax_rows_past_its_limits_run_chunked():
  """A decay past the kernel's range (overflowing its float32 factors: NaN gradients) or more
  segments than engine.delta_rule_segments: the device's rows run `chunked`, exactly."""
  pytest.importorskip('tokamax')
  from moetrain.kernels import delta_rule_tokamax as tk

  seg = packed(t=37)
  g = -jnp.ones((2, 37, 2))
  ordinal = tk._ordinals(seg)
  assert [int(x) for x in ordinal[:, -1]] == [4, 2]
  assert tk.fits(g, ordinal, 4) and tk.fits(g, None, 1)
  assert not tk.fits(g, ordinal, 3) and not tk.fits(g.at[1, 5, 0].set(-5.5), None, 1)
  q, k, v, g, beta, state = inputs(t=37, h=2, dk=16, dv=8)
  g = g.at[:, 20:36].set(-8.0)  # a 16-token block of the kernel's overflows at -5.9 a token
  w = jax.random.normal(jax.random.key(7), v.shape)
  args = (q, k, v, g, beta, state)
  got = _with_gradients(lambda *a: tk.chunked(*a, interpret=True), args, w)
  want = _with_gradients(lambda *a: delta_rule.chunked(*a[:5], 64, a[5]), args, w)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)


def test_tokamax_kernel_compiles_for_a_tpu_slice_and_is_priced():
  """Forward and backward compiled by XLA's TPU compiler (libtpu; no TPU needed) for a v5p-8, in
  the shard_map over its 4 chips: its five Mosaic kernels, priced by hlo_cost at the FLOPs
  counted from their bodies (the XLA form of the cond's other branch left out)."""
  pytest.importorskip('tokamax')
  pytest.importorskip('libtpu')
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from moetrain.core import hlo_cost, sharding
  from moetrain.kernels import delta_rule_tokamax
  from moetrain.planner import topology

  mesh_shape = (1, 4, 1, 1, 1, 1)
  mesh = sharding.make_mesh(mesh_shape, topology.parse('v5p-8').devices())
  b, t, h, d = 4, 128, 2, 128
  rows = NamedSharding(mesh, P('data'))
  shapes = [(b, t, h, d)] * 3 + [(b, t, h)] * 2
  args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=rows) for s in shapes]

  def loss(*a):
    out, s = delta_rule_tokamax.chunked(*a, mesh_shape=mesh_shape)
    return jnp.sum(out**2) + jnp.sum(s**2)

  with jax.set_mesh(mesh):
    text = jax.jit(jax.grad(loss, argnums=range(5))).lower(*args).compile().as_text()
  sites = {s.name.split('.')[0].strip('_'): s.flops for s in hlo_cost.top_matmuls(text, 50)}
  per_token = {  # per token and head, C = 64, K = V = 128
    'pallas_kda_fwd_intra_fused': 69312,
    'chunk_kda_fwd_h_o_varlen': 114688,
    'fused_recompute_w_u_vnew_from_h_pallas': 65536,
    'chunk_kda_bwd_dAv_kernel': 32768,
    'fused_dhu_wy_intra_cumsum_pallas_jit': 335872,
  }
  for name, flops in per_token.items():
    assert sites[name] == flops * (b // 4) * t * h, (name, sites)
  cost = hlo_cost.analyse(text)
  assert cost.flops == pytest.approx(sum(per_token.values()) * t * h, rel=0.05)


def test_auto_takes_the_kernel_when_tracing_for_a_tpu_it_declares():
  """engine.delta_rule_kernel='auto': the kernel on v6e (tokamax's supported TPUs), the XLA form
  on v5p, on a CPU, and on this host when nothing is traced for a TPU (the interpreter's tests
  above leave no TPU info behind); 'tokamax' and 'xla' as said."""
  pytest.importorskip('tokamax')
  pytest.importorskip('libtpu')
  from moetrain.model.config import ModelConfig
  from moetrain.planner import topology

  cfg = ModelConfig(linear_key_head_dim=128)
  tpu = cfg.laid_out('tpu', ())
  assert not cfg.delta_rule_tokamax() and not tpu.delta_rule_tokamax()
  assert tpu.with_engine(delta_rule_kernel='tokamax').delta_rule_tokamax()
  assert not tpu.with_engine(delta_rule_kernel='xla').delta_rule_tokamax()
  for name, takes in (('v6e-4', True), ('v5p-8', False)):
    devices = np.array(topology.parse(name).devices())
    with jax.set_mesh(jax.sharding.Mesh(devices, ('x',))):
      assert tpu.delta_rule_tokamax() is takes, name
      assert not dataclasses.replace(tpu, linear_key_head_dim=384).delta_rule_tokamax()

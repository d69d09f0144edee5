"""MoE engine: per-expert loop reference, dispatch strategies, expert parallelism, balancing."""

import dataclasses
import functools
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moetrain.core import sharding
from moetrain.kernels import exchange, grouped
from moetrain.model import dispatch, expert_parallel
from moetrain.model.moe import MoE, RouterBias, device_balance_loss, route, routing_stats
from moetrain.training.train_step import StepConfig, bias_update
from tests.helpers import expert_weights, jit_call, randomize, tiny, with_lora

EXPERT_LORA = r'experts\.(gate|up|down)$'


def make_moe(cfg, seed=0):
  moe = MoE(cfg, 'layers.moe', nnx.Rngs(seed))
  randomize(moe, seed + 1, nnx.LoRAParam, 0.05)
  randomize(moe, seed + 2, RouterBias, 0.05)
  return moe


def reference(moe: MoE, x_MD):
  """Obviously-correct LongCat MoE: loop over every expert, masked by its gate."""
  cfg = moe.cfg
  p = jax.nn.softmax(x_MD @ moe.router[...], axis=-1)
  _, idx = jax.lax.top_k(p + moe.router_bias[...][None], cfg.moe_topk)
  g = jnp.take_along_axis(p, idx, axis=-1) * cfg.routed_scaling_factor
  ex = moe.experts
  s = cfg.lora.scale

  def proj(x, name, e):
    y = x @ getattr(ex, name)[...][e]
    if name in ex.lora_names:
      y += s * (x @ getattr(ex, f'{name}_lora_a')[...][e]) @ getattr(ex, f'{name}_lora_b')[...][e]
    return y

  out = jnp.zeros_like(x_MD)
  for e in range(cfg.num_experts_total):
    w_M = jnp.sum(jnp.where(idx == e, g, 0.0), axis=-1)
    if e < cfg.n_routed_experts:
      y = proj(jax.nn.silu(proj(x_MD, 'gate', e)) * proj(x_MD, 'up', e), 'down', e)
    else:
      y = x_MD
    out += w_M[:, None] * y
  return out


def _run(moe, x_BTD):
  return moe(x_BTD, jnp.ones(x_BTD.shape[:2], bool))


def run(moe, x_BTD):
  return jit_call(_run, moe, x_BTD)


def _reference(moe, x_BTD):
  return reference(moe, x_BTD.reshape(-1, x_BTD.shape[-1])).reshape(x_BTD.shape)


def _engine(moe, x_BTD):
  return _run(moe, x_BTD)[0]


def loss_and_grads(moe, x_BTD, fn):
  """Gradients w.r.t. the input and every variable (router, experts, adapters)."""
  gd, st = nnx.split(moe)
  return _grads(fn, gd, st, x_BTD)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _grads(fn, gd, st, x_BTD):
  w = jax.random.normal(jax.random.key(9), x_BTD.shape)
  f = lambda st, x: jnp.sum(fn(nnx.merge(gd, st), x) * w)
  return jax.grad(f, argnums=(0, 1))(st, x_BTD)


# init_std 0.1 keeps outputs O(1), so float32 1e-5 compares the maths, not the rounding of big values.
CFG = with_lora(tiny(moe_backend='blocked', init_std=0.1), rank=3, targets=EXPERT_LORA, alpha=3.0)


SHAPES = [
  dict(),
  dict(n_routed_experts=6, zero_expert_num=2, moe_topk=2),
  dict(zero_expert_num=0, moe_topk=4),
]
LANES = dict(hidden_size=128, expert_ffn_hidden_size=128)
# Every backend on every shape; the loop backends compile slowly (~30 s each on 2 cores), so
# 'grouped' (its own test below covers ragged groups) and 'blocked' (no longer a default) run one
# shape by default and the rest under `make test-slow`.
CASES = (
  [(b, s) for b in ('gathered', 'ragged_dot', 'dense') for s in SHAPES]
  + [
    # The TPU kernel in Pallas interpret mode, on lane-sized experts (D, F multiples of 128; the
    # rank-3 adapters take ragged_dot).
    ('megablox', LANES),
    *(pytest.param('megablox', {**s, **LANES}, marks=pytest.mark.slow) for s in SHAPES[1:]),
  ]
  # tokamax's grouped matmul through its XLA form (its Triton and Mosaic GPU kernels need a
  # GPU: bench/gpu_session.sh checks them against this engine there), on the shape with zero
  # experts and uneven groups.
  + [('tokamax', SHAPES[1])]
  + [
    case
    for b in ('grouped', 'blocked')
    for case in [(b, SHAPES[0]), *(pytest.param(b, s, marks=pytest.mark.slow) for s in SHAPES[1:])]
  ]
)


@pytest.mark.parametrize('backend,shape', CASES)
def test_moe_matches_per_expert_loop(backend, shape):
  cfg = dataclasses.replace(CFG, **shape).with_engine(moe_backend=backend)
  moe = make_moe(cfg)
  x = jax.random.normal(jax.random.key(1), (2, 16, cfg.hidden_size))
  y, _ = run(moe, x)
  want = jit_call(_reference, moe, x)
  np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)
  if backend == 'megablox':
    gd, st = nnx.split(moe)
    assert 'pallas_call' in str(jax.make_jaxpr(lambda st: _engine(nnx.merge(gd, st), x))(st))
  g_engine = loss_and_grads(moe, x, _engine)
  g_ref = loss_and_grads(moe, x, _reference)
  chex.assert_trees_all_close(g_engine, g_ref, atol=1e-5, rtol=1e-5)


def test_dropless_equals_capacity_when_capacity_suffices():
  moe = make_moe(CFG)
  x = jax.random.normal(jax.random.key(2), (2, 16, CFG.hidden_size))
  y, _ = run(moe, x)
  big = CFG.with_engine(moe_dispatch='capacity', moe_capacity_factor=12.0)
  y_cap, stats = run(with_cfg(moe, big), x)
  assert float(stats['dropped_frac']) == 0.0
  np.testing.assert_allclose(y_cap, y, atol=1e-6)


def test_capacity_drops_exactly_what_it_reports():
  cfg = CFG.with_engine(moe_dispatch='capacity', moe_capacity_factor=0.5)
  moe = make_moe(cfg)
  m, d = 64, cfg.hidden_size
  x_MD = jax.random.normal(jax.random.key(3), (m, d))
  _, _, idx, gates, _ = route(x_MD, moe.router[...], moe.router_bias[...], cfg)
  y, dropped = dispatch.routed_experts(x_MD, idx, gates, moe.experts.weights(), cfg)
  # Expected drops: beyond the first C assignments (in token order) of each expert.
  c = dispatch.capacity(m, cfg)
  seen, want = {}, np.zeros(idx.shape)
  for t in range(m):
    for j in range(cfg.moe_topk):
      e = int(idx[t, j])
      if e < cfg.n_routed_experts:
        seen[e] = seen.get(e, 0) + 1
        want[t, j] = seen[e] > c
  np.testing.assert_array_equal(dropped, want)
  assert want.sum() > 0
  # The output is the dropless output with the dropped assignments' gates set to zero.
  dropless = cfg.with_engine(moe_dispatch='dropless')
  y_ref, _ = dispatch.routed_experts(
    x_MD, idx, jnp.where(want > 0, 0.0, gates), moe.experts.weights(), dropless
  )
  np.testing.assert_allclose(y, y_ref, atol=1e-5)


@pytest.mark.parametrize(
  'mesh_shape,comm,backend',
  [
    *(
      (m, c, 'auto')
      for c in ('fixed', 'ragged')
      for m in ((1, 4, 2, 1), (1, 2, 4, 1), (1, 1, 8, 1), (2, 1, 2, 2))
    ),
    # The CPU grouped engine (its per-batch tile switch) on the received rows of each exchange.
    *(((1, 2, 4, 1), c, 'grouped') for c in ('fixed', 'ragged')),
    # Backends that run the received rows in place (no layout copies).
    *(((1, 2, 4, 1), 'ragged', b) for b in ('ragged_dot', 'dense', 'tokamax')),
  ],
)
def test_expert_parallel_equals_single_device(mesh_shape, comm, backend):
  cfg = CFG.with_engine(
    rules=sharding.Rules.preset('fsdp_ep_tp'), moe_ep_comm=comm, moe_backend=backend
  )
  moe = make_moe(cfg)
  x = jax.random.normal(jax.random.key(4), (8, 8, cfg.hidden_size))
  fn = _engine
  y_ref = jit_call(fn, moe, x)
  g_ref = loss_and_grads(moe, x, fn)
  mesh = sharding.make_mesh(mesh_shape)
  moe = with_cfg(moe, cfg.laid_out('cpu', mesh))  # the engine laid out for the mesh
  with jax.set_mesh(mesh):
    gd, st = nnx.split(moe)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(('data', 'fsdp', 'expert')))
    xs = jax.device_put(x, spec)
    y = jax.jit(lambda st, x: fn(nnx.merge(gd, st), x))(st, xs)
    g = loss_and_grads(moe, xs, fn)
    hlo = jax.jit(lambda st, x: fn(nnx.merge(gd, st), x)).lower(st, xs).as_text()
  np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(g, g_ref, atol=1e-5, rtol=1e-5)
  # The ragged exchange's CPU emulation gathers every shard's rows.
  assert ('all_to_all' if comm == 'fixed' else 'all_gather') in hlo


@pytest.mark.parametrize('comm', ['fixed', 'ragged'])
def test_expert_parallel_takes_tokens_the_batch_shards_do_not_divide(comm):
  """A decode step's few tokens (here 3 on 8 batch shards) are padded with rows for no expert
  inside the exchange: the layer gives what it gives on one device."""
  cfg = CFG.with_engine(rules=sharding.Rules.preset('fsdp_ep_tp'), moe_ep_comm=comm)
  moe = make_moe(cfg)
  x = jax.random.normal(jax.random.key(5), (1, 3, cfg.hidden_size))
  want = jit_call(_engine, moe, x)
  mesh = sharding.make_mesh((1, 2, 4, 1))
  with jax.set_mesh(mesh):
    got = jit_call(_engine, with_cfg(moe, cfg.laid_out('cpu', mesh)), x)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_emulated_ragged_all_to_all_follows_the_jax_docs():
  """The CPU stand-in for lax.ragged_all_to_all on the example in its docstring (axis of 2)."""
  mesh = jax.make_mesh((2,), ('x',), (jax.sharding.AxisType.Explicit,), devices=jax.devices()[:2])
  a2a = lambda v: jax.lax.all_to_all(v, 'x', 0, 0, tiled=True)

  def f(x, in_off, send, out_off, recv):
    ex = exchange.Exchange(in_off, send, out_off, recv, a2a(out_off), a2a(in_off))
    return exchange.emulated_ragged_all_to_all(x, jnp.zeros(4, x.dtype), ex, 'x')

  spec = jax.sharding.PartitionSpec('x')
  fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))
  put = lambda v: jax.device_put(jnp.array(v), jax.NamedSharding(mesh, spec))
  args = [[1, 2, 2, 3, 4, 0], [0, 1, 0, 1], [1, 2, 1, 1], [0, 0, 1, 2], [1, 1, 2, 1]]
  out = fn(*map(put, args))
  np.testing.assert_array_equal(out, [1, 3, 0, 0, 2, 2, 4, 0])


def test_ragged_plan_is_consistent_across_shards():
  """Every shard's plan agrees with its peers' (what s sends to d is what d expects from s, at
  the same offsets), receive regions are disjoint, expert-sorted and inside the buffer, and a
  small buffer keeps groups in (expert, source) order until full; its later rounds (windows
  further along that order) send every remaining row once, each from where the last stopped."""
  ep, e_loc = 4, 3
  counts = np.random.default_rng(0).integers(0, 7, size=(ep, ep * e_loc))
  for buf, start in ((int(counts.sum()), 0), (20, 0), (20, 20), (20, 40)):
    plans = [
      expert_parallel.ragged_plan(jnp.array(counts), s, e_loc, buf, 0, start) for s in range(ep)
    ]
    for s in range(ep):
      ex_s, kept_s, _ = plans[s]
      np.testing.assert_array_equal(ex_s.send, kept_s)
      for d in range(ep):
        ex_d = plans[d][0]
        sl_s, sl_d = slice(d * e_loc, (d + 1) * e_loc), slice(s * e_loc, (s + 1) * e_loc)
        np.testing.assert_array_equal(ex_s.send[sl_s], ex_d.recv[sl_d])
        np.testing.assert_array_equal(ex_s.out_off[sl_s], ex_d.recv_off[sl_d])
        np.testing.assert_array_equal(ex_s.in_off[sl_s], ex_d.src_off[sl_d])
    for d in range(ep):
      ex, _, local = plans[d]
      # Source-major slices; in the buffer they go expert-major: sorted by local expert.
      off = np.asarray(ex.recv_off).reshape(ep, e_loc).T.ravel()
      size = np.asarray(ex.recv).reshape(ep, e_loc).T.ravel()
      ends = off + size
      assert (ends <= buf).all() and (off[1:] >= ends[:-1]).all()
      np.testing.assert_array_equal(local, np.asarray(ex.recv).reshape(ep, e_loc).sum(0))
    kept = np.stack([p[1] for p in plans])
    if buf == counts.sum():
      np.testing.assert_array_equal(kept, counts)
    else:
      assert kept.sum() < counts.sum() and (kept <= counts).all()
  # Rounds: every row of every group sent exactly once, a group's rows in order.
  rounds = [
    [expert_parallel.ragged_plan(jnp.array(counts), s, e_loc, 20, 0, k * 20) for k in range(9)]
    for s in range(ep)
  ]
  for s in range(ep):
    sent = np.stack([np.asarray(r[1]) for r in rounds[s]])
    np.testing.assert_array_equal(sent.sum(0), counts[s])
    group_start = np.cumsum(counts[s]) - counts[s]
    first = group_start + np.cumsum(sent, axis=0) - sent  # where each round's slice must start
    for k, r in enumerate(rounds[s]):
      np.testing.assert_array_equal(
        np.where(sent[k] > 0, r[0].in_off, 0), np.where(sent[k] > 0, first[k], 0)
      )


def route_on_ep_mesh(cfg, seed: int, m: int = 64):
  """Routes m random tokens on one device, then runs the routed experts on a (fsdp 2, expert 4)
  mesh: (x, idx, gates, weights, y, dropped)."""
  moe = make_moe(cfg)
  x = jax.random.normal(jax.random.key(seed), (m, cfg.hidden_size))
  _, _, idx, gates, _ = route(x, moe.router[...], moe.router_bias[...], cfg)
  mesh = sharding.make_mesh((1, 2, 4, 1))
  w = moe.experts.weights()
  with jax.set_mesh(mesh):
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(('fsdp', 'expert')))
    args = [jax.device_put(a, spec) for a in (x, idx, gates)]
    laid_out = cfg.laid_out('cpu', mesh)
    y, dropped = jax.jit(lambda *a: expert_parallel.routed_experts(*a, w, laid_out))(*args)
  return x, idx, gates, w, y, dropped


@pytest.mark.parametrize(
  'bound',
  [
    dict(moe_ep_recv_factor=0.5, moe_ep_overflow='drop'),
    dict(moe_dispatch='capacity', moe_capacity_factor=0.5),
  ],
)
def test_ragged_expert_parallel_drops_exactly_what_it_reports(bound):
  """A receive buffer smaller than the worst case (bounded for dropless with overflow 'drop', or
  sized by the capacity factor) drops overflow; the output is then the single-device dropless
  output with exactly the reported assignments' gates zeroed."""
  cfg = CFG.with_engine(**bound, rules=sharding.Rules.preset('fsdp_ep_tp'), moe_ep_comm='ragged')
  x, idx, gates, w, y, dropped = route_on_ep_mesh(cfg, seed=7)
  assert 0 < float(dropped.sum()) < float((idx < cfg.n_routed_experts).sum())
  single = cfg.with_engine(moe_expert_parallel=False, moe_dispatch='dropless')
  y_ref, _ = dispatch.routed_experts(x, idx, jnp.where(dropped > 0, 0.0, gates), w, single)
  np.testing.assert_allclose(y, y_ref, atol=1e-5)


def test_ragged_expert_parallel_overflow_rounds_are_dropless():
  """A receive buffer of 0.3x the local assignments (the default overflow 'rounds'; the fullest
  shard needs several rounds, and 'drop' drops on the same routing): nothing dropped, and the
  output and its gradients (tokens, gates, expert weights and adapters) are one device's
  dropless engine's."""
  cfg = CFG.with_engine(
    rules=sharding.Rules.preset('fsdp_ep_tp'), moe_ep_comm='ragged', moe_ep_recv_factor=0.3
  )
  assert expert_parallel.ep_rounds(64 * cfg.moe_topk, cfg, 4) == 14
  x, idx, gates, w, y, dropped = route_on_ep_mesh(cfg, seed=7)
  assert float(dropped.sum()) == 0
  single = cfg.with_engine(moe_expert_parallel=False)
  y_ref, _ = dispatch.routed_experts(x, idx, gates, w, single)
  np.testing.assert_allclose(y, y_ref, atol=1e-6)
  dropping = cfg.with_engine(moe_ep_overflow='drop')
  assert float(route_on_ep_mesh(dropping, seed=7)[-1].sum()) > 0

  cot = jax.random.normal(jax.random.key(3), y.shape)
  mesh = sharding.make_mesh((1, 2, 4, 1))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(('fsdp', 'expert')))

  def grads(c, *args):
    loss = lambda x, g, w: jnp.sum(expert_parallel.routed_experts(x, idx, g, w, c)[0] * cot)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)

  with jax.set_mesh(mesh):
    got = grads(cfg.laid_out('cpu', mesh), *(jax.device_put(a, spec) for a in (x, gates)), w)
  chex.assert_trees_all_close(got, grads(single, x, gates, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('comm', ['fixed', 'ragged', 'none'])
def test_capacity_is_per_expert_and_group(comm):
  """Capacity dispatch keeps per-expert buffers. Under expert parallelism, ragged: each expert
  keeps the first C assignments of its exchange group's tokens (the ep shards of one fsdp row)
  in token order, exactly one device's capacity dispatch of those tokens; fixed: each expert
  keeps the first c of every shard's own assignments (GShard's groups), exactly one device's
  capacity dispatch of each shard's tokens. Without it ('none'), the same per batch shard (left
  to XLA, the sort ran over the whole batch)."""
  ep = {'moe_ep_comm': comm} if comm != 'none' else {'moe_expert_parallel': False}
  cfg = CFG.with_engine(
    rules=sharding.Rules.preset('fsdp_ep_tp'),
    moe_dispatch='capacity',
    moe_capacity_factor=0.75,
    **ep,
  )
  x, idx, gates, w, y, dropped = route_on_ep_mesh(cfg, seed=8)
  single = cfg.with_engine(moe_expert_parallel=False)
  groups = 2 if comm == 'ragged' else 8
  parts = [
    dispatch.routed_experts(xs, ids, gs, w, single)
    for xs, ids, gs in zip(*(jnp.split(a, groups) for a in (x, idx, gates)))
  ]
  np.testing.assert_array_equal(dropped, jnp.concatenate([p[1] for p in parts]))
  np.testing.assert_allclose(y, jnp.concatenate([p[0] for p in parts]), atol=1e-5)
  assert 0 < float(dropped.sum()) < float((idx < cfg.n_routed_experts).sum())


def test_padding_takes_no_expert_capacity():
  """Padding tokens (segment 0) enter no expert: whether they come before or after the real
  tokens changes neither the real tokens' outputs nor what is dropped, and their own output is
  zero."""
  cfg = CFG.with_engine(moe_dispatch='capacity', moe_capacity_factor=0.5)
  moe = make_moe(cfg)
  real = jax.random.normal(jax.random.key(10), (1, 16, cfg.hidden_size))
  on, off = jnp.ones((1, 16), bool), jnp.zeros((1, 16), bool)

  def call(moe, x, valid):
    return moe(x, valid)

  # The padding rows copy the real ones, so they would route alike and compete for capacity.
  first = jit_call(call, moe, jnp.concatenate([real, real]), jnp.concatenate([off, on]))
  last = jit_call(call, moe, jnp.concatenate([real, real]), jnp.concatenate([on, off]))
  np.testing.assert_allclose(first[0][1], last[0][0], atol=1e-6)
  np.testing.assert_array_equal(first[0][0], 0.0)
  np.testing.assert_array_equal(last[0][1], 0.0)
  for k in ('load', 'dropped_frac', 'ffn_experts_mean'):
    np.testing.assert_allclose(first[1][k], last[1][k], atol=1e-6)
  assert float(first[1]['dropped_frac']) > 0


def test_bias_update_balances_a_skewed_router():
  cfg = tiny(n_routed_experts=8, zero_expert_num=4, moe_topk=3)
  moe = MoE(cfg, 'layers.moe', nnx.Rngs(0))
  skew = jnp.zeros((cfg.hidden_size, cfg.num_experts_total)).at[:, :2].set(0.5)
  moe.router[...] = moe.router[...] + skew  # experts 0 and 1 attract most tokens
  x = jax.random.normal(jax.random.key(5), (4, 64, cfg.hidden_size))
  step_cfg = StepConfig(model=cfg, bias_update_rate=0.05)

  def imbalance():
    load = run(moe, x)[1]['load'][: cfg.n_routed_experts]
    return float(load.max() / load.mean())

  before = imbalance()
  bias = nnx.state(moe, RouterBias)
  for step in range(300):
    load = run(moe, x)[1]['load'][None]
    bias = bias_update(jax.tree.map(lambda b: b[None], bias), load, step, step_cfg)
    bias = jax.tree.map(lambda b: b[0], bias)
    nnx.update(moe, bias)
  after = imbalance()
  assert before > 1.3 and after - 1 < 0.25 * (before - 1), (before, after)
  # zero-expert biases are never updated
  np.testing.assert_array_equal(moe.router_bias[...][cfg.n_routed_experts :], 0.0)


def test_bias_update_is_the_proportional_rule():
  """One update against TR eq. 2 by hand: db_i = mu (K_e/(K N) - T_i/(K T_all)) for the N = 4
  FFN experts, nothing for the zero experts; with the cosine decay, mu halves mid-way."""
  cfg = tiny(n_routed_experts=4, zero_expert_num=2, moe_topk=2, moe_expected_ffn_experts=1.5)
  load = jnp.array([[6.0, 2.0, 0.0, 4.0, 5.0, 3.0]])  # 20 assignments = 10 tokens x K=2
  want = 0.1 * (1.5 / (2 * 4) - np.array([6.0, 2.0, 0.0, 4.0]) / (2 * 10))
  bias = {'b': jnp.zeros((1, 6))}
  got = bias_update(bias, load, 0, StepConfig(model=cfg, bias_update_rate=0.1))['b'][0]
  np.testing.assert_allclose(got, np.concatenate([want, [0.0, 0.0]]), rtol=1e-6)
  decayed = StepConfig(model=cfg, bias_update_rate=0.1, bias_update_decay_steps=100)
  got = bias_update(bias, load, 50, decayed)['b'][0]
  np.testing.assert_allclose(got[:4], want / 2, rtol=1e-5)


def test_balance_loss_by_hand():
  """4 FFN experts in D = 2 groups plus the zero group, K = 2, K_e = 4/3: every group's target
  share tau_j is 1/3, so the loss is 3 sum_j f_j P_j here, and 1 when f = P = target."""
  cfg = tiny(n_routed_experts=4, zero_expert_num=2, moe_topk=2, moe_balance_groups=2)
  frac = jnp.array([0.1, 0.2, 0.3, 0.1, 0.2, 0.1])
  mean_p = jnp.array([0.3, 0.1, 0.1, 0.1, 0.3, 0.1])
  # Groups: f = (0.3, 0.4, zero 0.3), P = (0.4, 0.2, zero 0.4).
  np.testing.assert_allclose(
    device_balance_loss(frac, mean_p, cfg), 3 * (0.12 + 0.08 + 0.12), rtol=1e-6
  )
  target = jnp.full((6,), 1 / 6)
  np.testing.assert_allclose(device_balance_loss(target, target, cfg), 1.0, rtol=1e-6)
  # One group (D = 1) only weighs FFN against zero experts: moving load between FFN experts
  # changes nothing; with D = 2 it does (f = (0.4, 0.3): 3 (0.16 + 0.06 + 0.12)).
  swapped = frac[jnp.array([0, 2, 1, 3, 4, 5])]
  one = cfg.with_engine(moe_balance_groups=1)
  np.testing.assert_allclose(
    device_balance_loss(frac, mean_p, one), device_balance_loss(swapped, mean_p, one)
  )
  np.testing.assert_allclose(device_balance_loss(swapped, mean_p, cfg), 3 * 0.34, rtol=1e-6)


def with_cfg(moe, cfg):
  """The same MoE weights under another config."""
  return nnx.merge(nnx.graphdef(MoE(cfg, 'layers.moe', nnx.Rngs(0))), nnx.state(moe))


def test_balance_groups_default_to_the_expert_shards():
  cfg = CFG.with_engine(rules=sharding.Rules.preset('fsdp_ep_tp'))
  assert cfg.engine.moe_balance_groups == 0
  moe = make_moe(cfg)
  x = jax.random.normal(jax.random.key(12), (8, 8, cfg.hidden_size))
  loss = lambda moe, x: _run(moe, x)[1]['balance_loss']
  explicit = {
    d: jit_call(loss, with_cfg(moe, cfg.with_engine(moe_balance_groups=d)), x) for d in (1, 4)
  }
  assert abs(float(explicit[4] - explicit[1])) > 1e-4
  np.testing.assert_allclose(jit_call(loss, moe, x), explicit[1], rtol=1e-6)  # no mesh: D = 1
  mesh = sharding.make_mesh((1, 2, 4, 1))
  with jax.set_mesh(mesh):
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(('data', 'fsdp', 'expert')))
    auto = jit_call(loss, with_cfg(moe, cfg.laid_out('cpu', mesh)), jax.device_put(x, spec))
  np.testing.assert_allclose(auto, explicit[4], rtol=1e-5)


def test_routing_stats_by_hand():
  """Two real tokens and one padding token over E = 2 FFN + Z = 1 zero expert, top-2."""
  cfg = tiny(n_routed_experts=2, zero_expert_num=1, moe_topk=2)
  logits = jnp.array([[1.0, 0.0, -1.0], [0.0, 2.0, 0.0], [5.0, 5.0, 5.0]])
  probs = jax.nn.softmax(logits, -1)
  idx = jnp.array([[0, 2], [1, 0], [3, 3]])  # token 1 uses both FFN experts; 3 = padding's id
  valid = jnp.array([1.0, 1.0, 0.0])
  dropped = jnp.array([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
  st = routing_stats(logits, probs, idx, valid, dropped, cfg)
  np.testing.assert_array_equal(st['load'], [2, 1, 1])
  np.testing.assert_allclose(st['ffn_experts_mean'], 1.5)
  np.testing.assert_allclose(st['ffn_experts_std'], 0.5)
  np.testing.assert_allclose(st['dropped_frac'], 1 / 3)  # one of the 3 FFN assignments
  p = np.asarray(probs[:2])
  np.testing.assert_allclose(st['router_entropy'], np.mean(-np.sum(p * np.log(p), -1)), rtol=1e-6)
  lse = np.log(np.sum(np.exp(np.asarray(logits[:2])), -1))
  np.testing.assert_allclose(st['router_z_loss'], np.mean(lse**2), rtol=1e-6)


def test_routing_stats_add_up_over_micro_batches():
  """As gradient accumulation adds them (train_step.loss_fn: counts summed, token means weighted
  by each micro-batch's share of the valid tokens, then finish_routing_stats), two uneven halves
  give the whole batch's statistics, the dropped share (a ratio of sums) and the spread of FFN
  experts per token included."""
  from moetrain.model.moe import ROUTING_COUNTS, finish_routing_stats

  cfg = tiny(n_routed_experts=4, zero_expert_num=2, moe_topk=2)
  m, x = 10, cfg.num_experts_total
  logits = jax.random.normal(jax.random.key(0), (m, x))
  idx = jax.random.randint(jax.random.key(1), (m, 2), 0, x)
  valid = jnp.array([1.0] * 7 + [0.0] * 3)
  dropped = (jax.random.uniform(jax.random.key(2), (m, 2)) < 0.4) & (idx < cfg.n_routed_experts)
  args = lambda s: (logits[s], jax.nn.softmax(logits[s]), idx[s], valid[s], dropped[s] * 1.0, cfg)
  whole = routing_stats(*args(slice(None)))
  parts = [routing_stats(*args(s)) for s in (slice(0, 3), slice(3, None))]
  share = [float(valid[:3].sum() / valid.sum()), float(valid[3:].sum() / valid.sum())]
  summed = {
    k: sum(p[k] if k in ROUTING_COUNTS else p[k] * f for p, f in zip(parts, share)) for k in whole
  }
  summed = finish_routing_stats(summed, cfg)
  assert float(whole['dropped_frac']) > 0
  for k in ('load', 'dropped_frac', 'ffn_experts_mean', 'ffn_experts_std', 'router_entropy'):
    np.testing.assert_allclose(summed[k], whole[k], rtol=1e-6, err_msg=k)


def test_deterministic():
  moe = make_moe(CFG)
  x = jax.random.normal(jax.random.key(6), (2, 16, CFG.hidden_size))
  a, b = loss_and_grads(moe, x, _engine), loss_and_grads(moe, x, _engine)
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize(
  'sizes', [[5, 0, 55, 27], [0, 0, 0, 0], pytest.param([40, 8, 0, 71], marks=pytest.mark.slow)]
)
@pytest.mark.parametrize('pick', [0, 1, 2])
def test_grouped_tiles_match_rowwise_experts(sizes, pick):
  """The CPU 'grouped' engine on its own: groups that are empty, shorter than a tile, or not a
  multiple of it; outputs and gradients (x, every weight, and only the adapters, as under LoRA,
  where the base weights get no gradient work) against a per-row computation, for each of the
  row tiles the engine can switch between at run time (16, 32 and 48 rows)."""
  cfg = with_lora(tiny(expert_ffn_hidden_size=6), rank=2, targets=EXPERT_LORA, alpha=2.0)
  tiles = (16, 32, 48)
  e, d, f, b = len(sizes), cfg.hidden_size, 6, max(tiles)
  sizes_E = jnp.array(sizes, jnp.int32)
  rows = sum(sizes)
  keys = iter(jax.random.split(jax.random.key(0), 16))
  w = expert_weights(next(keys), e, d, f)
  x = jax.random.normal(next(keys), (rows + 3 + b, d)).at[rows:].set(0)  # + zero-expert rows
  expert_R = jnp.repeat(jnp.arange(e), sizes_E, total_repeat_length=rows)
  groups = grouped.Groups(jnp.cumsum(sizes_E) - sizes_E, sizes_E, jnp.int32(pick))

  def engine(x, w):
    train, frozen = grouped.split_trainable(w)
    return grouped.expert_ffn(x, train, frozen, groups, None, tiles, dispatch.spec(cfg))

  def rowwise(x, w):
    we = {k: v[expert_R] for k, v in w.items()}
    mm = lambda h, k: (
      jnp.einsum('ri,rio->ro', h, we[k])
      + cfg.lora.scale * jnp.einsum('ri,rik,rko->ro', h, we[f'{k}_lora_a'], we[f'{k}_lora_b'])
    )
    xr = x[:rows]
    y = mm(jax.nn.silu(mm(xr, 'gate')) * mm(xr, 'up'), 'down')
    return jnp.zeros_like(x).at[:rows].set(y)

  y = jax.jit(engine)(x, w)
  np.testing.assert_allclose(y, rowwise(x, w), atol=1e-5, rtol=1e-5)
  probe = jax.random.normal(next(keys), y.shape).at[rows:].set(0)
  loss = lambda fn: lambda x, w: jnp.sum(fn(x, w) * probe)
  got = jax.jit(jax.grad(loss(engine), argnums=(0, 1)))(x, w)
  want = jax.jit(jax.grad(loss(rowwise), argnums=(0, 1)))(x, w)
  np.testing.assert_allclose(got[0][:rows], want[0][:rows], atol=1e-5, rtol=1e-5)
  # Weight gradients sum over every row of a group (up to 71 here, in 16-48-row tiles): float32
  # rounding of that sum is relative to the gradient's scale, not to each element.
  tol = lambda a: 1e-5 * max(1.0, float(jnp.abs(a).max()))
  for k in w:
    np.testing.assert_allclose(got[1][k], want[1][k], atol=tol(want[1][k]), rtol=1e-5, err_msg=k)
  # Adapters only: the frozen base is closed over, as LoRA training differentiates it.
  base = {k: v for k, v in w.items() if '_lora_' not in k}
  adapters = {k: v for k, v in w.items() if '_lora_' in k}
  only = jax.jit(jax.grad(lambda a: loss(engine)(x, {**base, **a})))(adapters)
  for k in adapters:
    np.testing.assert_allclose(only[k], want[1][k], atol=tol(want[1][k]), rtol=1e-5, err_msg=k)


@pytest.mark.parametrize('expect', [1, 20, 85, 200, 341, 500, 1000, 3000])
def test_tile_rows_fit_the_expected_groups(expect):
  """The grouped engine's fitted tile: a multiple of 16 rows, at most 256 (a bigger expected
  group takes several tiles), and the fewest such tiles cover 1.1 x the expected group."""
  b = grouped.tile_rows(expect)
  tiles = -(-1.1 * expect // b)
  assert b % 16 == 0 and 16 <= b <= 256
  assert tiles * b >= 1.1 * expect and tiles == -(-1.1 * expect // 256)
  assert (tiles * (b - 16) < 1.1 * expect) or b == 16  # no smaller tile would do
  assert grouped.tile_candidates(expect, requested=64) == (64,)
  assert {b, 128} <= set(grouped.tile_candidates(expect))
  # A LongCat-style layer: 2048 tokens, top-4 over 16 FFN + 8 zero experts (bench/moe_layer).
  if expect == 341:
    cfg = dataclasses.replace(CFG, n_routed_experts=16, zero_expert_num=8, moe_topk=4)
    assert dispatch.expected_group(cfg, 2048 * 4) == pytest.approx(2048 * 4 / 24)
    assert b == 192
    assert grouped.tile_candidates(expect) == (128, 192, 384)


def test_choose_tile_follows_the_group_sizes():
  """Even groups take one big tile each; skewed groups the small tile that pads least."""
  tiles = (128, 192, 384)
  even = jnp.array([339, 328, 326, 367, 332, 344, 327, 322, 334, 343, 352, 346, 293, 333, 312, 362])
  skewed = jnp.array(
    [277, 375, 274, 316, 591, 335, 340, 287, 438, 127, 323, 402, 415, 254, 193, 366]
  )
  assert int(grouped.choose_tile(even, tiles)) == 2
  assert int(grouped.choose_tile(skewed, tiles)) == 0
  assert grouped.choose_tile(even, (64,)) == 0


def test_megablox_without_expert_parallelism_runs_on_each_batch_shard():
  """XLA cannot partition a Mosaic kernel: on a mesh without an expert axis the megablox engine
  runs in a shard_map over the batch shards, the weights entering as FSDP stores them (D over
  'fsdp') and gathered inside, their gradients leaving by reduce-scatter: the single-device
  result and gradients. (Its TPU compile: tests/test_plan.py.)"""
  cfg = dataclasses.replace(CFG, **LANES).with_engine(moe_backend='megablox')
  moe = make_moe(cfg)
  x = jax.random.normal(jax.random.key(3), (64, cfg.hidden_size))
  _, _, idx, gates, _ = route(x, moe.router[...], moe.router_bias[...], cfg)
  w = moe.experts.weights()
  loss = lambda y: jnp.sum(jnp.sin(y))
  want, want_g = jax.value_and_grad(
    lambda w: loss(dispatch.routed_experts(x, idx, gates, w, cfg)[0])
  )(w)
  mesh = sharding.make_mesh((1, -1, 1, 1))  # the 8 test devices over fsdp
  laid_out = cfg.with_engine(rules=sharding.Rules.preset('fsdp')).laid_out('cpu', mesh)
  specs = expert_parallel.stored_specs(w, laid_out)
  assert specs['gate'] == jax.sharding.PartitionSpec(None, 'fsdp', None), specs
  fn = lambda w, *a: loss(expert_parallel.routed_experts(*a, w, laid_out)[0])
  with jax.set_mesh(mesh):
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('fsdp'))
    args = [jax.device_put(a, spec) for a in (x, idx, gates)]
    w = {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, specs[k])) for k, v in w.items()}
    jaxpr = str(jax.make_jaxpr(jax.grad(fn))(w, *args))
    assert 'shard_map' in jaxpr and 'reduce_scatter' in jaxpr
    y, g = jax.jit(jax.value_and_grad(fn))(w, *args)
  np.testing.assert_allclose(y, want, atol=1e-4, rtol=1e-5)
  for k in want_g:
    np.testing.assert_allclose(g[k], want_g[k], atol=1e-5, rtol=1e-4, err_msg=k)


def test_the_gpu_engine_follows_the_routed_rows_or_says_why_not(monkeypatch):
  """On a GPU 'auto' takes tokamax's kernels where they are installed; XLA's ragged_dot (dense
  over every expert on XLA:GPU) comes with a warning naming the reason and the fix."""
  gpu = CFG.with_engine(moe_backend='auto', platform='gpu')
  assert dispatch.resolve_backend(gpu) == 'tokamax' and dispatch.gpu_engine_warning(gpu) is None
  monkeypatch.setattr(dispatch, 'tokamax_installed', lambda: False)
  assert dispatch.resolve_backend(gpu) == 'ragged_dot'
  assert 'tokamax is not installed' in dispatch.gpu_engine_warning(gpu)
  chosen = gpu.with_engine(moe_backend='ragged_dot')
  assert "engine.moe_backend='ragged_dot'" in dispatch.gpu_engine_warning(chosen)
  assert dispatch.gpu_engine_warning(gpu.with_engine(moe_dispatch='capacity')) is None
  assert dispatch.gpu_engine_warning(gpu.with_engine(platform='cpu')) is None


def test_tokamax_takes_the_first_gpu_kernel_that_fits_and_names_a_fallback(caplog):
  """tokamax_mm on a GPU tries Mosaic GPU, then Triton; where neither takes the product (here:
  a CPU, where both refuse) it runs tokamax's XLA form, says why once, and records the choice
  per product for the benchmarks, with values and gradients equal to ragged_dot's."""
  from moetrain.kernels import experts

  gpu = CFG.with_engine(platform='gpu', dtype='float32')
  x = jax.random.normal(jax.random.key(0), (10, 16))
  w = jax.random.normal(jax.random.key(1), (4, 16, 8))
  sizes = jnp.array([3, 0, 5, 2], jnp.int32)
  experts.TOKAMAX_CHOICES.clear()
  f = lambda x, w: experts.tokamax_mm(x, w, sizes, jnp.float32, gpu)
  ref = lambda x, w: jax.lax.ragged_dot(x, w, sizes)
  with caplog.at_level('WARNING'):
    np.testing.assert_allclose(jax.jit(f)(x, w), ref(x, w), rtol=1e-5, atol=1e-5)
    g, g_ref = (jax.grad(lambda w, fn=fn: fn(x, w).sum())(w) for fn in (f, ref))
  np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5)
  ((key, choice),) = experts.TOKAMAX_CHOICES.items()
  assert key == 'x [256, 16] @ w [4, 16, 8] float32'  # rows padded to Mosaic GPU's tile
  assert choice.startswith('xla (mosaic: ') and 'triton: ' in choice
  warned = [r.getMessage() for r in caplog.records if 'no GPU kernel' in r.getMessage()]
  assert len(warned) == 1 and key in warned[0] and 'densely' in warned[0]
  named = gpu.with_engine(tokamax_implementation='xla')
  experts.tokamax_mm(x, w, sizes, jnp.float32, named)
  assert experts.TOKAMAX_CHOICES[key] == 'xla'


def test_tokamax_on_a_gpu_zeroes_what_its_kernel_leaves_unwritten(monkeypatch):
  """A GPU kernel that leaves garbage (here NaN) in the output and input-gradient rows no group
  covers and in the weight gradient of an expert with no rows gives tokamax_mm the values and
  gradients of ragged_dot, finite, rows padded to the tile and back."""
  import tokamax

  from moetrain.kernels import experts

  def unwritten(x, w, sizes, preferred_element_type=None, **_):
    @jax.custom_vjp
    def f(x, w):
      return jnp.where(covered(x), jax.lax.ragged_dot(x, w, sizes), jnp.nan)

    def covered(x):
      return (jnp.arange(x.shape[0]) < sizes.sum())[:, None]

    def bwd(res, g):
      x, w = res
      _, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)
      dx, dw = vjp(g)
      return jnp.where(covered(x), dx, jnp.nan), jnp.where((sizes > 0)[:, None, None], dw, jnp.nan)

    f.defvjp(lambda x, w: (f(x, w), (x, w)), bwd)
    return f(x, w).astype(preferred_element_type)

  monkeypatch.setattr(tokamax, 'ragged_dot', unwritten)
  gpu = CFG.with_engine(platform='gpu', dtype='float32', tokamax_implementation='mosaic')
  x = jax.random.normal(jax.random.key(0), (300, 16))  # 7 rows past the groups
  w = jax.random.normal(jax.random.key(1), (4, 16, 8))
  sizes = jnp.array([100, 0, 150, 43], jnp.int32)  # expert 1 has no rows
  f = lambda x, w: experts.tokamax_mm(x, w, sizes, jnp.float32, gpu)
  ref = lambda x, w: jax.lax.ragged_dot(x, w, sizes)
  loss = lambda fn: lambda x, w: jnp.sum(fn(x, w) ** 2)
  y, g = jax.jit(f)(x, w), jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w)
  g_ref = jax.grad(loss(ref), argnums=(0, 1))(x, w)
  np.testing.assert_allclose(y, ref(x, w), rtol=1e-5, atol=1e-5)
  for a, b in zip(g, g_ref, strict=True):
    assert np.isfinite(a).all()
    # Float32 sums over the padded tiles in another order: the weight gradient's entries, up to
    # ~400, differ by float32 rounding (1.5e-5 on one of 512 on an AVX2 host), to the scale.
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
  ref = gpu.with_engine(kernels='reference')  # the kernel's reference: the same
  g_sel = jax.grad(loss(lambda x, w: experts.tokamax_mm(x, w, sizes, jnp.float32, ref)), (0, 1))
  for a, b in zip(g_sel(x, w), g, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_rocm_turns_on_xlas_grouped_gemm(monkeypatch):
  from importlib import metadata

  from moetrain.core import runtime

  plugin = type('Dist', (), {'metadata': {'Name': 'jax-rocm7-plugin'}})()
  monkeypatch.setattr(metadata, 'distributions', lambda: [plugin])
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  runtime.rocm_grouped_gemm()
  assert os.environ['XLA_FLAGS'].endswith(' ' + runtime.ROCM_GROUPED_GEMM)
  runtime.rocm_grouped_gemm()  # once
  assert os.environ['XLA_FLAGS'].count('grouped_gemm') == 1
  monkeypatch.setattr(metadata, 'distributions', lambda: [])
  monkeypatch.setenv('XLA_FLAGS', '')
  runtime.rocm_grouped_gemm()
  assert os.environ['XLA_FLAGS'] == ''

"""Every kernel's fast path against its plain-autodiff reference (moetrain/kernels): the same
values and the same gradients, one kernel at a time and through the whole model."""

import ast
import contextlib
import importlib
import pathlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moetrain import kernels
from moetrain.core import sharding
from moetrain.kernels import (
  attention,
  cross_entropy,
  distill,
  exchange,
  experts,
  grouped,
  lora,
  megablox,
  rounds,
  rows,
)
from moetrain.model import dispatch, expert_parallel
from moetrain.model.layers import Linear
from moetrain.model.masks import attention_mask
from moetrain.training.train_state import graphdef_of, split_model
from moetrain.training.train_step import forward_loss
from tests.helpers import expert_weights, model_and_ids, randomize, tiny, with_lora
from tests.test_sharding import batch

ROOT = pathlib.Path(__file__).parent.parent / 'moetrain'


def _kernels() -> list[kernels.Kernel]:
  found = []
  for info in pkgutil.iter_modules(kernels.__path__):
    module = importlib.import_module(f'moetrain.kernels.{info.name}')
    found += [v for v in vars(module).values() if isinstance(v, kernels.Kernel) and v not in found]
  return found


def _custom_vjp_sites() -> list[str]:
  """Every place in moetrain that makes a custom VJP (a decorator or a call of custom_vjp)."""
  sites = []
  for path in sorted(ROOT.rglob('*.py')):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Attribute) and node.attr == 'custom_vjp':
        sites.append(f'{path.relative_to(ROOT.parent)}:{node.lineno}')
  return sites


def test_every_custom_vjp_is_the_fast_path_of_a_kernel():
  sites = _custom_vjp_sites()
  assert all(s.startswith('moetrain/kernels/') for s in sites), sites
  fast = [k for k in _kernels() if isinstance(k.fast, jax.custom_vjp)]
  assert len(fast) == len(sites) == 16, (sorted(k.name for k in fast), sites)
  assert all(k.reference is not k.fast for k in _kernels())


def _with(args, argnums, diff):
  args = list(args)
  for i, d in zip(argnums, diff, strict=True):
    args[i] = d
  return args


def _plain(kernel, args, argnums):
  """make(reference) -> the kernel as a function of args[argnums]."""
  return lambda reference: lambda *d: kernel(*_with(args, argnums, d), reference=reference)


def _gather_rows():
  perm = np.random.default_rng(0).permutation(9)  # 9 slots for 7 rows: 2 empty
  idx_P = jnp.array(np.where(perm < 7, perm, 7))
  inv = jnp.array([int(np.flatnonzero(perm == r)[0]) for r in range(7)])
  x = jax.random.normal(jax.random.key(0), (7, 3))
  return _plain(rows.gather_rows, (x, idx_P, inv), (0,)), (x,)


def _dispatch_tokens():
  m, a, e = 6, 2, 4
  idx_MA = jax.random.randint(jax.random.key(1), (m, a), 0, e + 2)  # ids >= e: zero experts
  order_R, expert_sorted_R, _ = dispatch.sort_assignments(idx_MA.reshape(-1), e)
  asg_P, slot_R, _ = dispatch.place(dispatch.identity_layout(expert_sorted_R < e), order_R)
  x = jax.random.normal(jax.random.key(2), (m, 3))
  return _plain(rows.dispatch_tokens, (x, asg_P, slot_R), (0,)), (x,)


def _take_experts():
  w = jax.random.normal(jax.random.key(3), (4, 3, 5))
  return _plain(rows.take_experts, (w, jnp.array([0, 2, 2, 3, 0, 1])), (0,)), (w,)


def _lora_product():
  x, a, b = (
    jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(12, 6), (6, 2), (2, 5)])
  )
  return _plain(lora.lora_product, (x, a, b), (0, 1, 2)), (x, a, b)


def _attention(recompute):
  def case():
    t = 11
    ks = jax.random.split(jax.random.key(4), 3)
    q, k = (jax.random.normal(key, (2, 3, t, 6)) for key in ks[:2])
    v = jax.random.normal(ks[2], (2, 3, t, 5))
    seg = jnp.array([[1] * 5 + [2] * 6, [1] * 9 + [0] * 2])
    pos = jnp.array([list(range(5)) + list(range(6)), list(range(9)) + [0] * 2])
    mask = attention_mask(pos, seg, pos, seg) & jnp.tril(jnp.ones((1, t, t), jnp.bool_))
    mask = mask.at[1, t - 1].set(False)  # a query that sees no key
    blocks = ((0, 4, 4), (4, 8, 8), (8, 11, 11))
    args = (q, k, v, mask, 0.3, blocks, recompute)
    return _plain(attention.attention_core, args, (0, 1, 2)), (q, k, v)

  return case


def _head_ce():
  cfg = with_lora(tiny(), targets=r'lm_head$')
  head = Linear('BTD,DV->BTV', (32, 64), cfg, 'lm_head', nnx.Rngs(0))
  randomize(head, 1, nnx.LoRAParam)
  graphdef, adapters, base = nnx.split(head, nnx.LoRAParam, ...)
  k = jax.random.split(jax.random.key(5), 3)
  h = jax.random.normal(k[0], (2, 10, 32))
  targets = jax.random.randint(k[1], (2, 10), 0, 64)
  mask = (jax.random.uniform(k[2], (2, 10)) < 0.8).astype(jnp.float32)

  def make(reference):
    def fn(adapters, h):
      m = nnx.merge(graphdef, adapters, base)
      return cross_entropy.head_cross_entropy(m, h, targets, mask, 3, None, None, reference)

    return fn

  return make, (adapters, h)


def _head_distill(kind, top_k):
  """The distillation loss with LoRA on the student's head, against an online teacher head."""

  def case():
    cfg = with_lora(tiny(), targets=r'lm_head$')
    head = Linear('BTD,DV->BTV', (32, 64), cfg, 'lm_head', nnx.Rngs(0))
    randomize(head, 1, nnx.LoRAParam)
    graphdef, adapters, base = nnx.split(head, nnx.LoRAParam, ...)
    t_head = Linear('BTD,DV->BTV', (16, 64), tiny(), 'lm_head', nnx.Rngs(3))
    k = jax.random.split(jax.random.key(6), 4)
    t_h = jax.random.normal(k[0], (2, 10, 16)) * 3
    h = jax.random.normal(k[3], (2, 10, 32))
    targets = jax.random.randint(k[1], (2, 10), 0, 64)
    mask = (jax.random.uniform(k[2], (2, 10)) < 0.8).astype(jnp.float32)
    d = distill.Divergence(kind, 0.7, 2.0, 0.3, top_k)

    def make(reference):
      def fn(adapters, h):
        m = nnx.merge(graphdef, adapters, base)
        teacher = ('online', t_head, t_h)
        return distill.head_distillation(m, h, targets, mask, teacher, d, 3, None, None, reference)[
          0
        ]

      return fn

    return make, (adapters, h)

  return case


def _expert_ffn(adapters_only):
  def case():
    cfg = with_lora(tiny(expert_ffn_hidden_size=6), rank=2, targets=r'experts\.')
    sizes_E = jnp.array([5, 0, 20, 9], jnp.int32)
    e, d, f, tiles, n = 4, cfg.hidden_size, 6, (16, 32), 34
    w = expert_weights(jax.random.key(6), e, d, f)
    x = jax.random.normal(jax.random.key(7), (n + 3 + max(tiles), d)).at[n:].set(0)
    groups = grouped.Groups(jnp.cumsum(sizes_E) - sizes_E, sizes_E, jnp.int32(1))
    base = {k: v for k, v in w.items() if '_lora_' not in k}
    adapters = {k: v for k, v in w.items() if '_lora_' in k}

    def make(reference):
      def fn(x, trained):
        weights = {**base, **trained} if adapters_only else trained
        train, frozen = grouped.split_trainable(weights)
        return grouped.expert_ffn(
          x, train, frozen, groups, None, tiles, dispatch.spec(cfg), reference=reference
        )

      return fn

    return make, (x, adapters if adapters_only else w)

  return case


def _grouped_matmul(k, n, sizes, m, transposed=False):
  """The Pallas grouped matmul (interpreted on CPU) on an adapter's thin shapes: [D, rank] (the
  rank a whole-dimension block) and [rank, F]; m rows padded to the row tile (16 rows, or 128
  from 128 rows on: groups then span tiles), the rows past the groups zero, one group empty."""

  def case():
    sizes_E = jnp.array(sizes, jnp.int32)
    x = jax.random.normal(jax.random.key(8), (m, k))
    w = jax.random.normal(jax.random.key(9), (4, n, k) if transposed else (4, k, n))
    args = (x, w, sizes_E, transposed, True)
    return _plain(megablox.grouped_matmul, args, (0, 1)), (x, w)

  return case


def _ragged_adapter():
  """A LoRA factor per expert, float32 on float32 rows (the values and gradients the reference's
  to float32's precision; the bfloat16 case is tests/test_lora.py's), one group empty and rows
  past the groups."""
  sizes_E = jnp.array([3, 0, 21, 8], jnp.int32)
  x = jax.random.normal(jax.random.key(12), (37, 24))
  w = jax.random.normal(jax.random.key(13), (4, 24, 8))
  args = (x, w, sizes_E, jnp.dtype(jnp.float32))
  return _plain(experts.ragged_adapter, args, (0, 1)), (x, w)


def _round_sum():
  """Rounds 1 .. n-1 of a round function nonlinear in its arrays and in k, n (traced) below the
  static bound; integer arrays among the inputs, not differentiated and differentiated (a
  QLoRA base's codes travel with the weights)."""
  x, w = (
    jax.random.normal(jax.random.key(10), (5, 3)),
    jax.random.normal(jax.random.key(11), (3, 3)),
  )
  offset = jnp.array([1, 0, 2, 1, 0], jnp.int32)
  codes = jnp.array([3, -1, 2], jnp.int8)

  def fn(k, diff, static):
    x, (w, c) = diff
    (off,) = static
    return jnp.tanh((x @ (w * c[None, :])) * k + (off * k)[:, None])

  def make(reference):
    return lambda x, w: rounds.round_sum(
      fn, 6, jnp.int32(4), (x, (w, codes)), (offset,), reference=reference
    )

  return make, (x, w)


def _delta_rule_interpreted():
  """tokamax's delta-rule kernel in Pallas' interpreter against the chunked XLA rule: two
  packed segments, an initial state."""
  pytest.importorskip('tokamax')
  from moetrain.kernels import delta_rule_tokamax

  b, t, h, d = 1, 64, 2, 16
  ks = jax.random.split(jax.random.key(7), 6)
  norm = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q, k = (norm(jax.random.normal(key, (b, t, h, d))) for key in ks[:2])
  v = jax.random.normal(ks[2], (b, t, h, d))
  g = -jax.random.uniform(ks[3], (b, t, h), minval=0.05, maxval=0.5)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
  state = 0.1 * jax.random.normal(ks[5], (b, h, d, d))
  ordinal = jnp.array([[1] * 40 + [2] * 24], jnp.int32)

  def kernel(*args, reference=False):
    out, final = delta_rule_tokamax.interpreted_kernel(*args, 4, reference=reference)
    return out, final

  args = (q, k, v, g, beta, state, ordinal)
  return _plain(kernel, args, (0, 1, 2, 3, 4, 5)), (q, k, v, g, beta, state)


CASES = {
  'round_sum': _round_sum,
  'ragged_adapter': _ragged_adapter,
  'grouped_matmul_lora_a': _grouped_matmul(128, 8, [3, 0, 21, 8], 37),
  'grouped_matmul_lora_a_transposed': _grouped_matmul(256, 8, [3, 0, 150, 40], 200, True),
  'grouped_matmul_lora_b': _grouped_matmul(8, 256, [3, 0, 150, 40], 200),
  # Widths no lane tile divides (gpt-oss: 2880): partial last blocks along K and N.
  'grouped_matmul_partial_blocks': _grouped_matmul(576, 640 + 64, [3, 0, 150, 40], 200),
  'gather_rows': _gather_rows,
  'dispatch_tokens': _dispatch_tokens,
  'take_experts': _take_experts,
  'lora_product': _lora_product,
  'attention_core_recompute': _attention(True),
  'attention_core_saved_probs': _attention(False),
  'head_ce': _head_ce,
  'head_distill_forward_kl': _head_distill('forward_kl', 0),
  'head_distill_reverse_kl_top_k': _head_distill('reverse_kl', 5),
  'head_distill_jsd': _head_distill('jsd', 0),
  'expert_ffn': _expert_ffn(False),
  'delta_rule_interpreted': _delta_rule_interpreted,
  'expert_ffn_adapters_only': _expert_ffn(True),
}


def _assert_same_function(make, diff, seed=7):
  """Values and the pullback of a random cotangent, fast path (jitted) against reference."""
  fast, ref = jax.jit(make(False)), jax.jit(make(True))
  out, pull = jax.vjp(fast, *diff)
  want, want_pull = jax.vjp(ref, *diff)
  # Sums over a contraction: float32 rounding is relative to the output's scale (its order of
  # summation is the compiler's and the CPU's choice).
  for got, ref_o in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
    scale = max(1.0, float(jnp.abs(ref_o).max()))
    np.testing.assert_allclose(got, ref_o, atol=1e-5 * scale, rtol=1e-5)
  leaves, tree = jax.tree.flatten(want)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  cot = jax.tree.unflatten(
    tree, [jax.random.normal(k, v.shape, v.dtype) for k, v in zip(keys, leaves)]
  )
  got_g, want_g = pull(cot), want_pull(cot)
  for got, ref_g in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
    assert float(jnp.abs(ref_g).max()) > 0  # every input gets a gradient
    # Sums over many rows: float32 rounding is relative to the gradient's scale.
    scale = max(1.0, float(jnp.abs(ref_g).max()))
    np.testing.assert_allclose(got, ref_g, atol=1e-5 * scale, rtol=1e-5)


@pytest.mark.parametrize('case', CASES)
def test_fast_path_equals_its_autodiff_reference(case):
  _assert_same_function(*CASES[case]())


def test_ragged_exchange_equals_its_autodiff_reference():
  """The exchange inside a shard_map over 4 shards (its CPU emulation forward): the reverse
  exchange as its gradient against autodiff through the emulation's all_gather and take."""
  ep, e_loc, r, d, buf = 4, 2, 8, 3, 20
  auto = (jax.sharding.AxisType.Auto,)
  mesh = jax.make_mesh((ep,), ('expert',), axis_types=auto, devices=jax.devices()[:ep])
  ids = np.sort(np.random.default_rng(1).integers(0, ep * e_loc + 1, (ep, r)), axis=1)
  counts_SE = jnp.array([np.bincount(row, minlength=ep * e_loc + 1)[:-1] for row in ids])
  spec = jax.sharding.PartitionSpec('expert')

  def make(reference):
    def local(x):
      me = jax.lax.axis_index('expert')
      ex, _, _ = expert_parallel.ragged_plan(counts_SE, me, e_loc, buf)
      return exchange.ragged_exchange(x, ex, buf, 'expert', True, reference=reference)

    return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)

  x = jax.random.normal(jax.random.key(8), (ep * r, d))
  _assert_same_function(make, (x,))


def _loss_and_grads(cfg, mesh_shape=None):
  """{'fast'|'reference': (loss, gradients of the trained parameters)} on one batch."""
  model, _ = model_and_ids(cfg)
  randomize(model, 3, nnx.LoRAParam if cfg.lora.enabled else nnx.Param, 0.05)
  _, params, bias, frozen = split_model(model, cfg)
  data = batch(b=8, t=12)
  mesh = sharding.make_mesh(mesh_shape) if mesh_shape else None
  out = {}
  for kind in ('fast', 'reference'):
    gd = graphdef_of(cfg.with_engine(kernels=kind))
    step = jax.jit(jax.value_and_grad(lambda p, gd=gd: forward_loss(p, bias, frozen, gd, data)[0]))
    with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
      out[kind] = step(params)
  return out


@pytest.mark.parametrize(
  'setting',
  [
    # LoRA everywhere (Linear's lora_product, the head's loss, attention), the grouped engine.
    pytest.param(dict(lora=True, moe_backend='grouped'), marks=pytest.mark.slow),
    # Full training, experts over 4 shards exchanging ragged buffers, the gathered engine.
    pytest.param(
      dict(lora=False, moe_backend='gathered', moe_ep_comm='ragged', mesh=(1, 2, 4, 1)),
      marks=pytest.mark.slow,
    ),
  ],
  ids=['lora_grouped', 'full_expert_parallel'],
)
def test_model_with_reference_kernels_gives_the_same_loss_and_gradients(setting):
  """engine.kernels='reference' swaps every kernel for its autodiff twin: the training loss and
  every trained parameter's gradient are unchanged."""
  setting = dict(setting)
  mesh, use_lora = setting.pop('mesh', None), setting.pop('lora')
  cfg = tiny(attention_chunk=5, loss_chunk=5, **setting)
  cfg = with_lora(cfg) if use_lora else cfg
  if mesh:
    cfg = cfg.with_engine(rules=sharding.Rules.preset('fsdp_ep_tp'))
    cfg = cfg.laid_out('cpu', sharding.make_mesh(mesh))
  out = _loss_and_grads(cfg, mesh)
  (loss, grads), (want, want_grads) = out['fast'], out['reference']
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
    np.testing.assert_allclose(got, ref, atol=1e-5 * max(1.0, float(jnp.abs(ref).max())), rtol=1e-4)

"""Distillation: the divergences by hand, the fused chunked loss, the teacher in the step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moetrain.kernels import distill as kd
from moetrain.model.layers import Linear
from tests.helpers import tiny


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _kl(p, q):
  """KL(p || q), 0 log 0 = 0."""
  safe = lambda x: np.log(np.where(x > 0, x, 1))
  return np.sum(np.where(p > 0, p * (safe(p) - safe(q)), 0), -1)


def _by_hand(kind, t_logits, s_logits, T, beta=0.5, top_k=0):
  """The divergence per position, from probabilities written out in numpy."""
  q = _softmax(s_logits / T)
  if top_k:
    keep = np.argsort(-t_logits, -1)[..., :top_k]
    z = np.full_like(t_logits, -np.inf)
    np.put_along_axis(z, keep, np.take_along_axis(t_logits, keep, -1), -1)
    p = _softmax(z / T)  # truncated to the k best, renormalised
  else:
    p = _softmax(t_logits / T)
  if kind == 'forward_kl':
    return _kl(p, q)
  if kind == 'reverse_kl':
    if top_k:  # q over the teacher's tokens, renormalised
      q = np.where(p > 0, q, 0)
      q = q / q.sum(-1, keepdims=True)
    return _kl(q, p)
  m = beta * p + (1 - beta) * q
  return beta * _kl(p, m) + (1 - beta) * _kl(q, m)


@pytest.mark.parametrize('kind', kd.DIVERGENCES)
@pytest.mark.parametrize('top_k', [0, 3])
def test_divergences_by_hand(kind, top_k):
  rng = np.random.default_rng(0)
  t_logits, s_logits = rng.normal(size=(2, 4, 7)) * 2, rng.normal(size=(2, 4, 7))
  targets = rng.integers(0, 7, (2, 4))
  mask = np.array([[1, 1, 0, 1], [0, 1, 1, 1]], np.float32)
  T, alpha, beta = 2.0, 0.7, 0.3
  d = kd.Divergence(kind, alpha, T, beta, top_k)
  teacher = kd.teacher_dist(d, jnp.asarray(t_logits, jnp.float32))
  obj, (nll, div, correct) = kd.block_loss(
    jnp.asarray(s_logits, jnp.float32), jnp.asarray(targets), jnp.asarray(mask), teacher, d
  )
  want_div = np.sum(_by_hand(kind, t_logits, s_logits, T, beta, top_k) * mask)
  logq1 = np.log(_softmax(s_logits))
  want_nll = -np.sum(np.take_along_axis(logq1, targets[..., None], -1)[..., 0] * mask)
  np.testing.assert_allclose(div, want_div, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(nll, want_nll, rtol=1e-5)
  np.testing.assert_allclose(obj, alpha * T**2 * want_div + (1 - alpha) * want_nll, rtol=1e-5)
  # Masked positions count for nothing, whatever their logits.
  s2 = s_logits.copy()
  s2[mask == 0] = 100.0
  obj2, _ = kd.block_loss(jnp.asarray(s2, jnp.float32), targets, jnp.asarray(mask), teacher, d)
  np.testing.assert_allclose(obj2, obj, rtol=1e-5)


def test_top_k_from_cache_equals_from_logits():
  """Cached top-k log-probabilities (temperature 1, normalised over the whole vocabulary) give
  the teacher distribution the logits give, at any temperature; a larger cached k is cut."""
  z = jax.random.normal(jax.random.key(0), (2, 3, 11)) * 3
  d = kd.Divergence('forward_kl', 0.5, 3.0, top_k=4)
  ids, logp = kd.teacher_top(z, 6)
  want_ids, want = kd.teacher_dist(d, z)
  got_ids, got = kd.teacher_dist(d, None, ids, logp)
  np.testing.assert_array_equal(got_ids, want_ids)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(jnp.exp(got).sum(-1), 1.0, rtol=1e-6)  # renormalised


def _heads():
  cfg = tiny()
  head = Linear('BTD,DV->BTV', (32, 64), cfg, 'lm_head', nnx.Rngs(0))
  t_head = Linear('BTD,DV->BTV', (16, 64), cfg, 'lm_head', nnx.Rngs(1))
  k = jax.random.split(jax.random.key(5), 4)
  h, t_h = jax.random.normal(k[0], (2, 10, 32)), jax.random.normal(k[1], (2, 10, 16)) * 3
  targets = jax.random.randint(k[2], (2, 10), 0, 64)
  mask = (jax.random.uniform(k[3], (2, 10)) < 0.8).astype(jnp.float32)
  return head, t_head, h, t_h, targets, mask


@pytest.mark.parametrize('kind', kd.DIVERGENCES)
def test_online_and_offline_give_the_same_loss_and_gradient(kind):
  head, t_head, h, t_h, targets, mask = _heads()
  d = kd.Divergence(kind, 0.6, 2.0, 0.4, top_k=5)
  ids, logp = kd.teacher_top(t_head(t_h).astype(jnp.float32), 8)

  def loss(h, teacher):
    return kd.head_distillation(head, h, targets, mask, teacher, d, 3)

  online = jax.value_and_grad(lambda h: loss(h, ('online', t_head, t_h))[0])(h)
  offline = jax.value_and_grad(lambda h: loss(h, ('offline', ids, logp))[0])(h)
  np.testing.assert_allclose(online[0], offline[0], rtol=1e-5)
  np.testing.assert_allclose(online[1], offline[1], rtol=1e-4, atol=1e-6)


def test_whole_vocabulary_divergence_equals_one_block():
  """The chunked loss (blocks of 3 positions, the last padded) sums what one block gives."""
  head, t_head, h, t_h, targets, mask = _heads()
  d = kd.Divergence('jsd', 0.5, 1.5, 0.5)
  teacher = ('online', t_head, t_h)
  chunked = kd.head_distillation(head, h, targets, mask, teacher, d, 3)
  whole = kd.head_distillation(head, h, targets, mask, teacher, d, 0)
  for a, b in zip(chunked, whole):
    np.testing.assert_allclose(a, b, rtol=1e-5)


def test_the_teacher_gets_no_gradient():
  head, t_head, h, t_h, targets, mask = _heads()
  d = kd.Divergence('forward_kl', 0.5, 2.0)
  graphdef, t_state = nnx.split(t_head)

  def loss(t_state, t_h):
    teacher = ('online', nnx.merge(graphdef, t_state), t_h)
    return kd.head_distillation(head, h, targets, mask, teacher, d, 3)[0]

  g_state, g_h = jax.grad(loss, argnums=(0, 1))(t_state, t_h)
  assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(g_state))
  assert float(jnp.abs(g_h).max()) == 0


def test_divergence_config_checks():
  from moetrain.distill.config import DistillConfig

  for bad, key in [
    (dict(teacher='t', beta=1.0), 'distill.beta'),
    (dict(teacher='t', alpha=1.5), 'distill.alpha'),
    (dict(teacher='t', temperature=0.0), 'distill.temperature'),
    (dict(teacher='t', loss='kl'), 'distill.loss'),
    (dict(teacher='t', teacher_logits='x'), 'distill.top_k'),
    (dict(init_from_teacher='most_used'), 'distill.teacher'),
  ]:
    with pytest.raises(ValueError, match=key.replace('.', r'\.')):
      dataclasses.replace(DistillConfig(), **bad).validate()
  assert DistillConfig(teacher='t', alpha=0.0).divergence() is None  # labels alone


def test_init_from_teacher_copies_exactly_the_chosen_experts():
  from moetrain.distill import student
  from moetrain.distill.config import DistillConfig
  from moetrain.model.transformer import Transformer
  from moetrain.train_state import split_model

  t_cfg, s_cfg = tiny(num_layers=2), tiny(num_layers=1, n_routed_experts=4)
  teacher = nnx.state(Transformer(t_cfg, nnx.Rngs(1)))
  model = Transformer(s_cfg, nnx.Rngs(2))
  _, params, moe_bias, _ = split_model(model, s_cfg)
  # The router bias is 0 at init: a teacher's non-zero one shows which columns were taken.
  t_flat = dict(nnx.to_flat_state(teacher))
  bias = t_flat[('layers', 'moe', 'router_bias')]
  bias.set_value(jnp.arange(bias.get_value().size, dtype=bias.dtype).reshape(bias.shape))
  d = DistillConfig(teacher='t', init_layers=(1,))
  layers = student.layer_map(d, s_cfg, t_cfg)
  chosen = [[0, 1, 2, 3], [1, 4, 6, 7]]  # per teacher MoE layer; student layer 0 <- teacher 1
  ctx = (s_cfg, t_cfg, layers, chosen, t_flat)
  new, missed = student.copy_weights(params, ctx)
  new_bias, _ = student.copy_weights(moe_bias, ctx)
  assert missed == []
  s_flat = dict(nnx.to_flat_state(new))
  pick = jnp.asarray(chosen[1])
  for name in ('gate', 'up', 'down'):
    path = ('layers', 'moe', 'experts', name)
    want = t_flat[path].get_value()[1][pick]
    np.testing.assert_array_equal(s_flat[path].get_value()[0], want)
  columns = jnp.asarray(chosen[1] + [8, 9, 10, 11])  # then the 4 zero experts
  router = ('layers', 'moe', 'router')
  np.testing.assert_array_equal(
    s_flat[router].get_value()[0], t_flat[router].get_value()[1][:, columns]
  )
  got_bias = dict(nnx.to_flat_state(new_bias))[('layers', 'moe', 'router_bias')]
  np.testing.assert_array_equal(got_bias.get_value()[0], bias.get_value()[1][columns])
  embed = ('embed', 'embedding')
  np.testing.assert_array_equal(s_flat[embed].get_value(), t_flat[embed].get_value())
  assert student.layer_map(DistillConfig(), tiny(num_layers=2), tiny(num_layers=4)) == [0, 2]
  with pytest.raises(ValueError, match='distill.init_layers'):
    student.layer_map(dataclasses.replace(d, init_layers=(2,)), s_cfg, t_cfg)


def _demo_config(**overrides):
  from configs import distill as distill_config

  config = distill_config.get_config()
  for key, value in overrides.items():
    section, name = key.split('.')
    config[section][name] = value
  return config


def test_a_vocabulary_mismatch_is_refused_naming_both(tmp_path):
  from moetrain import setup as setup_lib

  with pytest.raises(ValueError, match=r'distill\.teacher=.* 512 .*model\.vocab_size\) 1024'):
    setup_lib.build(_demo_config(**{'model.vocab_size': 1024}), num_devices=1, process_count=1)
  other = tmp_path / 'tokenizer.model'
  other.write_bytes(b'another tokenizer')
  with pytest.raises(ValueError, match=r'tokenizer of distill\.teacher=.*data\.tokenizer='):
    setup_lib.build(_demo_config(**{'data.tokenizer': str(other)}), num_devices=1, process_count=1)


def test_a_stale_logits_manifest_is_refused_naming_the_field(tmp_path):
  import json

  from moetrain import setup as setup_lib
  from moetrain.distill import logits

  setup = setup_lib.build(_demo_config(**{'distill.top_k': 4}), num_devices=1, process_count=1)
  written = logits.manifest(setup, 8, 50, 1)
  (tmp_path / logits.MANIFEST).write_text(json.dumps(written))
  assert logits.check(setup, str(tmp_path), 1) == written  # k 8 serves a run's top_k 4
  for key, value in [('data.seq_len', 64), ('distill.top_k', 2), ('data.tokenizer', 'x')]:
    (tmp_path / logits.MANIFEST).write_text(json.dumps({**written, key: value}))
    with pytest.raises(ValueError, match=rf'written for {key}=') as e:
      logits.check(setup, str(tmp_path), 1)
    assert '\n' not in str(e.value)


def test_cached_logits_records_round_trip():
  from moetrain.distill import logits

  rng = np.random.default_rng(1)
  mask = (rng.uniform(size=(2, 5)) < 0.5).astype(np.float32)
  ids = rng.integers(0, 50, (2, 5, 4)).astype(np.int32)
  logp = rng.normal(size=(2, 5, 4)).astype(np.float32)
  got_ids, got_logp = logits.decode(logits.encode(mask, ids, logp), 2, 5, 3)
  on = mask > 0
  np.testing.assert_array_equal(got_ids[on], ids[on][:, :3])
  np.testing.assert_array_equal(got_logp[on], logp[on][:, :3])
  assert not got_ids[~on].any()


def test_the_teacher_rides_in_the_state_but_not_in_the_optimizer_or_checkpoints():
  from moetrain import aot, optim
  from moetrain import setup as setup_lib

  setup = setup_lib.build(_demo_config(), num_devices=1, process_count=1)
  mesh = setup.make_mesh(jax.devices()[:1])
  abstract, _ = aot.abstract_state(setup, mesh)
  assert jax.tree.leaves(abstract.teacher)
  assert 'teacher' not in abstract.saved()
  optimizer = optim.make_optimizer(setup.optim, setup.train.steps)
  want = jax.eval_shape(optimizer.init, abstract.params)
  assert jax.tree.structure(want) == jax.tree.structure(abstract.opt_state)


@pytest.mark.slow
def test_a_teacher_stored_int8_or_int4_keeps_its_choices(tmp_path):
  """distill.teacher_quant stores the online teacher as QLoRA stores a base: its cached top-8 on
  the first training batch keep the bfloat16 teacher's best token at almost every scored
  position, and its log-probabilities close."""
  from moetrain.distill import logits
  from moetrain.tools import teacher_logits

  got = {}
  for quant in ('none', 'int8', 'int4'):
    overrides = {'distill.teacher_quant': quant, 'train.steps': 1, 'optim.warmup_steps': 0}
    config = _demo_config(**overrides)
    out = tmp_path / quant
    stats = teacher_logits.write(config, str(out), top_k=8)
    assert stats['positions'] > 500
    (shard,) = sorted((out / 'host000').glob('*.array_record'))
    from array_record.python.array_record_module import ArrayRecordReader

    record = ArrayRecordReader(str(shard)).read([0])[0]
    got[quant] = logits.decode(record, 16, 128, 8)
  ids, logp = got['none']
  scored = logp[..., 0] != 0
  for quant, agree_min, gap_max in (('int8', 0.99, 0.02), ('int4', 0.9, 0.3)):
    q_ids, q_logp = got[quant]
    agree = np.mean(q_ids[..., 0][scored] == ids[..., 0][scored])
    gap = np.median(np.abs(np.exp(q_logp[..., 0]) - np.exp(logp[..., 0]))[scored])
    assert agree >= agree_min and gap <= gap_max, (quant, agree, gap)
    assert not np.array_equal(q_logp, logp)  # the stored teacher did change

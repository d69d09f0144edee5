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
  from moetrain.training.train_state import split_model

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
  """configs/distill.py's student and teacher on the reversal demo's data, the student from
  random weights (no teacher pass at start): the machinery these tests check, not the demo's
  figures (the slow test below runs the demo as shipped)."""
  from configs import distill as distill_config

  config = distill_config.get_config()
  config.distill.init_from_teacher = ''
  config.data.source, config.data.path = 'demo', ''
  for key, value in overrides.items():
    section, name = key.split('.')
    config[section][name] = value
  return config


def test_a_vocabulary_mismatch_is_refused_naming_both(tmp_path):
  from moetrain.run import startup

  with pytest.raises(ValueError, match=r'distill\.teacher=.* 512 .*model\.vocab_size\) 1024'):
    startup.build(_demo_config(**{'model.vocab_size': 1024}), num_devices=1, process_count=1)
  other = tmp_path / 'tokenizer.model'
  other.write_bytes(b'another tokenizer')
  with pytest.raises(ValueError, match=r'tokenizer of distill\.teacher=.*data\.tokenizer='):
    startup.build(_demo_config(**{'data.tokenizer': str(other)}), num_devices=1, process_count=1)


def test_a_stale_logits_manifest_is_refused_naming_the_field(tmp_path):
  import json

  from moetrain.distill import logits
  from moetrain.run import startup

  setup = startup.build(_demo_config(**{'distill.top_k': 4}), num_devices=1, process_count=1)
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
  from moetrain.run import startup
  from moetrain.training import aot, optim

  setup = startup.build(_demo_config(), num_devices=1, process_count=1)
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


# ---------------------------------------------------------------------------------------------
# Runs: a LoRA student from the teacher's layers, a teacher from a run directory, and the tools
# on a distillation run's directory.


def _few_steps(config):
  """`config` cut to a test run: 2 steps of 8 rows of 64 tokens, no evaluations, the last step
  saved."""
  config.data.update(dict(seq_len=64, global_batch_size=8, eval_split=''))
  config.train.update(dict(steps=2, log_every=1, checkpoint_every=2, async_checkpoint=False))
  config.train.compilation_cache = ''
  config.optim.warmup_steps = 0
  return config


def _flat(state) -> dict:
  """{path: host array} of an nnx.State."""
  return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(state)}


def _train(config, workdir):
  """train.run(config, workdir); the host copies of the state its loop starts from ('start') and
  ends with ('end'), the teacher experts the student started from ('experts') and what the copy
  from the teacher left out ('missed')."""
  from moetrain.distill import student
  from moetrain.run import train

  got = {'experts': [], 'missed': []}
  loop, choose, copy = train.loop, student.choose_experts, student.copy_weights

  def watched_loop(job, state):
    got['start'] = jax.device_get(state)  # (the step donates the state)
    state, last = loop(job, state)
    got['end'] = jax.device_get(state)
    return state, last

  def watched_choose(*args):
    got['experts'] = choose(*args)
    return got['experts']

  def watched_copy(*args):
    new, missed = copy(*args)
    got['missed'] += missed
    return new, missed

  with pytest.MonkeyPatch.context() as m:
    m.setattr(train, 'loop', watched_loop)
    m.setattr(student, 'choose_experts', watched_choose)
    m.setattr(student, 'copy_weights', watched_copy)
    got['out'] = train.run(config, str(workdir))
  return got


def _student_model(workdir, state, dtype='float32'):
  """The student of the run in `workdir` with `state`'s weights, computing in `dtype`; and its
  ModelConfig."""
  from moetrain.run import startup
  from moetrain.training.train_state import graphdef_of, merge_model

  cfg = startup.tool_setup(None, str(workdir)).model.with_engine(dtype=dtype)
  params, moe_bias, frozen = jax.device_put((state.params, state.moe_bias, state.frozen))
  return merge_model(graphdef_of(cfg), params, moe_bias, frozen), cfg


@pytest.fixture(scope='module')
def lora_student(tmp_path_factory):
  """The demo's student with LoRA adapters (rank 4) over a base from the teacher: its layer 0
  from the teacher's layer 1, and the teacher experts one batch routes to most."""
  workdir = tmp_path_factory.mktemp('lora_student')
  overrides = {
    'lora.rank': 4,
    'distill.init_from_teacher': 'most_used',
    'distill.init_layers': (1,),
    'distill.init_batches': 1,
  }
  return workdir, _train(_few_steps(_demo_config(**overrides)), workdir)


def test_a_lora_student_trains_adapters_over_the_teachers_layers(lora_student):
  """The frozen base holds the teacher's layer 1 with its chosen experts and their router
  columns, and everything else of the teacher's; the steps change the adapters alone."""
  from tests.test_train import losses

  workdir, got = lora_student
  start, end = got['start'], got['end']
  teacher, base = _flat(start.teacher), _flat(start.frozen)
  (_, chosen), zero = got['experts'], 4  # teacher MoE layers 0 and 1; the demo's 4 zero experts
  assert len(chosen) == 4 and chosen != [0, 1, 2, 3]  # the measured choice, not the first ones
  assert all('lora' in m for m in got['missed'])  # every base weight came from the teacher
  for name in ('gate', 'up', 'down'):
    path = ('layers', 'moe', 'experts', name)
    np.testing.assert_array_equal(base[path][0], teacher[path][1][chosen])
  router = ('layers', 'moe', 'router')
  columns = chosen + list(range(8, 8 + zero))
  np.testing.assert_array_equal(base[router][0], teacher[router][1][:, columns])
  for path in [('layers', 'attn_0', 'q_b', 'kernel'), ('layers', 'mlp_1', 'down', 'kernel')]:
    np.testing.assert_array_equal(base[path][0], teacher[path][1])
  for path in [('embed', 'embedding'), ('lm_head', 'kernel'), ('final_norm', 'scale')]:
    np.testing.assert_array_equal(base[path], teacher[path])
  # Training moved the adapters and nothing of the base.
  after = _flat(end.frozen)
  assert after.keys() == base.keys()
  for path, value in base.items():
    np.testing.assert_array_equal(after[path], value, err_msg=str(path))
  adapters = _flat(start.params)
  assert adapters and all('lora' in '.'.join(p) for p in adapters)
  moved = [p for p, v in _flat(end.params).items() if not np.array_equal(v, adapters[p])]
  assert len(moved) == len(adapters)
  loss = losses(workdir)
  assert np.isfinite(got['out']['divergence']) and all(np.isfinite(list(loss.values())))
  assert loss[2] < loss[1]


@pytest.fixture(scope='module')
def run_teacher(tmp_path_factory):
  """A teacher trained with LoRA for 2 steps into a run directory (the demo student's shape with
  the teacher's tokenizer), and a full student distilled from that directory."""
  from moetrain.data import demo_teacher

  teacher_dir, student_dir = tmp_path_factory.mktemp('teacher'), tmp_path_factory.mktemp('student')
  overrides = {'distill.teacher': '', 'data.tokenizer': str(demo_teacher.DIR), 'lora.rank': 4}
  teacher = _train(_few_steps(_demo_config(**overrides)), teacher_dir)
  student = _train(_few_steps(_demo_config(**{'distill.teacher': str(teacher_dir)})), student_dir)
  return teacher, student, student_dir


def test_a_teacher_from_a_run_directory_is_its_last_checkpoint(run_teacher):
  """distill.teacher names a moetrain run: the online teacher is that run's model as its last
  step left it, its LoRA adapters over the base its seed rebuilds; the student learns from it."""
  teacher, student, _ = run_teacher
  end = teacher['end']
  want = {**_flat(end.frozen), **_flat(end.moe_bias), **_flat(end.params)}
  got = _flat(student['start'].teacher)
  assert got.keys() == want.keys()
  assert any('lora' in '.'.join(p) for p in got)  # the run's own adapters came along
  for path, value in want.items():
    np.testing.assert_array_equal(got[path], value, err_msg=str(path))
  lora_b = ('lm_head', 'lora_b')  # (0 at init: the trained teacher, not the initial one)
  assert not np.array_equal(want[lora_b], _flat(teacher['start'].params)[lora_b])
  assert np.isfinite(student['out']['divergence']) and student['out']['divergence'] > 0


def _logits(model, ids):
  from tests.helpers import forward

  return np.asarray(forward(model, ids)[0])


def _ids():
  return jax.random.randint(jax.random.key(7), (2, 12), 0, 474)  # (the tokenizer's vocabulary)


@pytest.mark.slow  # ~45 s: a LoRA student's run, exported twice and decoded
def test_export_and_generate_read_a_lora_students_run(lora_student, tmp_path):
  """The tools see the student as training left it, its frozen base from the teacher included:
  the merged export reloads to its logits, the PEFT export holds its adapters, and generate
  loads its weights."""
  from moetrain.convert import hf, peft_adapter
  from moetrain.tools import export, generate
  from tests.helpers import max_err, perturb_lora

  workdir, got = lora_student
  trained, cfg = _student_model(workdir, got['end'])
  ids = _ids()
  want = _logits(trained, ids)
  merged = export.export(None, str(workdir), str(tmp_path / 'merged'))
  assert max_err(_logits(hf.load_model(merged, jnp.float32, remat='none'), ids), want) < 1e-4
  adapter = export.export(None, str(workdir), str(tmp_path / 'adapter'), adapter_only=True)
  fresh, _ = _student_model(workdir, got['end'])
  perturb_lora(fresh, 3)
  peft_adapter.load(fresh, cfg, adapter)
  for x, y in zip(jax.tree.leaves(nnx.state(fresh)), jax.tree.leaves(nnx.state(trained))):
    np.testing.assert_array_equal(x, y)
  model, tok, step = generate.load_run(None, str(workdir))
  assert step == 2
  state, want_state = _flat(nnx.state(model)), _flat(nnx.state(trained))
  assert state.keys() == want_state.keys()
  for path, value in want_state.items():
    np.testing.assert_array_equal(state[path], value, err_msg=str(path))
  prompt = [tok.bos_id, *tok.encode('reverse: red fox =')]
  out = generate.generate(model, [prompt], 4, vocab_size=tok.vocab_size)
  assert out.shape == (1, len(prompt) + 4) and int(out.max()) < tok.vocab_size


def test_a_full_students_merged_export_reloads_to_its_logits(run_teacher, tmp_path):
  """A student distilled from a run directory exports as any run does."""
  from moetrain.convert import hf
  from moetrain.tools import export
  from tests.helpers import max_err

  _, student, workdir = run_teacher
  trained, _ = _student_model(workdir, student['end'])
  merged = export.export(None, str(workdir), str(tmp_path / 'merged'))
  got = _logits(hf.load_model(merged, jnp.float32, remat='none'), _ids())
  assert max_err(got, _logits(trained, _ids())) < 1e-5


# ---------------------------------------------------------------------------------------------
# The cached logits' manifest and shards: what makes a cache stale, incomplete or damaged.


def _jsonl_setup(tmp_path, **overrides):
  """The demo distillation on a JSONL training file, its teacher a copy of the demo teacher."""
  import json
  import shutil

  from moetrain.data import demo_teacher
  from moetrain.run import startup

  teacher = tmp_path / 'teacher'
  if not teacher.exists():
    shutil.copytree(demo_teacher.DIR, teacher)
    rows = [{'prompt': f'reverse {i} {i + 1}', 'completion': f'{i + 1} {i}'} for i in range(40)]
    (tmp_path / 'train.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  paths = {
    'distill.teacher': str(teacher),
    'distill.top_k': 4,
    'data.source': 'jsonl',
    'data.path': str(tmp_path / '{split}.jsonl'),
    'data.eval_split': '',
  }
  config = _demo_config(**paths, **overrides)
  return startup.build(config, num_devices=1, process_count=1)


def test_a_logits_cache_whose_inputs_changed_in_place_is_refused(tmp_path):
  """The manifest holds the content of the training files and of the teacher: a shuffled JSONL,
  or teacher weights rewritten at the same size, make the cache stale, named in one line with
  the command that rebuilds it."""
  import json

  from moetrain.distill import logits

  setup = _jsonl_setup(tmp_path)
  cache = tmp_path / 'cache'
  cache.mkdir()
  (cache / logits.MANIFEST).write_text(json.dumps(logits.manifest(setup, 8, 50, 1)))
  logits.check(setup, str(cache), 1)
  data = tmp_path / 'train.jsonl'
  lines = data.read_text().splitlines(keepends=True)
  data.write_text(''.join(lines[1:] + lines[:1]))  # shuffled: the same size, other order
  with pytest.raises(ValueError, match=r'train\.jsonl.*changed.*tools\.teacher_logits') as e:
    logits.check(setup, str(cache), 1)
  assert '\n' not in str(e.value)
  data.write_text(''.join(lines))
  logits.check(setup, str(cache), 1)
  weights = tmp_path / 'teacher' / 'model.safetensors'
  blob = bytearray(weights.read_bytes())
  blob[-8:] = bytes(8)
  weights.write_bytes(bytes(blob))
  with pytest.raises(ValueError, match=r'model\.safetensors.*changed.*--out='):
    logits.check(setup, str(cache), 1)


def test_a_logits_cache_of_a_run_teacher_names_its_checkpoint_step(tmp_path):
  """A run directory as the teacher: the cache is of its latest checkpoint; one that trained
  further makes it stale."""
  import dataclasses
  import json

  from moetrain.distill import logits

  setup = _jsonl_setup(tmp_path)
  run = tmp_path / 'teacher_run'
  (run / 'checkpoints' / '2').mkdir(parents=True)
  (run / 'config.json').write_text(json.dumps({'model': {}, 'train': {}}))
  setup = dataclasses.replace(setup, distill=dataclasses.replace(setup.distill, teacher=str(run)))
  cache = tmp_path / 'cache'
  cache.mkdir()
  (cache / logits.MANIFEST).write_text(json.dumps(logits.manifest(setup, 8, 50, 1)))
  logits.check(setup, str(cache), 1)
  (run / 'checkpoints' / '4').mkdir()
  with pytest.raises(ValueError, match=r'checkpoint step 4.*step 2'):
    logits.check(setup, str(cache), 1)


def _cache(setup, directory, steps_per_shard=1):
  """A hand-written cache of `setup`'s logits (zeros, k 4), complete: its shards, their done
  markers, its manifest."""
  import json

  from array_record.python.array_record_module import ArrayRecordWriter

  from moetrain.distill import logits

  rows, seq = setup.data.global_batch_size, setup.data.seq_len
  record = logits.encode(np.ones((rows, seq)), np.zeros((rows, seq, 4)), np.zeros((rows, seq, 4)))
  steps = setup.train.steps
  for shard in range(-(-steps // steps_per_shard)):
    path = logits.shard_path(str(directory), 0, shard)
    (directory / 'host000').mkdir(parents=True, exist_ok=True)
    writer = ArrayRecordWriter(path, 'group_size:1')
    for _ in range(min(steps_per_shard, steps - shard * steps_per_shard)):
      writer.write(record)
    writer.close()
    (directory / 'host000' / f'shard-{shard:05d}.json').write_text('{}')
  want = logits.manifest(setup, 4, steps_per_shard, 1)
  (directory / logits.MANIFEST).write_text(json.dumps(want))
  return want


def test_the_writer_replaces_a_stale_cache_and_refuses_one_of_other_settings(tmp_path):
  import json

  from moetrain.distill import logits
  from moetrain.tools import teacher_logits

  setup = _jsonl_setup(tmp_path, **{'train.steps': 2, 'optim.warmup_steps': 0})
  cache = tmp_path / 'cache'
  want = _cache(setup, cache)
  teacher_logits._start(str(cache), want, 0)  # this setting's: goes on (nothing to do)
  assert len(list((cache / 'host000').iterdir())) == 4
  other = logits.manifest(setup, 8, 1, 1)
  with pytest.raises(ValueError, match=r'distill\.top_k=4.*choose another --out'):
    teacher_logits._start(str(cache), other, 0)
  data = tmp_path / 'train.jsonl'
  data.write_text(data.read_text().replace('reverse 0 ', 'reverse 00 '))
  now = logits.manifest(setup, 4, 1, 1)
  teacher_logits._start(str(cache), now, 0)  # stale: no run can read it, written anew
  assert not list((cache / 'host000').iterdir())
  assert not (cache / logits.MANIFEST).exists()  # (until every shard is written again)
  assert json.loads((cache / logits.PENDING).read_text()) == now


def test_an_unfinished_or_damaged_logits_shard_is_named(tmp_path):
  """Completeness is from the done markers (a writer killed in its last shard leaves the file
  without its marker); a shard cut short is named when the run starts, a record that cannot be
  read when the step reads it."""
  from moetrain.distill import logits

  setup = _jsonl_setup(tmp_path, **{'train.steps': 2, 'optim.warmup_steps': 0})
  cache = tmp_path / 'cache'
  saved = _cache(setup, cache)
  rows, seq = setup.data.global_batch_size, setup.data.seq_len
  batches = lambda: iter([{'inputs': np.zeros((rows, seq), np.int32)}] * 2)
  got = logits.WithTeacherLogits(batches(), str(cache), saved, 0, 4)
  assert next(got)['teacher_ids'].shape == (rows, seq, 4)
  last, marker = (
    cache / 'host000' / 'shard-00001.array_record',
    cache / 'host000' / 'shard-00001.json',
  )
  marker.unlink()
  with pytest.raises(FileNotFoundError, match=r'shard-00001\.array_record.*incomplete'):
    logits.WithTeacherLogits(batches(), str(cache), saved, 0, 4)
  marker.write_text('{}')
  whole = last.read_bytes()
  last.write_bytes(whole[: len(whole) // 3])
  with pytest.raises(ValueError, match=r'shard-00001\.array_record cannot be read') as e:
    logits.WithTeacherLogits(batches(), str(cache), saved, 0, 4)
  assert '\n' not in str(e.value)
  damaged = bytearray(whole)
  damaged[200:300] = bytes(100)
  last.write_bytes(bytes(damaged))
  got = logits.WithTeacherLogits(batches(), str(cache), saved, 0, 4)
  next(got)
  with pytest.raises(ValueError, match=r'shard-00001\.array_record cannot be read.*step 2'):
    next(got)


def test_a_run_directory_without_a_checkpoint_as_teacher_is_refused_before_compiling(tmp_path):
  """The teacher of a run directory is its latest checkpoint: none is refused by the config
  checks, naming distill.teacher."""
  from moetrain.data import demo_teacher
  from moetrain.run import startup

  run = tmp_path / 'teacher_run'
  run.mkdir()
  saved = _demo_config(**{'distill.teacher': '', 'data.tokenizer': str(demo_teacher.DIR)})
  (run / 'config.json').write_text(saved.to_json_best_effort())
  config = _demo_config(**{'distill.teacher': str(run)})
  with pytest.raises(ValueError, match=r'distill\.teacher=.*teacher_run.* no checkpoint'):
    startup.build(config, num_devices=1, process_count=1)
  (run / 'checkpoints' / '2').mkdir(parents=True)
  startup.build(config, num_devices=1, process_count=1)


def test_a_failed_logits_write_leaves_no_manifest_and_the_corrected_rerun_writes(
  tmp_path, monkeypatch
):
  """The manifest is written once every shard is: a write that failed (here loading its
  teacher) leaves an unfinished one, which a rerun with other settings replaces."""
  from moetrain.distill import logits
  from moetrain.run import startup
  from moetrain.tools import teacher_logits

  overrides = {'train.steps': 2, 'optim.warmup_steps': 0, 'data.seq_len': 64}
  config, out = _demo_config(**overrides, **{'data.global_batch_size': 8}), tmp_path / 'cache'

  def fails(*args):
    raise RuntimeError('the teacher could not be read')

  monkeypatch.setattr(startup, 'load_teacher', fails)
  with pytest.raises(RuntimeError, match='could not be read'):
    teacher_logits.write(config, str(out), top_k=8, steps_per_shard=1)
  assert not (out / logits.MANIFEST).exists() and (out / logits.PENDING).exists()

  def zeros(cfg, k, chunk):  # (the teacher itself is tested elsewhere)
    return jax.jit(lambda w, b: (jnp.zeros((*b['inputs'].shape, k), jnp.int32),) * 2)

  monkeypatch.setattr(startup, 'load_teacher', lambda *args: None)
  monkeypatch.setattr(teacher_logits, 'top_k_fn', zeros)
  teacher_logits.write(config, str(out), top_k=4, steps_per_shard=1)
  assert not (out / logits.PENDING).exists()
  setup = startup.build(config, num_devices=1, process_count=1)
  setup = dataclasses.replace(setup, distill=dataclasses.replace(setup.distill, top_k=4))
  saved = logits.check(setup, str(out), 1)
  assert saved['distill.top_k'] == 4 and len(logits.shards(str(out), 0, 2, 1)) == 2


@pytest.mark.slow  # six runs of the demo: ~10 minutes on 2 cores
def test_the_distillation_demo_beats_the_student_alone_over_seeds(tmp_path, monkeypatch):
  """The README's two distillation commands (configs/distill.py at its default steps, and the
  same with distill.alpha=0) over seeds 0-2: the distilled student's eval loss is below the
  student alone's on each seed, and so is its median (bench/RESULTS.md, "Distillation on the
  demo task"). Each runs as a user runs it, on one CPU device (not the suite's emulated eight)."""
  import statistics

  from bench.common import run_main, run_result

  monkeypatch.delenv('XLA_FLAGS', raising=False)

  def final(seed: int, *extra: str) -> float:
    workdir = tmp_path / f'{seed}{"_".join(extra)}'
    run_main(
      ['moetrain.main', '--config=configs/distill.py', f'--workdir={workdir}']
      + [f'--config.seed={seed}', *extra]
    )
    return run_result(str(workdir))['eval_loss']

  seeds = (0, 1, 2)
  distilled = [final(s) for s in seeds]
  alone = [final(s, '--config.distill.alpha=0') for s in seeds]
  assert all(d < a for d, a in zip(distilled, alone)), (distilled, alone)
  assert statistics.median(distilled) < statistics.median(alone), (distilled, alone)

"""Preference tuning: each loss against NumPy formulas (as TRL writes them), the adapters-off
reference, the packed pair rows, and a step."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moetrain.data import chat, demo_base, loader, packing, preference
from moetrain.data.tokenizer import load_tokenizer
from moetrain.training import preference as pref
from moetrain.training.train_state import graphdef_of, init_state, merge_model
from moetrain.training.train_step import StepConfig, eval_step, grads_and_stats, jit_train_step
from tests.helpers import perturb_lora, tiny, with_lora

# Sums of log-probabilities of 4 pairs: [pairs, (chosen, rejected, mismatched)].
POLICY = np.array([[-3.0, -5.0, -4.0], [-6.0, -2.5, -3.0], [-1.0, -1.2, -2.0], [-8.0, -9.5, -7.0]])
REFERENCE = np.array(
  [[-3.5, -4.0, -4.2], [-5.0, -3.0, -3.5], [-1.1, -1.0, -2.2], [-8.5, -9.0, -6.0]]
)
LENGTHS = np.array([[3.0, 4.0, 2.0], [5.0, 2.0, 3.0], [1.0, 1.0, 2.0], [6.0, 7.0, 4.0]])


def _logsig(x):
  return -np.log1p(np.exp(-x))


def _sig(x):
  return 1 / (1 + np.exp(-x))


def numpy_loss(name, beta=0.1, eps=0.0, gamma=0.5, wd=1.0, wu=1.0, labels=None):
  """TRL's formulas (DPOTrainer.dpo_loss, CPOTrainer simpo, ORPOTrainer.odds_ratio_loss,
  KTOTrainer.kto_loss) in NumPy, per pair."""
  pc, pr, pm = POLICY.T
  rc, rr, rm = REFERENCE.T
  lc, lr, _ = LENGTHS.T
  if name == 'sigmoid':
    z = beta * ((pc - pr) - (rc - rr))
    return -_logsig(z) * (1 - eps) - _logsig(-z) * eps
  if name == 'hinge':
    return np.maximum(0, 1 - beta * ((pc - pr) - (rc - rr)))
  if name == 'ipo':
    z = (pc / lc - pr / lr) - (rc / lc - rr / lr)
    return (z - 1 / (2 * beta)) ** 2
  if name == 'simpo':
    z = (pc / lc - pr / lr) - gamma / beta
    return -_logsig(beta * z) * (1 - eps) - _logsig(-beta * z) * eps
  if name == 'orpo':
    c, r = pc / lc, pr / lr
    log_odds = (c - r) - (np.log1p(-np.exp(c)) - np.log1p(-np.exp(r)))
    return -beta * _logsig(log_odds)
  if name == 'kto':
    kl = max(np.mean(pm - rm), 0.0)
    good = wd * (1 - _sig(beta * ((pc - rc) - kl)))
    bad = wu * (1 - _sig(beta * (kl - (pr - rr))))
    return np.where(labels, good, bad)
  raise ValueError(name)


@pytest.mark.parametrize(
  'name,kw',
  [
    ('sigmoid', {}),
    ('sigmoid', {'label_smoothing': 0.2}),
    ('hinge', {'beta': 0.5}),
    ('ipo', {'beta': 0.3}),
    ('simpo', {'beta': 2.0, 'gamma': 0.7}),
    ('orpo', {'beta': 0.25}),
    ('kto', {'beta': 0.2, 'desirable_weight': 1.5, 'undesirable_weight': 0.7}),
  ],
)
def test_each_loss_equals_its_formula(name, kw):
  cfg = pref.PreferenceConfig(loss=name, **kw)
  lengths = LENGTHS.copy()
  labels = np.array([True, False, True, False])
  if name == 'kto':  # one completion each: desirable in the chosen slot, else in the rejected
    lengths[~labels, 0] = 0
    lengths[labels, 1] = 0
  loss, rc, rr = pref.pair_losses(cfg, jnp.asarray(POLICY), jnp.asarray(REFERENCE), lengths)
  np_kw = dict(
    beta=cfg.beta,
    eps=cfg.label_smoothing,
    gamma=cfg.gamma,
    wd=cfg.desirable_weight,
    wu=cfg.undesirable_weight,
    labels=labels,
  )
  np.testing.assert_allclose(loss, numpy_loss(name, **np_kw), rtol=1e-5, atol=1e-7)
  if name not in pref.REFERENCE_FREE:  # the implicit rewards
    np.testing.assert_allclose(rc, cfg.beta * (POLICY[:, 0] - REFERENCE[:, 0]), rtol=1e-6)
    np.testing.assert_allclose(rr, cfg.beta * (POLICY[:, 1] - REFERENCE[:, 1]), rtol=1e-6)


def test_policy_equal_to_reference_gives_log_2_and_no_margin():
  cfg = pref.PreferenceConfig(loss='sigmoid', beta=0.3)
  loss, rc, rr = pref.pair_losses(cfg, jnp.asarray(POLICY), jnp.asarray(POLICY), LENGTHS)
  np.testing.assert_allclose(loss, np.log(2.0), rtol=1e-6)
  np.testing.assert_allclose(rc - rr, 0.0, atol=1e-7)


TOKENIZER = load_tokenizer(str(demo_base.DIR))


def _pair_batch(rows=4, seq_len=64, records='paired'):
  cfg = loader.DataConfig(
    records=records, tokenizer=str(demo_base.DIR), global_batch_size=rows, seq_len=seq_len
  )
  return next(loader.make_train_iterator(cfg, TOKENIZER))


def test_pairs_share_a_row_and_their_prompt_tokens():
  b = _pair_batch()
  for r in range(len(b['inputs'])):
    seg = b['segment_ids'][r]
    for s in sorted(set(seg[seg > 0]) & set(range(1, 200, 3))):  # each chosen sequence
      chosen, rejected = b['inputs'][r][seg == s], b['inputs'][r][seg == s + 1]
      assert len(rejected), 'a pair left its row'
      n = len(TOKENIZER.encode('reverse: x y z =')) - 4  # the prompt's tokens differ from here
      np.testing.assert_array_equal(chosen[:n], rejected[:n])
      # positions restart per sequence, and only completion tokens score
      np.testing.assert_array_equal(b['positions'][r][seg == s], np.arange(len(chosen)))
      scored = b['loss_mask'][r][seg == s] > 0
      assert 0 < scored.sum() < len(chosen) and not scored[0]


def test_conversations_tokenize_as_the_template_renders_them():
  fmt = chat.ChatFormat()
  prompt = [{'role': 'user', 'content': 'reverse: red fox cup ='}]
  convo = {
    'chosen': prompt + [{'role': 'assistant', 'content': 'cup fox red'}],
    'rejected': prompt + [{'role': 'assistant', 'content': 'red fox cup'}],
  }
  pair = preference.to_pair(convo, 'paired', 'x.jsonl:1')
  assert pair['prompt'] == prompt
  e = preference.tokenize_element(pair, TOKENIZER, max_len=200, chat_format=fmt)
  want, _ = packing._tokens({'messages': convo['chosen']}, TOKENIZER, False, fmt)
  np.testing.assert_array_equal(e['tokens'][e['role'] == 1], want)
  text = TOKENIZER.decode([int(t) for t, m in zip(e['tokens'], e['is_target']) if m and t > 3])
  assert 'cup fox red' in text and 'reverse' not in text


@pytest.mark.parametrize(
  'record,message',
  [
    ({'prompt': 'p', 'chosen': 'a'}, "no 'rejected'"),
    ({'prompt': 'p', 'chosen': '', 'rejected': 'b'}, "'chosen' is empty"),
    ({'prompt': 'p', 'chosen': 'a', 'rejected': 'a'}, 'equals'),
  ],
)
def test_bad_records_are_named_with_their_line(tmp_path, record, message):
  path = tmp_path / 'train.jsonl'
  good = {'prompt': 'p', 'chosen': 'a', 'rejected': 'b'}
  path.write_text(json.dumps(good) + '\n' + json.dumps(record) + '\n')
  with pytest.raises(ValueError, match=f'train.jsonl:2: .*{message}'):
    preference.PairSource([str(path)])


def test_a_pair_too_long_loses_its_prompts_first_tokens():
  pair = {'prompt': 'reverse: ' + 'red fox cup ' * 20 + '=', 'chosen': ' a b', 'rejected': ' b a'}
  e = preference.tokenize_element(pair, TOKENIZER, max_len=60)
  assert e['truncated'] and 0 < len(e['tokens']) <= 60
  assert e['tokens'][0] == TOKENIZER.bos_id
  completion = TOKENIZER.decode([int(t) for t, m in zip(e['tokens'], e['is_target']) if m])
  assert 'a b' in completion and 'b a' in completion


CFG = with_lora(tiny(init_std=0.05, vocab_size=TOKENIZER.vocab_size))


def _step_cfg(loss='sigmoid', lora_cfg=CFG, **kw):
  return StepConfig(
    model=lora_cfg, preference=pref.PreferenceConfig(loss=loss, **kw), bias_update_rate=0.0
  )


def test_adapters_off_reference_is_the_base_model():
  state = init_state(CFG, optax.sgd(0.0), 0)
  graphdef = graphdef_of(CFG)
  model = merge_model(graphdef, state.params, state.moe_bias, state.frozen)
  perturb_lora(model, 1, scale=0.3)  # adapters that change the output
  from flax import nnx

  params = nnx.state(model, nnx.LoRAParam)
  b = {k: jnp.asarray(v) for k, v in _pair_batch().items() if k in packing.ROW_KEYS}
  step = _step_cfg()
  from moetrain.training.train_step import reference_model

  @jax.jit
  def sums(params, moe_bias, frozen, b):
    ref = reference_model(params, moe_bias, frozen, graphdef, step, None)
    base = merge_model(graphdef, jax.tree.map(jnp.zeros_like, params), moe_bias, frozen)
    adapted = merge_model(graphdef, params, moe_bias, frozen)
    return [pref.reference_sums(m, b) for m in (ref, base, adapted)]

  got, want, adapted = sums(params, state.moe_bias, state.frozen, b)
  np.testing.assert_array_equal(got, want)
  assert float(jnp.abs(adapted - want).max()) > 1e-3  # (the adapters do change it)


OPT = optax.adam(3e-2)


@pytest.fixture(scope='module')
def dpo_step():
  """The DPO step (beta 0.5), compiled once for the tests below, and its first state."""
  cfg = _step_cfg('sigmoid', beta=0.5)
  return cfg, jit_train_step(cfg, OPT, lambda s: 3e-2, donate=False), init_state(CFG, OPT, 0)


def _rows(records='paired'):
  return {k: v for k, v in _pair_batch(records=records).items() if k in packing.ROW_KEYS}


def test_the_first_step_is_at_the_reference_and_accumulates(dpo_step):
  """LoRA's B starts at zero: the policy is its reference, DPO's loss is log 2, the margin 0;
  two micro-batches give the whole batch's loss and gradient (the means over pairs divide by
  the whole batch's count)."""
  import dataclasses

  cfg, fn, state = dpo_step
  b = _rows()
  _, m1 = fn(state, b)
  np.testing.assert_allclose(m1['pref/loss'], np.log(2.0), rtol=1e-5)
  np.testing.assert_allclose(m1['pref/margin'], 0.0, atol=1e-6)
  assert float(m1['grad_norm']) > 0
  two = jit_train_step(
    dataclasses.replace(cfg, grad_accum_steps=2), OPT, lambda s: 3e-2, donate=False
  )
  _, m2 = two(state, b)
  np.testing.assert_allclose(m2['total_loss'], m1['total_loss'], rtol=1e-5)
  np.testing.assert_allclose(m2['grad_norm'], m1['grad_norm'], rtol=1e-4)


def test_kto_at_the_reference_has_no_margin():
  """Unpaired rows (each example with a mismatched one for the KL estimate): at the reference
  every log-ratio and the KL estimate are 0, so each example's loss is its weight / 2."""
  graphdef = graphdef_of(CFG)
  cfg = _step_cfg('kto', desirable_weight=1.0, undesirable_weight=0.5)
  state = init_state(CFG, OPT, 0)
  fn = jax.jit(lambda s, b: grads_and_stats(s, graphdef, b, jax.random.key(0), cfg))
  _, stats, grads = fn(state, _rows('unpaired'))
  m = pref.metrics(stats['pref'])
  sums = stats['pref']
  want = (0.5 * sums['chosen'] + 0.25 * sums['rejected']) / sums['elements']
  np.testing.assert_allclose(m['pref/loss'], want, rtol=1e-5)
  np.testing.assert_allclose(m['pref/margin'], 0.0, atol=1e-6)
  assert sums['chosen'] > 0 and sums['rejected'] > 0
  assert float(optax.tree.norm(grads)) > 0


def test_steps_raise_the_margin_and_eval_reports_it(dpo_step):
  cfg, fn, state = dpo_step
  b = _rows()
  for _ in range(5):
    state, m = fn(state, b)
  assert float(m['pref/margin']) > 0 and float(m['pref/accuracy']) > 0.5
  sums = jax.jit(lambda s, b: eval_step(s, b, graphdef=graphdef_of(CFG), cfg=cfg))(state, b)
  assert float(pref.metrics(sums)['pref/margin']) > 0
  assert sums['tokens'] > 0 and sums['nll_sum'] > 0


def test_full_fine_tuning_reads_a_frozen_reference():
  """Without LoRA the reference is the state's frozen copy of the start: at the start the loss
  is log 2, and after the policy moves the reference stays."""
  from flax import nnx

  from moetrain.model.transformer import Transformer

  full = tiny(init_std=0.05, vocab_size=TOKENIZER.vocab_size)
  cfg = StepConfig(
    model=full,
    teacher=full.with_engine(remat='none'),
    preference=pref.PreferenceConfig(loss='sigmoid', beta=0.5),
    bias_update_rate=0.0,
  )
  opt = optax.adam(3e-2)
  import dataclasses

  state = init_state(full, opt, 0)
  state = dataclasses.replace(state, teacher=nnx.state(Transformer(full, nnx.Rngs(0))))
  b = {k: v for k, v in _pair_batch().items() if k in packing.ROW_KEYS}
  fn = jit_train_step(cfg, opt, lambda s: 3e-2, donate=False)
  state, m = fn(state, b)
  np.testing.assert_allclose(m['pref/loss'], np.log(2.0), rtol=1e-5)
  for _ in range(3):
    state, m = fn(state, b)
  assert float(m['pref/margin']) > 0


def test_a_reference_needs_lora_or_a_start(tmp_path):
  from configs import base
  from moetrain.run import startup

  config = base.get_config()
  config.lora.rank = 0
  config.preference.loss = 'sigmoid'
  with pytest.raises(ValueError, match='init.hf_checkpoint, which is empty'):
    startup.build(config)
  config.preference.loss = 'simpo'  # reference-free: every weight trains
  assert startup.build(config).step.teacher is None
  config.lora.rank, config.data.records = 4, 'paired'
  config.preference.loss = ''
  with pytest.raises(ValueError, match='set preference.loss'):
    startup.build(config)


@pytest.mark.slow  # ~5 minutes
def test_the_dpo_demo_prefers_the_reversal_and_keeps_its_accuracy(tmp_path):
  """docs/preference.md's claim: configs/dpo.py ends with eval pref/accuracy >= 0.9 and the
  completion accuracy above the start's (the LoRA demo's result)."""
  from tests.helpers import run_command

  out = run_command('moetrain.main', '--config=configs/dpo.py', f'--workdir={tmp_path}')
  assert out.returncode == 0, out.stderr[-2000:]
  records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  evals = [r for r in records if r.get('kind') == 'eval']
  first, last = evals[0], evals[-1]
  assert last['step'] == 100
  assert last['pref/accuracy'] >= 0.9
  assert last['accuracy'] > first['accuracy']


def _run_config(**train):
  from tests.test_train import small_config

  config = small_config(**train)
  config.preference.loss = 'sigmoid'
  config.loss.bias_update_rate = 0.0
  config.mesh.shape = (1, 2, 4, 1)  # data, fsdp, expert, tensor: 8 emulated devices
  return config


@pytest.mark.slow  # ~1 minute (3 minutes on a loaded VM): a run's two compiles on 8 devices
def test_a_preference_run_on_an_expert_mesh_logs_its_metrics(tmp_path):
  from moetrain.run import train

  train.run(_run_config(steps=3, checkpoint_every=3), str(tmp_path))
  records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  steps = [r for r in records if r['kind'] == 'train']
  evals = [r for r in records if r['kind'] == 'eval']
  assert [r['step'] for r in steps] == [1, 2, 3]
  names = ('loss', 'reward_chosen', 'reward_rejected', 'margin', 'accuracy', 'logp_chosen')
  for r in steps + evals:
    assert all(np.isfinite(r[f'pref/{k}']) for k in names), r
  np.testing.assert_allclose(evals[0]['pref/loss'], np.log(2.0), rtol=1e-5)  # the reference


@pytest.mark.slow  # ~2 minutes: two runs
def test_a_preference_run_resumes_bit_for_bit(tmp_path):
  from moetrain.run import train

  whole, parts = tmp_path / 'whole', tmp_path / 'parts'
  train.run(_run_config(steps=4, checkpoint_every=2), str(whole))
  train.run(_run_config(steps=4, checkpoint_every=2, stop_at_step=2), str(parts))
  train.run(_run_config(steps=4, checkpoint_every=2), str(parts))
  read = lambda d: [json.loads(x) for x in open(d / 'metrics.jsonl')]
  pick = lambda d: {r['step']: r['pref/loss'] for r in read(d) if r['kind'] == 'train'}
  assert pick(whole) == pick(parts) and len(pick(whole)) == 4

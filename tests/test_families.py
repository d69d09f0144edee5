"""The other families (Qwen3-MoE, Mixtral, DeepSeek-V3) against transformers 4.57.6: fixtures made
by tests/fixtures/make_family_fixtures.py are the oracle (float32)."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moetrain import train_state
from moetrain.convert import hf, peft_adapter
from moetrain.model import moe as moe_lib
from moetrain.model.config import LoraConfig
from tests.helpers import (
  ALL_TARGETS,
  assert_matches_hf,
  max_err,
  perturb_lora,
  perturb_router,
  sharded_forward,
)

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures')
FAMILIES = (
  'qwen3_moe_three_layer',  # GQA + q/k norm, layers moe / dense / moe
  'mixtral_two_layer',
  'deepseek_v3_three_layer',  # MLA, YaRN, dense first, sigmoid + groups + bias, shared expert
  'deepseek_v3_plain_q',  # MLA without the q low rank, two shared experts
)


def fixture(name: str) -> str:
  return os.path.join(FIXTURES, name)


def reference(name: str) -> dict:
  return dict(np.load(os.path.join(fixture(name), 'reference.npz')))


def f32_config(name: str, **kw):
  return hf.config_from_hf(
    hf.read_config(fixture(name)), dtype='float32', param_dtype='float32', remat='none', **kw
  )


def build(name: str, cfg, mesh=None):
  loaded = hf.load_params(fixture(name), cfg, mesh=mesh)
  model = train_state.merge_model(
    train_state.graphdef_of(cfg), loaded.params, loaded.moe_bias, loaded.frozen
  )
  return model, loaded


def logits_of(model, ids):
  return np.asarray(jax.jit(lambda m, x: m(x)[0])(model, jnp.asarray(ids)))


@pytest.mark.parametrize('name', FAMILIES)
def test_logits_loss_routing_grads(name, with_topk):
  ref, cfg = reference(name), f32_config(name)
  model, loaded = build(name, cfg)
  assert loaded.skipped == []
  assert_matches_hf(model, cfg, ref, name)


def test_group_limited_sigmoid_gates_by_hand():
  """DeepSeek-V3's routing (sigmoid scores, best 2 of 4 groups of score + bias, top-3,
  renormalised, x 2.5) of random tokens, against numpy."""
  name = 'deepseek_v3_three_layer'
  cfg = f32_config(name)
  model, _ = build(name, cfg)
  layer = nnx.merge(*nnx.split(model.layers))  # 2 MoE layers stacked; route their first
  x = np.random.default_rng(0).standard_normal((5, cfg.hidden_size)).astype(np.float32)
  w, b = layer.moe.router[...][0], layer.moe.router_bias[...][0]
  _, scores, idx, gates = moe_lib.route(jnp.asarray(x), w, b, cfg)
  # By hand: sigmoid scores, choice over the best 2 of 4 groups of (score + bias).
  s = 1 / (1 + np.exp(-(x @ np.asarray(w))))
  choice = s + np.asarray(b)
  groups = np.sort(choice.reshape(5, 4, 2), -1)[..., -2:].sum(-1)
  keep = np.argsort(-groups, -1)[:, :2]
  masked = np.zeros_like(choice)
  for m in range(5):
    for g in keep[m]:
      masked[m, 2 * g : 2 * g + 2] = choice[m, 2 * g : 2 * g + 2]
  want_idx = np.argsort(-masked, -1)[:, :3]
  np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(want_idx, -1))
  want = np.take_along_axis(s, want_idx, -1)
  want = want / want.sum(-1, keepdims=True) * 2.5
  np.testing.assert_allclose(
    np.sort(np.asarray(gates), -1), np.sort(want, -1), rtol=1e-5, atol=1e-6
  )


@pytest.mark.parametrize('name', ['qwen3_moe_three_layer', 'deepseek_v3_three_layer'])
def test_expert_parallel_mesh_equals_one_device(name):
  ref = reference(name)
  logits = sharded_forward(fixture(name), lambda **kw: f32_config(name, **kw), ref['input_ids'])
  err = max_err(logits, np.concatenate([ref['logits']] * 2))
  print(f'{name} on mesh (1,2,2,2): logits {err:.2e}')
  assert err < 1e-5


def lora_model(name: str, seed: int = 0):
  cfg = f32_config(name, lora=LoraConfig(rank=4, targets=ALL_TARGETS))
  loaded = hf.load_params(fixture(name), cfg, seed=seed)
  model = train_state.merge_model(
    train_state.graphdef_of(cfg), loaded.params, loaded.moe_bias, loaded.frozen
  )
  return model, cfg


def trained_lora_model(name: str):
  """lora_model with adapters (and a router bias, where the family has one) away from their
  initial values, as after training."""
  model, cfg = lora_model(name)
  perturb_lora(model, 3)
  if cfg.router_bias:
    perturb_router(model, 5)
  return model, cfg


@pytest.mark.parametrize('name', FAMILIES)
def test_lora_reaches_every_projection_and_starts_at_the_base(name):
  model, cfg = lora_model(name)
  adapted = {
    '.'.join(map(str, p[:-1])) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
  }
  kinds = {p.split('.')[-1] for p in adapted}
  attn = {'q', 'k', 'v', 'o'} if cfg.attention == 'gqa' else {'kv_a', 'kv_b', 'o'}
  assert attn <= kinds, kinds
  assert {'lm_head', 'layers.moe.experts'} <= adapted, adapted
  if cfg.n_shared_experts:
    assert any('.moe.shared.' in p for p in adapted), adapted
  np.testing.assert_allclose(
    logits_of(model, reference(name)['input_ids']), reference(name)['logits'], atol=1e-5
  )


@pytest.mark.parametrize('name', FAMILIES)
def test_merged_export_and_peft_adapter_round_trip(name, tmp_path):
  """save_hf (LoRA merged) reloads to the adapted model's logits; the PEFT adapter reloads into a
  fresh model exactly."""
  ids = reference(name)['input_ids']
  model, cfg = trained_lora_model(name)
  want = logits_of(model, ids)
  assert max_err(want, reference(name)['logits']) > 1e-3
  hf.save_hf(model, cfg, str(tmp_path / 'merged'), dtype=jnp.float32, max_shard_size=300_000)
  config = json.loads((tmp_path / 'merged' / 'config.json').read_text())
  assert config['model_type'] == cfg.model_type
  assert hf.config_from_hf(config) == hf.config_from_hf(hf.read_config(fixture(name)))
  got = logits_of(hf.load_model(str(tmp_path / 'merged'), jnp.float32, remat='none'), ids)
  assert max_err(got, want) < 1e-5
  peft_adapter.save(model, cfg, str(tmp_path / 'adapter'), base_model=fixture(name))
  adapter = json.loads((tmp_path / 'adapter' / 'adapter_config.json').read_text())
  assert adapter['modules_to_save'] == ['gate']
  fresh, _ = lora_model(name, seed=9)
  peft_adapter.load(fresh, cfg, str(tmp_path / 'adapter'))
  for x, y in zip(jax.tree.leaves(nnx.state(fresh)), jax.tree.leaves(nnx.state(model))):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize('name', FAMILIES)
def test_transformers_loads_the_exports(name, tmp_path):
  """Needs torch + transformers 4.57 + peft next to jax; skipped in the project venv. Run with
  the reference venv, the project's packages appended after its own:
    /work/hfvenv/bin/python -c "import sys; sys.path += ['.venv/lib/python3.11/site-packages'];
      sys.path.insert(0, '.'); import pytest; pytest.main(['tests/test_families.py', '-k',
      'transformers'])"
  """
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  peft = pytest.importorskip('peft')
  ids = reference(name)['input_ids']
  model, cfg = trained_lora_model(name)
  want = logits_of(model, ids)

  def hf_logits(m):
    with torch.no_grad():
      return m.eval()(input_ids=torch.from_numpy(ids).long()).logits.numpy()

  def auto(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=torch.float32, attn_implementation='eager'
    )

  hf.save_hf(model, cfg, str(tmp_path / 'merged'), dtype=jnp.float32)
  err = max_err(hf_logits(auto(str(tmp_path / 'merged'))), want)
  print(f'{name}: transformers on the merged export: logits {err:.2e}')
  assert err < 1e-5
  peft_adapter.save(model, cfg, str(tmp_path / 'adapter'), base_model=fixture(name))
  peft_model = peft.PeftModel.from_pretrained(auto(fixture(name)), str(tmp_path / 'adapter'))
  err = max_err(hf_logits(peft_model), want)
  print(f'{name}: peft on the adapter: logits {err:.2e}')
  assert err < 1e-5


@pytest.mark.parametrize('name', FAMILIES)
def test_greedy_generation_matches_transformers(name):
  """The cached decode (MLA latent or GQA keys/values) continues the prompt as transformers'
  greedy generate did, and its steps equal the full forward's last-position logits."""
  from moetrain.model import decode
  from moetrain.tools.generate import generate

  ref = reference(name)
  model = hf.load_model(fixture(name), jnp.float32)
  prompt = ref['input_ids'][:, :5]
  out = generate(model, prompt, 8, eos_id=2)
  np.testing.assert_array_equal(np.asarray(out)[:1], ref['greedy_ids'])
  ids = jnp.asarray(ref['input_ids'][:, :7])
  full = logits_of(model, ids)
  logits, cache = decode.prefill(model, ids[:, :5], 9)
  for pos in (5, 6):
    np.testing.assert_allclose(logits, full[:, pos - 1], atol=1e-5, rtol=1e-5)
    logits, cache = decode.decode_step(model, cache, ids[:, pos], pos, absorb=False)
  np.testing.assert_allclose(logits, full[:, 6], atol=1e-5, rtol=1e-5)


def _choices(seed, m=24, x=8, k=2):
  rng = np.random.default_rng(seed)
  logits = rng.standard_normal((m, x)).astype(np.float32)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  idx = np.argsort(-probs, -1)[:, :k]
  onehot = np.zeros((m, x), np.float32)
  np.put_along_axis(onehot, idx, 1.0, -1)
  return probs, onehot


def test_switch_and_sequence_balance_losses_by_hand():
  from moetrain.model.moe import balance_loss

  probs, onehot = _choices(0)
  valid = np.ones(24, np.float32)
  valid[-3:] = 0  # padding counts in neither
  cfg = dataclasses.replace(f32_config('mixtral_two_layer'), n_routed_experts=8, moe_topk=2)
  assert cfg.balance_loss_kind == 'switch'
  # transformers' load_balancing_loss_func: E * sum_e (share of tokens choosing e) * mean prob.
  v = valid.astype(bool)
  want = 8 * np.sum(onehot[v].mean(0) * probs[v].mean(0))
  got = balance_loss(jnp.asarray(onehot), jnp.asarray(probs), jnp.asarray(valid), 2, cfg)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # DeepSeek-V3's sequence-wise loss, per row of 12 tokens, averaged over the rows.
  seq = dataclasses.replace(cfg, moe_balance_loss='sequence')
  rows = []
  for r in range(2):
    sl = slice(12 * r, 12 * r + 12)
    t = valid[sl].sum()
    f = 8 / (2 * t) * (onehot[sl] * valid[sl, None]).sum(0)
    p = (probs[sl] * valid[sl, None]).sum(0) / t
    rows.append(np.sum(f * p))
  got = balance_loss(jnp.asarray(onehot), jnp.asarray(probs), jnp.asarray(valid), 2, seq)
  np.testing.assert_allclose(got, np.mean(rows), rtol=1e-5)


def test_sign_bias_rule_moves_each_group_by_its_own_layers():
  from moetrain.model.transformer import Transformer
  from moetrain.train_step import StepConfig, bias_update

  cfg = dataclasses.replace(
    f32_config('deepseek_v3_three_layer'), first_k_dense_replace=0, mlp_only_layers=(1,)
  )
  assert [g.name for g in cfg.layer_groups()] == ['layers', 'dense_layers', 'layers_1']
  assert cfg.bias_rule == 'sign'
  model = Transformer(cfg, nnx.Rngs(0))
  _, bias = nnx.split(model, moe_lib.RouterBias, ...)[:2]
  load = np.zeros((2, 8), np.float32)
  load[0, 0], load[1, 7] = 24.0, 24.0  # layer 0 overloads expert 0, layer 2 expert 7
  load += 3.0
  new = bias_update(bias, jnp.asarray(load), 0, StepConfig(model=cfg, bias_update_rate=0.01))
  d0 = np.asarray(new['layers']['moe']['router_bias'].get_value())[0]
  d1 = np.asarray(new['layers_1']['moe']['router_bias'].get_value())[0]
  np.testing.assert_allclose(d0, [-0.01] + [0.01] * 7)  # sign rule: +-gamma, not in proportion
  np.testing.assert_allclose(d1, [0.01] * 7 + [-0.01])

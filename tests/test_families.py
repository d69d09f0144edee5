"""The other families (Qwen3-MoE, Mixtral, DeepSeek-V3/V2, OLMoE, Qwen2-MoE, ...) against
transformers 4.57.6, or 5.24.0 for those it brought (HF5: MiniMax-M2, Qwen3-Next, Qwen3.5,
DeepSeek-V3.2, GLM-5): fixtures made by tests/fixtures/make_family_fixtures.py and
make_2026_fixtures.py are the oracle (float32)."""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moetrain.convert import hf, peft_adapter
from moetrain.core.engine import LoraConfig
from moetrain.kernels import quant
from moetrain.model import moe as moe_lib
from moetrain.training import train_state
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
  'olmoe_two_layer',  # GQA + q/k norm over the whole projections, q/k/v/o biases
  'qwen2_moe_four_layer',  # q/k/v biases, gated shared expert, layers moe / moe / dense / moe
  'deepseek_v2_three_layer',  # MLA, YaRN, softmax router over groups scored by their best
  'glm4_moe_three_layer',  # GQA, half the head rotated, q/k/v biases, DeepSeek-V3 router, MTP
  'gpt_oss_three_layer',  # sinks, sliding / full layers, biased router and experts, clamped SwiGLU
  'minimax_m2_two_layer',  # whole-projection q/k norms, partial RoPE, sigmoid router + bias
  'qwen3_next_four_layer',  # Gated DeltaNet / gated attention layers, offset norms, shared expert
  'qwen3_5_moe_text_four_layer',  # Qwen3-Next's parts, Gated DeltaNet's projections apart
  'deepseek_v32_three_layer',  # DeepSeek-V3's MLA and router + an indexer keeping 4 of 12 tokens
  'glm_moe_dsa_three_layer',  # the same in one group, the indexer's RoPE on adjacent pairs
)
# Families whose reference is transformers 5.24 (tests/fixtures/make_2026_fixtures.py).
HF5 = (
  'minimax_m2_two_layer',
  'qwen3_next_four_layer',
  'qwen3_5_moe_text_four_layer',
  'deepseek_v32_three_layer',
  'glm_moe_dsa_three_layer',
)
# Families whose export round trip and generation run with the slow tests (the default suite's
# time budget); their logits, loss, routing, gradients and LoRA reach run by default.
SLOW_EXTRAS = (
  'deepseek_v3_plain_q',
  'deepseek_v32_three_layer',
  'olmoe_two_layer',
  'qwen2_moe_four_layer',
  'deepseek_v2_three_layer',
  'glm4_moe_three_layer',
  'gpt_oss_three_layer',
  'minimax_m2_two_layer',
  'qwen3_next_four_layer',
  'qwen3_5_moe_text_four_layer',
  'glm_moe_dsa_three_layer',
)
EXTRAS = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_EXTRAS else n for n in FAMILIES]


def export_tolerance(name: str) -> float:
  """Logits of an export against the adapted model's. A Gated DeltaNet layer's state carries
  each merged kernel's rounding (W + s A B in float32) on to every later token: the hybrids'
  exports sit 1.0-1.7e-5 from the adapted model, the other families' about 2e-6."""
  return 2.5e-5 if name.startswith(('qwen3_next', 'qwen3_5')) else 1e-5


def reference_python(name: str) -> str:
  """The reference venv's python for fixture `name` (transformers 4.57.6, or 5.24.0 for HF5),
  from MOETRAIN_HF_PYTHON / MOETRAIN_HF5_PYTHON; skips the test where it is unset."""
  var, version = (
    ('MOETRAIN_HF5_PYTHON', '5.24.0') if name in HF5 else ('MOETRAIN_HF_PYTHON', '4.57.6')
  )
  python = os.environ.get(var)
  if not python:
    pytest.skip(f'{var} (a python with torch, transformers {version}, peft) is unset')
  return python


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
  assert [k for k in loaded.skipped if not hf.is_mtp(k, cfg)] == []  # GLM-4.5's MTP layer
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
  _, scores, idx, gates, _ = moe_lib.route(jnp.asarray(x), w, b, cfg)
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


@pytest.mark.parametrize(
  'name',
  [
    'qwen3_moe_three_layer',
    'deepseek_v3_three_layer',
    pytest.param('gpt_oss_three_layer', marks=pytest.mark.slow),  # expert biases sharded too
  ],
)
def test_expert_parallel_mesh_equals_one_device(name):
  ref = reference(name)
  logits = sharded_forward(fixture(name), lambda **kw: f32_config(name, **kw), ref['input_ids'])
  err = max_err(logits, np.concatenate([ref['logits']] * 2))
  print(f'{name} on mesh (1,2,2,2): logits {err:.2e}')
  assert err < 1e-5


# gpt-oss's experts are fused parameters PEFT does not adapt: its PEFT checks leave them out.
NO_EXPERTS = r'attn\.(q|k|v|o)$|lm_head$'


def lora_model(name: str, seed: int = 0, targets: str = ALL_TARGETS, rank=4, alpha=16.0):
  cfg = f32_config(name, lora=LoraConfig(rank=rank, alpha=alpha, targets=targets))
  loaded = hf.load_params(fixture(name), cfg, seed=seed)
  model = train_state.merge_model(
    train_state.graphdef_of(cfg), loaded.params, loaded.moe_bias, loaded.frozen
  )
  return model, cfg


def peft_targets(name: str) -> str:
  return ALL_TARGETS


def trained_lora_model(name: str, targets: str = ALL_TARGETS):
  """lora_model with adapters (and a router bias, where the family has one) away from their
  initial values, as after training."""
  model, cfg = lora_model(name, targets=targets)
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


@pytest.mark.parametrize('name', EXTRAS)
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
  assert max_err(got, want) < export_tolerance(name)
  if peft_targets(name) != ALL_TARGETS:
    with pytest.raises(ValueError, match='fused parameters'):
      peft_adapter.save(model, cfg, str(tmp_path / 'adapter'), base_model=fixture(name))
    model, cfg = trained_lora_model(name, peft_targets(name))
  peft_adapter.save(model, cfg, str(tmp_path / 'adapter'), base_model=fixture(name))
  adapter = json.loads((tmp_path / 'adapter' / 'adapter_config.json').read_text())
  assert adapter['modules_to_save'] == [peft_adapter.router_module(cfg)]
  if adapter['r'] != cfg.lora.rank:  # gpt-oss's fused experts: rank 2r at scale 1
    assert adapter['target_parameters'] and adapter['r'] == adapter['lora_alpha'] == 8
    fresh, fresh_cfg = lora_model(name, seed=9, targets=peft_targets(name), rank=8, alpha=8.0)
    peft_adapter.load(fresh, fresh_cfg, str(tmp_path / 'adapter'))
    assert max_err(logits_of(fresh, ids), want) < 1e-5
    return
  fresh, _ = lora_model(name, seed=9, targets=peft_targets(name))
  peft_adapter.load(fresh, cfg, str(tmp_path / 'adapter'))
  for x, y in zip(jax.tree.leaves(nnx.state(fresh)), jax.tree.leaves(nnx.state(model))):
    np.testing.assert_array_equal(x, y)


# transformers' side of test_transformers_loads_the_exports, run by the reference venv's python:
# argv: the merged export, the base checkpoint, the adapter, input ids (.npy), output (.npz).
_HF_SCRIPT = """
import sys, numpy as np, peft, torch, transformers
merged, base, adapter, ids, out = sys.argv[1:]
ids = torch.from_numpy(np.load(ids)).long()
def auto(d):
  return transformers.AutoModelForCausalLM.from_pretrained(
    d, dtype=torch.float32, attn_implementation='eager')
def logits(m):
  with torch.no_grad():
    return m.eval()(input_ids=ids).logits.numpy()
got = {'merged': logits(auto(merged))}
if adapter != '-':
  got['peft'] = logits(peft.PeftModel.from_pretrained(auto(base), adapter))
np.savez(out, **got)
"""


@pytest.mark.parametrize('name', FAMILIES)
def test_transformers_loads_the_exports(name, tmp_path):
  """transformers loads the merged export, and peft the adapter, with the model's logits.
  Needs a reference venv with torch + transformers 4.57.6 + peft (tests/fixtures/
  make_family_fixtures.py says how to make it), named by MOETRAIN_HF_PYTHON, and for the HF5
  families one with transformers 5.24.0 (make_2026_fixtures.py), MOETRAIN_HF5_PYTHON; skipped
  without:
    MOETRAIN_HF_PYTHON=/work/hfvenv/bin/python MOETRAIN_HF5_PYTHON=/work/hfvenv5/bin/python \\
      .venv/bin/python -m pytest tests/test_families.py -k transformers
  """
  import subprocess

  python = reference_python(name)
  ids = reference(name)['input_ids']
  model, cfg = trained_lora_model(name, peft_targets(name))
  want = logits_of(model, ids)
  hf.save_hf(model, cfg, str(tmp_path / 'merged'), dtype=jnp.float32)
  # transformers 5 runs the HF5 families' experts fused ([E, out, in] parameters under
  # mlp.experts), which the adapter reaches through target_parameters (fused_lora).
  adapter = tmp_path / 'adapter'
  peft_adapter.save(model, cfg, str(adapter), base_model=fixture(name))
  np.save(tmp_path / 'ids.npy', ids)
  dirs = [tmp_path / 'merged', fixture(name), adapter, tmp_path / 'ids.npy']
  run = subprocess.run(
    [python, '-c', _HF_SCRIPT, *map(str, dirs), str(tmp_path / 'out.npz')],
    capture_output=True,
    text=True,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  got = np.load(tmp_path / 'out.npz')
  for kind in got.files:
    err = max_err(got[kind], want)
    print(f'{name}: transformers on the {kind} export: logits {err:.2e}')
    assert err < export_tolerance(name), (kind, err)


# peft's side of test_a_peft_adapter_on_fused_experts_loads: a rank-4 adapter on q_proj and the
# fused experts (target_parameters), random factors, saved, with the adapted model's logits.
_PEFT_FUSED_SCRIPT = """
import sys, numpy as np, peft, torch, transformers
base, out, ids, logits = sys.argv[1:]
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_pretrained(
  base, dtype=torch.float32, attn_implementation='eager')
config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=['q_proj'],
  target_parameters=['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'])
model = peft.get_peft_model(model, config)
with torch.no_grad():
  for n, p in model.named_parameters():
    if 'lora_' in n:
      p.copy_(torch.randn_like(p) * 0.3)
model.save_pretrained(out)
with torch.no_grad():
  got = model.eval()(input_ids=torch.from_numpy(np.load(ids)).long()).logits.numpy()
np.save(logits, got)
"""


def test_a_peft_adapter_on_fused_experts_loads(tmp_path):
  """An adapter that peft itself made on gpt-oss's fused experts (target_parameters: one A per
  expert shared by gate and up) loads into moetrain's separate gate/up/down adapters with peft's
  logits. Needs MOETRAIN_HF_PYTHON, as test_transformers_loads_the_exports."""
  import subprocess

  python = reference_python('gpt_oss_three_layer')
  name = 'gpt_oss_three_layer'
  ids = reference(name)['input_ids']
  np.save(tmp_path / 'ids.npy', ids)
  out, logits = tmp_path / 'adapter', tmp_path / 'logits.npy'
  args = [python, '-c', _PEFT_FUSED_SCRIPT, fixture(name), str(out), str(tmp_path / 'ids.npy')]
  run = subprocess.run([*args, str(logits)], capture_output=True, text=True)
  assert run.returncode == 0, run.stderr[-3000:]
  targets = r'attn\.q$|experts\.(gate|up|down)$'
  model, cfg = lora_model(name, targets=targets, rank=4, alpha=8.0)
  peft_adapter.load(model, cfg, str(out))
  want = np.load(logits)
  assert max_err(want, reference(name)['logits']) > 1e-2  # the adapter changes the logits
  assert max_err(logits_of(model, ids), want) < 1e-4


@pytest.mark.parametrize('name', EXTRAS)
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
  seq = cfg.with_engine(moe_balance_loss='sequence')
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
  from moetrain.training.train_step import StepConfig, bias_update

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


# The released config.json files (the keys moetrain reads, and those it checks).
RELEASED = {
  'olmoe_1b_7b': {  # allenai/OLMoE-1B-7B-0924
    'model_type': 'olmoe',
    'attention_bias': False,
    'clip_qkv': None,
    'hidden_act': 'silu',
    'hidden_size': 2048,
    'initializer_range': 0.02,
    'intermediate_size': 1024,
    'max_position_embeddings': 4096,
    'norm_topk_prob': False,
    'num_attention_heads': 16,
    'num_experts': 64,
    'num_experts_per_tok': 8,
    'num_hidden_layers': 16,
    'num_key_value_heads': 16,
    'rms_norm_eps': 1e-05,
    'rope_scaling': None,
    'rope_theta': 10000.0,
    'tie_word_embeddings': False,
    'vocab_size': 50304,
  },
  'qwen1_5_moe_a2_7b': {  # Qwen/Qwen1.5-MoE-A2.7B
    'model_type': 'qwen2_moe',
    'hidden_act': 'silu',
    'hidden_size': 2048,
    'initializer_range': 0.02,
    'intermediate_size': 5632,
    'max_position_embeddings': 8192,
    'num_attention_heads': 16,
    'num_hidden_layers': 24,
    'num_key_value_heads': 16,
    'rms_norm_eps': 1e-06,
    'rope_theta': 1000000.0,
    'sliding_window': 32768,
    'tie_word_embeddings': False,
    'use_sliding_window': False,
    'vocab_size': 151936,
    'decoder_sparse_step': 1,
    'moe_intermediate_size': 1408,
    'shared_expert_intermediate_size': 5632,
    'num_experts_per_tok': 4,
    'num_experts': 60,
    'norm_topk_prob': False,
  },
  'deepseek_v2_lite': {  # deepseek-ai/DeepSeek-V2-Lite
    'model_type': 'deepseek_v2',
    'attention_bias': False,
    'first_k_dense_replace': 1,
    'hidden_act': 'silu',
    'hidden_size': 2048,
    'initializer_range': 0.02,
    'intermediate_size': 10944,
    'kv_lora_rank': 512,
    'max_position_embeddings': 163840,
    'moe_intermediate_size': 1408,
    'moe_layer_freq': 1,
    'n_group': 1,
    'n_routed_experts': 64,
    'n_shared_experts': 2,
    'norm_topk_prob': False,
    'num_attention_heads': 16,
    'num_experts_per_tok': 6,
    'num_hidden_layers': 27,
    'num_key_value_heads': 16,
    'q_lora_rank': None,
    'qk_nope_head_dim': 128,
    'qk_rope_head_dim': 64,
    'rms_norm_eps': 1e-06,
    'rope_scaling': {
      'beta_fast': 32,
      'beta_slow': 1,
      'factor': 40,
      'mscale': 0.707,
      'mscale_all_dim': 0.707,
      'original_max_position_embeddings': 4096,
      'type': 'yarn',
    },
    'rope_theta': 10000,
    'routed_scaling_factor': 1.0,
    'scoring_func': 'softmax',
    'tie_word_embeddings': False,
    'topk_group': 1,
    'topk_method': 'greedy',
    'v_head_dim': 128,
    'vocab_size': 102400,
  },
  'glm4_5_air': {  # zai-org/GLM-4.5-Air
    'model_type': 'glm4_moe',
    'attention_bias': True,
    'first_k_dense_replace': 1,
    'head_dim': 128,
    'hidden_act': 'silu',
    'hidden_size': 4096,
    'initializer_range': 0.02,
    'intermediate_size': 10944,
    'max_position_embeddings': 131072,
    'moe_intermediate_size': 1408,
    'n_group': 1,
    'n_routed_experts': 128,
    'n_shared_experts': 1,
    'norm_topk_prob': True,
    'num_attention_heads': 96,
    'num_experts_per_tok': 8,
    'num_hidden_layers': 46,
    'num_key_value_heads': 8,
    'num_nextn_predict_layers': 1,
    'partial_rotary_factor': 0.5,
    'rms_norm_eps': 1e-05,
    'rope_scaling': None,
    'rope_theta': 1000000,
    'routed_scaling_factor': 1.0,
    'tie_word_embeddings': False,
    'topk_group': 1,
    'use_qk_norm': False,
    'vocab_size': 151552,
  },
}
RELEASED['gpt_oss_20b'] = {  # openai/gpt-oss-20b (its quantization_config left out)
  'model_type': 'gpt_oss',
  'attention_bias': True,
  'experts_per_token': 4,
  'head_dim': 64,
  'hidden_act': 'silu',
  'hidden_size': 2880,
  'initializer_range': 0.02,
  'intermediate_size': 2880,
  'layer_types': ['sliding_attention', 'full_attention'] * 12,
  'max_position_embeddings': 131072,
  'num_attention_heads': 64,
  'num_experts_per_tok': 4,
  'num_hidden_layers': 24,
  'num_key_value_heads': 8,
  'num_local_experts': 32,
  'rms_norm_eps': 1e-05,
  'rope_scaling': {
    'beta_fast': 32.0,
    'beta_slow': 1.0,
    'factor': 32.0,
    'original_max_position_embeddings': 4096,
    'rope_type': 'yarn',
    'truncate': False,
  },
  'rope_theta': 150000,
  'sliding_window': 128,
  'swiglu_limit': 7.0,
  'tie_word_embeddings': False,
  'vocab_size': 201088,
}
RELEASED['gpt_oss_120b'] = {  # openai/gpt-oss-120b: what differs from gpt-oss-20b
  **RELEASED['gpt_oss_20b'],
  'layer_types': ['sliding_attention', 'full_attention'] * 18,
  'num_hidden_layers': 36,
  'num_local_experts': 128,
}
RELEASED['glm4_5'] = {  # zai-org/GLM-4.5: what differs from GLM-4.5-Air
  **RELEASED['glm4_5_air'],
  'first_k_dense_replace': 3,
  'hidden_size': 5120,
  'intermediate_size': 12288,
  'moe_intermediate_size': 1536,
  'n_routed_experts': 160,
  'num_hidden_layers': 92,
  'routed_scaling_factor': 2.5,
  'use_qk_norm': True,
}
# Qwen/Qwen3-Next-80B-A3B-Instruct (the layer_types transformers derives from
# full_attention_interval).
RELEASED['qwen3_next_80b_a3b'] = {
  'model_type': 'qwen3_next',
  'architectures': ['Qwen3NextForCausalLM'],
  'attention_bias': False,
  'decoder_sparse_step': 1,
  'full_attention_interval': 4,
  'head_dim': 256,
  'hidden_act': 'silu',
  'hidden_size': 2048,
  'intermediate_size': 5120,
  'linear_conv_kernel_dim': 4,
  'linear_key_head_dim': 128,
  'linear_num_key_heads': 16,
  'linear_num_value_heads': 32,
  'linear_value_head_dim': 128,
  'max_position_embeddings': 262144,
  'mlp_only_layers': [],
  'moe_intermediate_size': 512,
  'norm_topk_prob': True,
  'num_attention_heads': 16,
  'num_experts': 512,
  'num_experts_per_tok': 10,
  'num_hidden_layers': 48,
  'num_key_value_heads': 2,
  'partial_rotary_factor': 0.25,
  'rms_norm_eps': 1e-06,
  'rope_scaling': None,
  'rope_theta': 10000000,
  'shared_expert_intermediate_size': 512,
  'tie_word_embeddings': False,
  'vocab_size': 151936,
}
# Qwen/Qwen3.5-35B-A3B's text_config as transformers 5.24 writes its defaults (no
# intermediate_size: no dense layer).
RELEASED['qwen3_5_35b_a3b'] = {
  'model_type': 'qwen3_5_moe_text',
  'vocab_size': 248320,
  'hidden_size': 2048,
  'num_hidden_layers': 40,
  'num_attention_heads': 16,
  'num_key_value_heads': 2,
  'hidden_act': 'silu',
  'max_position_embeddings': 32768,
  'initializer_range': 0.02,
  'rms_norm_eps': 1e-06,
  'tie_word_embeddings': False,
  'rope_parameters': {'rope_theta': 10000.0, 'partial_rotary_factor': 0.25, 'rope_type': 'default'},
  'attention_bias': False,
  'head_dim': 256,
  'linear_conv_kernel_dim': 4,
  'linear_key_head_dim': 128,
  'linear_value_head_dim': 128,
  'linear_num_key_heads': 16,
  'linear_num_value_heads': 32,
  'moe_intermediate_size': 512,
  'shared_expert_intermediate_size': 512,
  'num_experts_per_tok': 8,
  'num_experts': 256,
  'layer_types': ['linear_attention'] * 3 + ['full_attention'],
}
RELEASED['qwen3_5_35b_a3b']['layer_types'] *= 10
# MiniMaxAI/MiniMax-M2 (its quantization_config and auto_map left out; the MTP modules it
# describes are not loaded).
RELEASED['minimax_m2'] = {
  'model_type': 'minimax_m2',
  'architectures': ['MiniMaxM2ForCausalLM'],
  'attn_type_list': [1] * 62,
  'head_dim': 128,
  'hidden_act': 'silu',
  'hidden_size': 3072,
  'intermediate_size': 1536,
  'max_position_embeddings': 196608,
  'mtp_transformer_layers': 1,
  'num_attention_heads': 48,
  'num_experts_per_tok': 8,
  'num_hidden_layers': 62,
  'num_key_value_heads': 8,
  'num_local_experts': 256,
  'num_mtp_modules': 3,
  'qk_norm_type': 'per_layer',
  'rms_norm_eps': 1e-06,
  'rope_theta': 5000000,
  'rotary_dim': 64,
  'scoring_func': 'sigmoid',
  'shared_intermediate_size': 0,
  'tie_word_embeddings': False,
  'use_mtp': True,
  'use_qk_norm': True,
  'use_routing_bias': True,
  'vocab_size': 200064,
}


# zai-org/GLM-5's shapes as transformers 5.24's GlmMoeDsaConfig defaults write them.
RELEASED['glm_5'] = {
  'model_type': 'glm_moe_dsa',
  'vocab_size': 154880,
  'hidden_size': 6144,
  'intermediate_size': 12288,
  'moe_intermediate_size': 2048,
  'num_hidden_layers': 78,
  'num_attention_heads': 64,
  'num_key_value_heads': 64,
  'n_shared_experts': 1,
  'n_routed_experts': 256,
  'routed_scaling_factor': 2.5,
  'kv_lora_rank': 512,
  'q_lora_rank': 2048,
  'qk_rope_head_dim': 64,
  'v_head_dim': 256,
  'qk_nope_head_dim': 192,
  'n_group': 1,
  'topk_group': 1,
  'num_experts_per_tok': 8,
  'norm_topk_prob': True,
  'hidden_act': 'silu',
  'max_position_embeddings': 202752,
  'initializer_range': 0.02,
  'rms_norm_eps': 1e-05,
  'tie_word_embeddings': False,
  'rope_parameters': {'rope_theta': 10000.0, 'rope_type': 'default'},
  'mlp_layer_types': ['dense'] * 3 + ['sparse'] * 75,
  'attention_bias': False,
  'index_topk': 2048,
  'index_head_dim': 128,
  'index_n_heads': 32,
  'head_dim': 64,
  'first_k_dense_replace': 3,
  'indexer_types': ['full'] * 78,
}


@pytest.mark.parametrize('preset', sorted(RELEASED))
def test_presets_are_the_released_configs(preset):
  from moetrain.model.families import MODEL_PRESETS

  assert hf.config_from_hf(RELEASED[preset]) == MODEL_PRESETS[preset]


@pytest.mark.parametrize(
  'preset, total, active',
  [
    # The released counts include the input embedding, which 'active' leaves out.
    ('olmoe_1b_7b', 6.92, 1.18),  # 6.9B, 1.3B (1.28B) with the embedding's 0.10B
    ('qwen1_5_moe_a2_7b', 14.32, 2.38),  # 14.3B, 2.7B with the embedding's 0.31B
    ('qwen2_57b_a14b', 57.41, 13.70),  # 57B, 14B with the embedding's 0.54B
    ('deepseek_v2_lite', 15.71, 2.45),  # 15.7B, 2.4B
    ('deepseek_v2_236b', 235.74, 20.85),  # 236B, 21B
    # The MTP layer left out (2.4B, 3.9B): 106B, 12B; 355B, 32B.
    ('glm4_5_air', 106.85, 12.80),
    ('glm4_5', 352.80, 32.86),
    ('gpt_oss_20b', 20.91, 3.61),  # 20.9B, 3.6B
    ('gpt_oss_120b', 116.83, 5.17),  # 116.8B, 5.1B
    ('minimax_m2', 228.69, 10.42),  # 230B, 10B (the MTP modules left out)
    ('qwen3_next_80b_a3b', 79.67, 3.56),  # 80B, 3B (the MTP layer left out)
    ('qwen3_5_35b_a3b', 34.66, 2.95),  # 35B, 3B (the vision tower and MTP layer left out)
    ('mixtral_8x22b', 140.63, 38.96),  # 141B, 39B with the embedding's 0.20B
    # DeepSeek-V3's 671B, 37B plus the indexers' 0.85B (685B with the MTP layer left out).
    ('deepseek_v32_671b', 671.88, 37.48),
    ('kimi_k2_5', 1026.41, 31.69),  # 1T, 32.86B with the embedding's 1.17B (vision tower apart)
    ('glm_5', 743.91, 40.83),  # 744B, 40B
  ],
)
def test_released_presets_parameter_counts(preset, total, active):
  from moetrain.model.families import MODEL_PRESETS
  from moetrain.planner.sizes import param_counts

  cfg = MODEL_PRESETS[preset]
  counts = param_counts(cfg)
  assert round(counts['total'] / 1e9, 2) == total
  assert round(counts['active'][cfg.moe_topk] / 1e9, 2) == active


@pytest.mark.parametrize(
  'change, error',
  [
    ({'topk_method': 'noaux_tc'}, "config.json topk_method='noaux_tc' is unsupported"),
    ({'norm_topk_prob': True}, 'config.json norm_topk_prob=True is unsupported'),
    ({'topk_method': 'group_limited_greedy', 'n_group': None}, "needs integer ['n_group']"),
  ],
)
def test_deepseek_v2_configs_moetrain_cannot_run_are_refused_by_key(change, error):
  c = {**RELEASED['deepseek_v2_lite'], **change}
  with pytest.raises(ValueError, match=re.escape(error)):
    hf.config_from_hf(c)


def test_deepseek_v2_softmax_scale_follows_deepseek_not_transformers():
  """DeepSeek's code scales the softmax by mscale(factor, mscale_all_dim)^2 under YaRN;
  transformers 4.57's deepseek_v2 leaves it out. moetrain keeps DeepSeek's (the model was
  trained with it): the fixtures' YaRN has no mscale_all_dim, where the two agree."""
  cfg = hf.config_from_hf(RELEASED['deepseek_v2_lite'])
  mscale = 0.1 * 0.707 * np.log(40) + 1
  np.testing.assert_allclose(cfg.attention_scale, 192**-0.5 * mscale**2, rtol=1e-6)


def test_olmoe_export_refuses_separate_q_and_o_biases():
  cfg = dataclasses.replace(f32_config('olmoe_two_layer'), o_bias=False)
  with pytest.raises(ValueError, match='model.o_bias=False: transformers olmoe has one'):
    hf.config_to_hf(cfg, 'float32')


def test_glm_mtp_layer_is_skipped_on_load_and_copied_on_export(tmp_path):
  """GLM-4.5 stores its MTP layer as model.layers.{num_hidden_layers}.*: transformers skips it,
  so does the import; an export from the checkpoint copies it unchanged. Without
  num_nextn_predict_layers it reads as a layer beyond the config."""
  from moetrain.convert import safetensors_io as stio

  name = 'glm4_moe_three_layer'
  cfg = f32_config(name)
  model, loaded = build(name, cfg)
  assert loaded.skipped and all(k.startswith('model.layers.3.') for k in loaded.skipped)
  hf.save_hf(model, cfg, str(tmp_path), base_dir=fixture(name))
  out, base = stio.Reader(str(tmp_path)), stio.Reader(fixture(name))
  for k in loaded.skipped:
    np.testing.assert_array_equal(out.read(k), base.read(k))
  with pytest.raises(ValueError, match='beyond the config'):
    hf.load_params(fixture(name), dataclasses.replace(cfg, num_nextn_predict_layers=0))


@pytest.mark.parametrize('name', ['deepseek_v3_three_layer', 'deepseek_v32_three_layer'])
def test_deepseek_mtp_layer_is_skipped_on_load(name, tmp_path):
  """DeepSeek-V3's release (and V3.2's, GLM-5's) stores its MTP layer past the decoder's,
  model.layers.61.*, with num_nextn_predict_layers 1: the import skips it, as transformers does,
  and loads the decoder's weights unchanged."""
  from moetrain.convert import safetensors_io as stio
  from tests.helpers import rewrite

  base = stio.Reader(fixture(name))
  config = hf.read_config(fixture(name))
  last = config['num_hidden_layers'] - 1
  mtp = {
    k.replace(f'model.layers.{last}.', f'model.layers.{last + 1}.'): base.read_stored(k)
    for k in base.keys()
    if k.startswith(f'model.layers.{last}.')
  }
  src = rewrite(
    fixture(name), tmp_path, config={**config, 'num_nextn_predict_layers': 1}, change=mtp
  )
  cfg = hf.config_from_hf(hf.read_config(src), dtype='float32', param_dtype='float32')
  assert cfg.num_nextn_predict_layers == 1
  loaded = hf.load_params(src, cfg)
  assert sorted(loaded.skipped) == sorted(mtp)
  plain = hf.load_params(fixture(name), f32_config(name))
  for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(plain.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gpt_oss_scans_its_alternating_layers_as_one_group():
  """Sliding and full layers are one stacked scan, each layer's window per-layer data: one
  group of 24 for gpt-oss-20b, where one group per layer kept every layer's MoE buffers apart
  (a v5p-8 plan at 403.9 GiB per chip)."""
  from moetrain.model.families import MODEL_PRESETS

  cfg = MODEL_PRESETS['gpt_oss_20b']
  assert [(g.name, g.count) for g in cfg.layer_groups()] == [('layers', 24)]
  assert cfg.layer_windows()[:4] == (128, 0, 128, 0)


@pytest.mark.slow
def test_gpt_oss_mxfp4_experts_read_dequantised(tmp_path):
  """The released layout: MXFP4 expert blocks and scales read as transformers dequantises them
  (its logits), in the run's dtype or quantised again for QLoRA; a bfloat16 export of the
  dequantised model reloads exactly (MXFP4 values are bfloat16 numbers) without the release's
  quantization_config."""
  name = 'gpt_oss_mxfp4'
  ref = reference(name)
  model = hf.load_model(fixture(name), jnp.float32)
  assert max_err(logits_of(model, ref['input_ids']), ref['logits']) < 1e-5
  cfg = f32_config(name, quant='int8', lora=LoraConfig(rank=4, targets=ALL_TARGETS))
  qlora, _ = build(name, cfg)
  for n in ('gate', 'up', 'down'):  # int8 codes of the dequantised experts: within half a step
    want = np.asarray(getattr(model.layers.moe.experts, n)[...])
    got = np.asarray(quant.value(getattr(qlora.layers.moe.experts, n), jnp.float32))
    assert np.abs(got - want).max() <= 0.5 / 127 * np.abs(want).max() * 1.001, n
  bf16 = hf.load_model(fixture(name), jnp.bfloat16)
  cfg16 = hf.config_from_hf(hf.read_config(fixture(name)), dtype='bfloat16')
  out = str(tmp_path / 'bf16')
  hf.save_hf(bf16, cfg16, out, dtype=jnp.bfloat16)
  config = json.loads(open(os.path.join(out, 'config.json')).read())
  assert 'quantization_config' not in config and config['dtype'] == 'bfloat16'
  again = hf.load_model(out, jnp.bfloat16)
  for x, y in zip(jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(bf16))):
    np.testing.assert_array_equal(x, y)


def test_transformers_loads_the_gpt_oss_bf16_export(tmp_path):
  """transformers 4.57 reads the bfloat16 export of the MXFP4 release's layout (fused experts,
  no quantization_config) to moetrain's logits of the same weights (MOETRAIN_HF_PYTHON, as
  test_transformers_loads_the_exports)."""
  import subprocess

  python = reference_python('gpt_oss_mxfp4')
  name = 'gpt_oss_mxfp4'
  cfg16 = hf.config_from_hf(hf.read_config(fixture(name)), dtype='bfloat16')
  hf.save_hf(hf.load_model(fixture(name), jnp.bfloat16), cfg16, str(tmp_path), jnp.bfloat16)
  ids = reference(name)['input_ids']
  np.save(tmp_path / 'ids.npy', ids)
  script = (
    'import sys, numpy as np, torch, transformers\n'
    'm = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)\n'
    'ids = torch.from_numpy(np.load(sys.argv[2])).long()\n'
    'with torch.no_grad(): np.save(sys.argv[3], m.eval()(input_ids=ids).logits.numpy())\n'
  )
  args = [str(tmp_path), str(tmp_path / 'ids.npy'), str(tmp_path / 'out.npy')]
  run = subprocess.run([python, '-c', script, *args], capture_output=True, text=True)
  assert run.returncode == 0, run.stderr[-3000:]
  want = logits_of(hf.load_model(str(tmp_path), jnp.float32), ids)
  assert max_err(np.load(tmp_path / 'out.npy'), want) < 1e-5


def test_a_hybrid_models_cached_decode_equals_the_full_forward():
  """Qwen3-Next's cache (keys and values of its attention layer, convolution inputs and delta
  rule state of its Gated DeltaNet layers): a prompt right-padded past its length, then one token
  at a time, gives the full forward's logits at every position."""
  from moetrain.model import decode

  name = 'qwen3_next_four_layer'
  cfg = f32_config(name)
  model, _ = build(name, cfg)
  ids = jnp.asarray(reference(name)['input_ids'])
  full = logits_of(model, ids)
  graphdef, state = nnx.split(model)
  prefill = jax.jit(lambda s, x: decode.prefill(nnx.merge(graphdef, s), x, ids.shape[1], length=5))
  step = jax.jit(lambda s, c, tok, pos: decode.decode_step(nnx.merge(graphdef, s), c, tok, pos))
  logits, cache = prefill(state, ids[:, :8].at[:, 5:].set(7))  # 3 padding tokens
  got = [logits]
  for pos in range(5, ids.shape[1] - 1):
    logits, cache = step(state, cache, ids[:, pos], pos)
    got.append(logits)
  np.testing.assert_allclose(np.stack(got, 1), full[:, 4:-1], atol=1e-5, rtol=1e-5)


def test_a_multimodal_qwen3_5_checkpoint_loads_its_language_model(tmp_path):
  """qwen3_5_moe (Qwen3_5MoeForConditionalGeneration): the text_config and the
  model.language_model.* weights load as qwen3_5_moe_text, with transformers' logits on text;
  the vision tower is skipped, and named."""
  from safetensors.numpy import load_file, save_file

  # The checkpoint: the fixture's config.json (transformers' own, made with the text fixture's
  # weights inside a vision model: make_2026_fixtures.py checked its logits on text equal the
  # text model's) and those weights under model.language_model., beside a vision tensor.
  text, multimodal = 'qwen3_5_moe_text_four_layer', 'qwen3_5_moe_multimodal'
  tensors = {
    ('model.language_model.' + k.removeprefix('model.') if k.startswith('model.') else k): v
    for k, v in load_file(os.path.join(fixture(text), 'model.safetensors')).items()
  }
  tensors['model.visual.pos_embed.weight'] = np.zeros((4, 16), np.float32)
  path = tmp_path / 'checkpoint'
  path.mkdir()
  save_file(tensors, str(path / 'model.safetensors'))
  (path / 'config.json').write_text(open(os.path.join(fixture(multimodal), 'config.json')).read())
  ref = reference(text)
  cfg = hf.config_from_hf(hf.read_config(str(path)), dtype='float32', param_dtype='float32')
  assert cfg.model_type == 'qwen3_5_moe_text' and cfg.linear_split_projections
  loaded = hf.load_params(str(path), cfg.with_engine(remat='none'))
  model = train_state.merge_model(
    train_state.graphdef_of(cfg), loaded.params, loaded.moe_bias, loaded.frozen
  )
  assert loaded.skipped == ['model.visual.pos_embed.weight']
  assert max_err(logits_of(model, ref['input_ids']), ref['logits']) < 1e-5

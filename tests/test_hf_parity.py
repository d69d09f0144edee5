"""Hugging Face LongCat-Flash interop: transformers 4.57 fixtures are the oracle (float32)."""

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from moetrain import sharding, train_state
from moetrain.convert import hf_longcat as hf
from moetrain.model import moe as moe_lib
from moetrain.model import quant
from moetrain.model.config import LoraConfig
from moetrain.model.transformer import Transformer
from tests.helpers import ALL_TARGETS

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures')
FLOAT = ('two_layer', 'wide_v', 'four_head')
BF16 = 'two_layer_sharded_bf16'


def fixture(name: str) -> str:
  return os.path.join(FIXTURES, f'longcat_{name}')


def reference(name: str) -> dict:
  return dict(np.load(os.path.join(fixture(name), 'reference.npz')))


def f32_config(path: str, **kw):
  return hf.config_from_hf(hf.read_config(path), dtype='float32', param_dtype='float32',
                           remat='none', **kw)


def lora_config(path: str, rank=4, **kw):
  return f32_config(path, lora=LoraConfig(rank=rank, targets=ALL_TARGETS), **kw)


@functools.cache
def load(name: str, cfg) -> hf.Loaded:
  """load_params, once per fixture and config for the whole module."""
  return hf.load_params(fixture(name), cfg)


def build(loaded, cfg):
  """A model over copies of the loaded Variables (merge shares them; tests mutate models)."""
  copy = lambda s: jax.tree.map(lambda x: x, s)
  return train_state.merge_model(train_state.graphdef_of(cfg), copy(loaded.params),
                                 copy(loaded.moe_bias), copy(loaded.frozen))


def perturb_lora(model, seed: int, scale: float = 0.01) -> None:
  """Non-zero adapters (B starts at 0), drawn with numpy so no per-shape kernel is compiled."""
  rng = np.random.default_rng(seed)
  noise = lambda x: jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape), x.dtype)
  nnx.update(model, jax.tree.map(noise, nnx.state(model, nnx.LoRAParam)))


def hf_loss(logits_BTV, ids_BT):
  """transformers' causal-LM loss: mean cross entropy over the B*(T-1) shifted tokens."""
  logp = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, ids_BT[:, 1:, None], axis=-1))


@pytest.fixture
def topk_log(monkeypatch):
  """Top-k expert sets the model's router picks, per layer in order (sorted like the fixtures)."""
  log, real = [], moe_lib.route

  def route(*args, **kw):
    out = real(*args, **kw)
    jax.debug.callback(lambda idx: log.append(np.sort(np.asarray(idx), -1)), out[2], ordered=True)
    return out

  monkeypatch.setattr(moe_lib, 'route', route)
  return log


def max_err(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize('name', FLOAT)
def test_float32_logits_loss_routing_grads(name, topk_log):
  path, ref = fixture(name), reference(name)
  cfg = f32_config(path)
  loaded = load(name, cfg)
  assert loaded.skipped == []
  graphdef, params, rest = nnx.split(build(loaded, cfg), nnx.Param, ...)
  ids = jnp.asarray(ref['input_ids'])

  def loss_fn(p):
    logits, _ = nnx.merge(graphdef, p, rest)(ids)
    return hf_loss(logits, ids), logits

  (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
  jax.effects_barrier()
  err = {'logits': max_err(logits, ref['logits']), 'loss': max_err(loss, ref['loss'])}
  assert err['logits'] < 1e-5 and err['loss'] < 1e-6, err
  want_topk = ref['router/topk_idx']
  assert len(topk_log) == cfg.num_layers
  for layer, got in enumerate(topk_log):
    np.testing.assert_array_equal(got, want_topk[layer], err_msg=f'layer {layer} top-k')
  # Gradient error relative to the largest |grad| of each HF tensor.
  got = dict(hf.hf_tensors(grads, cfg))
  want = {k.removeprefix('grad/'): v for k, v in ref.items() if k.startswith('grad/')}
  assert set(got) == set(want)
  rel = {k: max_err(got[k], want[k]) / max(np.abs(want[k]).max(), 1e-30) for k in want}
  worst = max(rel, key=rel.get)
  print(f'{name}: logits {err["logits"]:.2e} loss {err["loss"]:.2e} '
        f'grad rel {rel[worst]:.2e} ({worst})')
  assert rel[worst] < 1e-4, (worst, rel[worst])


@pytest.mark.parametrize('name', FLOAT)
def test_sharded_mesh_logits(name):
  path, ref = fixture(name), reference(name)
  mesh = sharding.make_mesh((1, 2, 2, 2))
  cfg = f32_config(path, rules=sharding.Rules.preset('fsdp_ep_tp'))
  loaded = hf.load_params(path, cfg, mesh=mesh)
  gate = loaded.frozen if cfg.lora.enabled else loaded.params
  spec = gate['layers']['moe']['experts']['gate'].get_value().sharding.spec
  assert spec[1] == 'expert', spec  # placed by the rules, not replicated
  graphdef = train_state.graphdef_of(cfg)
  with jax.set_mesh(mesh):
    ids = np.concatenate([ref['input_ids']] * 2)  # batch 4 splits over fsdp x expert
    ids = jax.device_put(ids, sharding.batch_sharding(mesh))
    fwd = jax.jit(lambda p, b, f, x: train_state.merge_model(graphdef, p, b, f)(x)[0])
    logits = fwd(loaded.params, loaded.moe_bias, loaded.frozen, ids)
  err = max_err(logits, np.concatenate([ref['logits']] * 2))
  print(f'{name} sharded (1,2,2,2): logits {err:.2e}')
  assert err < 1e-5


def test_sharded_bf16_checkpoint(topk_log):
  path, ref = fixture(BF16), reference(BF16)
  assert os.path.exists(os.path.join(path, 'model.safetensors.index.json'))
  model = hf.load_model(path, jnp.float32, remat='none')
  assert model.layers.attn_0.q_a.kernel.get_value().dtype == jnp.float32
  logits = jax.jit(lambda m, x: m(x)[0])(model, jnp.asarray(ref['input_ids']))
  jax.effects_barrier()
  err = max_err(logits, ref['logits'])
  print(f'{BF16}: logits {err:.2e}')
  assert err < 1e-5
  for layer, got in enumerate(topk_log):
    np.testing.assert_array_equal(got, ref['router/topk_idx'][layer])


def _rewrite(tmp_path, edit) -> str:
  """A copy of the two_layer fixture whose tensors went through `edit(dict)`."""
  src = fixture('two_layer')
  out = tmp_path / 'ckpt'
  out.mkdir(parents=True)
  shutil.copy(os.path.join(src, 'config.json'), out / 'config.json')
  with safe_open(os.path.join(src, 'model.safetensors'), 'numpy') as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  edit(tensors)
  save_file(tensors, str(out / 'model.safetensors'), metadata={'format': 'pt'})
  return str(out)


def test_missing_and_misshapen_tensors_name_the_key(tmp_path):
  cfg = f32_config(fixture('two_layer'))
  key = 'model.layers.1.mlp.experts.3.up_proj.weight'
  missing = _rewrite(tmp_path / 'a', lambda t: t.pop(key))
  with pytest.raises(ValueError, match=rf'{key}: missing'):
    hf.load_params(missing, cfg)
  key = 'model.layers.0.self_attn.1.kv_b_proj.weight'  # [N*(P+V), K] = [64, 32]
  wrong = _rewrite(tmp_path / 'b', lambda t: t.update({key: t[key][:, :-1]}))
  with pytest.raises(ValueError, match=rf'{key}: shape \(64, 31\).*expected \(64, 32\)'):
    hf.load_params(wrong, cfg)
  extra = _rewrite(tmp_path / 'c', lambda t: t.update({'model.mtp.norm.weight': t['model.norm.weight']}))
  assert hf.load_params(extra, cfg).skipped == ['model.mtp.norm.weight']


@pytest.mark.parametrize('key,value,match', [
  ('rope_scaling', {'type': 'yarn', 'factor': 4.0}, 'rope_scaling'),
  ('tie_word_embeddings', True, 'tie_word_embeddings'),
  ('head_dim', 64, 'head_dim=64 must equal qk_rope_head_dim=8'),
  ('q_lora_rank', None, 'q_lora_rank'),
])
def test_config_rejects_unsupported(key, value, match):
  config = {**hf.read_config(fixture('two_layer')), key: value}
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf(config)


def test_save_hf_round_trip_is_exact(tmp_path):
  src = fixture('two_layer')
  cfg = f32_config(src)
  model = build(load('two_layer', cfg), cfg)
  hf.save_hf(model, cfg, str(tmp_path), dtype=jnp.float32, max_shard_size=100_000)
  assert os.path.exists(tmp_path / 'model.safetensors.index.json')
  assert hf.config_from_hf(hf.read_config(str(tmp_path)), dtype='float32', param_dtype='float32',
                           remat='none') == cfg
  again = build(hf.load_params(str(tmp_path), cfg), cfg)
  a, b = nnx.state(model), nnx.state(again)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  # The shards hold exactly the fixture's tensors, router bias included.
  with open(tmp_path / 'model.safetensors.index.json') as f:
    weight_map = json.load(f)['weight_map']
  with safe_open(os.path.join(src, 'model.safetensors'), 'numpy') as f:
    assert set(weight_map) == set(f.keys())
    for k, shard in weight_map.items():
      with safe_open(str(tmp_path / shard), 'numpy') as g:
        np.testing.assert_array_equal(g.get_tensor(k), f.get_tensor(k), err_msg=k)


@pytest.mark.parametrize('mode', ['int8', 'int4'])
def test_quantised_load_matches_the_model_split(mode):
  path = fixture('four_head')
  cfg = lora_config(path, quant=mode, quant_group_size=16)
  loaded = load('four_head', cfg)
  want = train_state.split_model(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), cfg)[1:]
  for got, ref in zip(loaded[:3], want):
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
      assert (x.shape, x.dtype) == (y.shape, y.dtype)
  plain = load('four_head', f32_config(path))
  w = plain.params['layers']['moe']['experts']['down'].get_value()[0]
  t = quant.quantize(w, 8 if mode == 'int8' else 4, 1, 1, cfg.quant_group_size)
  k = loaded.frozen['layers']['moe']['experts']['down']
  np.testing.assert_array_equal(k['q'].get_value()[0], t.q)
  np.testing.assert_array_equal(k['scale'].get_value()[0], t.scale)


def lora_model(name, seed=3, **kw):
  cfg = lora_config(fixture(name), **kw)
  model = build(load(name, cfg), cfg)
  perturb_lora(model, seed)
  return model, cfg


def test_save_hf_merges_lora_and_decodes_int4(tmp_path):
  ids = jnp.asarray(reference('four_head')['input_ids'])
  model, cfg = lora_model('four_head', quant='int4', quant_group_size=16)
  hf.save_hf(model, cfg, str(tmp_path), dtype=jnp.float32)
  merged = hf.load_model(str(tmp_path), jnp.float32, remat='none')
  fwd = jax.jit(lambda m, x: m(x)[0])
  want, got = fwd(model, ids), fwd(merged, ids)
  assert max_err(want, reference('four_head')['logits']) > 0.1  # LoRA and int4 changed it
  assert max_err(got, want) < 1e-5


def test_peft_adapter_round_trip(tmp_path):
  path = fixture('two_layer')
  model, cfg = lora_model('two_layer')
  hf.save_peft_adapter(model, cfg, str(tmp_path))
  with open(tmp_path / 'adapter_config.json') as f:
    config = json.load(f)
  assert (config['r'], config['lora_alpha'], config['use_rslora']) == (4, 16.0, False)
  with safe_open(str(tmp_path / 'adapter_model.safetensors'), 'numpy') as f:
    shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
  pre = 'base_model.model.model.layers.1.'
  assert shapes[pre + 'self_attn.0.o_proj.lora_A.weight'] == (4, 2 * 16)  # [R, N*V]
  assert shapes[pre + 'self_attn.0.q_b_proj.lora_B.weight'] == (2 * 24, 4)  # [N*(P+R), R]
  assert shapes[pre + 'mlp.experts.3.down_proj.lora_B.weight'] == (64, 4)
  assert shapes['base_model.model.lm_head.lora_A.weight'] == (4, 64)
  fresh, _ = lora_model('two_layer', seed=9)
  hf.load_peft_adapter(fresh, cfg, str(tmp_path))
  for x, y in zip(jax.tree.leaves(nnx.state(fresh)), jax.tree.leaves(nnx.state(model))):
    np.testing.assert_array_equal(x, y)
  other = lora_config(path, rank=2)
  abstract = nnx.eval_shape(lambda: Transformer(other, nnx.Rngs(0)))
  with pytest.raises(ValueError, match='r=4 but the model has lora.rank=2'):
    hf.load_peft_adapter(abstract, other, str(tmp_path))


def test_transformers_loads_lora_merged_export(tmp_path):
  """Needs torch + transformers 4.57 next to jax; skipped in the default environment."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  path, ids = fixture('two_layer'), reference('two_layer')['input_ids']
  model, cfg = lora_model('two_layer')
  want = np.asarray(jax.jit(lambda m, x: m(x)[0])(model, jnp.asarray(ids)))
  hf.save_hf(model, cfg, str(tmp_path / 'merged'), dtype=jnp.float32)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path / 'merged'), dtype=torch.float32, attn_implementation='eager').eval()
  with torch.no_grad():
    got = hf_model(input_ids=torch.from_numpy(ids).long()).logits.numpy()
  assert max_err(want, reference('two_layer')['logits']) > 0.1
  assert max_err(got, want) < 1e-5
  peft = pytest.importorskip('peft')
  hf.save_peft_adapter(model, cfg, str(tmp_path / 'adapter'))
  base = transformers.AutoModelForCausalLM.from_pretrained(
    path, dtype=torch.float32, attn_implementation='eager')
  adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / 'adapter')).eval()
  with torch.no_grad():
    got = adapted(input_ids=torch.from_numpy(ids).long()).logits.numpy()
  assert max_err(got, want) < 1e-5

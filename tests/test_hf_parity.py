"""Hugging Face LongCat-Flash interop: transformers 4.57 fixtures are the oracle (float32)."""

import functools
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from moetrain.convert import hf, peft_adapter
from moetrain.convert import safetensors_io as stio
from moetrain.core import sharding
from moetrain.core.engine import LoraConfig
from moetrain.kernels import quant
from moetrain.model.transformer import Transformer
from moetrain.training import train_state
from tests.helpers import (
  ALL_TARGETS,
  assert_matches_hf,
  assert_same_topk,
  max_err,
  perturb_lora,
  perturb_router,
  sharded_forward,
)

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures')
FLOAT = ('two_layer', 'wide_v', 'four_head')
BF16 = 'two_layer_sharded_bf16'


def fixture(name: str) -> str:
  return os.path.join(FIXTURES, f'longcat_{name}')


def reference(name: str) -> dict:
  return dict(np.load(os.path.join(fixture(name), 'reference.npz')))


def f32_config(path: str, **kw):
  return hf.config_from_hf(
    hf.read_config(path), dtype='float32', param_dtype='float32', remat='none', **kw
  )


def lora_config(path: str, rank=4, **kw):
  return f32_config(path, lora=LoraConfig(rank=rank, targets=ALL_TARGETS), **kw)


@functools.cache
def load(name: str, cfg) -> hf.Loaded:
  """load_params, once per fixture and config for the whole module."""
  return hf.load_params(fixture(name), cfg)


def build(loaded, cfg):
  """A model over copies of the loaded Variables (merge shares them; tests mutate models)."""
  copy = lambda s: jax.tree.map(lambda x: x, s)
  return train_state.merge_model(
    train_state.graphdef_of(cfg), copy(loaded.params), copy(loaded.moe_bias), copy(loaded.frozen)
  )


@pytest.mark.parametrize('name', FLOAT)
def test_float32_logits_loss_routing_grads(name, with_topk):
  path, ref = fixture(name), reference(name)
  cfg = f32_config(path)
  loaded = load(name, cfg)
  assert loaded.skipped == []
  assert_matches_hf(build(loaded, cfg), cfg, ref, name)


# wide_v adds nothing the other two do not cover on the mesh (and each case costs a compile).
@pytest.mark.parametrize('name', ['two_layer', 'four_head'])
def test_sharded_mesh_logits(name):
  path, ref = fixture(name), reference(name)
  logits = sharded_forward(path, lambda **kw: f32_config(path, **kw), ref['input_ids'])
  err = max_err(logits, np.concatenate([ref['logits']] * 2))
  print(f'{name} sharded (1,2,2,2): logits {err:.2e}')
  assert err < 1e-5


def test_sharded_bf16_checkpoint(with_topk):
  path, ref = fixture(BF16), reference(BF16)
  assert os.path.exists(os.path.join(path, 'model.safetensors.index.json'))
  model = hf.load_model(path, jnp.float32, remat='none')
  assert model.layers.attn_0.q_a.kernel.get_value().dtype == jnp.float32
  logits, aux = jax.jit(lambda m, x: m(x))(model, jnp.asarray(ref['input_ids']))
  err = max_err(logits, ref['logits'])
  print(f'{BF16}: logits {err:.2e}')
  assert err < 1e-5
  assert_same_topk(aux['moe']['topk_idx'], ref['router/topk_idx'])
  # Kept in bf16, the loaded weights are the file's bits.
  bf16 = hf.load_params(path, f32_config(path), dtype=jnp.bfloat16)
  q_b = bf16.params['layers']['attn_1']['q_b']['kernel'].get_value()
  assert q_b.dtype == jnp.bfloat16
  with safe_open(os.path.join(path, 'model-00003-of-00003.safetensors'), 'numpy') as f:
    want = f.get_tensor('model.layers.1.self_attn.1.q_b_proj.weight').T.reshape(q_b.shape[1:])
  np.testing.assert_array_equal(np.asarray(q_b[1]), want)


NORM = 'model.norm.weight'


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
  mtp = _rewrite(tmp_path / 'c', lambda t: t.update({'model.mtp.norm.weight': t[NORM]}))
  assert hf.load_params(mtp, cfg).skipped == ['model.mtp.norm.weight']
  key = 'model.layers.0.mlp.experts.4.up_proj.weight'  # the config has 4 experts
  more = _rewrite(tmp_path / 'd', lambda t: t.update({key: t[key.replace('.4.', '.3.')]}))
  with pytest.raises(ValueError, match=rf'{key}: in .* but beyond the config'):
    hf.load_params(more, cfg)


def test_broken_checkpoint_files_are_named(tmp_path):
  """A truncated shard, an index without its weight map, a shard the index lists but lacks."""
  src = fixture('two_layer_sharded_bf16')
  shutil.copytree(src, tmp_path / 'a')
  shard = tmp_path / 'a' / 'model-00002-of-00003.safetensors'
  shard.write_bytes(shard.read_bytes()[:1000])
  with pytest.raises(ValueError, match='model-00002-of-00003.safetensors is not a readable'):
    stio.Reader(str(tmp_path / 'a'))
  shard.unlink()
  with pytest.raises(FileNotFoundError, match='model-00002-of-00003.safetensors does not exist'):
    stio.Reader(str(tmp_path / 'a'))
  (tmp_path / 'a' / 'model.safetensors.index.json').write_text('{"metadata": {}}')
  with pytest.raises(ValueError, match=r'index\.json: not a safetensors index'):
    stio.Reader(str(tmp_path / 'a'))
  # An index that lists a tensor under a shard that does not hold it.
  shutil.copytree(src, tmp_path / 'b')
  index = tmp_path / 'b' / 'model.safetensors.index.json'
  weights = json.loads(index.read_text())
  name, shard = next(iter(weights['weight_map'].items()))
  other = next(f for f in weights['weight_map'].values() if f != shard)
  weights['weight_map'][name] = other
  index.write_text(json.dumps(weights))
  with pytest.raises(
    ValueError, match=rf'{re.escape(name)}: listed in .*index\.json under {other}'
  ):
    stio.Reader(str(tmp_path / 'b')).shape(name)


@pytest.mark.parametrize(
  'key,value,match',
  [
    ('rope_scaling', {'type': 'yarn', 'factor': 4.0}, 'rope_scaling'),
    ('tie_word_embeddings', True, 'tie_word_embeddings'),
    ('head_dim', 64, 'head_dim=64 must equal qk_rope_head_dim=8'),
    ('q_lora_rank', None, 'q_lora_rank'),
    ('num_layers', '2', r"config\.json: \{'num_layers': '2'\} should be integers"),
  ],
)
def test_config_rejects_unsupported(key, value, match):
  config = {**hf.read_config(fixture('two_layer')), key: value}
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf(config)


# The release's configuration_longcat_flash.py (auto_map, trust_remote_code=True) derives the depth
# from num_layers with a read-only property: a config.json that sets num_hidden_layers fails there.
REMOTE_CONFIG = """
from transformers import PretrainedConfig


class LongcatFlashConfig(PretrainedConfig):
  model_type = 'longcat_flash'

  def __init__(self, num_layers=28, **kwargs):
    self.num_layers = num_layers
    super().__init__(**kwargs)

  @property
  def num_hidden_layers(self):
    return self.num_layers
"""


def released_style_config(name: str) -> dict:
  """A fixture's config.json as the Hub release writes it: remote code, no num_hidden_layers."""
  config = {k: v for k, v in hf.read_config(fixture(name)).items() if k != 'num_hidden_layers'}
  auto = 'configuration_longcat_flash.LongcatFlashConfig'
  return {**config, 'auto_map': {'AutoConfig': auto}, 'torch_dtype': 'bfloat16'}


def test_export_config_keeps_the_release_layer_keys():
  base = released_style_config('two_layer')
  out = hf.config_to_hf(hf.config_from_hf(base), 'bfloat16', base)
  assert 'num_hidden_layers' not in out and out['num_layers'] == 2
  assert out['auto_map'] == base['auto_map']
  # The weights' dtype under both names: the base's torch_dtype would contradict a float32 export.
  out = hf.config_to_hf(hf.config_from_hf(base), 'float32', base)
  assert out['dtype'] == out['torch_dtype'] == 'float32'


def test_remote_code_loads_the_export_config(tmp_path):
  transformers = pytest.importorskip('transformers')
  base = released_style_config('two_layer')
  (tmp_path / 'configuration_longcat_flash.py').write_text(REMOTE_CONFIG)
  with open(tmp_path / 'config.json', 'w') as f:
    json.dump(hf.config_to_hf(hf.config_from_hf(base), 'bfloat16', base), f)
  c = transformers.AutoConfig.from_pretrained(str(tmp_path), trust_remote_code=True)
  assert type(c).__module__.endswith('configuration_longcat_flash')
  assert c.num_hidden_layers == 2


def test_save_hf_round_trip_is_exact(tmp_path):
  src = fixture('two_layer')
  cfg = f32_config(src)
  model = build(load('two_layer', cfg), cfg)
  hf.save_hf(model, cfg, str(tmp_path), dtype=jnp.float32, max_shard_size=100_000)
  assert os.path.exists(tmp_path / 'model.safetensors.index.json')
  assert (
    hf.config_from_hf(
      hf.read_config(str(tmp_path)), dtype='float32', param_dtype='float32', remat='none'
    )
    == cfg
  )
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


def test_bf16_export_keeps_the_router_float32(tmp_path):
  cfg = f32_config(fixture('two_layer'))
  model = build(load('two_layer', cfg), cfg)
  perturb_router(model, seed=1)
  hf.save_hf(model, cfg, str(tmp_path), dtype=jnp.bfloat16)
  bias = np.asarray(model.layers.moe.router_bias.get_value())
  with safe_open(str(tmp_path / 'model.safetensors'), 'flax') as f:
    dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
    got = f.get_tensor('model.layers.1.mlp.router.e_score_correction_bias')
  router = {k for k in dtypes if '.mlp.router.' in k}
  assert len(router) == 2 * cfg.num_layers
  assert all(dtypes[k] == jnp.float32 for k in router)
  assert all(dtypes[k] == jnp.bfloat16 for k in set(dtypes) - router)
  np.testing.assert_array_equal(np.asarray(got), bias[1])  # not rounded to bfloat16


def test_export_copies_the_base_mtp_head(tmp_path):
  mtp = {'model.mtp.norm.weight': None, 'model.mtp.layers.0.eh_proj.weight': None}

  def add(t):
    mtp['model.mtp.norm.weight'] = t[NORM].astype(ml_dtypes.bfloat16)
    mtp['model.mtp.layers.0.eh_proj.weight'] = np.arange(12, dtype=np.float32).reshape(3, 4)
    t.update(mtp)

  base = _rewrite(tmp_path, add)
  cfg = f32_config(base)
  model = build(load('two_layer', cfg), cfg)
  out = tmp_path / 'out'
  hf.save_hf(model, cfg, str(out), dtype=jnp.float32, max_shard_size=100_000, base_dir=base)
  with open(out / 'model.safetensors.index.json') as f:
    weight_map = json.load(f)['weight_map']
  for k, want in mtp.items():  # copied as they are, dtype included
    with safe_open(str(out / weight_map[k]), 'numpy') as f:
      got = f.get_tensor(k)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
  # The export loads as a checkpoint again (the head is skipped, as in the release).
  assert sorted(hf.load_params(str(out), cfg).skipped) == sorted(mtp)


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
  t = quant.quantize(w, 8 if mode == 'int8' else 4, 1, 1, cfg.engine.quant_group_size)
  k = loaded.frozen['layers']['moe']['experts']['down']
  np.testing.assert_array_equal(k['q'].get_value()[0], t.q)
  np.testing.assert_array_equal(k['scale'].get_value()[0], t.scale)


def test_quantised_load_on_mesh_matches_single_device():
  path = fixture('four_head')
  cfg = lora_config(
    path, quant='int4', quant_group_size=16, rules=sharding.Rules.preset('fsdp_ep_tp')
  )
  mesh = sharding.make_mesh((1, 2, 2, 2))
  here = load('four_head', lora_config(path, quant='int4', quant_group_size=16))
  there = hf.load_params(path, cfg, mesh=mesh)
  abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
  want = dict(nnx.to_flat_state(train_state.state_shardings(abstract, mesh, cfg.engine.rules)))
  got = {}
  for part in there[:3]:
    got.update(nnx.to_flat_state(part))
  ref = {}
  for part in here[:3]:
    ref.update(nnx.to_flat_state(part))
  assert set(got) == set(want) == set(ref)
  for p, v in got.items():
    x = v.get_value()
    assert x.sharding.is_equivalent_to(want[p].get_value(), x.ndim), p
    np.testing.assert_array_equal(x, ref[p].get_value(), err_msg=str(p))
  assert got[('layers', 'moe', 'experts', 'up', 'q')].get_value().sharding.spec[1] == 'expert'


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
  print(f'int4 + LoRA model vs its merged float export: logits {max_err(got, want):.2e}')
  assert max_err(got, want) < 1e-5


def test_peft_adapter_round_trip(tmp_path):
  path = fixture('two_layer')
  model, cfg = lora_model('two_layer')
  perturb_router(model, 5)
  peft_adapter.save(model, cfg, str(tmp_path))
  with open(tmp_path / 'adapter_config.json') as f:
    config = json.load(f)
  assert (config['r'], config['lora_alpha'], config['use_rslora']) == (4, 16.0, False)
  assert config['modules_to_save'] == ['router']
  with safe_open(str(tmp_path / 'adapter_model.safetensors'), 'numpy') as f:
    shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
  pre = 'base_model.model.model.layers.1.'
  assert shapes[pre + 'self_attn.0.o_proj.lora_A.weight'] == (4, 2 * 16)  # [R, N*V]
  assert shapes[pre + 'self_attn.0.q_b_proj.lora_B.weight'] == (2 * 24, 4)  # [N*(P+R), R]
  assert shapes[pre + 'mlp.experts.3.down_proj.lora_B.weight'] == (64, 4)
  assert shapes['base_model.model.lm_head.lora_A.weight'] == (4, 64)
  assert shapes[pre + 'mlp.router.e_score_correction_bias'] == (6,)  # 4 routed + 2 zero experts
  assert shapes[pre + 'mlp.router.classifier.weight'] == (6, 64)
  # Adapters and routers (the base's before the load) come back exactly.
  fresh, _ = lora_model('two_layer', seed=9)
  peft_adapter.load(fresh, cfg, str(tmp_path))
  for x, y in zip(jax.tree.leaves(nnx.state(fresh)), jax.tree.leaves(nnx.state(model))):
    np.testing.assert_array_equal(x, y)
  key = 'base_model.model.model.layers.0.mlp.experts.1.up_proj.lora_B.weight'
  with safe_open(str(tmp_path / 'adapter_model.safetensors'), 'numpy') as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  save_file({**tensors, key: tensors[key][:-1]}, str(tmp_path / 'adapter_model.safetensors'))
  with pytest.raises(ValueError, match=rf'{key}: shape \(15, 4\).*expected \(16, 4\)'):
    peft_adapter.load(fresh, cfg, str(tmp_path))
  other = lora_config(path, rank=2)
  abstract = nnx.eval_shape(lambda: Transformer(other, nnx.Rngs(0)))
  with pytest.raises(ValueError, match='r=4 but the model has lora.rank=2'):
    peft_adapter.load(abstract, other, str(tmp_path))
  # Per-module scales would load with the wrong one: refused.
  (tmp_path / 'adapter_config.json').write_text(json.dumps({**config, 'alpha_pattern': {'o': 8}}))
  with pytest.raises(ValueError, match=r"adapter_config\.json: alpha_pattern=\{'o': 8\} is not"):
    peft_adapter.load(fresh, cfg, str(tmp_path))
  (tmp_path / 'adapter_config.json').write_text(json.dumps({**config, 'layers_to_transform': 0}))
  with pytest.raises(ValueError, match='layers_to_transform=0 is not supported'):
    peft_adapter.load(fresh, cfg, str(tmp_path))


def test_transformers_loads_lora_merged_export(tmp_path):
  """Needs torch + transformers 4.57 (and peft) next to jax; skipped in the project venv. Run with
  the reference venv, the project's packages appended after its own:
    /work/hfvenv/bin/python -c "import sys; sys.path += ['.venv/lib/python3.11/site-packages'];
      sys.path.insert(0, '.'); import pytest; pytest.main(['tests/test_hf_parity.py', '-k',
      'transformers'])"
  """
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  path, ids = fixture('two_layer'), reference('two_layer')['input_ids']
  model, cfg = lora_model('two_layer')
  perturb_router(model, 5)  # the adapter carries the routers (PEFT modules_to_save)
  want = np.asarray(jax.jit(lambda m, x: m(x)[0])(model, jnp.asarray(ids)))

  def hf_logits(directory):
    m = transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=torch.float32, attn_implementation='eager'
    ).eval()
    with torch.no_grad():
      return m(input_ids=torch.from_numpy(ids).long()).logits.numpy()

  merged = str(tmp_path / 'merged')
  hf.save_hf(model, cfg, merged, dtype=jnp.float32, max_shard_size=100_000)  # 3 shards + index
  got = hf_logits(merged)
  assert max_err(want, reference('two_layer')['logits']) > 0.1
  print(f'transformers on the merged export: logits {max_err(got, want):.2e}')
  assert max_err(got, want) < 1e-5
  # bf16 export: transformers and moetrain read the same rounded weights.
  hf.save_hf(model, cfg, str(tmp_path / 'bf16'), dtype=jnp.bfloat16)
  ours = hf.load_model(str(tmp_path / 'bf16'), jnp.float32, remat='none')
  ours = np.asarray(jax.jit(lambda m, x: m(x)[0])(ours, jnp.asarray(ids)))
  err = max_err(hf_logits(str(tmp_path / 'bf16')), ours)
  print(f'transformers on the bf16 export: logits {err:.2e}')
  assert err < 1e-5
  peft = pytest.importorskip('peft')
  peft_adapter.save(model, cfg, str(tmp_path / 'adapter'))
  base = transformers.AutoModelForCausalLM.from_pretrained(
    path, dtype=torch.float32, attn_implementation='eager'
  )
  adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / 'adapter')).eval()
  with torch.no_grad():
    got = adapted(input_ids=torch.from_numpy(ids).long()).logits.numpy()
  print(f'peft on the base + adapter: logits {max_err(got, want):.2e}')
  assert max_err(got, want) < 1e-5

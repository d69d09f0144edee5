"""Kimi-K2's int4 checkpoints (compressed-tensors pack-quantized experts) against a NumPy
reference written from the format: pack_to_int32 stores each signed code c as the nibble c + 8,
eight to an int32 word, the first input in the lowest bits; the weight is c times its group's
scale."""

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moetrain.convert import compressed_int4, hf
from moetrain.convert import safetensors_io as stio
from moetrain.convert import stacked_io as sio
from moetrain.core.engine import LoraConfig
from moetrain.kernels import quant
from moetrain.tools import export
from tests.helpers import ALL_TARGETS, rewrite, write_checkpoint

GROUP = 32
LORA = LoraConfig(rank=2, targets=ALL_TARGETS)  # a quantised base is QLoRA's
FIXTURE = os.path.join(os.path.dirname(__file__), 'fixtures', 'deepseek_v3_three_layer')


def pack_reference(codes: np.ndarray) -> np.ndarray:
  """int32 words [out, ceil(in / 8)] of signed codes [out, in], one word at a time."""
  out, n = codes.shape
  words = np.zeros((out, -(-n // 8)), np.uint32)
  for i in range(n):
    words[:, i // 8] |= (codes[:, i].astype(np.int64) + 8).astype(np.uint32) << (4 * (i % 8))
  return words.view(np.int32)


def dequant_reference(words: np.ndarray, scale: np.ndarray, shape) -> np.ndarray:
  out, n = shape
  w = np.zeros((out, n), np.float32)
  u = words.view(np.uint32)
  for i in range(n):
    code = ((u[:, i // 8] >> (4 * (i % 8))) & 0xF).astype(np.float32) - 8
    w[:, i] = code * scale[:, i // GROUP].astype(np.float32)
  return w


def kimi_config() -> dict:
  c = json.load(open(os.path.join(FIXTURE, 'config.json')))
  return {
    **c,
    'model_type': 'kimi_k2',
    'moe_intermediate_size': 32,
    'quantization_config': compressed_int4.quantization_config(GROUP),
  }


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
  """(packed dir, reference dir holding the dequantised float32 experts, {expert: codes, scale})."""
  rng = np.random.default_rng(0)
  config = kimi_config()
  cfg = hf.config_from_hf(config)
  shapes = hf._float_shapes(cfg)
  plain, packed, experts = {}, {}, {}
  for row in hf.table(cfg):
    shape = sio.flat_shape(shapes[row.key][row.lead :], row.n_in)
    for ix in row.indices(cfg.n_routed_experts):
      name = row.name(ix)
      if not row.experts:
        plain[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        if name.endswith('norm.weight'):
          plain[name] += 1
        continue
      codes = rng.integers(-8, 8, shape)
      scale = rng.uniform(0.01, 0.05, (shape[0], shape[1] // GROUP)).astype(ml_dtypes.bfloat16)
      words = pack_reference(codes)
      experts[name] = (codes, scale, words)
      plain[name] = dequant_reference(words, scale, shape)
      packed[name + '_packed'], packed[name + '_scale'] = words, scale
      packed[name + '_shape'] = np.asarray(shape, np.int64)
  base = tmp_path_factory.mktemp('kimi')
  ref_config = {k: v for k, v in config.items() if k != 'quantization_config'}
  ref = write_checkpoint(base / 'ref', {**ref_config, 'model_type': 'deepseek_v3'}, plain)
  quantized = {k: v for k, v in plain.items() if k not in experts} | packed
  return write_checkpoint(base / 'packed', config, quantized), ref, experts


def _float_reads(monkeypatch) -> list:
  """The names the checkpoint reader reads as floats from here on (PackedReader.read's)."""
  names = []
  real = compressed_int4.PackedReader.read
  monkeypatch.setattr(
    compressed_int4.PackedReader,
    'read',
    lambda self, n, index=None: names.append(n) or real(self, n, index),
  )
  return names


@pytest.mark.parametrize('group', [32, 16])
def test_int4_base_is_the_releases_codes_and_scales(checkpoints, group, monkeypatch):
  """quant_group_size dividing the checkpoint's group: the QuantKernel's codes are the packed
  nibbles re-laid and its scales the release's (repeated per sub-group), read without a float
  copy of any expert; dequantised, the experts equal the reference exactly."""
  path, _, experts = checkpoints
  float_reads = _float_reads(monkeypatch)
  cfg = hf.config_from_hf(hf.read_config(path), quant='int4', quant_group_size=group, lora=LORA)
  flat = hf.flat_values(hf.load_params(path, cfg).frozen)
  assert not [n for n in float_reads if n in experts]
  rows = [t for t in hf.table(cfg) if t.experts]
  assert rows
  for t in rows:
    q, scale = np.asarray(flat[t.key + ('q',)]), np.asarray(flat[t.key + ('scale',)])
    for ix in t.indices(cfg.n_routed_experts):
      codes, s, words = experts[t.name(ix)]
      n_out, n_in = codes.shape
      nib = (codes + 8).astype(np.uint8).T.reshape(n_in // group, group // 2, 2, n_out)
      np.testing.assert_array_equal(q[ix], nib[:, :, 0] | (nib[:, :, 1] << 4))
      want = np.repeat(s.astype(np.float32).T, GROUP // group, axis=0)[:, None]
      np.testing.assert_array_equal(scale[ix], want)
      t4 = quant.QTensor(jnp.asarray(q[ix]), jnp.asarray(scale[ix]), 4, -3)
      got = np.asarray(quant.dequant(t4, jnp.float32))
      np.testing.assert_array_equal(got.T, dequant_reference(words, s, codes.shape))


def test_unquantised_import_has_the_dequantised_checkpoints_logits(checkpoints):
  """engine.quant off: experts dequantised one at a time; the logits equal those of the same
  model read from a float32 checkpoint of the reference dequantisation (and kimi_k2 reads as
  deepseek_v3)."""
  path, ref, _ = checkpoints
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 8)), jnp.int32)
  a, b = hf.load_model(path, jnp.float32), hf.load_model(ref, jnp.float32)
  np.testing.assert_array_equal(np.asarray(a(ids)[0]), np.asarray(b(ids)[0]))


def test_int4_of_another_group_size_quantises_again(checkpoints):
  """quant_group_size 64 (the default) over groups of 32: the experts are quantised again,
  within half a step of the release's weights."""
  path, _, experts = checkpoints
  kw = dict(quant='int4', quant_group_size=64, lora=LORA)
  cfg = hf.config_from_hf(hf.read_config(path), **kw)
  model = hf.load_model(path, jnp.float32, **kw)
  t = next(t for t in hf.table(cfg) if t.experts and t.path.endswith('gate'))
  kernel = model
  for part in t.key:
    kernel = getattr(kernel, part)
  w = np.asarray(quant.value(kernel, jnp.float32))
  for ix in t.indices(cfg.n_routed_experts):
    codes, s, words = experts[t.name(ix)]
    want = dequant_reference(words, s, codes.shape).T
    step = np.abs(want).reshape(-1, 64, want.shape[-1]).max(1, keepdims=True) / 7
    assert (np.abs(w[ix] - want).reshape(step.shape[0], 64, -1) <= 0.5 * step * 1.001).all()


def test_bad_packed_tensors_are_refused_naming_tensor_and_file(checkpoints, tmp_path):
  path, _, experts = checkpoints
  name = sorted(experts)[0]
  lone = rewrite(path, tmp_path / 'lone', drop=[name + '_scale'])
  with pytest.raises(ValueError) as e:
    hf.load_model(lone, jnp.float32)
  assert name + '_packed' in str(e.value) and name + '_scale' in str(e.value)
  assert os.path.join(lone, stio.SINGLE) in str(e.value) and '\n' not in str(e.value)
  config = kimi_config()
  config['quantization_config']['config_groups']['group_0']['weights']['group_size'] = 48
  odd = rewrite(path, tmp_path / 'odd', config=config)
  with pytest.raises(ValueError) as e:
    hf.load_model(odd, jnp.float32)
  assert 'group_size 48 does not divide' in str(e.value) and os.path.join(odd, stio.SINGLE) in str(
    e.value
  )
  assert '_scale' in str(e.value) and '\n' not in str(e.value)


def test_compressed_int4_export_round_trip(checkpoints, tmp_path):
  """--quantize=compressed-int4: the routed experts written back pack-quantized are the
  release's words and scales exactly (weights on the int4 grid), with a quantization_config
  the import reads; the others as before."""
  path, _, experts = checkpoints
  cfg = hf.config_from_hf(hf.read_config(path), dtype='float32', param_dtype='float32')
  model = hf.load_model(path, jnp.float32)
  out = str(tmp_path / 'export')
  hf.save_hf(model, cfg, out, dtype=jnp.float32, quantize=compressed_int4.EXPORT)
  config = hf.read_config(out)
  assert compressed_int4.group_size(config) == GROUP
  reader = stio.Reader(out)
  for name, (codes, scale, words) in experts.items():
    np.testing.assert_array_equal(reader.read_int(name + '_packed'), words)
    np.testing.assert_array_equal(reader.read(name + '_scale'), scale)
    assert tuple(reader.read_int(name + '_shape')) == codes.shape
    assert name not in reader
  assert not any(k.endswith('_packed') and 'experts' not in k for k in reader.keys())
  ids = jnp.asarray(np.arange(16).reshape(2, 8), jnp.int32)
  again = hf.load_model(out, jnp.float32)
  np.testing.assert_array_equal(np.asarray(again(ids)[0]), np.asarray(model(ids)[0]))


def test_packing_matches_the_reference_with_padding():
  codes = np.random.default_rng(2).integers(-8, 8, (3, 37))
  words = compressed_int4.pack((codes + 8).astype(np.uint8))
  np.testing.assert_array_equal(words, pack_reference(codes))
  np.testing.assert_array_equal(compressed_int4.unpack(words, 37), codes + 8)


def kimi_k25(packed: str, directory) -> str:
  """Kimi-K2.5's multimodal layout of checkpoint `packed`: config.json's text_config (model_type
  kimi_k2) beside a vision_config, the quantization_config at the top; the language model's
  tensors under language_model. (KimiK25ForConditionalGeneration's module), beside a vision
  tower and projector."""
  reader = stio.Reader(packed)
  tensors = {'language_model.' + k: reader.read_stored(k) for k in reader.keys()}
  tensors['vision_tower.patch_embed.proj.weight'] = np.zeros((8, 3, 2, 2), np.float32)
  tensors['mm_projector.proj.0.weight'] = np.zeros((8, 8), np.float32)
  text = {k: v for k, v in kimi_config().items() if k != 'quantization_config'}
  config = {
    'model_type': 'kimi_k25',
    'architectures': ['KimiK25ForConditionalGeneration'],
    'text_config': text,
    'vision_config': {'model_type': '', 'patch_size': 2},
    'media_placeholder_token_id': 120,
    'quantization_config': compressed_int4.quantization_config(GROUP),
  }
  return write_checkpoint(directory, config, tensors)


def test_kimi_k25_multimodal_release_loads_its_language_model(checkpoints, tmp_path, monkeypatch):
  """kimi_k25: the text_config reads as deepseek_v3 and language_model.* as the text model's
  tensors, the vision tower and projector skipped and named. The int4 experts carry into the
  int4 base unchanged (no float read of an expert), and the unquantised logits are the flat
  checkpoint's."""
  path, _, experts = checkpoints
  mm = kimi_k25(path, tmp_path / 'kimi_k25')
  kw = dict(quant='int4', quant_group_size=GROUP, lora=LORA)
  cfg = hf.config_from_hf(hf.read_config(mm), **kw)
  assert cfg == hf.config_from_hf(hf.read_config(path), **kw) and cfg.model_type == 'deepseek_v3'
  float_reads = _float_reads(monkeypatch)
  loaded = hf.load_params(mm, cfg)
  assert not [n for n in float_reads if n in experts]
  assert loaded.skipped == ['mm_projector.proj.0.weight', 'vision_tower.patch_embed.proj.weight']
  got, want = hf.flat_values(loaded.frozen), hf.flat_values(hf.load_params(path, cfg).frozen)
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=str(k))
  ids = jnp.asarray(np.random.default_rng(3).integers(0, 128, (2, 8)), jnp.int32)
  a, b = hf.load_model(mm, jnp.float32), hf.load_model(path, jnp.float32)
  np.testing.assert_array_equal(np.asarray(a(ids)[0]), np.asarray(b(ids)[0]))
  # The merged export is the language model alone, a deepseek_v3 checkpoint.
  out = str(tmp_path / 'export')
  f32 = hf.config_from_hf(hf.read_config(mm), dtype='float32', param_dtype='float32')
  hf.save_hf(a, f32, out, dtype=jnp.float32, base_config=export.base_config(mm), base_dir=mm)
  written = hf.read_config(out)
  assert written['model_type'] == 'deepseek_v3' and 'vision_config' not in written
  assert not [k for k in stio.Reader(out).keys() if not k.startswith(('model.', 'lm_head.'))]
  again = hf.load_model(out, jnp.float32)
  np.testing.assert_array_equal(np.asarray(again(ids)[0]), np.asarray(a(ids)[0]))


def test_kimi_k25_needs_a_deepseek_v3_text_config():
  config = {'model_type': 'kimi_k25', 'text_config': {**kimi_config(), 'model_type': 'qwen3_moe'}}
  with pytest.raises(ValueError, match='needs a text_config of model_type kimi_k2 or deepseek_v3'):
    hf.config_from_hf(config)

"""Block-scaled FP8 releases against a NumPy reference written from the format (DeepSeek-V3's
weight_dequant, transformers' FP8Linear): a float8_e4m3fn weight [out, in] is each value times
the float32 scale of its bo x bi block, X.weight_scale_inv [ceil(out / bo), ceil(in / bi)], the
partial blocks at the edges scaled as whole ones."""

import json
import os
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moetrain.convert import block_fp8, hf
from moetrain.convert import safetensors_io as stio
from moetrain.core.engine import LoraConfig
from tests.helpers import ALL_TARGETS, rewrite, write_checkpoint

# (rows, cols): unequal sides that divide neither kv_a_proj_with_mqa's 40 rows nor the 64
# inputs, so that partial blocks appear at both edges and a transposed grid would show.
BLOCK = (16, 24)
FIXTURE = os.path.join(os.path.dirname(__file__), 'fixtures', 'deepseek_v3_three_layer')
# The Linear weights the releases store in FP8: attention and MLP projections, routed and
# shared experts (MiniMax-M2's w1, w2, w3); the embedding, the head, the routers and the norms
# stay unquantised.
QUANTIZED = re.compile(r'.*(_proj|_proj_with_mqa|\.w[123])\.weight')
LORA = LoraConfig(rank=2, targets=ALL_TARGETS)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def dequant_reference(values: np.ndarray, scale: np.ndarray, block=BLOCK) -> np.ndarray:
  """w[i, j] = float(values[i, j]) * scale[i // bo, j // bi], the scale gathered per element."""
  rows, cols = np.indices(values.shape)
  return values.astype(np.float32) * scale[rows // block[0], cols // block[1]]


def quantize_reference(w: np.ndarray, block=BLOCK) -> tuple[np.ndarray, np.ndarray]:
  """(float8 values, float32 scales) of float weights: each block's scale its max |w| / 448."""
  grid = [-(-n // b) for n, b in zip(w.shape, block)]
  amax = np.zeros(grid, np.float32)
  for i, j in np.ndindex(*grid):
    part = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
    amax[i, j] = np.abs(part).max()
  scale = np.where(amax > 0, amax / FP8_MAX, 1).astype(np.float32)
  rows, cols = np.indices(w.shape)
  full = scale[rows // block[0], cols // block[1]]
  values = np.clip(w / full, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
  return values, scale


def fp8_config(fixture=FIXTURE, block=BLOCK, **quant) -> dict:
  config = json.load(open(os.path.join(fixture, 'config.json')))
  qc = {
    'quant_method': 'fp8',
    'fmt': 'e4m3',
    'weight_block_size': list(block),
    'activation_scheme': 'dynamic',
    **quant,
  }
  return {**config, 'quantization_config': qc}


def fp8_copies(fixture: str, directory, config: dict, block=BLOCK):
  """(FP8 dir, reference dir of the dequantised weights in float32, {name: (values, scale)}) of
  a fixture's checkpoint, its QUANTIZED weights block-quantised as a release stores them."""
  reader = stio.Reader(fixture)
  plain, stored, pairs = {}, {}, {}
  for name in reader.keys():
    w = reader.read(name)
    if not QUANTIZED.fullmatch(name):
      plain[name] = stored[name] = w
      continue
    values, scale = quantize_reference(w, block)
    pairs[name] = (values, scale)
    stored[name], stored[name + '_scale_inv'] = values, scale
    plain[name] = dequant_reference(values, scale, block)
  ref_config = json.load(open(os.path.join(fixture, 'config.json')))
  ref = write_checkpoint(directory / 'ref', ref_config, plain)
  return write_checkpoint(directory / 'fp8', config, stored), ref, pairs


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
  out = fp8_copies(FIXTURE, tmp_path_factory.mktemp('fp8'), fp8_config())
  assert any(v.shape[0] % BLOCK[0] for v, _ in out[2].values())
  return out


def test_safetensors_stores_float8_e4m3fn(checkpoints):
  """The fixture is what a release holds: F8_E4M3 weights beside float32 F32 scales."""
  path, _, pairs = checkpoints
  reader = stio.Reader(path)
  name = sorted(pairs)[0]
  assert reader.dtype(name) == 'F8_E4M3' and reader.dtype(name + '_scale_inv') == 'F32'
  np.testing.assert_array_equal(
    reader.read_stored(name).view(np.uint8), pairs[name][0].view(np.uint8)
  )


def test_imported_weights_are_the_reference_dequantisation(checkpoints):
  """engine.quant off, float32: every FP8 weight of the model is the reference's, exactly, and
  the scales are nowhere among the checkpoint's keys."""
  path, _, pairs = checkpoints
  model = hf.load_model(path, jnp.float32)
  got = dict(hf.hf_tensors(model, model.cfg))
  for name, (values, scale) in pairs.items():
    np.testing.assert_array_equal(got[name], dequant_reference(values, scale), err_msg=name)
  loaded = hf.load_params(path, model.cfg)
  assert not [k for k in loaded.skipped if k.endswith('_scale_inv')]


def test_parts_read_only_their_blocks(checkpoints, monkeypatch):
  """A part at offsets inside blocks (a device's block of one expert) equals the reference's
  part, and reads only the scales of the blocks it touches."""
  path, _, pairs = checkpoints
  reader = block_fp8.wrap(stio.Reader(path), hf.read_config(path))
  scale_reads = []
  real = stio.Reader.read
  monkeypatch.setattr(
    stio.Reader, 'read', lambda self, n, ix=None: scale_reads.append(ix) or real(self, n, ix)
  )
  name = 'model.layers.0.self_attn.kv_a_proj_with_mqa.weight'  # [40, 64]
  values, scale = pairs[name]
  part = (slice(5, 37), slice(30, 64))
  np.testing.assert_array_equal(reader.read(name, part), dequant_reference(values, scale)[part])
  assert scale_reads == [(slice(0, 3), slice(1, 3))]
  every_other = (slice(None, None, 2), slice(3, 9))
  want = dequant_reference(values, scale)[every_other]
  np.testing.assert_array_equal(reader.read(name, every_other), want)


def test_logits_equal_the_dequantised_checkpoints(checkpoints):
  path, ref, _ = checkpoints
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 8)), jnp.int32)
  a, b = hf.load_model(path, jnp.float32), hf.load_model(ref, jnp.float32)
  np.testing.assert_array_equal(np.asarray(a(ids)[0]), np.asarray(b(ids)[0]))


@pytest.mark.parametrize('quant', ['int8', 'int4'])
def test_qlora_base_from_fp8_equals_the_one_from_float32(checkpoints, quant):
  """engine.quant int8/int4: the dequantised pieces are quantised again a layer at a time; the
  frozen base equals the one quantised from the float32 reference, code for code."""
  path, ref, _ = checkpoints
  cfg = hf.config_from_hf(hf.read_config(ref), quant=quant, quant_group_size=16, lora=LORA)
  a = hf.flat_values(hf.load_params(path, cfg).frozen)
  b = hf.flat_values(hf.load_params(ref, cfg).frozen)
  assert a.keys() == b.keys() and any(k[-1] == 'q' for k in a)
  for k in a:
    np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=str(k))


def _refused(path: str) -> str:
  with pytest.raises(ValueError) as e:
    hf.check_checkpoint(path, hf.config_from_hf(hf.read_config(path)))
  assert '\n' not in str(e.value)
  return str(e.value)


def test_bad_fp8_tensors_are_refused_naming_tensor_and_file(checkpoints, tmp_path):
  path, _, pairs = checkpoints
  name = sorted(pairs)[0]
  lone = rewrite(path, tmp_path / 'lone', drop=[name + '_scale_inv'])
  msg = _refused(lone)
  assert name in msg and name + '_scale_inv' in msg and os.path.join(lone, stio.SINGLE) in msg
  values, scale = pairs[name]
  wide = np.concatenate([scale, scale[:, :1]], axis=1)
  odd = rewrite(path, tmp_path / 'odd', change={name + '_scale_inv': wide})
  msg = _refused(odd)
  assert f'{name}_scale_inv in {os.path.join(odd, stio.SINGLE)}' in msg and str(wide.shape) in msg
  plain = rewrite(path, tmp_path / 'plain', change={name: dequant_reference(values, scale)})
  msg = _refused(plain)
  assert f'{name}_scale_inv in {os.path.join(plain, stio.SINGLE)}' in msg and 'F32' in msg


def test_other_fp8_configs_are_refused_naming_the_key(checkpoints, tmp_path):
  path, _, _ = checkpoints
  e5m2 = rewrite(path, tmp_path / 'e5m2', config=fp8_config(fmt='e5m2'))
  assert "quantization_config.fmt='e5m2' is unsupported" in _refused(e5m2)
  one_side = rewrite(path, tmp_path / 'one_side', config=fp8_config(weight_block_size=[16]))
  assert 'quantization_config.weight_block_size=[16] is unsupported' in _refused(one_side)
  # MiniMax-M2 names the format by its dtype, and a release's 128 x 128 blocks are read as such
  assert block_fp8.block_size(fp8_config(fmt='float8_e4m3fn', weight_block_size=[128, 128])) == (
    128,
    128,
  )


def test_export_writes_the_mtp_head_dequantised(checkpoints, tmp_path):
  """An export from an FP8 checkpoint copies its MTP head (model.mtp.*, skipped on load)
  dequantised in the export's dtype, without scales: the export has no quantization_config."""
  path, _, pairs = checkpoints
  values, scale = pairs['model.layers.0.self_attn.q_a_proj.weight']
  mtp = 'model.mtp.0.self_attn.q_a_proj.weight'
  change = {mtp: values, mtp + '_scale_inv': scale, 'model.mtp.0.enorm.weight': np.ones(64)}
  base = rewrite(path, tmp_path / 'mtp', change=change)
  model = hf.load_model(base, jnp.float32)
  hf.save_hf(model, model.cfg, str(tmp_path / 'out'), dtype=jnp.float32, base_dir=base)
  out = stio.Reader(str(tmp_path / 'out'))
  np.testing.assert_array_equal(out.read(mtp), dequant_reference(values, scale))
  assert out.dtype(mtp) == 'F32' and out.dtype('model.mtp.0.enorm.weight') == 'F64'
  assert not [k for k in out.keys() if k.endswith('_scale_inv')]
  assert 'quantization_config' not in hf.read_config(str(tmp_path / 'out'))


def test_minimax_m2_release_layout_loads(tmp_path):
  """MiniMax-M2's release: fmt float8_e4m3fn, 128 x 128 blocks (one partial block for each of
  the small fixture's weights), attention and w1/w2/w3 experts in FP8; the logits are those of
  its dequantised copy."""
  fixture = os.path.join(os.path.dirname(__file__), 'fixtures', 'minimax_m2_two_layer')
  config = fp8_config(fixture, (128, 128), fmt='float8_e4m3fn')
  path, ref, pairs = fp8_copies(fixture, tmp_path, config, (128, 128))
  assert any('.w1.' in k for k in pairs) and any('.q_proj.' in k for k in pairs)
  ids = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 8)), jnp.int32)
  a, b = hf.load_model(path, jnp.float32), hf.load_model(ref, jnp.float32)
  np.testing.assert_array_equal(np.asarray(a(ids)[0]), np.asarray(b(ids)[0]))

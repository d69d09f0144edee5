"""What an import from a Hugging Face checkpoint refuses, by name: tensors holding NaN or
infinity (found as they stream), model shapes set beside the checkpoint that decides them,
invalid engine settings (named as the model.<field> the user sets), and config.json shapes or
safetensors headers the weights contradict (from the headers, before anything is built); and a
train state or step larger than the devices' memory."""

import json
import os
import re
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from configs import longcat_lora
from moetrain.convert import hf
from moetrain.convert import safetensors_io as stio
from moetrain.data import demo_base
from moetrain.run import startup
from moetrain.training import aot
from tests.helpers import run_command

BASE = str(demo_base.DIR)


@pytest.mark.parametrize('dtype', [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize('bad', [np.nan, np.inf, -np.inf])
def test_a_non_finite_tensor_is_named_with_its_file(tmp_path, dtype, bad):
  x = np.arange(12, dtype=np.float32).reshape(3, 4)
  y = x.copy()
  y[2, 1] = bad
  save_file({'a.weight': x.astype(dtype), 'b.weight': y.astype(dtype)}, tmp_path / stio.SINGLE)
  reader = stio.Reader(str(tmp_path))
  np.testing.assert_array_equal(reader.read('a.weight'), x.astype(dtype))
  assert reader.read('b.weight', (slice(0, 2),)).shape == (2, 4)  # (the bad row is not read)
  with pytest.raises(ValueError) as e:
    reader.read('b.weight')
  path = tmp_path / stio.SINGLE
  assert str(e.value).startswith(f'b.weight in {path} holds non-finite values (NaN or infinity)')


def test_an_import_stops_at_the_first_non_finite_tensor(tmp_path):
  base = tmp_path / 'base'
  shutil.copytree(BASE, base)
  tensors = load_file(base / stio.SINGLE)
  name = 'model.layers.1.mlp.experts.5.up_proj.weight'
  tensors[name] = tensors[name].copy()
  tensors[name][0, 0] = np.nan
  save_file(tensors, base / stio.SINGLE)
  cfg = hf.config_from_hf(hf.read_config(str(base)), dtype='float32', remat='none')
  with pytest.raises(ValueError, match=rf'^{name} in {base}/model\.safetensors holds non-finite'):
    hf.load_params(str(base), cfg)


def test_shapes_that_the_checkpoint_decides_are_refused_naming_both_values():
  with pytest.raises(ValueError) as e:
    hf.check_overrides(BASE, {'model.moe_topk': 20, 'train.steps': 5})
  assert str(e.value).startswith(
    f'--config.model.moe_topk=20: init.hf_checkpoint={BASE} gives moe_topk=3 in its config.json'
  )
  with pytest.raises(ValueError, match=r'model\.n_routed_experts=4: .* gives n_routed_experts=8'):
    hf.check_overrides(BASE, {'model.n_routed_experts': 4})
  # The checkpoint's own values, and how the model computes, may be given.
  hf.check_overrides(BASE, {'model.moe_topk': 3, 'engine.remat': 'full', 'engine.dtype': 'float32'})


@pytest.mark.parametrize(
  'override, message',
  [
    ({'dtype': 'float8'}, r"^engine\.dtype='float8' is unknown"),
    ({'remat': 'fulll'}, r"^engine\.remat='fulll' is unknown"),
  ],
)
def test_engine_settings_are_named_as_engine_fields(override, message):
  with pytest.raises(ValueError, match=message):
    hf.config_from_hf(hf.read_config(BASE), **override)


def test_the_command_refuses_a_shape_beside_the_checkpoint_in_one_line(tmp_path):
  workdir = str(tmp_path / 'run')
  out = run_command(
    'moetrain.main',
    '--config=configs/longcat_lora.py',
    f'--workdir={workdir}',
    '--config.model.moe_topk=20',
  )
  assert out.returncode == 1, out.stderr[-2000:]
  errors = [line for line in out.stderr.splitlines() if line.startswith('Error:')]
  assert errors == [
    f'Error: --config.model.moe_topk=20: init.hf_checkpoint={BASE} gives moe_topk=3 in its '
    "config.json, which decides the model's shapes; leave it out (how the model computes is the "
    'engine section: engine.dtype, engine.remat, ...)'
  ]
  assert 'Traceback' not in out.stderr and not os.path.exists(workdir)


def _base_with(tmp_path, **config_json):
  base = tmp_path / 'base'
  shutil.copytree(BASE, base)
  path = base / 'config.json'
  path.write_text(json.dumps({**json.loads(path.read_text()), **config_json}))
  return base


def _demo_config(hf_checkpoint):
  config = longcat_lora.get_config()
  config.init.hf_checkpoint = str(hf_checkpoint)
  return config


@pytest.mark.parametrize('key, value', [('hidden_size', 10**9), ('expert_ffn_hidden_size', 96)])
def test_a_config_json_shape_the_weights_lack_is_refused_before_anything_is_built(
  tmp_path, key, value
):
  base = _base_with(tmp_path, **{key: value})
  with pytest.raises(ValueError) as e:
    startup.build(_demo_config(base))
  message = str(e.value)
  assert message.startswith(
    f"init.hf_checkpoint={base}: config.json's {key}={value} does not match the weights: "
  ), message
  assert 'in model.safetensors, the config implies' in message and '\n' not in message


def test_a_hostile_safetensors_header_is_refused_before_anything_is_built(tmp_path):
  base = _base_with(tmp_path)
  file = base / stio.SINGLE
  file.write_bytes(struct.pack('<Q', 2**62) + b'{}')
  with pytest.raises(ValueError, match=rf'^{file} is not a readable safetensors file: .*too large'):
    startup.build(_demo_config(base))
  head = json.dumps({'x': {'dtype': 'F32', 'shape': [1000], 'data_offsets': [0, 4000]}}).encode()
  file.write_bytes(struct.pack('<Q', len(head)) + head + bytes(16))
  with pytest.raises(ValueError, match=rf'^{file} is not a readable safetensors file: '):
    startup.build(_demo_config(base))


def test_a_remote_header_is_checked_as_a_local_one(tmp_path):
  file = tmp_path / stio.SINGLE
  file.write_bytes(struct.pack('<Q', 2**62) + b'{}')
  with pytest.raises(ValueError, match=r'header of \d+ bytes in a file of 10 bytes'):
    stio.RemoteFile(str(file))
  head = json.dumps({'x': {'dtype': 'F32', 'shape': [1000], 'data_offsets': [0, 4000]}}).encode()
  file.write_bytes(struct.pack('<Q', len(head)) + head + bytes(16))
  with pytest.raises(ValueError, match=r"^x: data offsets \[0, 4000\] past the end of the file's"):
    stio.RemoteFile(str(file))


def test_a_state_beyond_the_devices_memory_stops_before_the_compile(monkeypatch):
  setup = startup.build(longcat_lora.get_config())
  mesh = setup.make_mesh()
  state, _ = aot.abstract_state(setup, mesh)
  need = aot.state_bytes(state)
  assert 0 < need < 2**30
  monkeypatch.setattr(aot, 'host_memory', lambda: 8 * (need - 1))  # (8 devices share it)

  def compile_fn(*args, **kwargs):
    raise AssertionError('compiled')

  monkeypatch.setattr(aot, 'compile_fn', compile_fn)
  with pytest.raises(ValueError) as e:
    aot.precompile_train_step(setup, mesh, None, state, progress=lambda line: None)
  assert re.fullmatch(
    r"the train state needs [\d.]+ GiB per device, more than this host's [\d.]+ GiB of RAM "
    r'shared by its 8 devices: it cannot run; .* --search',
    str(e.value),
  ), e.value
  # A compiled step beyond it stops after the compile.
  monkeypatch.setattr(aot, 'host_memory', lambda: 8 * need)
  compiled = aot.Compiled('train step', {'total': 10**19}, 0.0, None, 0.0)
  monkeypatch.setattr(aot, 'compile_fn', lambda *args, **kwargs: compiled)
  monkeypatch.setattr(aot, 'state_formats', lambda executable: None)
  with pytest.raises(ValueError, match=r'^the compiled train step needs 9313225746\.15 GiB per'):
    aot.precompile_train_step(setup, mesh, None, state, progress=lambda line: None)

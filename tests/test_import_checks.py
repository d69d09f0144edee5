"""What an import from a Hugging Face checkpoint refuses, by name: tensors holding NaN or
infinity (found as they stream), model shapes set beside the checkpoint that decides them, and
invalid engine settings (named as the model.<field> the user sets)."""

import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from moetrain.convert import hf
from moetrain.convert import safetensors_io as stio
from moetrain.data import demo_base
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

"""init.base_cache: the converted (quantised) base of init.hf_checkpoint saved once as Orbax and
restored by later starts onto any mesh, without reading the safetensors."""

import json
import os

import jax
import numpy as np
import pytest

from moetrain.convert import hf
from moetrain.run import base_cache, startup
from moetrain.training import optim
from tests.test_configs import ROOT, load


def qlora_setup(cache: str, mesh_shape=(1, -1, 1, 1), quant='int4'):
  """The demo's LoRA config (the shipped HF base), quantised, with a base cache."""
  config = load(os.path.join(ROOT, 'configs', 'longcat_lora.py'), None)
  config.engine.quant = quant
  config.init.base_cache = cache
  config.mesh.shape = mesh_shape
  return startup.build(config, num_devices=jax.device_count())


def initial(setup):
  optimizer = optim.make_optimizer(setup.optim, setup.train.steps)
  mesh = setup.make_mesh()
  with jax.set_mesh(mesh):
    return startup.initial_state(setup, optimizer, mesh)


def leaves(tree) -> list[np.ndarray]:
  return [np.asarray(x.astype(np.float32)) for x in jax.tree.leaves(tree)]


@pytest.mark.slow  # ~14 s
def test_a_saved_base_restores_onto_another_mesh_without_the_safetensors(tmp_path, monkeypatch):
  cache = str(tmp_path / 'cache')
  first = initial(qlora_setup(cache))
  (entry,) = os.listdir(cache)
  with open(os.path.join(cache, entry, base_cache.KEY_FILE)) as f:
    assert json.load(f)['model']['quant'] == 'int4'
  frozen_dtypes = {x.dtype.name for x in jax.tree.leaves(first.frozen)}
  assert 'uint8' in frozen_dtypes  # the quantised base is what is cached (int4, two per byte)

  def no_import(*args, **kw):
    raise AssertionError('the safetensors were read again')

  monkeypatch.setattr(hf, 'load_params', no_import)
  again = initial(qlora_setup(cache, mesh_shape=(1, 1, 2, -1)))  # experts over 2 devices
  for name in ('params', 'moe_bias', 'frozen'):
    for a, b in zip(leaves(getattr(first, name)), leaves(getattr(again, name)), strict=True):
      np.testing.assert_array_equal(a, b)
  assert again.frozen is not None and {x.dtype.name for x in jax.tree.leaves(again.frozen)} == (
    frozen_dtypes
  )
  # Other settings of the stored base (int8): another entry, converted from the safetensors.
  with pytest.raises(AssertionError, match='read again'):
    initial(qlora_setup(cache, quant='int8'))
  # An entry a killed start left without its key file is never read (and is made again).
  os.remove(os.path.join(cache, entry, base_cache.KEY_FILE))
  with pytest.raises(AssertionError, match='read again'):
    initial(qlora_setup(cache))

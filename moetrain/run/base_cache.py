"""The frozen base of init.hf_checkpoint, converted (and for QLoRA quantised) once and saved as an
Orbax checkpoint under init.base_cache, so that later starts, resumes and tools restore it onto
any mesh instead of reading and converting the safetensors again (1.1 TB for LongCat-Flash).

A cache entry is <init.base_cache>/<key hash>/: the Orbax checkpoint of the weights load_params
gives (trainable params at their initial values, moe_bias, frozen), then KEY_FILE, written last,
saying what it was made from. An entry without KEY_FILE (a start killed while saving it) is never
read, and is made again. What makes the key: the checkpoint's path and its files' sizes, the
model settings that shape or store the weights (not those of the engine that computes with
them, nor the mesh or sharding rules: Orbax restores onto any), and the seed (the LoRA
adapters' initial values)."""

import dataclasses
import hashlib
import json

import jax
import orbax.checkpoint as ocp
from absl import logging

from moetrain.convert import safetensors_io as stio
from moetrain.core import storage
from moetrain.run import checkpoint
from moetrain.training import aot

KEY_FILE = 'moetrain_base.json'
VERSION = 1
# Engine fields that still change the stored weights; mesh-dependent fields that do not.
STORED = ('param_dtype', 'quant', 'quant_group_size', 'scan_layers')


def key(setup) -> dict:

  hf = setup.hf_checkpoint
  files = {
    n: storage.getsize(storage.join(hf, n))
    for n in storage.listdir(hf)
    if stio.is_model_file(n) or n == 'config.json'
  }
  model = {
    f.name: getattr(setup.model, f.name)
    for f in dataclasses.fields(setup.model)
    if f.name not in ('engine', 'train_indexer')  # (the frozen base is the same either way)
  }
  model |= {k: getattr(setup.model.engine, k) for k in STORED}
  model['lora'] = dataclasses.asdict(model['lora'])
  return json.loads(
    json.dumps(
      {'version': VERSION, 'hf_checkpoint': hf, 'files': files, 'model': model, 'seed': setup.seed}
    )
  )


def entry(setup) -> tuple[str, dict]:
  """(the cache entry's directory, its key)."""
  k = key(setup)
  digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:16]
  return storage.join(setup.base_cache, digest), k


def restore(setup, mesh, where: tuple[str, dict]):
  """(params, moe_bias, frozen) from the cache entry `where` (entry(setup)) onto `mesh`, or None
  when it is not whole."""
  directory, k = where
  marker = storage.join(directory, KEY_FILE)
  if not storage.exists(marker) or json.loads(storage.read_text(marker)) != k:
    return None

  abstract, _ = aot.abstract_state(setup, mesh)
  parts = {name: getattr(abstract, name) for name in ('params', 'moe_bias', 'frozen')}
  target = {
    name: {
      p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      for p, x in checkpoint.flatten(tree).items()
    }
    for name, tree in parts.items()
  }
  with ocp.StandardCheckpointer() as ckptr:
    flat = ckptr.restore(storage.join(directory, 'weights'), target)
  if jax.process_index() == 0:
    print(f'  the converted base restored from {directory}', flush=True)
  return tuple(checkpoint.unflatten_like(parts[n], flat[n]) for n in parts)


def save(where: tuple[str, dict], params, moe_bias, frozen) -> str | None:
  """Saves the converted weights as the cache entry `where` (every process takes part); its
  directory, or None when another run has just saved it."""
  directory, k = where
  tree = {
    'params': checkpoint.flatten(params),
    'moe_bias': checkpoint.flatten(moe_bias),
    'frozen': checkpoint.flatten(frozen),
  }
  try:
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(storage.join(directory, 'weights'), tree, force=True)
      ckptr.wait_until_finished()
  except Exception as e:  # (a concurrent start saving the same entry: one of them wins)
    logging.warning('The converted base was not cached in %s: %s', directory, e)
    return None
  if jax.process_index() == 0:
    storage.write_atomic(storage.join(directory, KEY_FILE), json.dumps(k, indent=1))
    print(f'  the converted base saved into {directory} (later starts restore it)', flush=True)
  return directory

"""PEFT LoRA adapters of the Hugging Face models (every family): adapter_model.safetensors and
adapter_config.json as peft's LoraConfig saves them, written from and read into moetrain's LoRA
params (and the routers, which training moves)."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.convert import safetensors_io as stio
from moetrain.convert import stacked_io as sio
from moetrain.convert.hf import (
  PEFT_PREFIX,
  ROUTER_SUFFIXES,
  check_rows,
  family_of,
  flat_values,
  lora_rows,
  table,
  value_of,
)
from moetrain.convert.stacked_io import Row
from moetrain.model.config import ModelConfig

ADAPTER_FILE = 'adapter_model.safetensors'
ADAPTER_CONFIG = 'adapter_config.json'
# Training moves every layer's e_score_correction_bias (the expert-bias update) and, with
# lora.train_router, the router classifier: an adapter holds the whole router module (the
# family's ROUTER_MODULE: LongCat's mlp.router, the others' mlp.gate or block_sparse_moe.gate)
# as PEFT's modules_to_save.


def _adapted(flat: dict, cfg: ModelConfig) -> list[Row]:
  return [r for t in table(cfg) if (lo := lora_rows(t)) and lo[0].key in flat for r in lo]


def _router_rows(cfg: ModelConfig) -> list[Row]:
  """The router's rows under PEFT's prefix (as PeftModel.save_pretrained names modules_to_save)."""
  return [
    dataclasses.replace(t, name_template=PEFT_PREFIX + t.name_template)
    for t in table(cfg)
    if t.path.endswith(ROUTER_SUFFIXES)
  ]


def router_module(cfg: ModelConfig) -> str:
  """The name (last component) of the HF router module: 'router' (LongCat) or 'gate'."""
  return family_of(cfg.model_type).ROUTER_MODULE


def _target_modules(rows: list[Row]) -> str:
  """A regex that PEFT full-matches against module names (model.layers.<l>.mlps.0.up_proj...)."""
  mods = {r.name_template.removeprefix(PEFT_PREFIX).rsplit('.', 2)[0] for r in rows}
  return '|'.join(
    sorted(m.replace('.', r'\.').replace('{l}', r'\d+').replace('{e}', r'\d+') for m in mods)
  )


def save(model, cfg: ModelConfig, out_dir: str, base_model: str = '') -> None:
  """adapter_model.safetensors (lora_A [R, in], lora_B [out, R] per module, experts one by one,
  and the routers whole: ROUTER_MODULE) and adapter_config.json, as peft's LoraConfig saves them
  for the HF model. base_model: the checkpoint the adapters belong to (its path), written as
  base_model_name_or_path for peft's AutoPeftModel."""
  flat = flat_values(model)
  rows = _adapted(flat, cfg)
  if not rows:
    raise ValueError('the model has no LoRA adapters (cfg.lora.rank is 0 or targets match none)')
  if not getattr(family_of(cfg.model_type), 'PEFT_EXPERTS', True) and any(r.experts for r in rows):
    raise ValueError(
      f'{cfg.model_type} stores its experts as fused parameters, which PEFT LoRA does not adapt: '
      'export the adapted experts merged (save_hf), or leave experts out of lora.targets'
    )
  saved = rows + _router_rows(cfg)
  items = [(r, ix) for r in saved for ix in r.indices(cfg.n_routed_experts)]
  dtype = jnp.dtype(cfg.param_dtype)  # the base's dtype, as the merged export
  specs = [
    (r.name(ix), sio.flat_shape(flat[r.key].shape[r.lead :], r.n_in), dtype) for r, ix in items
  ]
  writable = jax.process_index() == 0
  if writable:
    os.makedirs(out_dir, exist_ok=True)

  def produce(i):
    r, ix = items[i]
    return sio.to_flat(sio.to_host(flat[r.key][ix]), r.n_in).astype(dtype)

  stio.write_file(os.path.join(out_dir, ADAPTER_FILE), specs, produce, writable)
  lo = cfg.lora
  config = {
    'peft_type': 'LORA',
    'task_type': 'CAUSAL_LM',
    'r': lo.rank,
    'lora_alpha': lo.alpha,
    'use_rslora': lo.rslora,
    'lora_dropout': lo.dropout,
    'bias': 'none',
    'target_modules': _target_modules(rows),
    'fan_in_fan_out': False,
    'use_dora': False,
    'init_lora_weights': True,
    'inference_mode': True,
    'modules_to_save': [router_module(cfg)],
    'base_model_name_or_path': base_model or None,
  }
  if writable:
    with open(os.path.join(out_dir, ADAPTER_CONFIG), 'w') as f:
      json.dump(config, f, indent=2)


def load(model, cfg: ModelConfig, directory: str) -> None:
  """Reads a PEFT adapter into the model's LoRA params, and its routers when the adapter holds
  them (router_module), in place, keeping their shardings."""
  with open(os.path.join(directory, ADAPTER_CONFIG)) as f:
    c = json.load(f)
  for key, field, default in (
    ('r', 'rank', 8),
    ('lora_alpha', 'alpha', 8),
    ('use_rslora', 'rslora', False),
    ('use_dora', None, False),
  ):
    want = getattr(cfg.lora, field) if field else default
    if c.get(key, default) != want:
      raise ValueError(
        f'{ADAPTER_CONFIG}: {key}={c.get(key, default)!r} but the model has '
        f'{f"lora.{field}" if field else key}={want!r}'
      )
  # Per-module ranks and scales, or adapters on some layers only: one rank and one alpha for
  # every module here, so such an adapter would load with the wrong scale (or not at all).
  for key in ('rank_pattern', 'alpha_pattern', 'layers_to_transform'):
    if c.get(key) not in (None, [], {}):  # (layers_to_transform=0 means layer 0 alone)
      raise ValueError(
        f'{os.path.join(directory, ADAPTER_CONFIG)}: {key}={c[key]!r} is not supported (lora '
        'has one rank and one alpha for every adapted module, on every layer)'
      )
  router = router_module(cfg) in (c.get('modules_to_save') or ())
  filt = nnx.LoRAParam
  if router:
    routers = ('router', 'router_bias', 'router_linear_bias')
    filt = nnx.Any(filt, *(nnx.PathContains(k) for k in routers))
  variables = dict(nnx.to_flat_state(nnx.state(model, filt)))
  flat = {p: value_of(v) for p, v in variables.items()}
  rows = _adapted(flat, cfg) + (_router_rows(cfg) if router else [])
  reader = stio.Reader(directory, single=ADAPTER_FILE, index=None)
  extra = check_rows(reader, rows, cfg, {p: x.shape for p, x in flat.items()})
  if extra:
    raise ValueError(
      f'{directory}: {len(extra)} adapter tensors have no LoRA param in this '
      f'model (check lora.targets), e.g. {extra[:3]}'
    )
  abstract = {p: jax.ShapeDtypeStruct(x.shape, x.dtype) for p, x in flat.items()}
  shardings = {p: x.sharding for p, x in flat.items()}
  values = {}
  for r in rows:
    values.update(sio.load_row(reader, r, abstract, shardings, flat[r.key].shape))
  nnx.update(model, nnx.from_flat_state({p: variables[p].replace(values[p]) for p in values}))

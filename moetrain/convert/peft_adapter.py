"""PEFT LoRA adapters of the Hugging Face models (every family): adapter_model.safetensors and
adapter_config.json as peft's LoraConfig saves them, written from and read into moetrain's LoRA
params (and the routers, which training moves)."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moetrain.convert import gpt_oss
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
  fused = not getattr(family_of(cfg.model_type), 'PEFT_EXPERTS', True)
  if fused and any(r.experts for r in rows):
    return _save_fused(flat, rows, cfg, out_dir, base_model)
  saved = rows + _router_rows(cfg)
  items = [(r, ix) for r in saved for ix in r.indices(cfg.n_routed_experts)]
  dtype = jnp.dtype(cfg.engine.param_dtype)  # the base's dtype, as the merged export
  specs = [
    (r.name(ix), sio.flat_shape(flat[r.key].shape[r.lead :], r.n_in), dtype) for r, ix in items
  ]

  def produce(i):
    r, ix = items[i]
    return sio.to_flat(sio.to_host(flat[r.key][ix]), r.n_in).astype(dtype)

  lo = cfg.lora
  _write(out_dir, specs, produce, _config(cfg, rows, base_model, lo.rank, lo.alpha, lo.rslora))


def _write(out_dir: str, specs, produce, config: dict) -> None:
  writable = jax.process_index() == 0
  if writable:
    os.makedirs(out_dir, exist_ok=True)
  stio.write_file(os.path.join(out_dir, ADAPTER_FILE), specs, produce, writable)
  if writable:
    with open(os.path.join(out_dir, ADAPTER_CONFIG), 'w') as f:
      json.dump(config, f, indent=2)


def _config(cfg: ModelConfig, rows, base_model: str, rank, alpha, rslora, params=None) -> dict:
  lo = cfg.lora
  config = {
    'peft_type': 'LORA',
    'task_type': 'CAUSAL_LM',
    'r': rank,
    'lora_alpha': alpha,
    'use_rslora': rslora,
    'lora_dropout': lo.dropout,
    'bias': 'none',
    'target_modules': _target_modules(rows) if rows else [],
    'fan_in_fan_out': False,
    'use_dora': False,
    'init_lora_weights': True,
    'inference_mode': True,
    'modules_to_save': [router_module(cfg)],
    'base_model_name_or_path': base_model or None,
  }
  if params:
    config['target_parameters'] = params
  return config


def _save_fused(flat, rows: list[Row], cfg: ModelConfig, out_dir: str, base_model: str) -> None:
  """gpt-oss: its experts are fused parameters, which PEFT adapts through target_parameters at
  one rank for the whole adapter (gpt_oss.fused_adapter): rank 2r, scale 1, every module's
  factors padded with zeros and its B scaled."""

  rank, scale, e_count = cfg.lora.rank, cfg.lora.scale, cfg.n_routed_experts
  dtype = jnp.dtype(cfg.engine.param_dtype)
  host = lambda r, ix: sio.to_flat(sio.to_host(flat[r.key][ix]), r.n_in).astype(np.float32)
  shape = lambda r: sio.flat_shape(flat[r.key].shape[r.lead :], r.n_in)
  # name -> (shape, the tensor's maker): each tensor leaves the device once, when written.
  tensors, layers, params, modules = {}, {}, set(), set()
  for r in rows:
    for ix in r.indices(e_count):
      name = r.name(ix)
      if (where := gpt_oss.split_expert_row(name)) is None:
        a, (d0, d1) = r.name_template.endswith('lora_A.weight'), shape(r)
        padded = (2 * d0, d1) if a else (d0, 2 * d1)
        tensors[name] = (padded, functools.partial(_padded, host, r, ix, a, rank, scale))
        modules.add(r)
        continue
      prefix, e, piece, ab = where
      layers.setdefault(prefix, {}).setdefault((prefix, piece, ab), [None] * e_count)[e] = (r, ix)
  for pieces in layers.values():
    got = {k: [host(*x) for x in v] for k, v in pieces.items()}
    fused, targets = gpt_oss.fused_adapter(got, e_count, rank, scale)
    params.update(targets)
    tensors.update({n: (v.shape, lambda v=v: v) for n, v in fused.items()})
  for r in _router_rows(cfg):
    for ix in r.indices(e_count):
      tensors[r.name(ix)] = (shape(r), functools.partial(host, r, ix))
  names = list(tensors)
  specs = [(n, tensors[n][0], dtype) for n in names]
  produce = lambda i: tensors[names[i]][1]().astype(dtype)
  modules = [r for r in rows if r in modules]
  config = _config(cfg, modules, base_model, 2 * rank, 2 * rank, False, sorted(params))
  _write(out_dir, specs, produce, config)


def _padded(host, r: Row, ix, is_a: bool, rank: int, scale: float):
  """A module's PEFT factor at rank 2r, scale 1: A [r, in] under r rows of zeros, or B [out, r]
  times the scale beside r columns of zeros."""
  x = host(r, ix)
  if is_a:
    return np.concatenate([x, np.zeros_like(x)], axis=0)
  return np.concatenate([scale * x, np.zeros_like(x)], axis=1)


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
  fused_values = {}
  if c.get('target_parameters'):  # gpt-oss's fused experts (gpt_oss.fused_adapter)
    fused_values, rows = _load_fused(reader, c['target_parameters'], rows, flat, cfg)
  extra = check_rows(reader, rows, cfg, {p: x.shape for p, x in flat.items()})
  extra = [k for k in extra if k not in fused_values.get('read', ())]
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
  for key, x in fused_values.get('values', {}).items():
    values[key] = jax.device_put(x.astype(abstract[key].dtype), shardings[key])
  nnx.update(model, nnx.from_flat_state({p: variables[p].replace(values[p]) for p in values}))


def _load_fused(reader, targets: list[str], rows: list[Row], flat, cfg: ModelConfig):
  """({'values': {path: [..., E, in, r] or [..., E, r, out]}, 'read': fused tensor names}, the
  rows left to read one by one) for an adapter on gpt-oss's fused experts: expert e's gate and
  up adapters are the gate_up_proj factors' B_e and A_e's even / odd columns, down's those of
  down_proj (gpt_oss.fused_adapter's layout, as peft saves it)."""

  e_count, rank = cfg.n_routed_experts, cfg.lora.rank
  both = {f'mlp.experts.{f}' for f in gpt_oss.FUSED_TARGETS} <= set(targets)
  values, read, rest = {}, set(), []
  for r in rows:
    cache = {}
    get = lambda n, cache=cache: cache[n] if n in cache else cache.setdefault(n, reader.read(n))
    if not r.experts or gpt_oss.split_expert_row(r.name(r.indices(e_count)[0])) is None:
      rest.append(r)
      continue
    out = np.zeros(flat[r.key].shape, np.float32)
    for ix in r.indices(e_count):
      prefix, e, piece, ab = gpt_oss.split_expert_row(r.name(ix))
      fused = next(f for f, names in gpt_oss.FUSED_TARGETS.items() if piece in names)
      if f'mlp.experts.{fused}' not in targets:
        raise ValueError(
          f'{reader.directory}: target_parameters {targets} leave out mlp.experts.{fused}, '
          f'which lora.targets adapts ({r.path})'
        )
      inner = '.base_layer' if fused == 'gate_up_proj' and both else ''
      names = [f'{prefix}{inner}.lora_{x}.weight' for x in 'AB']
      read.update(names)
      if ab == 'A':  # moetrain's A [in, r]: B_e
        b_w = get(names[1])
        out[ix] = b_w.reshape(b_w.shape[0], rank, e_count)[:, :, e]
      else:  # moetrain's B [r, out]: A_e's columns of this piece
        a_w = get(names[0])
        pieces = gpt_oss.FUSED_TARGETS[fused]
        a_e = a_w.reshape(e_count, rank, a_w.shape[-1])[e]
        out[ix] = a_e[:, pieces.index(piece) :: len(pieces)]
    values[r.key] = out
  return {'values': values, 'read': read}, rest

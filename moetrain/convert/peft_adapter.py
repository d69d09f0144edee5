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

from moetrain.convert import fused_lora
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
  """The router's rows under PEFT's prefix (as PeftModel.save_pretrained names modules_to_save),
  in the runtime module of a fused-experts family (MiniMax-M2's block_sparse_moe is mlp)."""
  fam, rows = family_of(cfg.model_type), []
  layout = _layout(cfg)
  for t in table(cfg):
    if t.path.endswith(ROUTER_SUFFIXES):
      name = PEFT_PREFIX + t.name_template
      if layout:
        name = name.replace(f'.{fam.block}.', f'.{layout.block}.')
      rows.append(dataclasses.replace(t, name_template=name))
  return rows


def _layout(cfg: ModelConfig):
  """The family's fused experts (fused_lora.Layout), or None (per-expert modules)."""
  return getattr(family_of(cfg.model_type), 'PEFT_FUSED', None)


def router_module(cfg: ModelConfig) -> str:
  """The name (last component) of the HF router module: 'router' (LongCat) or 'gate'."""
  return family_of(cfg.model_type).ROUTER_MODULE


def _module(r: Row) -> str:
  """The HF module name template of a LoRA row (model.layers.{l}.mlp.up_proj)."""
  return r.name_template.removeprefix(PEFT_PREFIX).rsplit('.', 2)[0]


def _target_modules(rows: list[Row]) -> str:
  """A regex that PEFT full-matches against module names (model.layers.<l>.mlps.0.up_proj...)."""
  mods = {_module(r) for r in rows}
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
  if (layout := _layout(cfg)) and any(r.experts for r in rows):
    return _save_fused(flat, rows, cfg, out_dir, base_model, layout)
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


def _save_fused(flat, rows, cfg: ModelConfig, out_dir: str, base_model: str, layout) -> None:
  """Experts that transformers fuses into parameters, which PEFT adapts through
  target_parameters (fused_lora.fuse): gate_up_proj at rank 2r, by rank_pattern and
  alpha_pattern, or (layout.uniform) the whole adapter at rank 2r and scale 1, every module's
  factors padded with zeros and its B scaled."""
  rank, e_count, lo = cfg.lora.rank, cfg.n_routed_experts, cfg.lora
  scale = lo.scale if layout.uniform else 1.0
  dtype = jnp.dtype(cfg.engine.param_dtype)
  host = lambda r, ix: sio.to_flat(sio.to_host(flat[r.key][ix]), r.n_in).astype(np.float32)
  shape = lambda r: sio.flat_shape(flat[r.key].shape[r.lead :], r.n_in)
  # name -> (shape, the tensor's maker): each tensor leaves the device once, when written.
  tensors, layers, params = {}, {}, set()
  for r in (r for r in rows if not r.experts):
    for ix in r.indices(e_count):
      a, (d0, d1) = r.name_template.endswith('lora_A.weight'), shape(r)
      make = functools.partial(host, r, ix)
      if layout.uniform:
        d0, d1 = (2 * d0, d1) if a else (d0, 2 * d1)
        make = functools.partial(_padded, host, r, ix, a, rank, scale)
      tensors[r.name(ix)] = ((d0, d1), make)
  for r in (r for r in rows if r.experts):
    for ix in r.indices(e_count):
      prefix, e, piece, ab = fused_lora.split_row(r.name(ix), r.path, ix, layout)
      layers.setdefault(prefix, {}).setdefault((prefix, piece, ab), [None] * e_count)[e] = (r, ix)
  for pieces in layers.values():
    got = {k: [host(*x) for x in v] for k, v in pieces.items()}
    fused, targets = fused_lora.fuse(got, e_count, rank, layout, scale)
    params.update(targets)
    tensors.update({n: (v.shape, lambda v=v: v) for n, v in fused.items()})
  for r in _router_rows(cfg):
    for ix in r.indices(e_count):
      tensors[r.name(ix)] = (shape(r), functools.partial(host, r, ix))
  names = list(tensors)
  specs = [(n, tensors[n][0], dtype) for n in names]
  produce = lambda i: tensors[names[i]][1]().astype(dtype)
  modules = [r for r in rows if not r.experts]
  if layout.uniform:
    config = _config(cfg, modules, base_model, 2 * rank, 2 * rank, False, sorted(params))
  else:
    # peft on transformers 5 rewrites target_modules naming an MoE family's expert projections
    # (gate_proj, ...) into target_parameters for the fused experts, which leaves the shared
    # experts' and dense MLPs' projections unadapted: those go in as parameters too.
    mlp = [r for r in modules if _module(r).endswith(fused_lora.MLP_PROJECTIONS)]
    params.update(_module(r).split('{l}.', 1)[-1] + '.weight' for r in mlp)
    modules = [r for r in modules if r not in mlp]
    config = _config(cfg, modules, base_model, rank, lo.alpha, lo.rslora, sorted(params))
    config.update(fused_lora.patterns(rank, lo.alpha, lo.rslora))
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
  _check_config(c, cfg, os.path.join(directory, ADAPTER_CONFIG))
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
  if c.get('target_parameters'):  # fused experts (fused_lora)
    fused_values, rows = _load_fused(reader, c, rows, flat, cfg)
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


def _check_config(c: dict, cfg: ModelConfig, where: str) -> None:
  """Refuses an adapter_config.json whose rank, alpha or variant differ from cfg.lora's."""
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
  # every module here, so such an adapter would load with the wrong scale (or not at all). The
  # one exception: fused gate_up_proj experts at rank 2r and the same scale (fused_lora).
  lo = cfg.lora
  fused = fused_lora.patterns(lo.rank, lo.alpha, lo.rslora) if c.get('target_parameters') else {}
  for key in ('rank_pattern', 'alpha_pattern', 'layers_to_transform'):
    if c.get(key) not in (None, [], {}, fused.get(key)):  # (layers_to_transform=0: layer 0)
      raise ValueError(
        f'{where}: {key}={c[key]!r} is not supported (lora has one rank and one alpha for '
        'every adapted module, on every layer)'
      )


def _load_fused(reader, c: dict, rows: list[Row], flat, cfg: ModelConfig):
  """({'values': {path: [..., E, in, r] or [..., E, r, out]}, 'read': fused tensor names}, the
  rows left to read one by one) for an adapter on fused experts (target_parameters): each
  expert's gate, up and down factors out of gate_up_proj's and down_proj's
  (fused_lora.unfuse), as fused_lora.fuse writes them or peft saves them."""
  e_count, rank, layout = cfg.n_routed_experts, cfg.lora.rank, _layout(cfg)
  targets = c['target_parameters']
  if layout is None:
    raise ValueError(
      f'{reader.directory}: target_parameters {targets}, but {cfg.model_type} has no fused experts'
    )
  both = {f'{layout.block}.experts.{f}' for f in fused_lora.TARGETS} <= set(targets)
  values, read, rest, cache = {}, set(), [], {}
  get = lambda n: cache[n] if n in cache else cache.setdefault(n, reader.read(n))
  for r in rows:
    if not r.experts:
      rest.append(r)
      continue
    out = np.zeros(flat[r.key].shape, np.float32)
    for ix in r.indices(e_count):
      prefix, e, piece, ab = fused_lora.split_row(r.name(ix), r.path, ix, layout)
      fused = next(f for f, names in fused_lora.TARGETS.items() if piece in names)
      if f'{layout.block}.experts.{fused}' not in targets:
        raise ValueError(
          f'{reader.directory}: target_parameters {targets} leave out '
          f'{layout.block}.experts.{fused}, which lora.targets adapts ({r.path})'
        )
      inner = '.base_layer' if fused == 'gate_up_proj' and both else ''
      names = [f'{prefix}{inner}.lora_{x}.weight' for x in 'AB']
      read.update(names)
      out[ix] = fused_lora.unfuse(*map(get, names), e, e_count, piece, ab, rank, layout)
    values[r.key] = out
  return {'values': values, 'read': read}, rest

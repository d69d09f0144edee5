"""Hugging Face checkpoints of every family <-> moetrain: config.json, the weight-name table
(the family's: longcat.py, standard.py, hybrid.py), streaming load and save (PEFT adapters:
peft_adapter.py)."""

import json
import os
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import SingleDeviceSharding

from moetrain.convert import (
  block_fp8,
  compressed_int4,
  gpt_oss,
  hybrid,
  longcat,
  multimodal,
  standard,
)
from moetrain.convert import safetensors_io as stio
from moetrain.convert import stacked_io as sio
from moetrain.convert.stacked_io import Row
from moetrain.core import storage
from moetrain.core.engine import split_engine_keys
from moetrain.model.config import ModelConfig
from moetrain.model.transformer import Transformer
from moetrain.training import train_state

# ---------------------------------------------------------------------------------------------
# config.json and the weight-name table, per family


def family_of(model_type: str):
  """The module or object that knows a family's config.json and weight names."""
  families = {
    **standard.FAMILIES,
    **hybrid.FAMILIES,
    **multimodal.FAMILIES,
    'gpt_oss': gpt_oss.GPT_OSS,
  }
  if model_type == longcat.MODEL_TYPE:
    return longcat
  if model_type in families:
    return families[model_type]
  raise ValueError(
    f'config.json model_type={model_type!r} is unsupported: moetrain loads '
    f'{[longcat.MODEL_TYPE, *families]}'
  )


def read_config(path: str) -> dict:
  """<path>/config.json of a Hugging Face checkpoint directory; errors name what is missing."""
  if not storage.isdir(path):
    raise FileNotFoundError(
      f'checkpoint directory {path!r} does not exist (init.hf_checkpoint / --hf_checkpoint take '
      'a Hugging Face directory with config.json and *.safetensors, or a gs:// one)'
    )
  file = storage.join(path, 'config.json')
  if not storage.isfile(file):
    raise FileNotFoundError(f'{file} does not exist: {path!r} is not a Hugging Face checkpoint')
  try:
    return json.loads(storage.read_text(file))
  except json.JSONDecodeError as e:
    raise ValueError(f'{file}: malformed JSON: {e}') from e


def config_from_hf(config_json: dict, **overrides) -> ModelConfig:
  """ModelConfig of a config.json of any supported family (its model_type; LongCat-Flash when
  absent); `overrides` set the derived fields (engine, lora) or single engine keys (dtype, remat,
  ...). Errors name the model.<field>, and say when config.json gave the value."""
  kw = family_of(config_json.get('model_type', longcat.MODEL_TYPE)).config_from_hf(config_json)
  kw, engine = split_engine_keys({**kw, **overrides})  # (init_std: initializer_range)
  cfg = ModelConfig(**kw).with_engine(**engine)
  try:
    cfg.validate('model')
  except ValueError as e:
    field = re.match(r'model\.(\w+)', str(e)).group(1) if str(e).startswith('model.') else ''
    if field in overrides or field not in kw:
      raise
    raise ValueError(f'{e} (the value config.json gives)') from None
  return cfg


def check_overrides(path: str, overrides: dict) -> None:
  """With init.hf_checkpoint the checkpoint's config.json decides the model's shapes: a
  model.<field> set on the command line (`overrides`: {'model.moe_topk': 20, ...}) that differs
  from the checkpoint's is refused, naming both values (the engine section is the config's)."""
  given = {k.removeprefix('model.'): v for k, v in overrides.items() if k.startswith('model.')}
  if not given:
    return
  kw = family_of((c := read_config(path)).get('model_type', longcat.MODEL_TYPE)).config_from_hf(c)
  base = ModelConfig(**split_engine_keys(kw)[0])
  for key, value in given.items():
    if hasattr(base, key) and getattr(base, key) != value:
      raise ValueError(
        f'--config.model.{key}={value!r}: init.hf_checkpoint={path} gives {key}='
        f"{getattr(base, key)!r} in its config.json, which decides the model's shapes; leave "
        'it out (how the model computes is the engine section: engine.dtype, engine.remat, ...)'
      )


def config_to_hf(cfg: ModelConfig, dtype: str, base: dict | None = None) -> dict:
  """config.json for transformers; keys of `base` (bos/eos, auto_map...) are kept."""
  out = {'bos_token_id': 1, 'eos_token_id': 2, **(base or {})}
  out.update(family_of(cfg.model_type).config_to_hf(cfg))
  out.pop('quantization_config', None)  # the release's (MXFP4, FP8): exports are not quantised
  out.update(
    model_type=cfg.model_type,
    attention_dropout=0.0,
    dtype=dtype,
    torch_dtype=dtype,  # the key transformers before 4.56 reads (the release's, kept from base)
  )
  return out


def table(cfg: ModelConfig) -> tuple[Row, ...]:
  """Every HF tensor of the checkpoint, grouped by the moetrain variable it fills."""
  return tuple(family_of(cfg.model_type).table(cfg))


PEFT_PREFIX = 'base_model.model.'


def lora_rows(t: Row) -> tuple[Row, Row] | None:
  """PEFT's lora_A [R, prod(in)] and lora_B [prod(out), R] for a Linear or expert row. moetrain's
  A [in..., R] and B [R, out...] map like kernels with t.n_in and 1 input dims."""
  if not (t.path.endswith('.kernel') or t.experts):
    return None
  module = PEFT_PREFIX + t.name_template.removesuffix('.weight')
  base = t.path.removesuffix('.kernel') + '.' if t.path.endswith('.kernel') else t.path + '_'
  return (
    Row(f'{module}.lora_A.weight', base + 'lora_a', t.n_in, t.layers, t.experts),
    Row(f'{module}.lora_B.weight', base + 'lora_b', 1, t.layers, t.experts),
  )


# ---------------------------------------------------------------------------------------------
# Loading


class Loaded(NamedTuple):
  """The split of train_state.split_model, filled from a checkpoint."""

  params: nnx.State  # trainable: LoRA adapters at their init (A random, B 0), or the HF weights
  moe_bias: nnx.State  # e_score_correction_bias of every layer
  frozen: nnx.State  # the rest: the HF base, quantised when cfg.quant is int8/int4
  skipped: list[str]  # checkpoint tensors moetrain has no place for (model.mtp.*)


def value_of(v):
  return v.get_value() if isinstance(v, nnx.Variable) else v


def flat_values(tree) -> dict:
  state = nnx.state(tree) if isinstance(tree, nnx.Module) else tree
  return {p: value_of(v) for p, v in nnx.to_flat_state(state)}


def _float_shapes(cfg: ModelConfig) -> dict:
  plain = cfg.with_engine(quant='none')
  return {
    p: x.shape
    for p, x in flat_values(nnx.eval_shape(lambda: Transformer(plain, nnx.Rngs(0)))).items()
  }


def _shardings(abstract_state, mesh, rules) -> dict:
  if mesh is None:
    one = SingleDeviceSharding(jax.local_devices()[0])
    return {p: one for p, _ in nnx.to_flat_state(abstract_state)}
  return flat_values(train_state.state_shardings(abstract_state, mesh, rules))


class ShapeMismatch(ValueError):
  """A checkpoint tensor whose shape is not the one the config implies."""

  def __init__(self, message: str, name: str, got: tuple, want: tuple):
    super().__init__(message)
    self.name, self.got, self.want = name, got, want


def check_rows(reader, rows, cfg, shapes: dict) -> list[str]:
  """Raises on a missing or misshapen tensor; returns the checkpoint keys no row uses."""
  expected = set()
  for t in rows:
    want = sio.flat_shape(shapes[t.key][t.lead :], t.n_in)
    for ix in t.indices(cfg.n_routed_experts):
      name = t.name(ix)
      expected.add(name)
      if name not in reader:
        raise ValueError(
          f'{name}: missing from {reader.directory} (moetrain {t.path} needs it, shape {want})'
        )
      if (got := reader.shape(name)) != want:
        raise ShapeMismatch(
          f'{name}: shape {got} in {reader.directory}, expected '
          f'{want} for moetrain {t.path}; does config.json match the weights?',
          name,
          got,
          want,
        )
  skipped = sorted(set(reader.keys()) - expected)
  mtp = set(k for k in skipped if is_mtp(k, cfg))
  pattern = re.compile(
    '|'.join(
      re.escape(t.name_template).replace(r'\{l\}', r'\d+').replace(r'\{e\}', r'\d+') for t in rows
    )
  )
  extra = [k for k in skipped if pattern.fullmatch(k) and k not in mtp]
  if extra:  # e.g. more layers or experts in the file than in cfg: never drop them silently
    raise ValueError(
      f'{extra[0]}: in {reader.directory} but beyond the config '
      f'({len(extra)} such tensors); does config.json match the weights?'
    )
  return skipped


def check_checkpoint(path: str, cfg: ModelConfig) -> None:
  """Before anything is built or compiled: every safetensors header of `path` (its length sane,
  its offsets within the file) and the shape of every tensor the config implies, from the
  headers alone. A tensor whose shape differs is refused naming config.json's key."""
  reader = _reader(stio.Reader(path), cfg)
  try:
    check_rows(reader, table(cfg), cfg, _float_shapes(cfg))
  except ShapeMismatch as e:
    keys = mismatched_keys(read_config(path), e.got, e.want)
    given = ', '.join(f'{k}={v}' for k, v in keys.items()) or 'a shape'
    file = getattr(reader, 'files', {}).get(e.name, 'its safetensors')
    raise ValueError(
      f"init.hf_checkpoint={path}: config.json's {given} does not match the weights: "
      f'{e.name} has shape {e.got} in {file}, the config implies {e.want}'
    ) from None


def mismatched_keys(config_json: dict, got: tuple, want: tuple) -> dict:
  """config.json's integer keys whose value is a dimension `want` has and `got` lacks."""
  dims = list(got)
  extra = set()
  for d in want:
    if d in dims:
      dims.remove(d)
    else:
      extra.add(d)
  return {
    k: v
    for k, v in config_json.items()
    if isinstance(v, int) and not isinstance(v, bool) and v in extra
  }


def load_params(path, cfg: ModelConfig, mesh=None, rules=None, dtype=None, seed=0) -> Loaded:
  """Reads model.safetensors or indexed shards in `path` into the model's state split.

  Host memory: each target is built per layer with jax.make_array_from_callback, whose callback
  reads, from the memory-mapped files, only the block of each HF tensor that one device holds
  (per expert for expert stacks); layers are written into a donated on-device buffer, and
  int8/int4 quantisation runs on device per layer. A host so holds at most its local devices'
  blocks of one layer of one variable, never a whole shard file or stacked tensor; on a pod each
  host reads only its own slices.

  Args:
    cfg: the model (config_from_hf plus engine settings); cfg.quant quantises the frozen base.
    mesh, rules: place every array by its logical axes (rules default to cfg.rules); no mesh:
      the first local device (each process loads a whole copy).
    dtype: storage dtype of float weights (default cfg.param_dtype; the router stays float32).
    seed: of the LoRA init (A random, B zero) when cfg.lora is on.
  """
  if dtype is not None:
    cfg = cfg.with_engine(param_dtype=jnp.dtype(dtype).name)
  rules = cfg.engine.rules if rules is None else rules
  reader = _reader(stio.Reader(path), cfg)
  graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(seed))))
  variables = dict(nnx.to_flat_state(abstract_state))
  abstract = {p: value_of(v) for p, v in variables.items()}
  shardings = _shardings(abstract_state, mesh, rules)
  shapes = _float_shapes(cfg)
  rows = table(cfg)
  skipped = check_rows(reader, rows, cfg, shapes)
  values = {}
  for t in rows:
    values.update(
      sio.load_row(
        reader, t, abstract, shardings, shapes[t.key], cfg.engine.quant, cfg.engine.quant_group_size
      )
    )
  for r in (r for t in rows for r in lora_rows(t) or () if r.key in abstract):
    x = abstract[r.key]
    values[r.key] = sio.init_adapter(r, x.shape, shardings[r.key], x.dtype, seed)
  unfilled = sorted('.'.join(p) for p in set(variables) - set(values))
  if unfilled:
    raise ValueError(f'no checkpoint tensor fills {unfilled}')
  state = nnx.from_flat_state({p: v.replace(values[p]) for p, v in variables.items()})
  if skipped:
    logging.warning(
      '%s: skipped %d tensors moetrain does not use, e.g. %s', path, len(skipped), skipped[:5]
    )
  _, params, moe_bias, frozen = train_state.split_model(nnx.merge(graphdef, state), cfg)
  return Loaded(params, moe_bias, frozen, skipped)


def load_model(path, dtype=jnp.float32, mesh=None, **overrides) -> Transformer:
  """model = load_model(path); logits_BTV, _ = model(ids_BT). `dtype` is the compute dtype (and
  the storage dtype when float32/bfloat16); `overrides` are further ModelConfig fields."""
  name = jnp.dtype(dtype).name
  kw = {'dtype': name, 'param_dtype': name if name in ('float32', 'bfloat16') else 'float32'}
  cfg = config_from_hf(read_config(path), **{**kw, **overrides})
  loaded = load_params(path, cfg, mesh=mesh)
  return train_state.merge_model(
    train_state.graphdef_of(cfg), loaded.params, loaded.moe_bias, loaded.frozen
  )


# ---------------------------------------------------------------------------------------------
# Saving


def _export(flat: dict, t: Row, ix, cfg: ModelConfig, dtype):
  """HF tensor of row t at ix: the kernel (decoded if quantised) plus scale * A @ B if adapted."""
  bits, kernel = 0, flat.get(t.key)
  if kernel is None:
    bits = 8 if cfg.engine.quant == 'int8' else 4
    kernel = (flat[t.key + ('q',)], flat[t.key + ('scale',)])
  lo = lora_rows(t)
  lora = tuple(flat[r.key] for r in lo) if lo and lo[0].key in flat else None
  return sio.export_piece(t, ix, kernel, lora, cfg.lora.scale, bits, dtype)


def _export_items(flat: dict, cfg: ModelConfig, strict: bool) -> list:
  shapes = _float_shapes(cfg)
  items = []
  for t in table(cfg):
    if t.key not in flat and t.key + ('q',) not in flat:
      if strict:
        raise ValueError(
          f'the state has no {t.path} (HF {t.name_template}); pass the whole model state'
        )
      continue
    shape = sio.flat_shape(shapes[t.key][t.lead :], t.n_in)
    items += [(t, ix, shape) for ix in t.indices(cfg.n_routed_experts)]
  return items


# The router's classifier and its e_score_correction_bias stay float32 in every export, as the
# model keeps them (transformers: _keep_in_fp32_modules; vLLM: router_dtype float32). In bfloat16
# the bias's steps of ~1e-3 against expert scores of ~0.04 would round away and re-route tokens.
MTP_PREFIX = 'model.mtp.'  # the multi-token-prediction head: skipped on load, copied on export
# The paths of every group's router (gpt-oss's has a logit bias too).
ROUTER_SUFFIXES = ('.moe.router', '.moe.router_bias', '.moe.router_linear_bias')


def is_mtp(key: str, cfg: ModelConfig) -> bool:
  """Whether checkpoint tensor `key` belongs to a multi-token-prediction head: LongCat's
  model.mtp.*, or the num_nextn_predict_layers layers stored past the decoder's (GLM-4.5)."""
  m = re.match(r'model\.layers\.(\d+)\.', key)
  extra = m and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + cfg.num_nextn_predict_layers
  return key.startswith(MTP_PREFIX) or bool(extra)


def _export_dtype(t: Row, dtype, quantize: str = ''):
  # gpt-oss's attention sinks too: the model keeps them float32, as the softmax they join; the
  # experts of a quantised export are packed from float32 (a base's grid survives)
  float32 = t.path.endswith((*ROUTER_SUFFIXES, '.attn.sinks')) or bool(quantize and t.experts)
  return jnp.dtype(jnp.float32) if float32 else jnp.dtype(dtype)


def _dequantized(reader):
  """`reader` with a release's quantised weights read as weights: block-scaled FP8
  (block_fp8.py), pack-quantized int4 (Kimi-K2's experts: compressed_int4.py), the latter
  outermost so that its codes can be carried into an int4 base unchanged; a multimodal
  release's language model under the text model's names beneath both (multimodal.py)."""
  file = storage.join(reader.directory, 'config.json')
  config = read_config(reader.directory) if storage.isfile(file) else {}
  if top := multimodal.FAMILIES.get(config.get('model_type')):
    reader = top.nested(reader)
  return compressed_int4.wrap(block_fp8.wrap(reader, config), config)


def _reader(reader, cfg: ModelConfig):
  """The family's view of a checkpoint (gpt-oss: fused experts read as per-expert pieces), its
  quantised weights read as weights (_dequantized)."""
  reader = _dequantized(reader)
  return getattr(family_of(cfg.model_type), 'reader', lambda r, cfg: r)(reader, cfg)


def _fuse(cfg: ModelConfig, specs, produce):
  return getattr(family_of(cfg.model_type), 'fuse', lambda s, p: (s, p))(specs, produce)


def hf_tensors(model_or_state, cfg: ModelConfig, dtype='float32'):
  """(HF name, array) in checkpoint layout for every table row the state holds (a grad state
  without the router bias, say): LoRA merged, quantised kernels decoded."""
  flat = flat_values(model_or_state)
  items = _export_items(flat, cfg, strict=False)
  specs = [(t.name(ix), shape, None) for t, ix, shape in items]
  specs, produce = _fuse(
    cfg, specs, lambda i: _export(flat, *items[i][:2], cfg, _export_dtype(items[i][0], dtype))
  )
  return [(name, produce(i)) for i, (name, _, _) in enumerate(specs)]


def save_hf(
  model_or_state,
  cfg: ModelConfig,
  out_dir: str,
  dtype=None,
  max_shard_size: int = 5 * 2**30,
  base_config: dict | None = None,
  base_dir: str = '',
  quantize: str = '',
) -> None:
  """Writes config.json and model.safetensors (or shards of at most max_shard_size bytes plus
  the index) in the transformers LongCat-Flash layout: LoRA merged into the base, quantised
  weights decoded, e_score_correction_bias included. One tensor is on the host at a time; with
  several processes all must call it (shards are gathered) and process 0 writes. With base_dir
  (the HF checkpoint the run started from), its MTP head (model.mtp.*, which moetrain does not
  load or train) is copied over unchanged, so that speculative decoding with it still works.
  quantize='compressed-int4' writes the routed experts pack-quantized, int4 in groups of 32
  along the inputs, with their quantization_config (compressed_int4.py), as Kimi-K2 ships."""
  if quantize not in ('', compressed_int4.EXPORT):
    raise ValueError(f'quantize={quantize!r}: use {compressed_int4.EXPORT!r} or none')
  flat = flat_values(model_or_state)
  dt = jnp.dtype(dtype or cfg.engine.param_dtype)
  items = _export_items(flat, cfg, strict=True)
  specs = [(t.name(ix), shape, _export_dtype(t, dt, quantize)) for t, ix, shape in items]
  writable = jax.process_index() == 0
  base = _dequantized(stio.Reader(base_dir)) if base_dir else None
  copied = [k for k in base.keys() if is_mtp(k, cfg)] if base else []
  # (an FP8 release's MTP weights are written dequantised, in the export's dtype)
  specs += [(k, base.shape(k), stio.DTYPES.get(base.dtype(k), dt)) for k in copied]

  def produce(i):
    if i < len(items):
      return _export(flat, *items[i][:2], cfg, pieces[i][2])
    name, shape, dtype = pieces[i]  # a copied tensor: only the writing process reads it
    return base.read(name) if writable else np.empty(shape, dtype)

  pieces = specs
  specs, produce = _fuse(cfg, pieces, produce)
  config = config_to_hf(cfg, dt.name, base_config)
  if quantize:
    specs, produce = compressed_int4.pack_specs(specs, produce)
    config['quantization_config'] = compressed_int4.quantization_config()

  stio.write_sharded(out_dir, specs, produce, max_shard_size, writable)
  if writable:
    with open(os.path.join(out_dir, 'config.json'), 'w') as f:
      json.dump(config, f, indent=2, sort_keys=True)

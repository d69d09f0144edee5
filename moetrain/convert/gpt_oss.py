"""gpt-oss's Hugging Face layout (transformers 4.57 `gpt_oss`): config.json, the weight table,
and its fused expert tensors. The experts of a layer are stored together, [E, D, 2F] for gate and
up interleaved along the last axis (gate at even columns) plus [E, F, D] for down, unlike every
other family's per-expert [out, in] Linear weights; the released checkpoints hold them as MXFP4
(`*_blocks` of packed 4-bit codes, `*_scales` of power-of-two exponents per 32 values). The
table names per-expert pieces as the other families do; `FusedReader` presents the fused (or
MXFP4) tensors under those names, dequantised, and `fuse` assembles exports back."""

import re

import numpy as np

from moetrain.convert import fused_lora, standard
from moetrain.model.config import ModelConfig

# moetrain's per-expert piece -> (fused tensor, its column slice of the fused tensor's last
# axis for gate/up (None: all), whether it is a bias).
PIECES = {
  'gate_proj.weight': ('gate_up_proj', slice(0, None, 2), False),
  'up_proj.weight': ('gate_up_proj', slice(1, None, 2), False),
  'down_proj.weight': ('down_proj', slice(None), False),
  'gate_proj.bias': ('gate_up_proj_bias', slice(0, None, 2), True),
  'up_proj.bias': ('gate_up_proj_bias', slice(1, None, 2), True),
  'down_proj.bias': ('down_proj_bias', slice(None), True),
}
_VIRTUAL = re.compile(r'(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+\.(?:weight|bias))$')
# The e2m1 values of a 4-bit code (sign bit 3), as the MXFP4 format defines them.
FP4_VALUES = np.asarray(
  [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32
)


def dequant_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """float32 [..., rows, G * 32] of MXFP4 `blocks` [..., rows, G, 16] (two codes a byte, the low
  nibble first) and `scales` [..., rows, G] (exponents biased by 127), as transformers'
  convert_moe_packed_tensors before its final transpose."""
  codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], -1)
  exp = scales.astype(np.int32) - 127
  out = np.ldexp(FP4_VALUES[codes], exp[..., None])
  return out.reshape(*out.shape[:-2], -1)


class FusedReader:
  """A checkpoint Reader whose fused expert tensors (plain or MXFP4) read as per-expert pieces
  'model.layers.{l}.mlp.experts.{e}.<gate|up|down>_proj.<weight|bias>' in the [out, in] layout
  of the other families ([1, out] for a bias). Only the piece's expert is read."""

  def __init__(self, reader):
    self.reader, self.directory = reader, reader.directory
    self.virtual = {}  # piece name -> (experts prefix, expert, piece)
    hidden = set()
    for key in reader.keys():
      m = re.fullmatch(r'(model\.layers\.\d+\.mlp\.experts)\.(\w+?)(_blocks|_scales)?', key)
      if not m or m.group(2) not in {f for f, _, _ in PIECES.values()}:
        continue
      hidden.add(key)
      e = self._fused_shape(m.group(1), m.group(2))[0]
      for piece, (fused, _, _) in PIECES.items():
        if fused == m.group(2):
          for i in range(e):
            self.virtual[f'{m.group(1)}.{i}.{piece}'] = (m.group(1), i, piece)
    self.plain = [k for k in reader.keys() if k not in hidden]

  def keys(self) -> list[str]:
    return self.plain + list(self.virtual)

  def __contains__(self, name: str) -> bool:
    return name in self.virtual or name in self.reader

  def _fused_shape(self, prefix, fused):
    if f'{prefix}.{fused}' in self.reader:
      return self.reader.shape(f'{prefix}.{fused}')
    e, rows, g, b = self.reader.shape(f'{prefix}.{fused}_blocks')
    return (e, g * b * 2, rows)  # the MXFP4 codes are stored [E, out, in]: transposed

  def shape(self, name: str) -> tuple[int, ...]:
    if name not in self.virtual:
      return self.reader.shape(name)
    prefix, _, piece = self.virtual[name]
    fused, cols, bias = PIECES[piece]
    shape = self._fused_shape(prefix, fused)
    out = len(range(shape[-1])[cols])
    return (1, out) if bias else (out, shape[1])

  def dtype(self, name: str) -> str:
    if name not in self.virtual:
      return self.reader.dtype(name)
    prefix, _, piece = self.virtual[name]
    fused = f'{prefix}.{PIECES[piece][0]}'
    return self.reader.dtype(fused) if fused in self.reader else 'F32'

  def read(self, name: str, index=None) -> np.ndarray:
    if name not in self.virtual:
      return self.reader.read(name, index)
    prefix, e, piece = self.virtual[name]
    fused, cols, bias = PIECES[piece]
    key = f'{prefix}.{fused}'
    if key in self.reader:
      x = self.reader.read(key, (slice(e, e + 1),))[0]  # [in, out] or [out] (a bias)
    else:
      sl = (slice(e, e + 1),)
      # uint8 codes and exponents, which Reader.read (float tensors only) refuses
      raw = (np.asarray(self.reader._slice(f'{key}{s}')[sl]) for s in ('_blocks', '_scales'))
      blocks, scales = (x[0] for x in raw)
      x = dequant_mxfp4(blocks, scales).T  # [in, out]
    x = x[..., cols]
    x = x[None] if bias else x.T
    return x[tuple(index)] if index else x


def fuse(specs, produce):
  """(specs, produce) of save_hf with every layer's per-expert pieces assembled into the fused
  tensors transformers loads: [E, D, 2F] gate_up_proj (interleaved), [E, F, D] down_proj and
  their biases [E, 2F], [E, D]."""
  out_specs, makers, groups = [], [], {}
  for i, (name, shape, dtype) in enumerate(specs):
    m = _VIRTUAL.match(name)
    if not m:
      out_specs.append((name, shape, dtype))
      makers.append(lambda i=i: produce(i))
      continue
    fused, cols, _ = PIECES[m.group(3)]
    groups.setdefault(f'{m.group(1)}.{fused}', []).append((i, int(m.group(2)), cols, shape, dtype))
  for target, parts in groups.items():
    e = 1 + max(p[1] for p in parts)
    out = sum(shape[0] for _, x, _, shape, _ in parts if x == 0)  # pieces are [out, in]
    bias = target.endswith('_bias')
    shape = (
      (e, sum(s[1] for _, x, _, s, _ in parts if x == 0)) if bias else (e, parts[0][3][1], out)
    )
    out_specs.append((target, shape, parts[0][4]))
    makers.append(lambda parts=parts, shape=shape: _assemble(parts, shape, produce))
  return out_specs, lambda i: makers[i]()


def _assemble(parts, shape, produce) -> np.ndarray:
  out = None
  for i, e, cols, _, _ in parts:
    x = np.asarray(produce(i))
    if out is None:
      out = np.zeros(shape, x.dtype)
    out[e, ..., cols] = x[0] if len(shape) == 2 else x.T
  return out


def fuse_named(pairs):
  """fuse for an iterator of (name, array): the fused tensors where all their pieces are there."""
  pairs = list(pairs)
  specs = [(n, np.shape(x), np.asarray(x).dtype) for n, x in pairs]
  specs, produce = fuse(specs, lambda i: pairs[i][1])
  return [(name, produce(i)) for i, (name, _, _) in enumerate(specs)]


def _read(c: dict, kw: dict) -> dict:
  """layer_types absent: sliding then full, alternating (transformers' default); the released
  rope_scaling is YaRN without truncation (also transformers' default when the key is absent)."""
  n = kw['num_layers']
  types = c.get('layer_types') or [
    'sliding_attention' if (i + 1) % 2 else 'full_attention' for i in range(n)
  ]
  rs = c['rope_scaling'] if 'rope_scaling' in c else DEFAULT_YARN
  return {
    **standard._yarn_from_hf({'rope_scaling': rs}),
    'layer_types': tuple(types),
    'ffn_hidden_size': kw['expert_ffn_hidden_size'],  # no dense MLP
  }


def _write(cfg: ModelConfig) -> dict:
  return {
    **standard._yarn_to_hf(cfg),
    'head_dim': cfg.gqa_head_dim,
    'layer_types': list(cfg.layer_types),
    'experts_per_token': cfg.moe_topk,  # the key OpenAI's own loader reads
  }


DEFAULT_YARN = {
  'rope_type': 'yarn',
  'factor': 32.0,
  'beta_fast': 32.0,
  'beta_slow': 1.0,
  'truncate': False,
  'original_max_position_embeddings': 4096,
}


class GptOss(standard.Family):
  """The table of a standard family, its experts' pieces named per expert (FusedReader, fuse);
  the router (mlp.router: weight and bias) and each layer's attention sinks."""

  def moe_entries(self, cfg: ModelConfig) -> list:
    return [
      ('mlp.router.weight', 'moe.router', 1),
      ('mlp.router.bias', 'moe.router_linear_bias', None),
    ]

  def expert_entries(self) -> list:
    out = [(f'mlp.experts.{{e}}.{n}_proj.weight', f'moe.experts.{n}', 1) for n in _NAMES]
    return out + [
      (f'mlp.experts.{{e}}.{n}_proj.bias', f'moe.experts.{n}_bias', None) for n in _NAMES
    ]

  PEFT_FUSED = fused_lora.GPT_OSS  # PEFT's LoRA reaches these experts as parameters

  def reader(self, reader, cfg: ModelConfig):
    return FusedReader(reader)

  def fuse(self, specs, produce):
    return fuse(specs, produce)


_NAMES = ('gate', 'up', 'down')
GPT_OSS = GptOss(
  'gpt_oss',
  'GptOssForCausalLM',
  required={
    'num_key_value_heads': 'num_kv_heads',
    'intermediate_size': 'expert_ffn_hidden_size',
    'num_local_experts': 'n_routed_experts',
  },
  optional={
    'head_dim': ('head_dim', 64),
    'sliding_window': ('sliding_window', 128),
    'rms_norm_eps': ('rms_norm_eps', 1e-5),
    'rope_theta': ('rope_theta', 150000.0),
    'initializer_range': ('init_std', 0.02),
    'max_position_embeddings': ('max_position_embeddings', 131072),
  },
  # transformers sets attention_bias and hard-codes the SwiGLU limit whatever config.json says.
  fixed={'attention_bias': True, 'swiglu_limit': 7.0},
  block='mlp',
  experts=('gate_proj', 'up_proj', 'down_proj'),
  read=_read,
  write=_write,
  router_module='router',
)

"""Block-scaled FP8 releases: float8_e4m3fn Linear weights read as float32 through their scales.

The layout (DeepSeek-V3's inference/kernel.py weight_dequant, transformers' finegrained_fp8
FP8Linear; DeepSeek-V3/V3.2, Kimi-K2-Instruct, GLM-4.5/GLM-5 -FP8, MiniMax-M2, Qwen3-Next and
Qwen3.5 -FP8): a Linear weight X.weight [out, in] is stored as float8_e4m3fn (safetensors
F8_E4M3) beside X.weight_scale_inv, float32 [ceil(out / bo), ceil(in / bi)] for config.json's
quantization_config.weight_block_size [bo, bi] ([128, 128] in the releases). The weight is each
value times the scale of its bo x bi block; the partial blocks at the bottom and right edges
have a scale of their own, as whole ones do. Modules the release leaves unquantised (the
embedding, routers, norms, the head) are stored in bf16 and read as before.

Exactness. A float8 value times its float32 scale is computed in float32, one rounding, as
transformers' Fp8Dequantize does; a bfloat16 run rounds that once more (as DeepSeek's
fp8_cast_bf16 does). QLoRA int8/int4 quantises the dequantised weights again, a layer at a
time, one expert at a time within it (stacked_io.load_row): no float copy of the whole model."""

import numpy as np

from moetrain.convert import safetensors_io as stio

FP8 = 'F8_E4M3'  # safetensors' name of float8_e4m3fn
SCALE = '_scale_inv'  # X.weight's scales: X.weight_scale_inv
BLOCK = (128, 128)  # weight_dequant's block where config.json names none
FORMATS = ('e4m3', 'float8_e4m3fn')  # quantization_config.fmt (DeepSeek's; MiniMax-M2's)


def quantization_config(config_json: dict) -> dict:
  """config.json's quantization_config, its own or (a multimodal checkpoint's) its
  text_config's; {} without one. Every quantised release reader starts from it."""
  text = config_json.get('text_config') or {}
  return config_json.get('quantization_config') or text.get('quantization_config') or {}


def block_size(config_json: dict) -> tuple[int, int]:
  """quantization_config.weight_block_size (rows, cols) of config.json's quant_method fp8 config
  (its own or its text_config's); BLOCK without one. Another fmt than float8_e4m3fn, or a block
  size that is not two positive integers, is refused naming the key."""
  qc = quantization_config(config_json)
  if qc.get('quant_method') != 'fp8':
    return BLOCK
  if (fmt := qc.get('fmt', FORMATS[0])) not in FORMATS:
    raise ValueError(
      f'config.json quantization_config.fmt={fmt!r} is unsupported: moetrain reads block-scaled '
      f'float8_e4m3fn weights (fmt one of {list(FORMATS)})'
    )
  block = qc.get('weight_block_size')
  sides = block if isinstance(block, list | tuple) and len(block) == 2 else ()
  if not sides or not all(type(b) is int and b > 0 for b in sides):
    raise ValueError(
      f'config.json quantization_config.weight_block_size={block!r} is unsupported: moetrain '
      'reads block-scaled FP8 weights, two positive block sides [rows, cols] ([128, 128])'
    )
  return tuple(sides)


def dequantize(values: np.ndarray, scale: np.ndarray, block, start=(0, 0)) -> np.ndarray:
  """float32 weights of float8 `values` [r, c] whose first element is (start) of the tensor, and
  the scales [R, C] of the blocks they touch (the first that of the block holding `start`)."""
  (bo, bi), (r0, c0) = block, start
  s = np.repeat(np.asarray(scale, np.float32), bo, axis=0)[r0 % bo :][: values.shape[0]]
  s = np.repeat(s, bi, axis=1)[:, c0 % bi :][:, : values.shape[1]]
  return values.astype(np.float32) * s


def _span(ix, n: int) -> tuple[int, int]:
  a, b, step = ix.indices(n)
  return (a, max(a, b)) if step == 1 else (0, n)  # another step: the whole axis, then sliced


class Fp8Reader:
  """A checkpoint Reader whose float8 weights X.weight read as float32 [out, in], dequantised
  with X.weight_scale_inv, which keys() hides. `read` of a part reads only its rows of the
  float8 values and the scales of the blocks it touches. Every pair is checked from the
  headers when the reader is made; errors name the tensor and its file. Other tensors (and
  read_int) read as the wrapped reader reads them."""

  def __init__(self, reader, block=BLOCK):
    self.reader, self.directory, self.block = reader, reader.directory, tuple(block)
    self.fp8 = {k for k in reader.keys() if reader.dtype(k) == FP8}
    for name in sorted(self.fp8):
      self._check(name)
    for scale in (k for k in reader.keys() if k.endswith(SCALE)):
      if (name := scale.removesuffix(SCALE)) not in self.fp8:
        dtype = reader.dtype(name) if name in reader else 'no tensor'
        raise ValueError(
          f'{scale} in {reader.path(scale)}: beside {name} of {dtype}, not float8_e4m3fn '
          '(a block scale belongs to a float8 weight)'
        )
    hidden = {n + SCALE for n in self.fp8}
    self.plain = [k for k in reader.keys() if k not in hidden]
    self.files = getattr(reader, 'files', {})

  def _check(self, name: str) -> None:
    r, scale = self.reader, name + SCALE
    if scale not in r:
      raise ValueError(
        f'{name} in {r.path(name)}: float8_e4m3fn without its {scale} (block-scaled FP8 '
        'weights are read with their inverse scales)'
      )
    shape, got = r.shape(name), r.shape(scale)
    want = tuple(-(-n // b) for n, b in zip(shape, self.block))
    if len(shape) != 2 or got != want or r.dtype(scale) not in stio.DTYPES:
      raise ValueError(
        f'{scale} in {r.path(scale)}: {r.dtype(scale)} {got} beside {name} {shape}; blocks of '
        f'{list(self.block)} (quantization_config.weight_block_size) need float scales {want}'
      )

  def keys(self) -> list[str]:
    return list(self.plain)

  def __contains__(self, name: str) -> bool:
    return name in self.reader

  def shape(self, name: str) -> tuple[int, ...]:
    return self.reader.shape(name)

  def dtype(self, name: str) -> str:
    return self.reader.dtype(name)

  def path(self, name: str) -> str:
    return self.reader.path(name)

  def read_int(self, name: str, index=None) -> np.ndarray:
    return self.reader.read_int(name, index)

  def read(self, name: str, index=None) -> np.ndarray:
    """The tensor, or the part selected by a tuple of slices (rows, cols); float8 weights
    dequantised to float32."""
    if self.reader.dtype(name) != FP8:
      return self.reader.read(name, index)
    shape, (bo, bi) = self.reader.shape(name), self.block
    ix = (*(index or ()), slice(None), slice(None))[:2]
    (r0, r1), (c0, c1) = (_span(i, n) for i, n in zip(ix, shape))
    values = self.reader.read_stored(name, (slice(r0, r1), slice(c0, c1)))
    scale = self.reader.read(
      name + SCALE, (slice(r0 // bo, -(-r1 // bo)), slice(c0 // bi, -(-c1 // bi)))
    )
    w = dequantize(values, scale, self.block, (r0, c0))
    if not stio.finite(w):
      raise ValueError(
        f'{name} in {self.path(name)} dequantises to non-finite values (a NaN float8 value or '
        'an infinite scale): the checkpoint is damaged'
      )
    sub = tuple(slice(None) if (i.step or 1) == 1 else i for i in ix)
    return w[sub]


def wrap(reader, config_json: dict):
  """`reader`, or an Fp8Reader over it when it holds float8 weights or their scales."""
  if not any(k.endswith(SCALE) or reader.dtype(k) == FP8 for k in reader.keys()):
    return reader
  return Fp8Reader(reader, block_size(config_json))

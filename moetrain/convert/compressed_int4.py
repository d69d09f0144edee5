"""compressed-tensors `pack-quantized` int4 checkpoints (Kimi-K2-Thinking, Kimi-K2.5): packed
Linear weights read as floats or carried into moetrain's int4 codes, and exports packed back.

The layout (compressed-tensors' pack_to_int32 / unpack_from_int32, symmetric int4 in groups
along the inputs): a Linear weight X.weight [out, in] is stored as X.weight_packed, int32
[out, ceil(in / 8)], whose word j holds the codes of inputs 8j..8j+7 in 4-bit steps from the
lowest bits, each code c in [-8, 7] as the unsigned nibble c + 8 (padding nibbles 0);
X.weight_scale [out, in / group] (bfloat16 in the releases); X.weight_shape = [out, in]. The
weight is (nibble - 8) * scale of its group.

Exactness. engine.quant=int4 with a quant_group_size that divides the checkpoint's group (32 or
16 for Kimi's 32) carries the nibbles and scales over unchanged (`exact_piece`): the QLoRA base
equals the release's weights bit for bit, and no float copy of an expert is made. Without
quantisation the weights are dequantised one expert at a time in float32, where a code times a
bfloat16 scale is exact, then cast to the run's dtype (exact in float32; bfloat16 rounds
products that need more than 8 significant bits, as the release's own bfloat16 dequantisation
does). int8, or int4 of another group size (the default 64), quantises those floats again per
layer: not exact."""

import functools
import re

import jax
import ml_dtypes
import numpy as np

from moetrain.convert import block_fp8
from moetrain.kernels import quant

PACK = 8  # int4 codes per int32 word, the first input in the lowest bits
OFFSET = 8  # a code c in [-8, 7] is stored as the nibble c + 8
SUFFIXES = ('_packed', '_scale', '_shape')  # of X.weight
FORMAT = 'pack-quantized'
EXPORT = 'compressed-int4'  # the export tool's --quantize value
# A routed expert's Linear weight (per-expert names: every family but gpt-oss's fused experts).
EXPERT = re.compile(r'.*\.experts\.\d+\.\w+\.weight')
_SCHEME = {'num_bits': 4, 'type': 'int', 'symmetric': True, 'strategy': 'group'}


def group_size(config_json: dict) -> int | None:
  """The group size of config.json's compressed-tensors quantization_config (its own or its
  text_config's); None without one. Anything but pack-quantized symmetric int4 in groups along
  the inputs, weights only, is refused naming the key."""
  qc = block_fp8.quantization_config(config_json)
  if not qc or qc.get('quant_method') != 'compressed-tensors':
    return None
  sizes = set()
  for name, group in (qc.get('config_groups') or {}).items():
    w = group.get('weights') or {}
    bad = {k: w.get(k) for k, v in _SCHEME.items() if w.get(k) != v}
    bad.update({k: group[k] for k in ('input_activations', 'output_activations') if group.get(k)})
    if w.get('actorder'):
      bad['actorder'] = w['actorder']
    if (fmt := group.get('format') or qc.get('format')) != FORMAT:
      bad['format'] = fmt
    if bad:
      raise ValueError(
        f'config.json quantization_config.config_groups.{name}: {bad} is unsupported: moetrain '
        f'reads {FORMAT} weights, {_SCHEME}, without activation quantisation'
      )
    sizes.add(w.get('group_size'))
  g = next(iter(sizes)) if len(sizes) == 1 else None
  if not isinstance(g, int) or g <= 0 or g % 2:
    raise ValueError(
      f'config.json quantization_config: group_size {sorted(map(str, sizes))} is unsupported: '
      'one positive even group size for every config group'
    )
  return g


def unpack(packed: np.ndarray, n_in: int) -> np.ndarray:
  """uint8 nibbles (code + 8) [..., n_in] of int32 words [..., ceil(n_in / 8)]."""
  words = np.ascontiguousarray(packed).view(np.uint32)
  nib = (words[..., None] >> (4 * np.arange(PACK, dtype=np.uint32))) & 0xF
  return nib.reshape(*words.shape[:-1], -1)[..., :n_in].astype(np.uint8)


def pack(nibbles: np.ndarray) -> np.ndarray:
  """int32 words [..., ceil(n / 8)] of uint8 nibbles [..., n] (padded with nibble 0)."""
  pad = [(0, 0)] * (nibbles.ndim - 1) + [(0, -nibbles.shape[-1] % PACK)]
  x = np.pad(nibbles.astype(np.uint32), pad)
  x = x.reshape(*x.shape[:-1], -1, PACK) << (4 * np.arange(PACK, dtype=np.uint32))
  return np.bitwise_or.reduce(x, axis=-1).astype(np.uint32).view(np.int32)


def dequantize(nibbles: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
  """float32 weights [..., n] of nibbles [..., n] and their groups' scales [..., n / group]."""
  s = np.repeat(np.asarray(scale, np.float32), group, axis=-1)[..., : nibbles.shape[-1]]
  return (nibbles.astype(np.float32) - OFFSET) * s


class PackedReader:
  """A checkpoint Reader whose pack-quantized weights (X.weight_packed, X.weight_scale,
  X.weight_shape) read as X.weight [out, in]: `read` dequantises the rows asked for to float32,
  `codes` gives their nibbles and scales. The other tensors (the release's ignore list:
  attention, shared experts, the head) read as before. Every triple is checked from the headers
  when the reader is made; errors name the tensor and its file."""

  def __init__(self, reader, group: int | None = None):
    self.reader, self.directory = reader, reader.directory
    names = [k.removesuffix('_packed') for k in reader.keys() if k.endswith('.weight_packed')]
    self.packed = {n: self._check(n, group) for n in names}  # X.weight -> (out, in, group)
    hidden = {n + s for n in self.packed for s in SUFFIXES}
    self.plain = [k for k in reader.keys() if k not in hidden]
    files = getattr(reader, 'files', {})
    self.files = {**files, **{n: files.get(n + '_packed') for n in self.packed}}
    self._verified = set()

  def _check(self, name: str, group: int | None) -> tuple[int, int, int]:
    r, packed, scale = self.reader, name + '_packed', name + '_scale'
    for other in (scale, name + '_shape'):
      if other not in r:
        raise ValueError(
          f'{packed} in {r.path(packed)} has no {other} beside it (a pack-quantized weight '
          f'is the three tensors {[name + s for s in SUFFIXES]})'
        )
    if r.dtype(packed) != 'I32' or len(r.shape(packed)) != 2 or len(r.shape(scale)) != 2:
      raise ValueError(
        f'{packed} in {r.path(packed)}: {r.dtype(packed)} {r.shape(packed)} with scales '
        f'{r.shape(scale)}; expected int32 [out, in / 8] and [out, in / group]'
      )
    (out, words), (s_out, n_groups) = r.shape(packed), r.shape(scale)
    n_in = words * PACK
    g = group or n_in // max(n_groups, 1)
    if s_out != out or not g or n_in % g or n_in // g != n_groups:
      raise ValueError(
        f'{scale} in {r.path(scale)}: shape {(s_out, n_groups)} beside {packed} {(out, words)} '
        f'({n_in} inputs): group_size {g} does not divide them into {n_groups} groups'
      )
    return out, n_in, g

  def keys(self) -> list[str]:
    return self.plain + list(self.packed)

  def __contains__(self, name: str) -> bool:
    return name in self.packed or name in self.reader

  def shape(self, name: str) -> tuple[int, ...]:
    return self.packed[name][:2] if name in self.packed else self.reader.shape(name)

  def dtype(self, name: str) -> str:
    return self.reader.dtype(name + '_scale' if name in self.packed else name)

  def path(self, name: str) -> str:
    return self.reader.path(name + '_packed' if name in self.packed else name)

  def group(self, name: str) -> int:
    return self.packed[name][2]

  def codes(self, name: str, rows=slice(None)) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 nibbles [r, in], float32 scales [r, in / group]) of `rows` of packed `name`."""
    out, n_in, _ = self.packed[name]
    if name not in self._verified:  # the stored shape: one small read per tensor, on first use
      got = tuple(int(v) for v in self.reader.read_int(name + '_shape'))
      if got != (out, n_in):
        raise ValueError(
          f'{name}_shape in {self.reader.path(name + "_shape")} is {got}, but {name}_packed '
          f'holds ({out}, {n_in}): padded inputs are unsupported'
        )
      self._verified.add(name)
    nib = unpack(self.reader.read_int(name + '_packed', (rows,)), n_in)
    return nib, self.reader.read(name + '_scale', (rows,)).astype(np.float32)

  def read(self, name: str, index=None) -> np.ndarray:
    if name not in self.packed:
      return self.reader.read(name, index)
    rows, cols = (*(index or ()), slice(None), slice(None))[:2]
    nib, scale = self.codes(name, rows)
    return dequantize(nib, scale, self.group(name))[:, cols]


def wrap(reader, config_json: dict):
  """`reader`, or a PackedReader over it when it holds pack-quantized weights."""
  if not any(k.endswith('.weight_packed') for k in reader.keys()):
    return reader
  return PackedReader(reader, group_size(config_json))


# ---------------------------------------------------------------------------------------------
# Into moetrain's int4 storage


def exact_group(reader, row, group: int) -> int | None:
  """moetrain's int4 group for expert row `row` when its checkpoint tensors are packed in
  groups that it subdivides (quant_group_size 32 or 16 under Kimi's 32), so the codes and
  scales carry over unchanged; None otherwise (the weights are quantised again)."""
  if not (isinstance(reader, PackedReader) and row.experts and row.stacked and row.n_in == 1):
    return None
  name = row.name(row.indices(1)[0])
  if name not in reader.packed:
    return None
  _, n_in, ckpt_group = reader.packed[name]
  g = quant.int4_group(n_in, group)
  return g if ckpt_group % g == 0 else None


def to_moetrain(nib: np.ndarray, scale: np.ndarray, ckpt_group: int, g: int):
  """moetrain's int4 (q [K/g, g/2, N] uint8, scale [K/g, 1, N] float32; quant.quantize's
  layout: two codes + 8 a byte, the even input in the low nibble) of one expert's nibbles
  [N, K] and scales [N, K / ckpt_group], g dividing ckpt_group: a re-laying, no arithmetic."""
  n, k = nib.shape
  q = (nib[:, 0::2] | (nib[:, 1::2] << 4)).reshape(n, k // g, g // 2)
  s = np.repeat(scale, ckpt_group // g, axis=1)[:, :, None]
  return q.transpose(1, 2, 0), s.transpose(1, 2, 0)


def exact_piece(reader: PackedReader, row, ix, shapes, shardings, g: int, scale_dtype):
  """(q, scale) of layer ix of expert row `row` ([E, K/g, g/2, N] and [E, K/g, 1, N]) placed by
  `shardings`: each device block is re-laid from the packed codes of its experts and output
  rows, as stacked_io's float pieces are read."""
  cache = {}

  def block(index, which):
    key = (index[0].indices(shapes[0][0])[:2], index[3].indices(shapes[0][3])[:2])
    if key not in cache:
      parts = []
      for e in range(*key[0]):
        name = row.name((*ix, e))
        nib, scale = reader.codes(name, slice(*key[1]))
        parts.append(to_moetrain(nib, scale, reader.group(name), g))
      cache[key] = [np.stack(p) for p in zip(*parts)]
    x = cache[key][which][(slice(None), index[1], index[2])]
    return x.astype(scale_dtype) if which else x

  return tuple(
    jax.make_array_from_callback(tuple(s), sh, functools.partial(_call, block, which))
    for which, (s, sh) in enumerate(zip(shapes, shardings))
  )


def _call(block, which, index):
  return block(index, which)


# ---------------------------------------------------------------------------------------------
# Exports


def quantize(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
  """(nibbles [out, in], bfloat16 scales [out, in / group]) of float weights [out, in]: each
  group takes the scale max|w| / k (k = 7, 8, 6, ..., 1) of least squared error, so weights on
  an int4 grid (codes times a bfloat16 scale: an imported base, unchanged) come back exactly;
  others cost up to eight passes."""
  w = np.asarray(w, np.float32)
  wg = w.reshape(w.shape[0], -1, group)
  amax = np.abs(wg).max(-1)
  best_err, best = np.full(amax.shape, np.inf, np.float32), np.ones(amax.shape, np.float32)
  for k in (7, 8, 6, 5, 4, 3, 2, 1):
    s = (amax / k).astype(ml_dtypes.bfloat16).astype(np.float32)
    s = np.where(s == 0, 1.0, s)
    err = ((np.clip(np.round(wg / s[..., None]), -8, 7) * s[..., None] - wg) ** 2).sum(-1)
    better = err < best_err
    best_err, best = np.where(better, err, best_err), np.where(better, s, best)
    if not best_err.any():
      break
  codes = np.clip(np.round(wg / best[..., None]), -8, 7) + OFFSET
  return codes.astype(np.uint8).reshape(w.shape), best.astype(ml_dtypes.bfloat16)


def pack_specs(specs, produce, group: int = 32):
  """(specs, produce) of save_hf with every routed expert's weight [out, in] written as its
  pack-quantized triple (quantize, pack); the other tensors as they were."""
  out_specs, makers, last = [], [], {}

  def packed(i):  # the words and the scales of one expert from one quantisation
    if last.get('i') != i:
      nib, scale = quantize(produce(i), group)
      last.update(i=i, value=(pack(nib), scale))
    return last['value']

  for i, (name, shape, dtype) in enumerate(specs):
    if not (EXPERT.fullmatch(name) and len(shape) == 2):
      out_specs.append((name, shape, dtype))
      makers.append(functools.partial(produce, i))
      continue
    n_out, n_in = shape
    if n_in % group:
      raise ValueError(f'{name}: {n_in} inputs, not a multiple of the group size {group}')
    out_specs += [
      (name + '_packed', (n_out, -(-n_in // PACK)), np.int32),
      (name + '_scale', (n_out, n_in // group), ml_dtypes.bfloat16),
      (name + '_shape', (2,), np.int64),
    ]
    makers += [
      lambda i=i: packed(i)[0],
      lambda i=i: packed(i)[1],
      lambda shape=shape: np.asarray(shape, np.int64),
    ]
  if len(out_specs) == len(specs):
    raise ValueError(f'--quantize={EXPORT}: the model has no per-expert Linear weights to pack')
  return out_specs, lambda i: makers[i]()


def quantization_config(group: int = 32) -> dict:
  """config.json's quantization_config of a pack_specs export: the routed experts' Linear
  layers (named by a regular expression) int4 in groups of `group`; the rest unquantised."""
  weights = {
    **_SCHEME,
    'group_size': group,
    'actorder': None,
    'block_structure': None,
    'dynamic': False,
    'observer': 'minmax',
    'observer_kwargs': {},
  }
  return {
    'quant_method': 'compressed-tensors',
    'format': FORMAT,
    'quantization_status': 'compressed',
    'config_groups': {
      'group_0': {
        'targets': [r're:.*\.experts\.\d+\.\w+$'],
        'weights': weights,
        'input_activations': None,
        'output_activations': None,
      }
    },
    'ignore': ['lm_head'],
    'kv_cache_scheme': None,
    'sparsity_config': {},
  }

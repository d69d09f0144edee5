"""Stacked moetrain variables <-> per-layer, per-expert 2-D checkpoint tensors, streamed."""

import dataclasses
import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moetrain.convert import compressed_int4
from moetrain.kernels import quant


@dataclasses.dataclass(frozen=True)
class Row:
  """A moetrain variable and the checkpoint tensors that fill it, one per layer and expert."""

  name_template: str  # e.g. 'model.layers.{l}.mlp.experts.{e}.up_proj.weight'
  path: str  # dotted moetrain state path, e.g. 'layers.moe.experts.up'
  # Input dims of a kernel [in..., out...]: the checkpoint holds it transposed and flattened,
  # [prod(out), prod(in)] (torch Linear). None: the same layout on both sides.
  n_in: int | None
  # A stacked variable's leading layer axis L: the checkpoint's layer number {l} of each entry
  # (a group of layers: range(start, start + count)); () = not stacked.
  layers: tuple = ()
  experts: bool = False  # then the routed-expert axis E

  @property
  def key(self) -> tuple[str, ...]:
    return tuple(self.path.split('.'))

  @property
  def stacked(self) -> bool:
    return bool(self.layers)

  @property
  def lead(self) -> int:  # leading axes that one checkpoint tensor's index ix covers
    return self.stacked + self.experts

  def indices(self, num_experts: int) -> list[tuple[int, ...]]:
    """Index (layer position, expert) of each checkpoint tensor of the row."""
    ls = [(i,) for i in range(len(self.layers))] if self.stacked else [()]
    return [(*ix, e) for ix in ls for e in range(num_experts)] if self.experts else ls

  def name(self, ix: tuple[int, ...]) -> str:
    layer = self.layers[ix[0]] if ix else 0
    return self.name_template.format(l=layer, e=ix[1] if len(ix) > 1 else 0)

  def quant_dims(self) -> tuple[int, int]:
    """(batch dims, input dims) of a per-layer piece, as Embed / Linear / Experts quantise it."""
    return (1, 1) if self.experts or self.n_in is None else (0, self.n_in)


def flat_shape(shape, n_in: int | None) -> tuple[int, ...]:
  """Checkpoint shape of a per-layer (per-expert) moetrain piece of `shape`."""
  return tuple(shape) if n_in is None else (math.prod(shape[n_in:]), math.prod(shape[:n_in]))


def to_flat(w, n_in: int | None):
  return w if n_in is None else w.reshape(math.prod(w.shape[:n_in]), -1).T


def read_block(reader, name, shape, n_in, index, dtype) -> np.ndarray:
  """Block `index` (slices) of the moetrain view, of shape `shape`, of checkpoint tensor `name`.
  Reads only the rows / columns covering the first sliced input and output dims."""
  if n_in is None:
    return reader.read(name, index).astype(dtype)
  ins, outs = shape[:n_in], shape[n_in:]

  def span(dims, ix):
    a, b, _ = ix[0].indices(dims[0])
    inner = math.prod(dims[1:])
    return slice(a * inner, b * inner), b - a

  rows, n_out0 = span(outs, index[n_in:])
  cols, n_in0 = span(ins, index[:n_in])
  w = reader.read(name, (rows, cols)).T.reshape(n_in0, *ins[1:], n_out0, *outs[1:])
  return np.ascontiguousarray(
    w[(slice(None), *index[1:n_in], slice(None), *index[n_in + 1 :])], dtype=dtype
  )


def drop_lead(sharding, n: int, drop_at: int | None = None):
  """The sharding of a per-layer piece: first n dims dropped (and one more at drop_at)."""
  if not isinstance(sharding, NamedSharding):
    return sharding
  spec = list(sharding.spec)  # logical_to_spec names every dim
  if drop_at is not None:
    del spec[n + drop_at]
  return NamedSharding(sharding.mesh, P(*spec[n:]))


@functools.cache
def _zeros(shape, dtype, sharding):
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.cache
def _setter(sharding):
  def set_layer(buf, x, layer):
    return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), layer, 0)

  return jax.jit(set_layer, out_shardings=sharding, donate_argnums=0)


@functools.cache
def _quantizer(bits, n_batch, n_in, group, q_sharding, scale_sharding):
  def f(w):
    t = quant.quantize(w, bits, n_batch, n_in, group)
    return t.q, t.scale

  return jax.jit(f, out_shardings=(q_sharding, scale_sharding))


def _piece(reader, row: Row, ix, shape, sharding, dtype, window=None) -> jax.Array:
  """Layer ix of `row` ([E, ...] for experts) placed by `sharding`: each device block is read
  from the memory-mapped file, one checkpoint-tensor slice at a time. window (axis, start,
  stop): only that range of the piece along one axis (a chunk of an unstacked variable)."""
  cache = {}  # devices holding the same block (replicated axes) share one host copy
  out_shape = list(shape)
  if window is not None:
    out_shape[window[0]] = window[2] - window[1]

  def block(index):
    if window is not None:
      ax, start, _ = window
      a, b, _ = index[ax].indices(out_shape[ax])
      index = (*index[:ax], slice(start + a, start + b), *index[ax + 1 :])
    key = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
    if key not in cache:
      if row.experts:
        es = range(*key[0])
        out = np.empty((len(es), *(b - a for a, b in key[1:])), dtype)
        for i, e in enumerate(es):
          out[i] = read_block(reader, row.name((*ix, e)), shape[1:], row.n_in, index[1:], dtype)
        cache[key] = out
      else:
        cache[key] = read_block(reader, row.name(ix), shape, row.n_in, index, dtype)
    return cache[key]

  return jax.make_array_from_callback(tuple(out_shape), sharding, block)


# An unstacked variable (the embedding, the head) is read and quantised in chunks of at most
# this many float32 bytes, so start-up holds no whole float32 copy of a 163840-token table.
CHUNK_BYTES = 64 * 2**20


def chunk_axis(row: Row, quantized: bool) -> int:
  """The axis an unstacked piece is read in chunks along: its first (vocabulary rows of an
  embedding), or for a quantised kernel without batch dims its last (outputs), since int4
  groups and int8 scales run along the inputs."""
  return 0 if not quantized or row.quant_dims()[0] else -1


def _chunks(shape, axis: int, shardings) -> list[tuple[int, int]] | None:
  """[start, stop) ranges along `axis` of at most CHUNK_BYTES float32 each; None: one piece
  (small enough, or that axis split over devices)."""
  if math.prod(shape) * 4 <= CHUNK_BYTES:
    return None
  for sh in shardings:
    if isinstance(sh, NamedSharding) and len(sh.spec) == len(shape) and sh.spec[axis] is not None:
      return None
  n = shape[axis]
  step = max(1, CHUNK_BYTES // (4 * math.prod(shape) // n))
  return [(a, min(a + step, n)) for a in range(0, n, step)]


@functools.cache
def _chunk_setter(sharding, axis: int):
  def put(buf, x, start):
    return jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), start, axis)

  return jax.jit(put, out_shardings=sharding, donate_argnums=0)


def load_row(
  reader, row: Row, abstract: dict, shardings: dict, float_shape, quant_mode='none', group=64
) -> dict:
  """{state path: jax.Array} of `row`: its variable, or the (q, scale) of a quantised kernel.

  Stacked rows are built layer by layer and written into a donated device buffer, and
  quantisation runs on device per layer, so a host holds at most its devices' blocks of one
  layer's piece (plus one tensor slice being read).
  """
  quantized = row.key not in abstract
  keys = [row.key + ('q',), row.key + ('scale',)] if quantized else [row.key]
  n = int(row.stacked)
  piece_shape = float_shape[n:]
  piece_sh = [drop_lead(shardings[k], n) for k in keys]
  if quantized:
    bits = 8 if quant_mode == 'int8' else 4
    nb, n_in = row.quant_dims()
    float_sh = drop_lead(shardings[keys[0]], n, None if bits == 8 else nb + 1)
    quantize = _quantizer(bits, nb, n_in, group, *piece_sh)
    make = lambda ix, w=None: quantize(
      _piece(reader, row, ix, piece_shape, float_sh, np.float32, w)
    )
    if bits == 4 and (g := compressed_int4.exact_group(reader, row, group)):  # codes as stored
      shapes, dt = [abstract[k].shape[n:] for k in keys], abstract[keys[1]].dtype
      make = lambda ix, w=None: compressed_int4.exact_piece(
        reader, row, ix, shapes, piece_sh, g, dt
      )
  else:
    float_sh = piece_sh[0]
    dt = abstract[row.key].dtype
    make = lambda ix, w=None: (_piece(reader, row, ix, piece_shape, piece_sh[0], dt, w),)
  if not row.stacked:
    axis = chunk_axis(row, quantized) % len(piece_shape)
    chunks = _chunks(piece_shape, axis, [float_sh, *piece_sh])
    if chunks is None:
      return dict(zip(keys, make(())))
    axes = [axis if axis == 0 else abstract[k].ndim - 1 for k in keys]
    bufs = [_zeros(abstract[k].shape, abstract[k].dtype, shardings[k])() for k in keys]
    for a, b in chunks:
      parts = make((), (axis, a, b))
      bufs = [
        _chunk_setter(shardings[k], ax)(buf, x, a) for k, ax, buf, x in zip(keys, axes, bufs, parts)
      ]
    return dict(zip(keys, bufs))
  bufs = [_zeros(abstract[k].shape, abstract[k].dtype, shardings[k])() for k in keys]
  for layer in range(abstract[keys[0]].shape[0]):
    bufs = [_setter(shardings[k])(b, x, layer) for k, b, x in zip(keys, bufs, make((layer,)))]
  return dict(zip(keys, bufs))


def _truncated_normal(rng, shape) -> np.ndarray:
  x = rng.standard_normal(shape)
  while (bad := np.abs(x) > 2).any():  # redraw outside [-2, 2], as jax.random.truncated_normal
    x[bad] = rng.standard_normal(int(bad.sum()))
  return x


def init_adapter(row: Row, shape, sharding, dtype, seed: int) -> jax.Array:
  """A LoRA adapter as Linear / Experts initialise it: B zero, A truncated normal with std
  fan_in**-0.5. A is drawn with numpy per layer and expert from (seed, path, l, e): every host
  agrees on the values, materialises only its own blocks and compiles nothing."""
  piece = shape[row.lead :]
  std = math.prod(piece[:-1]) ** -0.5

  def block(index):
    spans = [range(*s.indices(n)) for s, n in zip(index, shape)]
    out = np.zeros([len(r) for r in spans], dtype)
    if row.path.endswith('lora_b'):
      return out
    for pos in np.ndindex(*out.shape[: row.lead]):
      ix = tuple(int(spans[i][p]) for i, p in enumerate(pos))
      rng = np.random.default_rng([seed, zlib.crc32(row.path.encode()), *ix])
      out[pos] = (std * _truncated_normal(rng, piece))[index[row.lead :]]
    return out

  return jax.make_array_from_callback(tuple(shape), sharding, block)


@functools.partial(jax.jit, static_argnames=('bits', 'axis', 'n_in', 'dtype'))
def _flat_piece(ix, kernel, lora, lora_scale, *, bits, axis, n_in, dtype):
  if bits:
    w = quant.dequant(quant.QTensor(kernel[0][ix], kernel[1][ix], bits, axis), jnp.float32)
  else:
    w = kernel[ix]
  if lora is not None:
    a, b = (x[ix].astype(jnp.float32) for x in lora)
    w = w.astype(jnp.float32) + lora_scale * jnp.tensordot(a, b, axes=1)
  return to_flat(w.astype(dtype), n_in)


def export_piece(row: Row, ix, kernel, lora=None, lora_scale=0.0, bits=0, dtype=np.float32):
  """Checkpoint tensor ix of `row` on the host: the kernel (or its (q, scale) codes, decoded),
  plus lora_scale * A @ B when `lora` holds the stacked (A, B). Sliced on device, so only
  that tensor is gathered (across processes when the array spans several)."""
  axis = 0
  if bits == 4:  # QTensor counts the groups dim from the end: nb - E of the piece's q dims
    axis = row.quant_dims()[0] - row.experts - (kernel[0].ndim - row.lead)
  out = _flat_piece(
    ix, kernel, lora, lora_scale, bits=bits, axis=axis, n_in=row.n_in, dtype=jnp.dtype(dtype)
  )
  return to_host(out)


def to_host(x) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)

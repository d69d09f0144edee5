"""Storage of frozen base weights: plain float parameters, or int8 / int4 for QLoRA.
(Design: docs/design.md, "moetrain/kernels/quant.py".)"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.core.engine import EngineConfig


class QuantWeight(nnx.Variable):
  """Frozen quantised storage (codes or scales); never trained, never in the optimizer."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QTensor:
  q: jax.Array  # int8 codes, or uint8 holding two int4 codes
  scale: jax.Array
  bits: int = dataclasses.field(metadata={'static': True})
  # int4: the groups dim of q, counted from the end (negative), so stacking layers in front or
  # indexing an expert away leaves it valid.
  axis: int = dataclasses.field(metadata={'static': True})

  @property
  def shape(self):
    if self.bits == 8:
      return self.q.shape
    s, ax = list(self.q.shape), self.q.ndim + self.axis
    return (*s[:ax], s[ax] * s[ax + 1] * 2, *s[ax + 2 :])


class QuantKernel(nnx.Module):
  def __init__(self, q, scale, bits, axis, q_axes, scale_axes):
    self.q = QuantWeight(q, axes=q_axes)
    self.scale = QuantWeight(scale, axes=scale_axes)
    self.bits, self.axis = bits, axis

  def tensor(self) -> QTensor:
    return QTensor(self.q[...], self.scale[...], self.bits, self.axis)


def quantize(w, bits: int, n_batch: int, n_in: int, group: int) -> QTensor:
  w = w.astype(jnp.float32)
  in_axes = tuple(range(n_batch, n_batch + n_in))
  if bits == 8:
    scale = jnp.max(jnp.abs(w), axis=in_axes, keepdims=True) / 127.0
    scale = jnp.where(scale == 0, 1.0, scale)
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return QTensor(q, scale, 8, 0)
  ax = n_batch
  k = w.shape[ax]
  g = int4_group(k, group)
  if k % g:
    raise ValueError(f'quant_group_size: dimension {k} of shape {w.shape} is odd; int4 needs even')
  wg = w.reshape(*w.shape[:ax], k // g, g, *w.shape[ax + 1 :])
  scale = jnp.max(jnp.abs(wg), axis=ax + 1, keepdims=True) / 7.0
  scale = jnp.where(scale == 0, 1.0, scale)
  codes = (jnp.clip(jnp.round(wg / scale), -8, 7) + 8).astype(jnp.uint8)
  lo = jax.lax.slice_in_dim(codes, 0, g, 2, axis=ax + 1)
  hi = jax.lax.slice_in_dim(codes, 1, g, 2, axis=ax + 1)
  return QTensor(lo | (hi << 4), scale, 4, ax - (w.ndim + 1))


def int4_group(k: int, group: int) -> int:
  """The int4 group that an input dim of k rows gets for quant_group_size `group`: the group
  where it divides k (and is even), else the whole dim as one group."""
  return group if (k % group == 0 and group % 2 == 0) else k + (k % 2)


def dequant(w, dtype):
  """Float view of a weight: plain arrays are cast; QTensors are decoded."""
  if not isinstance(w, QTensor):
    return w.astype(dtype)
  if w.bits == 8:
    return (w.q.astype(jnp.float32) * w.scale).astype(dtype)
  ax = w.q.ndim + w.axis
  lo = (w.q & 0xF).astype(jnp.int8) - 8
  hi = (w.q >> 4).astype(jnp.int8) - 8
  codes = jnp.stack([lo, hi], axis=ax + 2)  # [..., K/g, g/2, 2, ...]
  s = codes.shape
  codes = codes.reshape(*s[: ax + 1], s[ax + 1] * 2, *s[ax + 3 :])
  return (codes.astype(jnp.float32) * w.scale).astype(dtype).reshape(w.shape)


def take(w, idx):
  """Indexes the leading (batch) dim of a weight: an expert's slice, or rows of an embedding."""
  if not isinstance(w, QTensor):
    return w[idx]
  return QTensor(w.q[idx], w.scale[idx], w.bits, w.axis)


def make_param(kernel, axes, engine: EngineConfig, n_batch: int = 0, n_in: int = 1):
  """A frozen-base kernel: nnx.Param, or a QuantKernel when engine.quant is int8/int4."""
  if engine.quant == 'none':
    return nnx.Param(kernel, axes=tuple(axes))
  t = quantize(kernel, _bits(engine), n_batch, n_in, engine.quant_group_size)
  return _stored(t, tuple(axes), n_batch, n_in)


def _bits(engine: EngineConfig) -> int:
  return 8 if engine.quant == 'int8' else 4


def _stored(t: QTensor, axes: tuple, n_batch: int, n_in: int) -> QuantKernel:
  if t.bits == 8:
    scale_axes = tuple(None if n_batch <= i < n_batch + n_in else a for i, a in enumerate(axes))
    return QuantKernel(t.q, t.scale, 8, t.axis, axes, scale_axes)
  # The input dim's name on its groups and, as a fallback, on the rows within a group: where the
  # mesh axis does not divide the group count (6144 / 64 = 96 groups on fsdp=64) it shards those
  # instead of leaving the weight whole on every device (a mesh axis is used once per array).
  grouped = (*axes[:n_batch], axes[n_batch], axes[n_batch], *axes[n_batch + 1 :])
  return QuantKernel(t.q, t.scale, 4, t.axis, grouped, grouped)


# A random frozen kernel of more elements than this is drawn a slice at a time (drawn_param).
SLICE_ELEMENTS = 2**22


def drawn_param(rngs, shape, std, axes, engine: EngineConfig, n_batch: int = 0, n_in: int = 1):
  """make_param of std times a truncated standard normal in engine.param_dtype (layers.normal's
  draw). A kernel of more than SLICE_ELEMENTS is drawn and stored in slices one after the other
  (lax.map over keys split from one), along an axis its quantisation does not reduce (the batch
  axis, else the last output axis). XLA:CPU's random draw holds several uint32 buffers of its
  output's size; drawn whole, every kernel of a layer was alive in float32 with those buffers
  (Moonlight's int4 init: 148 GiB of temporaries for a 10 GiB state)."""
  shape, dtype = tuple(shape), jnp.dtype(engine.param_dtype)
  size = math.prod(shape)

  def draw(key, s):
    return (std * jax.random.truncated_normal(key, -2.0, 2.0, s)).astype(dtype)

  if size <= SLICE_ELEMENTS:
    return make_param(draw(rngs.params(), shape), axes, engine, n_batch, n_in)
  ax = 0 if n_batch else len(shape) - 1
  fits = (c for c in range(2, shape[ax]) if shape[ax] % c == 0 and size <= c * SLICE_ELEMENTS)
  n = next(fits, shape[ax])
  piece = (*shape[:ax], shape[ax] // n, *shape[ax + 1 :])

  def one(key):
    w = draw(key, piece)
    return (
      w
      if engine.quant == 'none'
      else quantize(w, _bits(engine), n_batch, n_in, engine.quant_group_size)
    )

  def join(x):  # [n, *slice] -> the slices side by side on their axis (first, or last)
    a = 0 if ax == 0 else x.ndim - 2
    x = jnp.moveaxis(x, 0, a)
    return x.reshape(*x.shape[:a], -1, *x.shape[a + 2 :])

  t = jax.tree.map(join, jax.lax.map(one, jax.random.split(rngs.params(), n)))
  if engine.quant == 'none':
    return nnx.Param(t, axes=tuple(axes))
  return _stored(t, tuple(axes), n_batch, n_in)


def raw(param):
  """The engine-facing value: an array for nnx.Param, a QTensor for QuantKernel."""
  return param.tensor() if isinstance(param, QuantKernel) else param[...]


def value(param, dtype):
  return dequant(raw(param), dtype)

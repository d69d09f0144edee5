"""Storage of frozen base weights: plain float parameters, or int8 / int4 for QLoRA.
(Design: docs/design.md, "moetrain/model/quant.py".)"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.model.config import ModelConfig


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
  g = group if (k % group == 0 and group % 2 == 0) else k + (k % 2)
  if k % g:
    raise ValueError(f'quant_group_size: dimension {k} of shape {w.shape} is odd; int4 needs even')
  wg = w.reshape(*w.shape[:ax], k // g, g, *w.shape[ax + 1 :])
  scale = jnp.max(jnp.abs(wg), axis=ax + 1, keepdims=True) / 7.0
  scale = jnp.where(scale == 0, 1.0, scale)
  codes = (jnp.clip(jnp.round(wg / scale), -8, 7) + 8).astype(jnp.uint8)
  lo = jax.lax.slice_in_dim(codes, 0, g, 2, axis=ax + 1)
  hi = jax.lax.slice_in_dim(codes, 1, g, 2, axis=ax + 1)
  return QTensor(lo | (hi << 4), scale, 4, ax - (w.ndim + 1))


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


def make_param(kernel, axes, cfg: ModelConfig, n_batch: int = 0, n_in: int = 1):
  """A frozen-base kernel: nnx.Param, or a QuantKernel when cfg.quant is int8/int4."""
  axes = tuple(axes)
  if cfg.quant == 'none':
    return nnx.Param(kernel, axes=axes)
  bits = 8 if cfg.quant == 'int8' else 4
  t = quantize(kernel, bits, n_batch, n_in, cfg.quant_group_size)
  if bits == 8:
    scale_axes = tuple(None if n_batch <= i < n_batch + n_in else a for i, a in enumerate(axes))
    return QuantKernel(t.q, t.scale, 8, t.axis, axes, scale_axes)
  # The input dim's name on its groups and, as a fallback, on the rows within a group: where the
  # mesh axis does not divide the group count (6144 / 64 = 96 groups on fsdp=64) it shards those
  # instead of leaving the weight whole on every device (a mesh axis is used once per array).
  grouped = (*axes[:n_batch], axes[n_batch], axes[n_batch], *axes[n_batch + 1 :])
  return QuantKernel(t.q, t.scale, 4, t.axis, grouped, grouped)


def raw(param):
  """The engine-facing value: an array for nnx.Param, a QTensor for QuantKernel."""
  return param.tensor() if isinstance(param, QuantKernel) else param[...]


def value(param, dtype):
  return dequant(raw(param), dtype)

"""Building blocks: einsum Linear with optional LoRA, RMSNorm, embedding and RoPE."""

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moetrain.core import axes
from moetrain.core.sharding import constrain, gather_weight
from moetrain.kernels import quant
from moetrain.kernels.lora import lora_dropout, lora_product
from moetrain.model.config import ModelConfig, yarn_mscale


def dtype_of(name: str):
  return jnp.dtype(name)


def normal(rngs: nnx.Rngs, shape, std: float, dtype) -> jax.Array:
  """std times a standard normal truncated at +-2 (jax.nn.initializers' convention): the weights'
  own standard deviation is 0.88 std. (transformers draws an untruncated normal of std
  initializer_range. Rescaled to match, the tiny pretraining demo reached eval perplexity 2.18
  at step 200 instead of 1.00: kept as it is.)"""
  return (std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape)).astype(dtype)


def matmul_dims(eqn: str) -> int:
  """The number of contracted dimensions of a projection 'BTNH,NHD->BTD': the input's trailing
  letters must be the kernel's leading ones and the output the input's leading letters followed
  by the kernel's others, so the projection is one 2-D matmul [tokens, in] @ [in, out]."""
  lhs, out = eqn.split('->')
  x, w = lhs.split(',')
  n_in = sum(c in x for c in w)
  lead = x[: len(x) - n_in]
  if x[len(lead) :] != w[:n_in] or out != lead + w[n_in:] or not lead:
    raise ValueError(f'{eqn!r} is not of the form "<lead><in>,<in><out>-><lead><out>"')
  return n_in


class Linear(nnx.Module):
  """A projection `eqn` (e.g. 'BTD,DNH->BTNH') whose kernel [D, N, H] carries the logical axis
  names of its letters (moetrain/core/axes.py), plus a bias [prod(out)] with `bias`; LoRA adapters
  A [in.., J] and B [J, out..] are added when `path` matches lora.targets (the weight delta
  A @ B is never formed), and the frozen kernel may be stored quantised (QLoRA).

  It runs as 2-D matmuls over the flattened tokens: with the batch and sequence dimensions kept
  apart, the weight-gradient contractions (over both) made XLA:CPU transpose the activation
  gradients through slow strided fusions, 3x the time of the LoRA MLP (bench/RESULTS.md). Not
  under a context split (`flat` False): there both axes are sharded (rows over the batch axes,
  tokens over 'context'), the partitioner could not split their merge and gathered the tokens,
  and every projection ran on whole rows on each context shard (C times its FLOPs)."""

  def __init__(
    self,
    eqn,
    shape,
    cfg: ModelConfig,
    path: str,
    rngs: nnx.Rngs,
    std=None,
    gather: bool = True,
    bias: bool = False,
  ):
    self.eqn, self.path = eqn, path
    names = axes.names(eqn.split('->')[0].split(',')[1])
    self.compute_dtype = dtype_of(cfg.engine.dtype)
    self.names, self.rules = names, cfg.engine.rules
    self.gather = gather and cfg.engine.gather_weights
    self.flat = cfg.engine.context_shards == 1
    std = cfg.engine.init_std if std is None else std
    n_in = self.n_in = matmul_dims(eqn)
    self.kernel = quant.drawn_param(rngs, shape, std, names, cfg.engine, n_batch=0, n_in=n_in)
    if bias:  # [prod(out)], as transformers stores it; small, so never sharded or quantised
      out = math.prod(shape[n_in:])
      self.bias = nnx.Param(
        jnp.zeros((out,), dtype_of(cfg.engine.param_dtype)), axes=axes.names('O')
      )
    self.lora_scale, self.lora_dropout = cfg.lora.scale, cfg.lora.dropout
    self.reference_kernels = cfg.engine.reference_kernels
    self.has_lora = cfg.lora.matches(path)
    if self.has_lora:
      in_shape, out_shape = shape[:n_in], shape[n_in:]
      r = cfg.lora.rank
      ldt = dtype_of(cfg.lora.param_dtype)
      a = normal(rngs, (*in_shape, r), math.prod(in_shape) ** -0.5, ldt)
      b = jnp.zeros((r, *out_shape), ldt)
      self.lora_a = nnx.LoRAParam(a, axes=(*names[:n_in], *axes.names('J')))
      self.lora_b = nnx.LoRAParam(b, axes=(*axes.names('J'), *names[n_in:]))

  def __call__(self, x, rng=None):
    return self.apply(x, self.operands(), rng)

  def operands(self) -> tuple:
    """The product's arrays: the kernel in the compute dtype (dequantised; gathered for use
    under engine.gather_weights), then LoRA's A and B as stored (lora_product casts them and
    returns their gradients in their own dtype), and the bias in the compute dtype."""
    dt = self.compute_dtype
    w = quant.value(self.kernel, dt)
    if self.gather:
      w = gather_weight(w, self.names, self.rules)
    ops = (w,)
    if self.has_lora:
      ops += (self.lora_a[...], self.lora_b[...])
    if hasattr(self, 'bias'):
      ops += (self.bias[...].astype(dt),)
    return ops

  def sliced(self, operands: tuple, start, size: int) -> tuple:
    """operands (self.operands()'s) for the outputs [start, start + size) of the first output
    axis alone (start may be traced): the kernel's and LoRA B's slices, A whole."""
    if hasattr(self, 'bias'):
      raise NotImplementedError(f'{self.path}: slicing the outputs of a projection with a bias')
    w, *lora = operands
    cut = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, start, size, axis)  # noqa: E731
    return (cut(w, self.n_in), *((lora[0], cut(lora[1], 1)) if lora else ()))

  def apply(self, x, operands: tuple, rng=None, flat: bool | None = None):
    """The layer on x from `operands`' arrays alone, so that a shard_map can run it with them
    passed in (MLA's expansion of a context split's gathered latent). flat: whether the leading
    axes merge into one (default self.flat); inside a shard_map, where x is the shard's own,
    they can whatever the split."""
    dt = self.compute_dtype
    lead = x.shape[: x.ndim - self.n_in]
    flat = self.flat if flat is None else flat
    # M: the tokens in one axis, or under a context split the leading axes as they are.
    x_MI = x.astype(dt).reshape(*((math.prod(lead),) if flat else lead), -1)
    w, *rest = operands
    out_shape = w.shape[self.n_in :]
    y_MO = x_MI @ w.reshape(x_MI.shape[-1], -1)
    if self.has_lora:
      a, b, *rest = rest
      rng = None if rng is None else jax.random.fold_in(rng, zlib.crc32(self.path.encode()))
      a_IJ = a.reshape(x_MI.shape[-1], -1)
      b_JO = b.reshape(a_IJ.shape[1], -1)
      xa_MI = lora_dropout(x_MI, self.lora_dropout, rng)
      lora_MO = lora_product(xa_MI, a_IJ, b_JO, reference=self.reference_kernels)
      y_MO = y_MO + self.lora_scale * lora_MO
    if rest:  # the bias [O], over every leading axis
      y_MO = y_MO + rest[0].reshape(*(1,) * (y_MO.ndim - 1), -1)
    return y_MO.reshape(*lead, *out_shape)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)), of hidden width `width` (default ffn_hidden_size)."""

  def __init__(self, cfg: ModelConfig, path: str, rngs: nnx.Rngs, width: int = 0):
    d, f = cfg.hidden_size, width or cfg.ffn_hidden_size
    self.gate = Linear('BTD,DF->BTF', (d, f), cfg, f'{path}.gate', rngs)
    self.up = Linear('BTD,DF->BTF', (d, f), cfg, f'{path}.up', rngs)
    self.down = Linear('BTF,FD->BTD', (f, d), cfg, f'{path}.down', rngs)
    self.rules = cfg.engine.rules

  def __call__(self, x_BTD, rng=None):
    h_BTF = jax.nn.silu(self.gate(x_BTD, rng).astype(jnp.float32)) * self.up(x_BTD, rng)
    h_BTF = constrain(h_BTF.astype(x_BTD.dtype), axes.names('BTF'), self.rules)
    return self.down(h_BTF, rng)


class RMSNorm(nnx.Module):
  """(offset + w) * x * rsqrt(mean(x^2) + eps), in float32, cast back to the input dtype. The
  offset is cfg.norm_offset (Qwen3-Next stores w - 1; `plain` keeps 0 for a norm that does not)."""

  def __init__(self, dim: int, letter: str, eps: float, cfg: ModelConfig, plain: bool = False):
    """letter: the normalised dimension's (moetrain/core/axes.py)."""
    self.eps = eps
    self.offset = 0.0 if plain else cfg.norm_offset
    self.scale = nnx.Param(
      jnp.full((dim,), 1.0 - self.offset, dtype_of(cfg.engine.param_dtype)),
      axes=axes.names(letter),
    )

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32).reshape((1,) * (y.ndim - 1) + (-1,))
    return ((scale + self.offset) * y).astype(x.dtype)


class Embed(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.compute_dtype = dtype_of(cfg.engine.dtype)
    self.rules = cfg.engine.rules
    shape = (cfg.vocab_size, cfg.hidden_size)
    self.embedding = quant.drawn_param(
      rngs, shape, cfg.engine.init_std, axes.names('VD'), cfg.engine, 1, 1
    )

  def __call__(self, ids_BT):
    # The table is stored with D sharded (over fsdp): gathered whole along D first, as FSDP does
    # for every weight, the lookup's rows come out batch-sharded like its ids. Left to XLA, rows
    # sharded on D had to be resharded to the batch, which it could only do by replicating
    # them when a tensor axis also split the vocabulary.
    table = jax.tree.map(
      lambda a: constrain(a, ('vocab', None), self.rules), quant.raw(self.embedding)
    )
    return quant.dequant(quant.take(table, ids_BT), self.compute_dtype)


def rope_frequencies(h: int, cfg: ModelConfig):
  """(inverse frequencies [H/2] float32, cos/sin factor) of RoPE over h features, with YaRN's
  scaling when cfg.yarn_factor > 1 (as transformers' _compute_yarn_parameters)."""
  base, factor = cfg.rope_theta, cfg.yarn_factor
  if factor <= 1:
    return base ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h), 1.0
  pos_freqs = base ** (np.arange(0, h, 2, dtype=np.float32) / h)
  original = cfg.yarn_original_max_position or cfg.max_position_embeddings

  def correction_dim(rotations):
    return h * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low, high = correction_dim(cfg.yarn_beta_fast), correction_dim(cfg.yarn_beta_slow)
  if cfg.yarn_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, h - 1)
  ramp = np.clip((np.arange(h // 2, dtype=np.float32) - low) / max(high - low, 1e-3), 0, 1)
  extrapolate = 1 - ramp
  inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolate
  if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
    scale = yarn_mscale(factor, cfg.yarn_mscale) / yarn_mscale(factor, cfg.yarn_mscale_all_dim)
  else:
    scale = yarn_mscale(factor)
  return jnp.asarray(inv_freq, jnp.float32), scale


def rope(x_BTNH, positions_BT, cfg: ModelConfig, interleaved: bool | None = None):
  """Rotary embedding: pair i of the H features rotates by pos * rope_theta^(-2i/H). The pairs
  are adjacent features (x[2i], x[2i+1]) with cfg.rope_interleaved (DeepSeek, LongCat), else
  the two halves (x[i], x[i + H/2]) (Qwen, Mixtral). The two are different functions of the
  same weights (logits off by ~1 on a real checkpoint when mixed up). `interleaved` overrides
  the layout (DeepSeek-V3.2's indexer rotates halves inside interleaved MLA)."""
  h = x_BTNH.shape[-1]
  inv_freq, factor = rope_frequencies(h, cfg)
  ang = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, H/2]
  cos, sin = (factor * f(ang)[:, :, None, :] for f in (jnp.cos, jnp.sin))
  x = x_BTNH.astype(jnp.float32)
  if cfg.rope_interleaved if interleaved is None else interleaved:
    x = x.reshape(*x_BTNH.shape[:-1], h // 2, 2)
    x0, x1, axis = x[..., 0], x[..., 1], -1
  else:
    x0, x1, axis = x[..., : h // 2], x[..., h // 2 :], -2
  out = jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=axis)
  return out.reshape(x_BTNH.shape).astype(x_BTNH.dtype)


def by_blocks(fn, xs, chunk: int, remat: bool = False):
  """fn(*blocks) over blocks of `chunk` positions of axis 1 of every array of xs (0, or chunk >=
  the length: one block), its outputs' axis 1 joined back: a loop (lax.map), the last block
  padded with zeros, its padding cut off. remat: each block recomputed in the backward pass,
  which keeps only its inputs (not fn's intermediates) of every block."""
  b, t = xs[0].shape[:2]
  step = chunk if 0 < chunk < t else t
  pad = -t % step

  def split(x):  # [B, T, ...] -> [U, B, step, ...]
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, -1, step, *x.shape[2:]), 1, 0)

  run = jax.checkpoint(fn) if remat else fn
  out = jax.lax.map(lambda blocks: run(*blocks), tuple(split(x) for x in xs))
  return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1).reshape(b, t + pad, *y.shape[3:])[:, :t], out)

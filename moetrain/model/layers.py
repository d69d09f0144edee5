"""Building blocks: einsum Linear with optional LoRA, RMSNorm, embedding and interleaved RoPE."""

import math
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.model import quant
from moetrain.model.config import ModelConfig
from moetrain.sharding import constrain


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
  """A projection `eqn` (e.g. 'BTD,DNH->BTNH') whose kernel carries logical axis names; LoRA
  adapters A [in.., R] and B [R, out..] are added when `path` matches lora.targets (the weight
  delta A @ B is never formed), and the frozen kernel may be stored quantised (QLoRA).

  It runs as 2-D matmuls over the flattened tokens: with the batch and sequence dimensions kept
  apart, the weight-gradient contractions (over both) made XLA:CPU transpose the activation
  gradients through slow strided fusions, 3x the time of the LoRA MLP (bench/RESULTS.md)."""

  def __init__(self, eqn, shape, axes, cfg: ModelConfig, path: str, rngs: nnx.Rngs, std=None):
    self.eqn, self.path = eqn, path
    self.compute_dtype = dtype_of(cfg.dtype)
    std = cfg.init_std if std is None else std
    n_in = self.n_in = matmul_dims(eqn)
    kernel = normal(rngs, shape, std, dtype_of(cfg.param_dtype))
    self.kernel = quant.make_param(kernel, axes, cfg, n_batch=0, n_in=n_in)
    self.lora_scale, self.lora_dropout = cfg.lora.scale, cfg.lora.dropout
    self.has_lora = cfg.lora.matches(path)
    if self.has_lora:
      in_shape, out_shape = shape[:n_in], shape[n_in:]
      r = cfg.lora.rank
      a = normal(rngs, (*in_shape, r), math.prod(in_shape) ** -0.5, dtype_of(cfg.param_dtype))
      b = jnp.zeros((r, *out_shape), dtype_of(cfg.param_dtype))
      self.lora_a = nnx.LoRAParam(a, axes=(*axes[:n_in], 'lora_rank'))
      self.lora_b = nnx.LoRAParam(b, axes=('lora_rank', *axes[n_in:]))

  def __call__(self, x, rng=None):
    dt = self.compute_dtype
    lead, n_in = x.shape[: x.ndim - self.n_in], self.n_in
    x_MK = x.astype(dt).reshape(math.prod(lead), -1)
    w = quant.value(self.kernel, dt)
    out_shape = w.shape[n_in:]
    y_MN = x_MK @ w.reshape(x_MK.shape[1], -1)
    if self.has_lora:
      rng = None if rng is None else jax.random.fold_in(rng, zlib.crc32(self.path.encode()))
      a_KR = self.lora_a[...].astype(dt).reshape(x_MK.shape[1], -1)
      b_RN = self.lora_b[...].astype(dt).reshape(a_KR.shape[1], -1)
      xa_MK = lora_dropout(x_MK, self.lora_dropout, rng)
      y_MN = y_MN + self.lora_scale * lora_product(xa_MK, a_KR, b_RN)
    return y_MN.reshape(*lead, *out_shape)


@jax.custom_vjp
def lora_product(x_MK, a_KR, b_RN):
  """(x @ a) @ b for 2-D LoRA factors, with a backward whose adapter gradients are plain matmuls.

  Autodiff forms dA = x^T dh and dB = h^T g, which contract the token rows of both operands.
  XLA:CPU runs that form in its generic dot, and for these thin shapes (rank 16) at 8-15
  GFLOP/s: 8% of the single-core LoRA step went there (bench/RESULTS.md). Here the
  thin [M, R] factors are transposed first (cheap: R rows) and the gradients formed as
  dA^T = dh^T x and dB = h^T g, ordinary products that run on the fast matmul path."""
  return (x_MK @ a_KR) @ b_RN


def _lora_fwd(x_MK, a_KR, b_RN):
  h_MR = x_MK @ a_KR
  return h_MR @ b_RN, (x_MK, a_KR, b_RN, h_MR)


def _lora_bwd(res, g_MN):
  x_MK, a_KR, b_RN, h_MR = res
  g_MN = g_MN.astype(h_MR.dtype)
  # The barriers keep XLA from folding the transposes back into the products: into x^T dh
  # again, or, where the forward is recomputed in the same loop (the grouped MoE engine), into a
  # product a^T x^T that forms h^T directly, which is a generic dot too.
  dh_MR, h_MR = jax.lax.optimization_barrier((g_MN @ b_RN.T, h_MR))
  dh_RM, h_RM = jax.lax.optimization_barrier((dh_MR.T, h_MR.T))
  da_RK = jax.lax.optimization_barrier(dh_RM @ x_MK)
  return dh_MR @ a_KR.T, da_RK.T.astype(a_KR.dtype), (h_RM @ g_MN).astype(b_RN.dtype)


lora_product.defvjp(_lora_fwd, _lora_bwd)


def lora_dropout(x, rate: float, rng):
  if rate == 0.0 or rng is None:
    return x
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def swiglu(x, mm, dtype):
  h = jax.nn.silu(mm(x, 'gate').astype(jnp.float32)) * mm(x, 'up').astype(jnp.float32)
  return mm(h.astype(dtype), 'down')


def with_lora(base_mm, weights, scale, rng, dropout):
  """Adds the per-expert adapters as two small grouped matmuls on the permuted rows. Where they
  are one expert's 2-D factors (the grouped and blocked tiles), layers.lora_product runs them:
  its backward keeps their gradients on the fast matmul path."""

  def mm(x, name):
    y = base_mm(x, weights[name])
    if f'{name}_lora_a' in weights:
      key = None if rng is None else jax.random.fold_in(rng, zlib.crc32(name.encode()))
      xa = lora_dropout(x, dropout, key)
      a, b = weights[f'{name}_lora_a'], weights[f'{name}_lora_b']
      if a.ndim == 2:
        y = y + scale * lora_product(xa, a.astype(xa.dtype), b.astype(xa.dtype))
      else:
        y = y + scale * base_mm(base_mm(xa, a), b)
    return y

  return mm


class RMSNorm(nnx.Module):
  """w * x * rsqrt(mean(x^2) + eps), in float32, cast back to the input dtype."""

  def __init__(self, dim: int, axis: str, eps: float, cfg: ModelConfig):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), dtype_of(cfg.param_dtype)), axes=(axis,))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32).reshape((1,) * (y.ndim - 1) + (-1,))
    return (scale * y).astype(x.dtype)


class Embed(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.compute_dtype = dtype_of(cfg.dtype)
    self.rules = cfg.rules
    emb = normal(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.init_std, dtype_of(cfg.param_dtype))
    self.embedding = quant.make_param(emb, ('vocab', 'embed'), cfg, n_batch=1, n_in=1)

  def __call__(self, ids_BT):
    # The table is stored with D sharded (over fsdp): gathered whole along D first, as FSDP does
    # for every weight, the lookup's rows come out batch-sharded like its ids. Left to XLA, rows
    # sharded on D had to be resharded to the batch, which it could only do by replicating
    # them when a tensor axis also split the vocabulary.
    table = jax.tree.map(
      lambda a: constrain(a, ('vocab', None), self.rules), quant.raw(self.embedding)
    )
    return quant.dequant(quant.take(table, ids_BT), self.compute_dtype)


def rope_interleaved(x_BTNH, positions_BT, theta: float):
  """DeepSeek/LongCat RoPE: adjacent pairs (x[2i], x[2i+1]) rotate by pos * theta^(-2i/H).
  Rotate-half on this layout is a different function (logits off by ~1 on real weights)."""
  h = x_BTNH.shape[-1]
  inv_freq = theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)
  ang = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, H/2]
  cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
  x = x_BTNH.astype(jnp.float32).reshape(*x_BTNH.shape[:-1], h // 2, 2)
  x0, x1 = x[..., 0], x[..., 1]
  out = jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)
  return out.reshape(x_BTNH.shape).astype(x_BTNH.dtype)

"""LoRA adapters' products: the 2-D product with a backward on XLA:CPU's fast matmul path, and the
per-expert adapters of the routed experts' matmuls."""

import zlib

import jax
import jax.numpy as jnp

from moetrain.kernels import Kernel


@jax.custom_vjp
def _lora_product(x_MI, a_IJ, b_JO):
  return (x_MI @ a_IJ) @ b_JO


def _lora_fwd(x_MI, a_IJ, b_JO):
  h_MJ = x_MI @ a_IJ
  return h_MJ @ b_JO, (x_MI, a_IJ, b_JO, h_MJ)


def _lora_bwd(res, g_MO):
  x_MI, a_IJ, b_JO, h_MJ = res
  g_MO = g_MO.astype(h_MJ.dtype)
  # The barriers keep XLA from folding the transposes back into the products: into x^T dh
  # again, or, where the forward is recomputed in the same loop (the grouped MoE engine), into a
  # product a^T x^T that forms h^T directly, which is a generic dot too.
  dh_MJ, h_MJ = jax.lax.optimization_barrier((g_MO @ b_JO.T, h_MJ))
  dh_JM, h_JM = jax.lax.optimization_barrier((dh_MJ.T, h_MJ.T))
  da_JI = jax.lax.optimization_barrier(dh_JM @ x_MI)
  return dh_MJ @ a_IJ.T, da_JI.T.astype(a_IJ.dtype), (h_JM @ g_MO).astype(b_JO.dtype)


_lora_product.defvjp(_lora_fwd, _lora_bwd)

# (x @ a) @ b for 2-D LoRA factors x [M, I], a [I, J], b [J, O]. Autodiff forms dA = x^T dh and
# dB = h^T g, which contract the token rows of both operands; XLA:CPU runs that form in its
# generic dot, and for these thin shapes (rank 16) at 8-15 GFLOP/s: 8% of the single-core LoRA
# step went there (bench/RESULTS.md). The fast backward transposes the thin [M, J] factors first
# (cheap: J rows) and forms dA^T = dh^T x and dB = h^T g, ordinary products on the fast path.
lora_product = Kernel('lora_product', _lora_product, lambda x, a, b: (x @ a) @ b)


def lora_dropout(x, rate: float, rng):
  if rate == 0.0 or rng is None:
    return x
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def with_lora(base_mm, weights, spec, rng, adapter_mm=None):
  """base_mm(x, weights[name]) plus, where `weights` holds name_lora_a / _lora_b, the adapters'
  two small matmuls on the same rows (spec: anything with the `engine` and `lora` configs, for the
  LoRA scale, dropout and kernels). Where they are one expert's 2-D factors (the grouped and blocked tiles),
  lora_product runs them; per-expert factors run through adapter_mm (default base_mm)."""
  reference = spec.engine.reference_kernels
  adapter_mm = adapter_mm or base_mm

  def mm(x, name):
    y = base_mm(x, weights[name])
    if f'{name}_lora_a' in weights:
      key = None if rng is None else jax.random.fold_in(rng, zlib.crc32(name.encode()))
      xa = lora_dropout(x, spec.lora.dropout, key)
      a, b = weights[f'{name}_lora_a'], weights[f'{name}_lora_b']
      if a.ndim == 2:
        ab = lora_product(xa, a.astype(xa.dtype), b.astype(xa.dtype), reference=reference)
      else:
        ab = adapter_mm(adapter_mm(xa, a), b)
      y = y + spec.lora.scale * ab
    return y

  return mm

"""LoRA adapters' products: the 2-D product with a backward on XLA:CPU's fast matmul path, and the
per-expert adapters of the routed experts' matmuls."""

import zlib

import jax
import jax.numpy as jnp

from moetrain.kernels import Kernel


def _reference(x_MI, a_IJ, b_JO):
  dt = x_MI.dtype
  return (x_MI @ a_IJ.astype(dt)) @ b_JO.astype(dt)


@jax.custom_vjp
def _lora_product(x_MI, a_IJ, b_JO):
  return _reference(x_MI, a_IJ, b_JO)


def _lora_fwd(x_MI, a_IJ, b_JO):
  h_MJ = x_MI @ a_IJ.astype(x_MI.dtype)
  return h_MJ @ b_JO.astype(x_MI.dtype), (x_MI, a_IJ, b_JO, h_MJ)


def _lora_bwd(res, g_MO):
  x_MI, a_IJ, b_JO, h_MJ = res
  dt = x_MI.dtype
  g_MO = g_MO.astype(dt)
  a_c, b_c = a_IJ.astype(dt), b_JO.astype(dt)
  if x_MI.ndim > 2:  # leading axes kept apart (a context split): one contraction over them
    dh_MJ = g_MO @ b_c.T
    lead = ''.join(chr(ord('a') + i) for i in range(x_MI.ndim - 1))
    da_IJ = jnp.einsum(f'{lead}i,{lead}j->ij', x_MI, dh_MJ, preferred_element_type=a_IJ.dtype)
    db_JO = jnp.einsum(f'{lead}j,{lead}o->jo', h_MJ, g_MO, preferred_element_type=b_JO.dtype)
    return dh_MJ @ a_c.T, da_IJ, db_JO
  # The barriers keep XLA from folding the transposes back into the products: into x^T dh
  # again, or, where the forward is recomputed in the same loop (the grouped MoE engine), into a
  # product a^T x^T that forms h^T directly, which is a generic dot too.
  dh_MJ, h_MJ = jax.lax.optimization_barrier((g_MO @ b_c.T, h_MJ))
  dh_JM, h_JM = jax.lax.optimization_barrier((dh_MJ.T, h_MJ.T))
  da_JI = jax.lax.optimization_barrier(jnp.matmul(dh_JM, x_MI, preferred_element_type=a_IJ.dtype))
  db_JO = jnp.matmul(h_JM, g_MO, preferred_element_type=b_JO.dtype)
  return dh_MJ @ a_c.T, da_JI.T, db_JO


_lora_product.defvjp(_lora_fwd, _lora_bwd)

# (x @ a) @ b for LoRA factors x [..., I], a [I, J], b [J, O], in x's dtype. The adapters' gradients
# are summed over the tokens in the adapters' own dtype (float32 by default: lora.param_dtype), so
# a mesh that splits the tokens another way sums them in float32, not in bfloat16's ulps.
# Autodiff forms dA = x^T dh and dB = h^T g, which contract the token rows of both operands;
# XLA:CPU runs that form in its generic dot, and for these thin shapes (rank 16) at 8-15
# GFLOP/s: 8% of the single-core LoRA step went there (bench/RESULTS.md). The fast backward of a
# 2-D x transposes the thin [M, J] factors first (cheap: J rows) and forms dA^T = dh^T x and
# dB = h^T g, ordinary products on the fast path.
lora_product = Kernel('lora_product', _lora_product, _reference)


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
        ab = lora_product(xa, a, b, reference=reference)
      else:
        ab = adapter_mm(adapter_mm(xa, a), b)
      y = y + spec.lora.scale * ab
    return y

  return mm

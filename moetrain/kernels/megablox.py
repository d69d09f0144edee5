"""Grouped matmuls on the Pallas TPU kernel (jax.experimental.pallas.ops.tpu.megablox) with a
backward whose three products are each tiled for their own shapes.

megablox's own VJP reuses the forward's tiling for the transposed products, so one tile has to
suit both K and N: the thin products of the experts' LoRA adapters (rank 8: [D, 8] and [8, F]
per expert) have none, and went through XLA's ragged_dot, whose weight gradient (a grouped
product over a ragged *contracting* dimension) XLA's TPU compiler lowers as a dense product over
every expert under a mask: the activations broadcast to all local experts, per adapter
(bench/RESULTS.md, "Expert LoRA adapters on TPU"). Here the rank is a whole-dimension block, and the gradient of
the weights is the transposed kernel (tgmm), per expert over its own rows."""

import jax
import jax.numpy as jnp

from moetrain.kernels import Kernel, vjp


def lane_tile(d: int) -> int:
  """The block for a dimension of d: the largest of 512/256/128 dividing it (TPU lanes); else
  the whole dimension up to 512 (a block as wide as the array is always legal: a LoRA rank);
  else the one of them that pads d least, the larger on a tie (the kernels mask the last,
  partial block). A whole 2880-wide dimension (gpt-oss) made a [2880, 2880] weight block: 36.66
  MiB of a v5e's 16 MiB of scoped VMEM."""
  tiles = (512, 256, 128)
  if any(d % t == 0 for t in tiles) or d <= tiles[0]:
    return next((t for t in tiles if d % t == 0), d)
  return min(tiles, key=lambda t: (-d % t, -t))


def row_tile(m: int) -> int:
  return 128 if m >= 128 else -(-m // 16) * 16


def _backend():
  """The kernels' module (imported on first use: it loads Pallas' TPU support)."""
  import importlib

  return importlib.import_module('jax.experimental.pallas.ops.tpu.megablox.gmm')


def _padded(x_MK, tm: int):
  return jnp.pad(x_MK, ((0, -x_MK.shape[0] % tm), (0, 0)))


def _inside(sizes_G, rows: int):
  return (jnp.arange(rows) < jnp.sum(sizes_G))[:, None]


def _product(x_MK, w, sizes_G, transposed: bool, interpret: bool):
  """x times each group's w: w [G, K, N], or w [G, N, K] (transposed). Rows past the groups come
  out zero (the kernel leaves them unwritten); rows are padded to the row tile for the kernel."""
  m, k = x_MK.shape
  n = w.shape[1 if transposed else 2]
  tiling = (row_tile(m), lane_tile(k), lane_tile(n))
  x = _padded(x_MK, tiling[0])
  w = w.astype(x_MK.dtype)
  y = _backend().gmm(
    x, w, sizes_G, x_MK.dtype, tiling, transpose_rhs=transposed, interpret=interpret
  )
  return jnp.where(_inside(sizes_G, x.shape[0]), y, 0)[:m]


def _gmm_fwd(x_MK, w, sizes_G, transposed, interpret):
  xv, wv, sizes = vjp.values((x_MK, w, sizes_G))
  y = _product(xv, wv, sizes, transposed, interpret)
  return y, (xv, wv, sizes, x_MK.perturbed, w.perturbed)


def _gmm_bwd(transposed, interpret, res, g_MN):
  x_MK, w, sizes_G, x_perturbed, w_perturbed = res
  g_MN = vjp.dense(g_MN).astype(x_MK.dtype)
  dx = dw = None
  if x_perturbed:  # g times each group's w^T: the same kernel, the other way round
    dx = _product(g_MN, w, sizes_G, not transposed, interpret)
  if w_perturbed:  # per group over its own rows: x^T g ([G, K, N]) or g^T x ([G, N, K])
    tm = row_tile(x_MK.shape[0])
    a, b = (g_MN, x_MK) if transposed else (x_MK, g_MN)
    a, b = _padded(a, tm), _padded(b, tm)
    tiling = (tm, lane_tile(a.shape[1]), lane_tile(b.shape[1]))
    dw = _backend().tgmm(a.T, b, sizes_G, w.dtype, tiling, interpret=interpret)
  return dx, dw, None


_gmm_vjp = jax.custom_vjp(_product, nondiff_argnums=(3, 4))
_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd, symbolic_zeros=True)


def _reference(x_MK, w, sizes_G, transposed, interpret):
  del interpret
  w_GKN = jnp.swapaxes(w, 1, 2) if transposed else w
  return jax.lax.ragged_dot(
    x_MK, w_GKN.astype(x_MK.dtype), sizes_G, preferred_element_type=x_MK.dtype
  )


# x [M, K] (rows sorted by group; rows past sum(sizes) give zeros) times each group's
# w [K, N] (w [G, K, N]), or w[g]^T with transposed=True (w [G, N, K]: a LoRA A factor kept with
# its rank second-minor, since a rank minor is padded to 128 TPU lanes: 16x the bytes at rank 8,
# for the factor's bf16 copy and its float32 gradient accumulated over the layers), in x's dtype.
# w is cast to x's dtype inside, and its gradient (tgmm) accumulates and comes out in w's own
# dtype: float32 LoRA factors get float32 gradients, summed over the expert's rows without a
# bfloat16 rounding (and a mesh then sums them in float32). interpret: Pallas' interpreter (off
# TPU: slow; the CPU tests).
grouped_matmul = Kernel('grouped_matmul', _gmm_vjp, _reference)

"""The routed experts' SwiGLU over dispatched rows, one function per grouped-matmul backend
(model.moe_backend; dispatch.py places the rows for each and resolve_backend picks one):
ragged_dot (XLA's grouped matmul), megablox (the Pallas TPU kernel), dense (every row against its
own expert's gathered weights: the reference), and the CPU engines blocked and gathered (rows in
blocks of one expert each). The grouped CPU engine is grouped.py."""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moetrain.kernels.lora import with_lora
from moetrain.kernels.rows import take_experts
from moetrain.model import quant
from moetrain.model.config import ModelConfig

# Names for the remat policies (model/transformer.py remat_policy): what the experts' backward
# reads. Saving them spares the backward the forward's routing, exchange and expert matmuls.
EXPERT_INPUT, EXPERT_GATE, EXPERT_UP = 'moe_expert_in', 'moe_expert_gate', 'moe_expert_up'


def swiglu(x, mm, dtype):
  x = checkpoint_name(x, EXPERT_INPUT)  # rows in expert order, after any exchange
  g = checkpoint_name(mm(x, 'gate'), EXPERT_GATE)
  u = checkpoint_name(mm(x, 'up'), EXPERT_UP)
  h = jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)
  return mm(h.astype(dtype), 'down')


def ragged_ffn(x_RD, sizes_E, weights, cfg: ModelConfig, rng):
  dt = jnp.dtype(cfg.dtype)

  def mm(x, w):
    return jax.lax.ragged_dot(x, quant.dequant(w, dt), sizes_E, preferred_element_type=dt)

  return swiglu(x_RD, with_lora(mm, weights, cfg, rng), dt)


def _gmm_tile(k: int, n: int) -> int | None:
  """One megablox tile for both the K and N dimensions: its VJP reuses the forward's tiling for
  the transposed products, so the tile must suit both (TPU lanes: a multiple of 128 dividing
  each). None where there is none (small LoRA ranks)."""
  return next((t for t in (512, 256, 128) if k % t == 0 and n % t == 0), None)


def megablox_interpret(cfg: ModelConfig) -> bool:
  """The megablox kernel is Mosaic (TPU) code; elsewhere Pallas interprets it."""
  return cfg.platform != 'tpu'


def megablox_ffn(x_RD, sizes_E, weights, cfg: ModelConfig, rng):
  """The Pallas TPU grouped matmul (jax.experimental.pallas.ops.tpu.megablox) for the expert
  weights; the LoRA adapters' thin products (rank < 128) go through ragged_dot. Off TPU the
  kernel runs in Pallas' interpret mode: slow, but it checks this path on CPU. Rows are padded
  to a multiple of the row tile, and the kernel leaves rows past the groups (zero-expert
  assignments, padding) unwritten, so they are masked to zeros, which also keeps their garbage
  out of the gradients."""
  from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

  dt = jnp.dtype(cfg.dtype)
  r = x_RD.shape[0]
  tm = 128 if r >= 128 else -(-r // 16) * 16
  rows = -(-r // tm) * tm
  inside = (jnp.arange(rows) < jnp.sum(sizes_E))[:, None]
  interpret = megablox_interpret(cfg)

  def mm(x, w):
    w = quant.dequant(w, dt)
    t = _gmm_tile(*w.shape[1:])
    if t is None:  # the thin LoRA products: XLA's ragged_dot
      y = jax.lax.ragged_dot(x.astype(dt), w, sizes_E, preferred_element_type=dt)
    else:
      y = megablox.gmm(x.astype(dt), w, sizes_E, dt, (tm, t, t), None, None, False, interpret)
    return jnp.where(inside, y, 0)

  x_PD = jnp.where(inside, jnp.pad(x_RD, ((0, rows - r), (0, 0))), 0)
  mm = with_lora(mm, weights, cfg, rng)
  return swiglu(x_PD, mm, dt)[:r]


def dense_ffn(x_RD, expert_R, weights, cfg: ModelConfig, rng):
  """Reference backend: every row multiplies its own expert's gathered weights."""
  dt = jnp.dtype(cfg.dtype)
  e_R = jnp.minimum(expert_R, cfg.n_routed_experts - 1)

  def mm(x, w):
    return jnp.einsum('rd,rdf->rf', x, quant.dequant(quant.take(w, e_R), dt))

  return swiglu(x_RD, with_lora(mm, weights, cfg, rng), dt)


def blocked_ffn(x_UPD, block_expert_U, used, weights, cfg: ModelConfig, rng):
  """A scan over blocks; blocks past `used` (the padding left by zero-expert assignments) are
  skipped by a cond, so their matmuls never run."""
  n, b, d = x_UPD.shape
  dt = jnp.dtype(cfg.dtype)

  def ffn(x_PD, ex, k):
    w = {name: quant.take(v, ex) for name, v in weights.items()}
    key = None if rng is None else jax.random.fold_in(rng, k)
    mm = with_lora(lambda x, wt: x @ quant.dequant(wt, dt), w, cfg, key)
    return swiglu(x_PD, mm, dt).astype(dt)

  def body(_, inp):
    x_PD, ex, k = inp
    skip = lambda x, ex, k: jnp.zeros((b, d), dt)
    return None, jax.lax.cond(k < used, ffn, skip, x_PD, ex, k)

  _, y_UPD = jax.lax.scan(body, None, (x_UPD, block_expert_U, jnp.arange(n)))
  return y_UPD.reshape(n * b, d)


def gathered_ffn(x_UPD, block_expert_U, weights, cfg: ModelConfig, rng):
  n, b, d = x_UPD.shape
  dt = jnp.dtype(cfg.dtype)
  w_U = {
    name: quant.take(v, block_expert_U)
    if isinstance(v, quant.QTensor)
    else take_experts(v, block_expert_U, reference=cfg.reference_kernels)
    for name, v in weights.items()
  }

  def mm(x, w):
    return jnp.einsum('UPD,UDF->UPF', x, quant.dequant(w, dt))

  mm = with_lora(mm, w_U, cfg, rng)
  return swiglu(x_UPD, mm, dt).reshape(n * b, d)

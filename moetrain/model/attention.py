"""Multi-head latent attention (MLA) as in DeepSeek-V2 / LongCat-Flash."""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.model.config import ModelConfig
from moetrain.model.layers import Linear, RMSNorm, rope_interleaved
from moetrain.sharding import constrain


def attention_mask(q_pos_BT, q_seg_BT, k_pos_BS, k_seg_BS):
  """Causal within a packed segment: key position <= query position and same segment id."""
  causal = k_pos_BS[:, None, :] <= q_pos_BT[:, :, None]
  same = q_seg_BT[:, :, None] == k_seg_BS[:, None, :]
  return causal & same  # [B, T, S]


def masked_scores(s_BNTS, mask_BTS, scale: float):
  """Scaled scores with the masked ones at the float32 minimum (a row that sees no key gets
  uniform weights rather than NaNs)."""
  return jnp.where(mask_BTS[:, None], s_BNTS * scale, jnp.finfo(jnp.float32).min)


def attention_probs(s_BNTS, mask_BTS, scale: float):
  """Scaled, masked softmax over keys, in float32."""
  return jax.nn.softmax(masked_scores(s_BNTS, mask_BTS, scale), axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def attention_core(q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale: float, blocks, recompute=True):
  """softmax(scale * q k^T, masked) v, by blocks of queries: block (start, end, keys) takes
  queries [start, end) against keys [0, keys).

  What the backward pass keeps: the float32 probabilities (recompute=False: O(T * S) per head,
  no extra work), or only each query's softmax max and sum (recompute=True: O(T); the backward
  recomputes each block's scores, one more q k^T product, as flash attention does). Long
  sequences need the latter: at 8k tokens and 64 heads the probabilities are 16 GiB per sequence
  and layer.

  The backward pass is written out for XLA:CPU (bench/RESULTS.md). Autodiff of the same forward
  formed the key and value gradients as ds^T q and p^T dO, contracting the query rows of the big
  [T, S] blocks, which ran in a slow generic dot; and it transposed whole score blocks for the
  shared rope key's gradient. Here they are formed transposed, dK^T = q^T ds and dV^T = dO^T p,
  contracting the query rows of the thin q and dO blocks instead. That form also goes to XLA's
  generic dot (its left operand is column-major), but for these batched products (a head's
  rows out, a 128-query block contracted) it runs ~1.5x faster there than YNNPACK's batched
  matmul on transposed copies, and needs no copies."""
  return _core_fwd(q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale, blocks, recompute)[0]


def _dot(a, b, contract: tuple[int, int], dtype=None):
  """[B, N, ., .] x [B, N, ., .] over a's dimension contract[0] and b's contract[1] (2 or 3)."""
  dims = (((contract[0],), (contract[1],)), ((0, 1), (0, 1)))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=dtype)


def _scores(q_BNTH, k_BNSH, mask_BTS, scale, block):
  """Block (start, end, keys)'s scaled, masked float32 scores [B, N, end - start, keys]."""
  start, end, keys = block
  s_BNTS = _dot(q_BNTH[:, :, start:end], k_BNSH[:, :, :keys], (3, 3), jnp.float32)
  return masked_scores(s_BNTS, mask_BTS[:, start:end, :keys], scale)


def _core_fwd(q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale, blocks, recompute):
  outs, kept = [], []
  for block in blocks:
    z_BNTS = _scores(q_BNTH, k_BNSH, mask_BTS, scale, block)
    max_BNT = jnp.max(z_BNTS, axis=-1)
    exp_BNTS = jnp.exp(z_BNTS - max_BNT[..., None])
    sum_BNT = jnp.sum(exp_BNTS, axis=-1)
    p_BNTS = exp_BNTS / sum_BNT[..., None]  # the softmax, from the stats the backward may keep
    outs.append(_dot(p_BNTS.astype(v_BNSH.dtype), v_BNSH[:, :, : block[2]], (3, 2)))
    kept.append((max_BNT, sum_BNT) if recompute else p_BNTS)
  out_BNTH = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
  return out_BNTH, (q_BNTH, k_BNSH, v_BNSH, out_BNTH, tuple(kept), mask_BTS)


def _core_bwd(scale, blocks, recompute, res, g_BNTH):
  q_BNTH, k_BNSH, v_BNSH, out_BNTH, kept, mask_BTS = res
  f32, s = jnp.float32, k_BNSH.shape[2]
  g_BNTH = g_BNTH.astype(v_BNSH.dtype)
  # d softmax: ds = p * (dp - sum_s p dp), and sum_s p dp = sum_h g o.
  delta_BNT = jnp.sum(g_BNTH.astype(f32) * out_BNTH.astype(f32), axis=-1)
  b, n, hk, hv = *q_BNTH.shape[:2], q_BNTH.shape[3], g_BNTH.shape[3]
  dq = []
  dk_BNHS, dv_BNHS = jnp.zeros((b, n, hk, s), f32), jnp.zeros((b, n, hv, s), f32)
  for block, saved in zip(blocks, kept):
    start, end, keys = block
    if recompute:  # saved: the block's softmax row max and sum
      max_BNT, sum_BNT = saved
      z_BNTS = _scores(q_BNTH, k_BNSH, mask_BTS, scale, block)
      p_BNTS = jnp.exp(z_BNTS - max_BNT[..., None]) / sum_BNT[..., None]
    else:  # saved: the block's probabilities
      p_BNTS = saved
    dp_BNTS = _dot(g_BNTH[:, :, start:end], v_BNSH[:, :, :keys], (3, 3), f32)
    ds_BNTS = p_BNTS * (dp_BNTS - delta_BNT[:, :, start:end, None]) * scale
    # Masked scores get no gradient (as through the forward's select), also in a row that sees
    # no key, whose uniform weights are not zero there.
    ds_BNTS = jnp.where(mask_BTS[:, None, start:end, :keys], ds_BNTS, 0).astype(q_BNTH.dtype)
    dq.append(_dot(ds_BNTS, k_BNSH[:, :, :keys], (3, 2)))
    dk_BNHS = dk_BNHS.at[..., :keys].add(_dot(q_BNTH[:, :, start:end], ds_BNTS, (2, 2), f32))
    p_BNTS = p_BNTS.astype(v_BNSH.dtype)
    dv_BNHS = dv_BNHS.at[..., :keys].add(_dot(g_BNTH[:, :, start:end], p_BNTS, (2, 2), f32))
  dq_BNTH = dq[0] if len(dq) == 1 else jnp.concatenate(dq, axis=2)
  dk_BNSH = dk_BNHS.transpose(0, 1, 3, 2).astype(k_BNSH.dtype)
  dv_BNSH = dv_BNHS.transpose(0, 1, 3, 2).astype(v_BNSH.dtype)
  return dq_BNTH, dk_BNSH, dv_BNSH, None


attention_core.defvjp(_core_fwd, _core_bwd)


class MLA(nnx.Module):
  """Low-rank q, compressed kv latent c (K) plus one rope key shared by all heads."""

  def __init__(self, cfg: ModelConfig, path: str, rngs: nnx.Rngs):
    self.cfg = cfg
    d, n, q, k = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    qk, nope, v, rope = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
    self.q_a = Linear('BTD,DQ->BTQ', (d, q), ('embed', 'q_lora'), cfg, f'{path}.q_a', rngs)
    self.q_a_norm = RMSNorm(q, 'q_lora', cfg.mla_norm_eps, cfg)
    self.q_b = Linear(
      'BTQ,QNH->BTNH', (q, n, qk), ('q_lora', 'heads', 'head_dim'), cfg, f'{path}.q_b', rngs
    )
    self.kv_a = Linear(
      'BTD,DK->BTK', (d, k + rope), ('embed', 'kv_lora'), cfg, f'{path}.kv_a', rngs
    )
    self.kv_a_norm = RMSNorm(k, 'kv_lora', cfg.mla_norm_eps, cfg)
    self.kv_b = Linear(
      'BTK,KNH->BTNH', (k, n, nope + v), ('kv_lora', 'heads', 'head_dim'), cfg, f'{path}.kv_b', rngs
    )
    self.o = Linear(
      'BTNH,NHD->BTD', (n, v, d), ('heads', 'head_dim', 'embed'), cfg, f'{path}.o', rngs
    )
    # Variance alignment of the low-rank paths (TR eq. 6-7); HF applies them unconditionally.
    self.alpha_q = math.sqrt(d / q) if cfg.mla_scale_q_lora else 1.0
    self.alpha_kv = math.sqrt(d / k) if cfg.mla_scale_kv_lora else 1.0

  def project_q(self, x_BTD, positions_BT, rng=None):
    q_BTNH = self.q_b(self.q_a_norm(self.q_a(x_BTD, rng)), rng) * self.alpha_q
    nope = self.cfg.qk_nope_head_dim
    q_pe = rope_interleaved(q_BTNH[..., nope:], positions_BT, self.cfg.rope_theta)
    return q_BTNH[..., :nope], q_pe

  def latent(self, x_BTD, positions_BT, rng=None):
    """The per-token cache content: normalised, scaled latent c [B,T,K] and rope key [B,T,H]."""
    ckv_BTK = self.kv_a(x_BTD, rng)
    k = self.cfg.kv_lora_rank
    c_BTK = self.kv_a_norm(ckv_BTK[..., :k]) * self.alpha_kv
    k_pe = rope_interleaved(ckv_BTK[..., None, k:], positions_BT, self.cfg.rope_theta)[:, :, 0]
    return c_BTK, k_pe

  def attend(self, q_nope, q_pe, c_BSK, k_pe_BSH, mask_BTS, rng=None, causal_chunk: int = 0):
    """Attention of the T queries over the S keys of the latent c. With causal_chunk > 0 (self-
    attention, T == S, positions increasing within each segment) the queries go in blocks of that
    size and block i scores only keys [0, end of block i): later keys are masked anyway, so the
    result is the same while the upper triangle of the T x T square is skipped block by block."""
    cfg = self.cfg
    kv_BSNH = self.kv_b(c_BSK, rng)
    nope = cfg.qk_nope_head_dim
    k_nope, v_BSNH = kv_BSNH[..., :nope], kv_BSNH[..., nope:]
    # One score product over [nope | rope] features: the rope key, shared by all heads, is
    # broadcast to each (its gradient sums over them). Head-major once, not per block.
    k_pe_BSNH = jnp.broadcast_to(
      k_pe_BSH[:, :, None].astype(k_nope.dtype), (*k_nope.shape[:3], k_pe_BSH.shape[-1])
    )
    q_BNTH = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], -1).transpose(0, 2, 1, 3)
    k_BNSH = jnp.concatenate([k_nope, k_pe_BSNH], -1).transpose(0, 2, 1, 3)
    v_BNSH = v_BSNH.transpose(0, 2, 1, 3)
    t, s = q_BNTH.shape[2], k_BNSH.shape[2]
    step = causal_chunk if 0 < causal_chunk < t else t
    blocks = tuple(
      (i, min(i + step, t), min(i + step, t) if causal_chunk else s) for i in range(0, t, step)
    )
    scale = cfg.qk_head_dim**-0.5
    out_BNTH = attention_core(
      q_BNTH, k_BNSH, v_BNSH, mask_BTS, scale, blocks, cfg.attention_recompute
    )
    out_BTNH = constrain(out_BNTH.transpose(0, 2, 1, 3), ('batch', 'seq', 'heads', None), cfg.rules)
    return self.o(out_BTNH, rng)

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, rng=None):
    q_nope, q_pe = self.project_q(x_BTD, positions_BT, rng)
    c_BTK, k_pe = self.latent(x_BTD, positions_BT, rng)
    mask = attention_mask(positions_BT, segment_ids_BT, positions_BT, segment_ids_BT)
    # Causal in index order too: it changes nothing within a segment (positions increase there)
    # and makes padding (segment 0, repeated positions) independent of attention_chunk.
    t = x_BTD.shape[1]
    mask &= jnp.tril(jnp.ones((1, t, t), jnp.bool_))
    return self.attend(q_nope, q_pe, c_BTK, k_pe, mask, rng, self.cfg.attention_chunk)

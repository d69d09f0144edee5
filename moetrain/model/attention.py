"""Attention: multi-head latent attention (MLA; DeepSeek-V2/V3, LongCat-Flash) and grouped-query
attention (GQA; Qwen3-MoE, Mixtral), over one blocked causal core; a row split over the
'context' mesh axis runs model/context.py's."""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.core import axes
from moetrain.core.sharding import constrain
from moetrain.kernels import splash
from moetrain.kernels.attention import attention_core, masked_scores, uniform
from moetrain.model.config import ModelConfig
from moetrain.model.context import context_self_attention, context_split, gather_tokens
from moetrain.model.indexer import Indexer, kl_loss, top_k_mask
from moetrain.model.layers import Linear, RMSNorm, by_blocks, rope
from moetrain.model.masks import selected_mask, self_mask


def attention_probs(s_BNTS, mask_BTS, scale: float):
  """Scaled, masked softmax over keys, in float32."""
  return jax.nn.softmax(masked_scores(s_BNTS, mask_BTS, scale), axis=-1)


def head_mean_probs(q_BTNH, k_BSNH, mask_BTS, scale: float, chunk: int = 0):
  """Each query's attention weights summed over heads and L1-normalised (their mean over heads):
  [B, T, S] float32, without gradient, by blocks of `chunk` queries (0: one block) so that the
  heads' [B, N, T, S] weights never exist whole (the indexer's KL target, indexer.kl_loss)."""
  k_BSNH = jax.lax.stop_gradient(k_BSNH)

  def block(q_BTNH, mask_BTS):
    s_BNTS = jnp.einsum('BTNH,BSNH->BNTS', q_BTNH, k_BSNH, preferred_element_type=jnp.float32)
    return jnp.mean(attention_probs(s_BNTS, mask_BTS, scale), axis=1)

  return by_blocks(block, (jax.lax.stop_gradient(q_BTNH), mask_BTS), chunk)


def multi_head(
  q_BTNH, k_BSNH, v_BSNH, mask_BTS, cfg: ModelConfig, causal_chunk: int = 0, sinks_N=None
):
  """Softmax attention of T queries over S keys, per head; out [B, T, N, H]. With
  causal_chunk > 0 (self-attention, T == S, positions increasing within each segment) the
  queries go in blocks of that size and block i scores only keys [0, end of block i): later
  keys are masked anyway, so the result is the same while the upper triangle of the T x T
  square is skipped block by block."""
  q_BNTH, k_BNSH, v_BNSH = (x.transpose(0, 2, 1, 3) for x in (q_BTNH, k_BSNH, v_BSNH))
  t, s = q_BNTH.shape[2], k_BNSH.shape[2]
  step = causal_chunk if 0 < causal_chunk < t else t
  blocks = tuple(
    (i, min(i + step, t), min(i + step, t) if causal_chunk else s) for i in range(0, t, step)
  )
  out_BNTH = attention_core(
    q_BNTH,
    k_BNSH,
    v_BNSH,
    mask_BTS,
    cfg.attention_scale,
    blocks,
    cfg.engine.attention_recompute,
    sinks_N,
    reference=cfg.engine.reference_kernels,
  )
  return constrain(out_BNTH.transpose(0, 2, 1, 3), axes.names('BTN') + (None,), cfg.engine.rules)


def causal_self_attention(
  q_BTNH, k_BTNH, v_BTNH, positions_BT, segment_ids_BT, cfg: ModelConfig, window=0, sinks_N=None
):
  """Attention of a packed row over itself (k/v with N_kv heads dividing N): the splash kernel
  where cfg.splash_attention says so, else self_mask and the chunked XLA path. Both are causal in
  index order within each segment (packing restarts positions per example, so that is causal
  by position too), a sliding window and sinks (gpt-oss) included. With the row split over the
  'context' mesh axis: context_self_attention (the XLA path, on TPU too)."""
  if context_split(cfg, q_BTNH.shape[1]):
    return context_self_attention(
      q_BTNH, k_BTNH, v_BTNH, positions_BT, segment_ids_BT, cfg, window, sinks_N
    )
  if cfg.splash_attention(q_BTNH.shape[1]):
    heads = dict(cfg.engine.rules.activations).get('heads')

    def run(w: int):
      return splash.splash_attention(
        *(x.transpose(0, 2, 1, 3) for x in (q_BTNH, k_BTNH, v_BTNH)),
        segment_ids_BT,
        cfg.attention_scale,
        interpret=cfg.engine.platform != 'tpu',
        mesh_shape=cfg.engine.mesh_shape,
        head_axis=heads if isinstance(heads, str) else None,
        window=w,
        sinks_N=sinks_N,
      )

    if isinstance(window, int) or not cfg.sliding_window:
      out_BNTH = run(window if isinstance(window, int) else 0)
    else:  # a layer's window under the layer scan: the kernel's mask is static, so one of two
      out_BNTH = jax.lax.cond(window > 0, lambda: run(cfg.sliding_window), lambda: run(0))
    return constrain(out_BNTH.transpose(0, 2, 1, 3), axes.names('BTN') + (None,), cfg.engine.rules)
  groups = cfg.num_heads // k_BTNH.shape[2]
  k_BTNH, v_BTNH = (jnp.repeat(x, groups, axis=2) for x in (k_BTNH, v_BTNH))
  mask = self_mask(positions_BT, segment_ids_BT, window)
  return multi_head(q_BTNH, k_BTNH, v_BTNH, mask, cfg, cfg.engine.attention_chunk, sinks_N)


class MLA(nnx.Module):
  """Low-rank q, compressed kv latent c (K) plus one rope key shared by all heads; with
  cfg.index_n_heads, DeepSeek Sparse Attention: each query attends only to the keys its
  lightning indexer (model/indexer.py) selects."""

  def __init__(self, cfg: ModelConfig, path: str, rngs: nnx.Rngs):
    self.cfg = cfg
    d, n, q, k = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    qk, nope, v, rope = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
    if q:
      self.q_a = Linear('BTD,DQ->BTQ', (d, q), cfg, f'{path}.q_a', rngs)
      self.q_a_norm = RMSNorm(q, 'Q', cfg.mla_norm_eps, cfg)
      self.q_b = Linear('BTQ,QNH->BTNH', (q, n, qk), cfg, f'{path}.q_b', rngs)
    else:  # q_lora_rank 0: one plain projection (DeepSeek-V2-Lite, Moonlight)
      self.q = Linear('BTD,DNH->BTNH', (d, n, qk), cfg, f'{path}.q', rngs)
    self.kv_a = Linear('BTD,DK->BTK', (d, k + rope), cfg, f'{path}.kv_a', rngs)
    self.kv_a_norm = RMSNorm(k, 'K', cfg.mla_norm_eps, cfg)
    self.kv_b = Linear('BTK,KNH->BTNH', (k, n, nope + v), cfg, f'{path}.kv_b', rngs)
    self.o = Linear('BTNH,NHD->BTD', (n, v, d), cfg, f'{path}.o', rngs)
    # Variance alignment of the low-rank paths (TR eq. 6-7); HF applies them unconditionally.
    self.alpha_q = math.sqrt(d / q) if cfg.mla_scale_q_lora and q else 1.0
    self.alpha_kv = math.sqrt(d / k) if cfg.mla_scale_kv_lora else 1.0
    self.indexer = Indexer(cfg, f'{path}.indexer', rngs) if cfg.index_n_heads else None

  def project_q(self, x_BTD, positions_BT, rng=None):
    if self.cfg.q_lora_rank:
      q_BTNH = self.q_b(self.q_a_norm(self.q_a(x_BTD, rng)), rng) * self.alpha_q
    else:
      q_BTNH = self.q(x_BTD, rng)
    nope = self.cfg.qk_nope_head_dim
    q_pe = rope(q_BTNH[..., nope:], positions_BT, self.cfg)
    return q_BTNH[..., :nope], q_pe

  def latent(self, x_BTD, positions_BT, rng=None):
    """The per-token cache content: normalised, scaled latent c [B,T,K] and rope key [B,T,H]."""
    ckv_BTK = self.kv_a(x_BTD, rng)
    k = self.cfg.kv_lora_rank
    c_BTK = self.kv_a_norm(ckv_BTK[..., :k]) * self.alpha_kv
    k_pe = rope(ckv_BTK[..., None, k:], positions_BT, self.cfg)[:, :, 0]
    return c_BTK, k_pe

  def attend(self, q_nope, q_pe, c_BSK, k_pe_BSH, mask_BTS, rng=None, causal_chunk: int = 0):
    """Attention of the T queries over the S keys of the latent c (multi_head's causal_chunk)."""
    q_BTNH, k_BSNH, v_BSNH = self.heads(q_nope, q_pe, c_BSK, k_pe_BSH, rng)
    out_BTNH = multi_head(q_BTNH, k_BSNH, v_BSNH, mask_BTS, self.cfg, causal_chunk)
    return self.o(out_BTNH, rng)

  def heads(self, q_nope, q_pe, c_BSK, k_pe_BSH, rng=None):
    """Per-head queries and keys over [nope | rope] features and values from the latent c: one
    score product, the rope key (shared by all heads) broadcast to each (its gradient sums
    over them)."""
    q_BTNH = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], -1)
    return q_BTNH, *self.keys_values(c_BSK, k_pe_BSH, self.kv_b.operands(), rng)

  def keys_values(
    self, c_BSK, k_pe_BSH, operands: tuple, rng=None, local: bool = False, heads=None
  ):
    """heads' keys and values from the latent c and rope key, kv_b's arrays passed in
    (`operands`): a context split runs it inside its shard_map (`local`: on the shard's own
    arrays, where its tokens flatten into one axis for kv_b's 2-D product). heads: (first,
    count), the heads to expand (a device's own, with heads split over a mesh axis), or all."""
    if heads is not None:
      operands = self.kv_b.sliced(operands, *heads)
    kv_BSNH = self.kv_b.apply(c_BSK, operands, rng, flat=True if local else None)
    nope = self.cfg.qk_nope_head_dim
    k_nope, v_BSNH = kv_BSNH[..., :nope], kv_BSNH[..., nope:]
    k_pe_BSNH = jnp.broadcast_to(
      k_pe_BSH[:, :, None].astype(k_nope.dtype), (*k_nope.shape[:3], k_pe_BSH.shape[-1])
    )
    return jnp.concatenate([k_nope, k_pe_BSNH], -1), v_BSNH

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, rng=None, window=0):
    del window  # no MLA family has sliding windows
    return self.forward(x_BTD, positions_BT, segment_ids_BT, rng)[0]

  def forward(self, x_BTD, positions_BT, segment_ids_BT, rng=None):
    """(the attention's output [B, T, D], the indexer's KL loss summed over the row's tokens:
    None unless cfg.train_indexer)."""
    q_nope, q_pe = self.project_q(x_BTD, positions_BT, rng)
    c_BTK, k_pe = self.latent(x_BTD, positions_BT, rng)
    s = c_BTK.shape[1]
    split = context_split(self.cfg, s)
    trains = self.cfg.train_indexer and self.indexer is not None
    dense = not (self.sparse(s) or trains)
    if split:
      # The all-gather and the ring move the latent, not the heads' keys: each shard expands it
      # to keys and values inside the attention's shard_map (the all-gather: the row's; the
      # ring: each visitor's), so the backward sums the latent's gradient over 'context', not
      # the heads' (36x the bytes for LongCat-Flash). LoRA dropout on kv_b draws its masks
      # outside: inside, every shard of the rows would draw the same (then the all-gather
      # expands the gathered latent outside, and the ring sends the heads).
      if self.cfg.engine.context_attention != 'ring':
        c_BTK, k_pe = gather_tokens(c_BTK, self.cfg), gather_tokens(k_pe, self.cfg)
      if dense and (rng is None or not (self.kv_b.has_lora and self.kv_b.lora_dropout)):
        q_BTNH = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], -1)
        expand = (functools.partial(self.keys_values, local=True), (self.kv_b.operands(),))
        out_BTNH = context_self_attention(
          q_BTNH, c_BTK, k_pe, positions_BT, segment_ids_BT, self.cfg, expand=expand
        )
        return self.o(out_BTNH, rng), None
    q_BTNH, k_BTNH, v_BTNH = self.heads(q_nope, q_pe, c_BTK, k_pe, rng)
    if dense:
      out_BTNH = causal_self_attention(
        q_BTNH, k_BTNH, v_BTNH, positions_BT, segment_ids_BT, self.cfg
      )
      return self.o(out_BTNH, rng), None
    if split:
      raise NotImplementedError('the sparse attention indexer (index_n_heads) over a context split')
    out_BTNH, kl = self.indexed(x_BTD, (q_BTNH, k_BTNH, v_BTNH), positions_BT, segment_ids_BT, rng)
    return self.o(out_BTNH, rng), kl

  def indexed(self, x_BTD, qkv, positions_BT, segment_ids_BT, rng=None):
    """(heads' output [B, T, N, H], KL loss or None) of attention with the indexer: over its
    selection where it selects (sparse), over every key otherwise; the indexer's KL loss
    (cfg.train_indexer) over the same keys, towards these heads' weights."""
    cfg = self.cfg
    qr_BTQ = self.q_a_norm(self.q_a(x_BTD, rng))  # the latent q_b reads (one q_a under jit)
    t, chunk = x_BTD.shape[1], cfg.engine.attention_chunk
    blocks = tuple((i, min(i + chunk, t), t) for i in range(0, t, chunk or t))
    if self.sparse(t) and not cfg.train_indexer and uniform(blocks, t, t):
      return self.selected(x_BTD, qr_BTQ, qkv, positions_BT, segment_ids_BT, blocks), None
    score_BTS = self.indexer.row_scores(x_BTD, qr_BTQ, positions_BT, cfg.engine.attention_chunk)
    keep_BTS = self_mask(positions_BT, segment_ids_BT)
    if self.sparse(x_BTD.shape[1]):
      keep_BTS = top_k_mask(jax.lax.stop_gradient(score_BTS), keep_BTS, cfg.index_topk)
      out_BTNH = multi_head(*qkv, keep_BTS, cfg, cfg.engine.attention_chunk)
    else:
      out_BTNH = causal_self_attention(*qkv, positions_BT, segment_ids_BT, cfg)
    if not cfg.train_indexer:
      return out_BTNH, None
    p_BTS = head_mean_probs(*qkv[:2], keep_BTS, cfg.attention_scale, cfg.engine.attention_chunk)
    return out_BTNH, kl_loss(p_BTS, score_BTS, keep_BTS, segment_ids_BT > 0)

  def selected(self, x_BTD, qr_BTQ, qkv, positions_BT, segment_ids_BT, blocks):
    """indexed's sparse output with the indexer frozen, over even blocks of queries: each
    block's selection made inside attention_core's loop (selected_mask) from the indexer's
    queries, weights and keys, none of them differentiated."""
    x_BTD, qr_BTQ = jax.lax.stop_gradient((x_BTD, qr_BTQ))
    iq_BTNH, w_BTN = self.indexer.queries(x_BTD, qr_BTQ, positions_BT)
    index_T = jnp.arange(x_BTD.shape[1])
    q_meta = (positions_BT, segment_ids_BT, index_T)
    q_meta += (iq_BTNH.transpose(0, 2, 3, 1), w_BTN.transpose(0, 2, 1))
    k_meta = (positions_BT, segment_ids_BT, index_T, self.indexer.keys(x_BTD, positions_BT))
    out_BNTH = attention_core(
      *(x.transpose(0, 2, 1, 3) for x in qkv),
      jax.lax.stop_gradient((q_meta, k_meta)),
      self.cfg.attention_scale,
      blocks,
      self.cfg.engine.attention_recompute,
      None,
      functools.partial(selected_mask, self.cfg.index_topk),
      reference=self.cfg.engine.reference_kernels,
    )
    return constrain(
      out_BNTH.transpose(0, 2, 1, 3), axes.names('BTN') + (None,), self.cfg.engine.rules
    )

  def sparse(self, s: int) -> bool:
    """Whether queries over s keys attend to the indexer's selection: with fewer keys than
    index_topk every query keeps all it sees, the dense path's result, which runs instead."""
    return self.indexer is not None and s > self.cfg.index_topk


class GQA(nnx.Module):
  """Grouped-query attention: N query heads share N_kv key/value heads (N / N_kv each), with
  RMSNorm over each query and key head (Qwen3), or over the whole q and k projections (OLMoE),
  before RoPE when cfg.qk_norm; biases on q/k/v (cfg.qkv_bias) and o (cfg.o_bias); RoPE on part
  of each head (cfg.partial_rotary_factor, GLM-4.5); a learned sink logit per head
  (cfg.attention_sinks) and a sliding window (gpt-oss: the layer's, given at each call); an
  output gate per head and feature (cfg.attn_output_gate, Qwen3-Next)."""

  def __init__(self, cfg: ModelConfig, path: str, rngs: nnx.Rngs):
    self.cfg = cfg
    d, n, g, h = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.gqa_head_dim
    qkv = dict(bias=cfg.qkv_bias)
    # With attn_output_gate each head's projection is [query H | gate H] (as transformers'
    # q_proj rows): the gate rides with the query to attend().
    hq = 2 * h if cfg.attn_output_gate else h
    self.q = Linear('BTD,DNH->BTNH', (d, n, hq), cfg, f'{path}.q', rngs, **qkv)
    # The key/value heads N_kv are heads too ('heads' shards them like the query heads).
    self.k = Linear('BTD,DNH->BTNH', (d, g, h), cfg, f'{path}.k', rngs, **qkv)
    self.v = Linear('BTD,DNH->BTNH', (d, g, h), cfg, f'{path}.v', rngs, **qkv)
    self.o = Linear('BTNH,NHD->BTD', (n, h, d), cfg, f'{path}.o', rngs, bias=cfg.o_bias)
    if cfg.attention_sinks:  # float32, like the softmax it joins
      self.sinks = nnx.Param(jnp.zeros((n,), jnp.float32), axes=axes.names('N'))
    if cfg.qk_norm and cfg.qk_norm_per_head:
      self.q_norm = RMSNorm(h, 'H', cfg.rms_norm_eps, cfg)
      self.k_norm = RMSNorm(h, 'H', cfg.rms_norm_eps, cfg)
    elif cfg.qk_norm:  # one norm over all heads' features: [N * H], [N_kv * H]
      self.q_norm = RMSNorm(n * h, 'O', cfg.rms_norm_eps, cfg)
      self.k_norm = RMSNorm(g * h, 'O', cfg.rms_norm_eps, cfg)

  def norm_qk(self, q_BTNH, k_BTNH):
    if self.cfg.qk_norm_per_head:
      return self.q_norm(q_BTNH), self.k_norm(k_BTNH)
    whole = lambda norm, x: norm(x.reshape(*x.shape[:2], -1)).reshape(x.shape)
    return whole(self.q_norm, q_BTNH), whole(self.k_norm, k_BTNH)

  def project(self, x_BTD, positions_BT, rng=None):
    """Queries [B, T, N, H] and the cache content: keys and values [B, T, N_kv, H]."""
    q_BTNH, k_BTNH = self.q(x_BTD, rng), self.k(x_BTD, rng)
    q_BTNH, gate_BTNH = self.split_gate(q_BTNH)
    if self.cfg.qk_norm:
      q_BTNH, k_BTNH = self.norm_qk(q_BTNH, k_BTNH)
    q_BTNH, k_BTNH = (self.rotate(x, positions_BT) for x in (q_BTNH, k_BTNH))
    if gate_BTNH is not None:
      q_BTNH = jnp.concatenate([q_BTNH, gate_BTNH], -1)
    return q_BTNH, k_BTNH, self.v(x_BTD, rng)

  def split_gate(self, q_BTNH):
    """(queries, output gate or None) of a projection [query | gate] per head."""
    if not self.cfg.attn_output_gate:
      return q_BTNH, None
    h = q_BTNH.shape[-1] // 2
    return q_BTNH[..., :h], q_BTNH[..., h:]

  def output(self, out_BTNH, gate_BTNH, rng=None):
    """The o projection of the heads' outputs, gated per feature first (attn_output_gate)."""
    if gate_BTNH is not None:
      gate = jax.nn.sigmoid(gate_BTNH.astype(jnp.float32))
      out_BTNH = (out_BTNH.astype(jnp.float32) * gate).astype(out_BTNH.dtype)
    return self.o(out_BTNH, rng)

  def rotate(self, x_BTNH, positions_BT):
    """RoPE on the first cfg.rotary_dim features of each head (all but GLM-4.5's: all)."""
    r = self.cfg.rotary_dim
    if r == x_BTNH.shape[-1]:
      return rope(x_BTNH, positions_BT, self.cfg)
    return jnp.concatenate([rope(x_BTNH[..., :r], positions_BT, self.cfg), x_BTNH[..., r:]], -1)

  def attend(self, q_BTNH, k_BSNH, v_BSNH, mask_BTS, rng=None, causal_chunk: int = 0):
    """Each key/value head serves its N / N_kv consecutive query heads (HF's repeat_kv)."""
    groups = self.cfg.num_heads // self.cfg.kv_heads
    k_BSNH, v_BSNH = (jnp.repeat(x, groups, axis=2) for x in (k_BSNH, v_BSNH))
    q_BTNH, gate_BTNH = self.split_gate(q_BTNH)
    out_BTNH = multi_head(q_BTNH, k_BSNH, v_BSNH, mask_BTS, self.cfg, causal_chunk, self.sinks_N)
    return self.output(out_BTNH, gate_BTNH, rng)

  @property
  def sinks_N(self):
    return self.sinks[...] if self.cfg.attention_sinks else None

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, rng=None, window=0):
    q_BTNH, k_BTNH, v_BTNH = self.project(x_BTD, positions_BT, rng)
    q_BTNH, gate_BTNH = self.split_gate(q_BTNH)
    out_BTNH = causal_self_attention(
      q_BTNH, k_BTNH, v_BTNH, positions_BT, segment_ids_BT, self.cfg, window, self.sinks_N
    )
    return self.output(out_BTNH, gate_BTNH, rng)


def make_attention(cfg: ModelConfig, path: str, rngs: nnx.Rngs):
  if cfg.attention == 'mla':
    return MLA(cfg, path, rngs)
  return GQA(cfg, path, rngs)

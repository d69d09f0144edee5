"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): which past tokens each
query of an MLA layer attends to."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.core import axes
from moetrain.model.config import ModelConfig
from moetrain.model.layers import Linear, by_blocks, dtype_of, rope


class LayerNorm(nnx.Module):
  """(x - mean) * rsqrt(var + eps) * w + b over the last dimension, in float32 (torch's
  nn.LayerNorm: the indexer's key norm, the one norm with a bias)."""

  def __init__(self, dim: int, letter: str, eps: float, cfg: ModelConfig):
    dt = dtype_of(cfg.engine.param_dtype)
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), dt), axes=axes.names(letter))
    self.bias = nnx.Param(jnp.zeros((dim,), dt), axes=axes.names(letter))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    shape = (1,) * (y.ndim - 1) + (-1,)
    w, b = (p[...].astype(jnp.float32).reshape(shape) for p in (self.scale, self.bias))
    return (y * w + b).astype(x.dtype)


def top_k_mask(score_BTS, allowed_BTS, k: int):
  """The keys each query keeps: its k best-scored among those `allowed_BTS` lets it see (causal,
  same segment), all of them where it sees k or fewer. Boolean [B, T, S]."""
  if k >= score_BTS.shape[-1]:
    return allowed_BTS
  masked = jnp.where(allowed_BTS, score_BTS, -jnp.inf)
  _, idx_BTK = jax.lax.top_k(masked, k)
  chosen = jnp.put_along_axis(
    jnp.zeros(allowed_BTS.shape, jnp.bool_), idx_BTK, True, axis=-1, inplace=False
  )
  return chosen & allowed_BTS  # a short row's top-k also took keys it may not see


def index_scores(q_BTNH, w_BTN, k_BSH):
  """The indexer's I [B, T, S] (Indexer's formula) from its float32 queries, head weights and
  keys."""
  s_BTNS = jnp.einsum('BTNH,BSH->BTNS', q_BTNH, k_BSH.astype(jnp.float32))
  s_BTNS = jax.nn.relu(s_BTNS * k_BSH.shape[-1] ** -0.5)
  return jnp.einsum('BTN,BTNS->BTS', w_BTN, s_BTNS)


class Indexer(nnx.Module):
  """Scores every (query t, key s) pair of an MLA layer and keeps each query's index_topk best:

    I[t, s] = sum_n w[t, n] relu(q[t, n] . k[s] / sqrt(H_i)),  w = weights_proj(x) / sqrt(N_i)

  q: N_i heads of H_i from the q low-rank latent after q_a_norm (wq_b); k: one key per token
  shared by the heads, LayerNorm(wk(x)); RoPE (the MLA's table, YaRN included) on the first
  qk_rope_head_dim features of both, on halves (DeepSeek-V3.2) or adjacent pairs (GLM-5).
  transformers scores in float32 without the released kernels' Hadamard rotation (orthogonal:
  dot products kept) and FP8 casts, and so does this.

  The selection is an integer top-k: no gradient of the LM loss reaches the indexer, whose
  input is detached from the main model. Its weights stay as loaded (frozen; LoRA never targets
  them) unless loss.indexer_kl trains them on DeepSeek's KL loss (kl_loss). With the indexer
  frozen and the row in even blocks of engine.attention_chunk queries, each block's selection
  is made inside the attention's loop (masks.selected_mask): no [T, S] score or mask exists
  whole, but each block still scores all S keys densely. A kernel that gathers each query
  block's selected keys (sparse FLOPs) is not built."""

  def __init__(self, cfg: ModelConfig, path: str, rngs: nnx.Rngs):
    self.cfg = cfg
    d, n, h = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    self.wq_b = Linear('BTQ,QNH->BTNH', (cfg.q_lora_rank, n, h), cfg, f'{path}.wq_b', rngs)
    self.wk = Linear('BTD,DH->BTH', (d, h), cfg, f'{path}.wk', rngs)
    self.k_norm = LayerNorm(h, 'H', 1e-6, cfg)
    self.weights_proj = Linear('BTD,DN->BTN', (d, n), cfg, f'{path}.weights_proj', rngs)

  def rotate(self, x_BTNH, positions_BT):
    r = self.cfg.qk_rope_head_dim
    turned = rope(x_BTNH[..., :r], positions_BT, self.cfg, self.cfg.index_rope_interleaved)
    return jnp.concatenate([turned, x_BTNH[..., r:]], -1)

  def queries(self, x_BTD, qr_BTQ, positions_BT):
    """(queries [B, T, N_i, H_i], head weights [B, T, N_i]) in float32."""
    q_BTNH = self.rotate(self.wq_b(qr_BTQ), positions_BT).astype(jnp.float32)
    w_BTN = self.weights_proj(x_BTD).astype(jnp.float32) * self.cfg.index_n_heads**-0.5
    return q_BTNH, w_BTN

  def keys(self, x_BTD, positions_BT):
    """The per-token key [B, T, H_i] (what a KV cache keeps of the indexer)."""
    k_BTH = self.k_norm(self.wk(x_BTD))
    return self.rotate(k_BTH[:, :, None], positions_BT)[:, :, 0]

  def scores(self, q_BTNH, w_BTN, k_BSH, chunk: int = 0):
    """I [B, T, S] of the queries against the keys, float32, by blocks of `chunk` queries (0:
    one block), each recomputed in the backward pass: the heads' [B, T, N_i, S] products are
    never kept whole (the KL loss's backward kept them: 64 GiB a row of 16k tokens)."""
    k_BSH = k_BSH.astype(jnp.float32)
    block = functools.partial(index_scores, k_BSH=k_BSH)
    return by_blocks(block, (q_BTNH, w_BTN), chunk, remat=True)

  def select(self, q_BTNH, w_BTN, k_BSH, allowed_BTS):
    """The keys each query attends to: boolean [B, T, S] within allowed_BTS."""
    score_BTS = jax.lax.stop_gradient(self.scores(q_BTNH, w_BTN, k_BSH))
    return top_k_mask(score_BTS, allowed_BTS, self.cfg.index_topk)

  def row_scores(self, x_BTD, qr_BTQ, positions_BT, chunk: int = 0):
    """I [B, T, S] of a row over itself (S = T), float32, differentiable in the indexer's weights:
    its input is detached from the main model (what trains it is kl_loss alone)."""
    x_BTD, qr_BTQ = jax.lax.stop_gradient((x_BTD, qr_BTQ))
    q_BTNH, w_BTN = self.queries(x_BTD, qr_BTQ, positions_BT)
    return self.scores(q_BTNH, w_BTN, self.keys(x_BTD, positions_BT), chunk)

  def __call__(self, x_BTD, qr_BTQ, positions_BT, allowed_BTS):
    """select() of a row over itself."""
    score_BTS = jax.lax.stop_gradient(self.row_scores(x_BTD, qr_BTQ, positions_BT))
    return top_k_mask(score_BTS, allowed_BTS, self.cfg.index_topk)


def kl_loss(p_BTS, score_BTS, keep_BTS, valid_BT):
  """The indexer's training loss as DeepSeek-V3.2 releases it, summed over the valid queries:
  KL(p_t || softmax(I_t)) over the keys keep_BTS gives each query t, where p_t is the main
  attention's weights summed over heads and L1-normalised (attention.head_mean_probs, taken
  with the same keep_BTS, no gradient). keep_BTS is what the main attention attends to: every
  key the query sees where the row is within index_topk (the dense warm-up's form), else its
  selected top-k set S_t (the sparse stage's form). Float32 scalar."""
  logq_BTS = jax.nn.log_softmax(jnp.where(keep_BTS, score_BTS, jnp.finfo(jnp.float32).min), -1)
  p_BTS = jax.lax.stop_gradient(jnp.where(keep_BTS, p_BTS, 0.0))
  logp_BTS = jnp.log(jnp.where(p_BTS > 0, p_BTS, 1.0))
  kl_BT = jnp.sum(jnp.where(p_BTS > 0, p_BTS * (logp_BTS - logq_BTS), 0.0), axis=-1)
  return jnp.sum(kl_BT * valid_BT)

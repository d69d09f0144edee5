"""Incremental decoding against a KV cache: MLA's compressed latent (not per-head K/V), or GQA's
grouped keys and values; a Gated DeltaNet layer's fixed-size state."""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.kernels import delta_rule, quant
from moetrain.model import stages
from moetrain.model.attention import MLA, attention_probs
from moetrain.model.config import ModelConfig
from moetrain.model.layers import Linear
from moetrain.model.linear_attention import GatedDeltaNet
from moetrain.model.masks import attention_mask, window_mask
from moetrain.model.transformer import Transformer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """What attention needs of every past token, per layer and attention block (LongCat's layers
  have two; slot s of axis 3 holds absolute position s), by name:
    MLA: c [L, blocks, B, S, K], the latent after kv_a_norm and alpha_kv; k_pe [..., R], the
      shared rope key after RoPE. Per token and block K + R numbers instead of the N * (P + R +
      V) of expanded keys and values (576 vs 20,480 for LongCat-Flash). With sparse attention
      also index_k [..., H_i], the indexer's key (after its norm and RoPE).
    GQA: k, v [L, 1, B, S, N_kv, H], keys (normed, after RoPE) and values of the N_kv heads.
  With Gated DeltaNet layers (Qwen3-Next) also, for those layers: conv [L, B, kernel - 1, C],
  the last inputs of the short convolution, and delta [L, B, Nv, Dk, Dv], the delta rule's
  float32 state: a fixed size, whatever the length."""

  arrays: dict

  @property
  def max_len(self) -> int:
    return next(a for n, a in self.arrays.items() if n in KV_NAMES).shape[3]


KV_NAMES = ('c', 'k_pe', 'k', 'v', 'index_k')  # the arrays with a slot per position


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
  blocks = 2 if cfg.layer_layout == 'shortcut' else 1
  dt, lead = jnp.dtype(cfg.engine.dtype), (cfg.num_layers, blocks, batch, max_len)
  if cfg.attention == 'mla':
    widths = {'c': (cfg.kv_lora_rank,), 'k_pe': (cfg.qk_rope_head_dim,)}
    if cfg.index_n_heads:
      widths['index_k'] = (cfg.index_head_dim,)
  else:
    widths = {n: (cfg.kv_heads, cfg.gqa_head_dim) for n in ('k', 'v')}
  arrays = {n: jnp.zeros((*lead, *w), dt) for n, w in widths.items()}
  if 'linear' in cfg.layer_mixers():
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    channels = 2 * nk * dk + nv * dv
    conv = (cfg.num_layers, batch, cfg.linear_conv_kernel_dim - 1, channels)
    arrays['conv'] = jnp.zeros(conv, jnp.float32)
    arrays['delta'] = jnp.zeros((cfg.num_layers, batch, nv, dk, dv), jnp.float32)
  return KVCache(arrays)


def effective_kernel(linear: Linear) -> jax.Array:
  """The kernel of one unstacked Linear in its compute dtype: dequantised base + scale * A @ B."""
  w = quant.value(linear.kernel, linear.compute_dtype)
  if linear.has_lora:
    a, b = (v[...].astype(w.dtype) for v in (linear.lora_a, linear.lora_b))
    w = w + linear.lora_scale * jnp.tensordot(a, b, axes=1)
  return w


def attend_absorbed(mla: MLA, q_nope_BTNH, q_pe_BTNH, c_BSK, k_pe_BSH, mask_BTS):
  """MLA.attend with kv_b folded into the query (for keys) and into the output (for values), so
  scores and the weighted sum run on the K-wide latents and the cache is never expanded per head.
  Per step that costs O(S * N * K) instead of kv_b's O(S * K * N * (P + V))."""
  cfg, f32 = mla.cfg, jnp.float32
  w_KNH = effective_kernel(mla.kv_b)
  w_k_KNH, w_v_KNH = w_KNH[..., : cfg.qk_nope_head_dim], w_KNH[..., cfg.qk_nope_head_dim :]
  q_BTNK = jnp.einsum('BTNH,KNH->BTNK', q_nope_BTNH, w_k_KNH)
  c_BSK = c_BSK.astype(q_BTNK.dtype)
  s_BNTS = jnp.einsum('BTNK,BSK->BNTS', q_BTNK, c_BSK, preferred_element_type=f32)
  s_BNTS += jnp.einsum(
    'BTNH,BSH->BNTS', q_pe_BTNH, k_pe_BSH.astype(q_pe_BTNH.dtype), preferred_element_type=f32
  )
  p_BNTS = attention_probs(s_BNTS, mask_BTS, cfg.attention_scale).astype(c_BSK.dtype)
  o_BTNK = jnp.einsum('BNTS,BSK->BTNK', p_BNTS, c_BSK)
  return mla.o(jnp.einsum('BTNK,KNH->BTNH', o_BTNK, w_v_KNH))


def new_entries(attn, x_BTD, positions_BT):
  """(the queries, {cache name: [B, T, ...] entries of the T tokens})."""
  if isinstance(attn, MLA):
    c_BTK, k_pe_BTH = attn.latent(x_BTD, positions_BT)
    new = {'c': c_BTK, 'k_pe': k_pe_BTH}
    if attn.indexer is not None:
      new['index_k'] = attn.indexer.keys(x_BTD, positions_BT)
    return attn.project_q(x_BTD, positions_BT), new
  q_BTNH, k_BTNH, v_BTNH = attn.project(x_BTD, positions_BT)
  return (q_BTNH,), {'k': k_BTNH, 'v': v_BTNH}


def cached_attention(
  attn, x_BTD, positions_BT, cache: KVCache, layer, block: int, start, absorb: bool
):
  """Writes the T new tokens' entries into cache slots start.. of (layer, block), in place, then
  attends over that block's slots. Returns (out_BTD, cache).

  A Python-int start (prefill) attends over slots [0, start + T) only, exactly like the training
  forward; a traced start attends over all S slots, where the causal mask (key position <= query
  position) also hides the slots not written yet. absorb: MLA in the latent space."""
  q, new = new_entries(attn, x_BTD, positions_BT)
  b, t = positions_BT.shape
  s = start + t if isinstance(start, int) else cache.max_len
  arrays, past = dict(cache.arrays), {}
  for name, old in ((n, a) for n, a in cache.arrays.items() if n in KV_NAMES):
    tail = (0,) * (old.ndim - 4)
    arrays[name] = jax.lax.dynamic_update_slice(
      old, new[name][None, None].astype(old.dtype), (layer, block, 0, start, *tail)
    )
    size = (1, 1, b, s, *old.shape[4:])
    past[name] = jax.lax.dynamic_slice(arrays[name], (layer, block, 0, 0, *tail), size)[0, 0]
  k_pos_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  ones_BT, ones_BS = jnp.ones((b, t), jnp.int32), jnp.ones((b, s), jnp.int32)
  mask_BTS = attention_mask(positions_BT, ones_BT, k_pos_BS, ones_BS)
  windows = attn.cfg.layer_windows()
  if any(windows):  # this layer's (layer: its index, traced under the scan)
    mask_BTS = window_mask(mask_BTS, positions_BT, k_pos_BS, jnp.asarray(windows)[layer])
  # From slot 0 (a prefill) the T queries face their own T keys: causal blocks, as training.
  chunk = attn.cfg.engine.attention_chunk if isinstance(start, int) and start == 0 else 0
  if isinstance(attn, MLA) and attn.sparse(s):  # the indexer's choice among the cached slots
    qr_BTQ = attn.q_a_norm(attn.q_a(x_BTD))
    q_BTNH, w_BTN = attn.indexer.queries(x_BTD, qr_BTQ, positions_BT)
    mask_BTS = attn.indexer.select(q_BTNH, w_BTN, past['index_k'], mask_BTS)
  if isinstance(attn, MLA):
    if absorb:
      out_BTD = attend_absorbed(attn, *q, past['c'], past['k_pe'], mask_BTS)
    else:
      out_BTD = attn.attend(*q, past['c'], past['k_pe'], mask_BTS, causal_chunk=chunk)
  else:
    out_BTD = attn.attend(*q, past['k'], past['v'], mask_BTS, causal_chunk=chunk)
  return out_BTD, KVCache(arrays)


def cached_linear(net: GatedDeltaNet, x_BTD, cache: KVCache, layer, last):
  """A Gated DeltaNet layer over T new tokens from its cached convolution inputs and state,
  which it updates: the chunked rule for a prompt, the recurrence for one token. last (a
  prefill's right-padded prompt: its last real index, may be traced): the tokens after it change
  neither the state (beta and decay set to no-ops) nor the convolution's inputs. Returns
  (out_BTD, cache)."""
  b, t = x_BTD.shape[:2]
  qkv, z, beta, g = net.inputs(x_BTD)
  if last is not None:
    real = (jnp.arange(t) <= last)[None, :, None]
    beta, g = jnp.where(real, beta, 0.0), jnp.where(real, g, 0.0)
  conv, delta = cache.arrays['conv'][layer], cache.arrays['delta'][layer]
  qkv, full = net.convolve(qkv, jnp.ones((b, t), jnp.int32), conv, keep_all=True)
  kern = conv.shape[1]
  conv = jax.lax.dynamic_slice_in_dim(full, t if last is None else last + 1, kern, axis=1)
  q, k, v = net.heads(qkv)
  if t == 1:
    o, delta = delta_rule.recurrent(q, k, v, g, beta, delta)
  else:
    o, delta = delta_rule.chunked(q, k, v, g, beta, net.cfg.delta_chunk, delta)
  arrays = dict(cache.arrays)
  arrays['conv'] = arrays['conv'].at[layer].set(conv)
  arrays['delta'] = arrays['delta'].at[layer].set(delta)
  return net.finish(o, z, x_BTD.dtype), KVCache(arrays)


def forward(
  model: Transformer, cache: KVCache, ids_BT, start, *, absorb=False, last=None, routes=False
):
  """Runs ids_BT at absolute positions start..start+T-1 (the same for every row) through the
  layers: per group of layers a scan over their stacked state like Transformer.run_layers, whose
  carry holds the whole cache so that each attention block writes its T new slots in place.
  Returns float32 logits of the last position [B, V] (or of index `last` of the T, may be
  traced) and the updated cache. start + T must not exceed cache.max_len. Routing is per token,
  so this equals the full forward under dropless dispatch; capacity dispatch drops depend on how
  many tokens share a call. routes: also return the top-k ids each MoE layer chose for the T
  tokens, [B, T, L, K] int32 (the sampler's record for routing replay)."""
  b, t = ids_BT.shape
  _check_room(cache, start, t)
  positions_BT = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
  valid_BT = jnp.ones((b, t), bool)
  h_BTD = model.embed(ids_BT)
  chosen = []
  for group in model.cfg.layer_groups():
    graphdef, state = nnx.split(getattr(model, group.name))
    state = stages.in_layer_order(state, model.cfg)  # (tools load in layer order: a no-op)

    def body(carry, xs, graphdef=graphdef):
      h_BTD, cache = carry
      layer_state, layer_index = xs
      layer = nnx.merge(graphdef, layer_state)
      box = [cache]  # attend() threads the cache through the layer's attention blocks

      def attend(i, x_BTD):
        attn = layer.attn if hasattr(layer, 'attn') else (layer.attn_0, layer.attn_1)[i]
        if isinstance(attn, GatedDeltaNet):
          out_BTD, box[0] = cached_linear(attn, x_BTD, box[0], layer_index, last)
          return out_BTD
        out_BTD, box[0] = cached_attention(
          attn, x_BTD, positions_BT, box[0], layer_index, i, start, absorb
        )
        return out_BTD

      h_BTD, stats = layer.body(h_BTD, attend, valid_BT, [None] * 5)
      return (h_BTD, box[0]), (stats['routes'] if routes and stats is not None else None)

    layers_L = jnp.arange(group.start, group.start + group.count, dtype=jnp.int32)
    (h_BTD, cache), ids_LBTK = jax.lax.scan(body, (h_BTD, cache), (state, layers_L))
    if ids_LBTK is not None:
      chosen.append(ids_LBTK)
  h_BTD = h_BTD[:, -1:] if last is None else jax.lax.dynamic_slice_in_dim(h_BTD, last, 1, axis=1)
  logits_BTV = model.lm_head(model.final_norm(h_BTD))
  logits_BV = logits_BTV[:, 0].astype(jnp.float32)
  if not routes:
    return logits_BV, cache
  return logits_BV, cache, jnp.transpose(jnp.concatenate(chosen), (1, 2, 0, 3))


def _check_room(cache: KVCache, start, t: int) -> None:
  """Positions start..start+t-1 must have slots: past the end, the cache write would clamp onto
  the last slot and the logits would be wrong, silently. Checked where start is known (a Python
  int or a concrete array); a traced start is the caller's to keep in range."""
  try:
    first = int(start)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return
  if first < 0 or first + t > cache.max_len:
    raise ValueError(
      f'positions {first}..{first + t - 1} do not fit a cache of max_len={cache.max_len} '
      '(prefill with a larger max_len: prompt length + new tokens)'
    )


def prefill(model: Transformer, ids_BT, max_len: int, *, absorb: bool = False, length=None):
  """A fresh cache of max_len slots filled with the prompt; returns (last logits [B, V], cache).
  length (may be traced): the prompt is ids_BT[:, :length], right-padded to T so that prompts
  of several lengths share one compilation; the logits are position length - 1's. The padding's
  slots are written too, behind the causal mask until decoding overwrites them in order."""
  cache = init_cache(model.cfg, ids_BT.shape[0], max_len)
  last = None if length is None else length - 1
  return forward(model, cache, ids_BT, 0, absorb=absorb, last=last)


def decode_step(model: Transformer, cache: KVCache, token_B, pos, *, absorb: bool = True):
  """Feeds one token per row at absolute position pos (< cache.max_len; may be traced).
  Returns (logits [B, V] for the next token, cache)."""
  return forward(model, cache, token_B[:, None], jnp.asarray(pos, jnp.int32), absorb=absorb)

"""Attention masks: causal within packed segments, sliding windows, and the masks of a row split
over the 'context' mesh axis (each shard's queries against keys from anywhere in the row, by
their global positions and token indices; model/context.py)."""

import jax
import jax.numpy as jnp

from moetrain.model.indexer import index_scores, top_k_mask


def attention_mask(q_pos_BT, q_seg_BT, k_pos_BS, k_seg_BS):
  """Causal within a packed segment: key position <= query position and same segment id."""
  causal = k_pos_BS[:, None, :] <= q_pos_BT[:, :, None]
  same = q_seg_BT[:, :, None] == k_seg_BS[:, None, :]
  return causal & same  # [B, T, S]


def window_mask(mask_BTS, q_pos_BT, k_pos_BS, window):
  """mask where each query also sees only the keys of its last `window` positions (0: all;
  window may be traced: a layer's, under the layer scan)."""
  if isinstance(window, int) and not window:
    return mask_BTS
  inside = k_pos_BS[:, None, :] > q_pos_BT[:, :, None] - window
  return mask_BTS & (inside | (window <= 0))


def self_mask(positions_BT, segment_ids_BT, window: int = 0):
  """attention_mask of a sequence over itself, causal in index order too: that changes nothing
  within a segment (positions increase there) and makes padding (segment 0, repeated positions)
  independent of attention_chunk; within the last `window` positions when window > 0."""
  mask = attention_mask(positions_BT, segment_ids_BT, positions_BT, segment_ids_BT)
  t = positions_BT.shape[1]
  mask = mask & jnp.tril(jnp.ones((1, t, t), jnp.bool_))
  return window_mask(mask, positions_BT, positions_BT, window)


def shard_mask(pos_BT, seg_BT, pos_BS, seg_BS, window, index=None):
  """self_mask of one context shard's T queries over the row's S keys (inside the shard_map),
  as attention_core's (queries' arrays, keys' arrays) for block_mask: causal in the row's index
  order too, by the tokens' original indices under dual-chunk order (`index`,
  dual_chunk_order's; None: the row's own order)."""
  t, s = pos_BT.shape[1], pos_BS.shape[1]
  first = jax.lax.axis_index('context') * t  # this shard's first slot in the row
  k_index_S, q_index_T = jnp.arange(s), first + jnp.arange(t)
  if index is not None:
    k_index_S = jnp.asarray(index)
    q_index_T = k_index_S[q_index_T]
  return (pos_BT, seg_BT, q_index_T), (pos_BS, seg_BS, k_index_S, window)


def block_mask(q_meta, k_meta):
  """ring_mask of shard_mask's arrays (attention_core's mask_fn: the queries' arrays a block's)."""
  pos_BT, seg_BT, q_index_T = q_meta
  pos_BS, seg_BS, k_index_S, window = k_meta
  return ring_mask((pos_BT, seg_BT, q_index_T, window), (pos_BS, seg_BS, k_index_S))


def ring_mask(q_meta, k_meta):
  """self_mask of queries over keys from anywhere in the row, each side given as its global
  positions, segment ids and token indices in the row's own order (q_meta also the window):
  what a ring's visiting block carries."""
  pos_BT, seg_BT, q_index_T, window = q_meta
  pos_BS, seg_BS, k_index_S = k_meta
  in_order = k_index_S[None, :] <= q_index_T[:, None]
  mask = attention_mask(pos_BT, seg_BT, pos_BS, seg_BS) & in_order[None]
  return window_mask(mask, pos_BT, pos_BS, window)


def selected_mask(topk: int, q_meta, k_meta):
  """The keys a block of queries attends to under DeepSeek Sparse Attention (attention_core's
  mask_fn): each query's `topk` best by the indexer among those self_mask lets it see, scored
  here from the block's indexer queries [B, N_i, H_i, T] and head weights [B, N_i, T] (T last,
  as the loop splits them) and the row's indexer keys: no [T, S] score or mask exists whole."""
  pos_BT, seg_BT, q_index_T, q_BNHT, w_BNT = q_meta
  pos_BS, seg_BS, k_index_S, k_BSH = k_meta
  allowed_BTS = ring_mask((pos_BT, seg_BT, q_index_T, 0), (pos_BS, seg_BS, k_index_S))
  score_BTS = index_scores(q_BNHT.transpose(0, 3, 1, 2), w_BNT.transpose(0, 2, 1), k_BSH)
  return top_k_mask(score_BTS, allowed_BTS, topk)

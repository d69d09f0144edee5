"""Batched sampling for reinforcement learning: prompts of different lengths in one compiled loop
over the KV-cache decoder (model/decode.py), recording per generated token the sampler's
log-probability and per position the top-k experts every MoE layer chose (routing replay's
record, docs/rl.md)."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.model.decode import forward, init_cache


def sample_top_p(logits_BV, key, temperature, top_p):
  """Nucleus sampling: draws from the smallest set of most likely tokens whose probability
  reaches top_p; the most likely token is always in it, so top_p -> 0 is greedy."""
  logits_BV = logits_BV / temperature
  order_BV = jnp.argsort(-logits_BV, axis=-1)  # stable: ties rank by id, as argmax does
  sorted_BV = jnp.take_along_axis(logits_BV, order_BV, axis=-1)
  p_BV = jax.nn.softmax(sorted_BV, axis=-1)
  before_BV = jnp.cumsum(p_BV, axis=-1) - p_BV
  first_BV = jnp.arange(p_BV.shape[-1])[None, :] == 0
  keep_BV = (before_BV < top_p) | first_BV
  choice_B = jax.random.categorical(key, jnp.where(keep_BV, sorted_BV, -jnp.inf), axis=-1)
  return jnp.take_along_axis(order_BV, choice_B[:, None], axis=-1)[:, 0]


def top_k_only(logits_BV, top_k):
  """The logits with all but the top_k largest of each row at -inf (top_k <= 0: all kept)."""
  v = logits_BV.shape[-1]
  kth_B1 = jnp.sort(logits_BV, axis=-1)[:, v - jnp.clip(top_k, 1, v)][:, None]
  return jnp.where((top_k <= 0) | (logits_BV >= kth_B1), logits_BV, -jnp.inf)


class Samples(NamedTuple):
  """What sample() returns. tokens [B, S + 1]: the prompt, then the completion (eos included),
  then padding; logp [B, S + 1]: the sampler's log-probability of each generated token (0
  elsewhere), at temperature (not truncated by top-k or top-p); routes [B, S, L, K]: the ids
  each MoE layer chose for the token at each position; end [B]: the tokens in the row (prompt
  + completion)."""

  tokens: jax.Array
  logp: jax.Array
  routes: jax.Array
  end: jax.Array


def _choose(i, logits_BV, rng, opts: dict):
  """(the token drawn for each row at step i, its log-probability at the temperature)."""
  greedy = opts['temperature'] <= 0
  temperature = jnp.where(greedy, 1.0, opts['temperature'])
  in_vocab_BV = jnp.arange(logits_BV.shape[-1])[None, :] < opts['vocab']
  logits_BV = jnp.where(in_vocab_BV, logits_BV, -jnp.inf)
  logp_BV = jax.nn.log_softmax(logits_BV / temperature, axis=-1)
  key = jax.random.fold_in(rng, i)

  def draw():  # (the sorts of top-k and top-p only where they apply)
    kept_BV = jax.lax.cond(
      opts['top_k'] > 0, lambda: top_k_only(logits_BV, opts['top_k']), lambda: logits_BV
    )
    return sample_top_p(kept_BV, key, temperature, opts['top_p'])

  tok_B = jax.lax.cond(greedy, lambda: jnp.argmax(logits_BV, axis=-1), draw).astype(jnp.int32)
  return tok_B, jnp.take_along_axis(logp_BV, tok_B[:, None], axis=-1)[:, 0]


def _emit(pos, logits_BV, rows, length_B, limit_B, rng, opts):
  """Position pos + 1 of every row from the logits at pos: a drawn token where the row's prompt
  is read and it is not done (eos, or its limit), else the prompt's own. rows: (tokens, logp,
  end, done)."""
  tokens, logp, end_B, done_B = rows
  new_B, lp_B = _choose(pos, logits_BV, rng, opts)
  gen_B = (pos + 1 >= length_B) & ~done_B & (pos + 1 < limit_B)
  prompt_B = jax.lax.dynamic_index_in_dim(tokens, pos + 1, axis=1, keepdims=False)
  put = lambda x, v: jax.lax.dynamic_update_slice_in_dim(x, v[:, None], pos + 1, axis=1)
  tokens = put(tokens, jnp.where(gen_B, new_B, prompt_B))
  logp = put(logp, jnp.where(gen_B, lp_B, 0.0))
  end_B = jnp.where(gen_B, pos + 2, end_B)
  done_B = done_B | (gen_B & ((new_B == opts['eos_id']) | (pos + 2 >= limit_B)))
  return tokens, logp, end_B, done_B


@functools.partial(jax.jit, static_argnames=('graphdef', 'max_new', 'absorb', 'prefill'))
def sample(
  graphdef, state, prompt_BS, length_B, rng, opts: dict, *, max_new: int, absorb=True, prefill=0
):
  """Completes each row's prompt, prompt_BS[b, :length_B[b]] (right-padded to S + 1 tokens), by
  up to max_new tokens, stopping a row at eos. The first `prefill` tokens of every row (no
  prompt may be shorter) run as one forward pass; then one decode step per position for every
  row: a row whose prompt is longer still reads it in while the others generate, so prompts of
  any lengths share the loop (and one compilation), which exits once every row is done. The
  draws depend on the positions alone, not on `prefill`.

  opts holds traced scalars: temperature (0: greedy; logp then of temperature 1), top_p, top_k
  (0: off), eos_id (< 0: none) and vocab (ids >= vocab are never chosen)."""
  model = nnx.merge(graphdef, state)
  b, total = prompt_BS.shape
  s = total - 1
  cache = init_cache(model.cfg, b, s)
  limit_B = jnp.minimum(length_B + max_new, total)  # a row's tokens at most
  n_moe = len(model.cfg.moe_layer_indices)
  routes = jnp.zeros((b, s, n_moe, model.cfg.moe_topk), jnp.int32)
  emit = functools.partial(_emit, length_B=length_B, limit_B=limit_B, rng=rng, opts=opts)

  def cond(carry):
    pos, done_B = carry[0], carry[2][3]
    return (pos < s) & ~jnp.all(done_B)

  def body(carry):
    pos, routes, rows, cache = carry
    tok_B = jax.lax.dynamic_index_in_dim(rows[0], pos, axis=1, keepdims=False)
    logits_BV, cache, r_B1LK = forward(
      model, cache, tok_B[:, None], pos, absorb=absorb, routes=True
    )
    routes = jax.lax.dynamic_update_slice_in_dim(routes, r_B1LK, pos, axis=1)
    return pos + 1, routes, emit(pos, logits_BV, rows), cache

  rows = (prompt_BS, jnp.zeros((b, total), jnp.float32), length_B, length_B >= limit_B)
  if prefill:  # tokens 0 .. prefill - 1 at once, as the training forward runs them
    logits_BV, cache, r_BPLK = forward(model, cache, prompt_BS[:, :prefill], 0, routes=True)
    routes = routes.at[:, :prefill].set(r_BPLK)
    rows = emit(prefill - 1, logits_BV, rows)
  carry = (jnp.int32(prefill), routes, rows, cache)
  _, routes, (tokens, logp, end_B, _), _ = jax.lax.while_loop(cond, body, carry)
  return Samples(tokens, logp, routes, end_B)


def sample_opts(temperature=0.0, top_p=1.0, top_k=0, eos_id=None, vocab=None) -> dict:
  """sample()'s traced options (one compilation for all their values)."""
  return {
    'temperature': jnp.float32(temperature),
    'top_p': jnp.float32(top_p),
    'top_k': jnp.int32(top_k),
    'eos_id': jnp.int32(-1 if eos_id is None else eos_id),
    'vocab': jnp.int32(vocab),
  }

"""Cross entropy of the lm head, fused and chunked along the sequence.
(Design: docs/design.md, "moetrain/kernels/cross_entropy.py".)"""

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.core import axes
from moetrain.core.sharding import Rules, constrain
from moetrain.kernels import Kernel, vjp


def head_cross_entropy(
  head: nnx.Module,
  h_BTD,
  targets_BT,
  mask_BT,
  chunk: int,
  rng=None,
  rules=None,
  reference=False,
  context: int = 1,
):
  """Masked sums (NLL, tokens whose target holds the top logit) of head(h) against targets.

  head(x_BTD, rng) -> logits [B, c, V] (an nnx module, LoRA adapters and quantised weights
  included); chunk = positions per block (0 = one block). Dropout keys fold in the block index.
  Differentiable in h and in the head's float weights; "correct" is a count (no gradient).
  reference: the same blocks differentiated by autodiff, instead of the fused backward.
  context: the 'context' mesh axis the rows' tokens are split over (_blocks).
  """
  graphdef, state = nnx.split(head)
  leaves, treedef = jax.tree.flatten(state)
  mask_BT = mask_BT.astype(jnp.float32)
  static = (graphdef, treedef, rules or Rules(), context)
  return head_ce(leaves, h_BTD, targets_BT, mask_BT, rng, static, chunk, reference=reference)


def _block_size(t: int, chunk: int, shards: int) -> tuple[int, int]:
  """(context shards C, positions per shard and block c): a row's blocks hold c positions of
  each of its C shards (C = 1 where the shards do not split t)."""
  shards = shards if t % shards == 0 else 1
  local = t // shards
  c = chunk if 0 < chunk < local else local
  return (shards, c) if local % c == 0 else (1, chunk if 0 < chunk < t else t)


def _blocks(h_BTD, targets_BT, mask_BT, chunk: int, shards: int = 1):
  """[n, B, C * c, ...] blocks of the sequence (padded with masked positions to a multiple of
  C * c). With the row split over C 'context' shards, block j holds the j-th c positions of
  each shard, so every block stays split like the row and each device scores its own tokens."""
  t = targets_BT.shape[1]
  shards, c = _block_size(t, chunk, shards)
  pad = -t % (shards * c)

  def split(x):
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], shards, -1, c, *x.shape[2:]).transpose(
      2, 0, 1, 3, *range(4, x.ndim + 2)
    )
    return x.reshape(x.shape[0], x.shape[1], shards * c, *x.shape[4:])

  return split(h_BTD), split(targets_BT), split(mask_BT)


def _unblock(x_U, t: int, chunk: int, shards: int = 1):
  """_blocks' inverse: [n, B, C * c, ...] -> [B, t, ...]."""
  shards, c = _block_size(t, chunk, shards)
  n, b = x_U.shape[:2]
  x = x_U.reshape(n, b, shards, c, *x_U.shape[3:]).transpose(1, 2, 0, 3, *range(4, x_U.ndim + 1))
  return x.reshape(b, n * shards * c, *x_U.shape[3:])[:, :t]


def _stats(logits_BTV, targets_BT, mask_BT):
  """(nll sum, correct count, d nll / d logits) of one block, in float32."""
  max_BT = jnp.max(logits_BTV, axis=-1)
  exp_BTV = jnp.exp(logits_BTV - max_BT[..., None])
  sum_BT = jnp.sum(exp_BTV, axis=-1)
  gold_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
  nll = jnp.sum((max_BT + jnp.log(sum_BT) - gold_BT) * mask_BT)
  # "Correct" compares the target's logit with the row max the log-sum-exp needs anyway (a tie
  # counts) instead of an argmax: XLA:CPU runs that variadic reduce over the vocabulary slowly.
  correct = jnp.sum((gold_BT >= max_BT) * mask_BT)
  onehot_BTV = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=jnp.float32)
  dlogits_BTV = (exp_BTV / sum_BT[..., None] - onehot_BTV) * mask_BT[..., None]
  return nll, correct, dlogits_BTV


def _logits_fn(static, rng):
  graphdef, treedef, rules = static[:3]

  def logits(leaves, x_BTD, i):
    key = None if rng is None else jax.random.fold_in(rng, i)
    head = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    return constrain(head(x_BTD, key).astype(jnp.float32), axes.names('BTV'), rules)

  return logits


def _head_ce_primal(leaves, h_BTD, targets_BT, mask_BT, rng, static, chunk):
  """static: (graphdef, treedef, rules, context shards)."""
  logits = _logits_fn(static, rng)
  h_U, t_U, m_U = _blocks(h_BTD, targets_BT, mask_BT, chunk, shards=static[3])

  def block(_, xs):
    h, t, m, i = xs
    nll, correct, _ = _stats(logits(leaves, h, i), t, m)
    return None, (nll, correct)

  _, (nll, correct) = jax.lax.scan(block, None, (h_U, t_U, m_U, jnp.arange(h_U.shape[0])))
  return nll.sum(), correct.sum()


_head_ce = jax.custom_vjp(_head_ce_primal, nondiff_argnums=(5, 6))


def _head_ce_fwd(leaves, h_BTD, targets_BT, mask_BT, rng, static, chunk):
  # symbolic_zeros: inputs arrive as CustomVJPPrimal(value, perturbed); only the perturbed head
  # weights (not the frozen base under LoRA) get gradient work.
  trained = [p.perturbed for p in leaves]
  leaves, h_BTD, targets_BT, mask_BT, rng = vjp.values((leaves, h_BTD, targets_BT, mask_BT, rng))
  need = [v for v, d in zip(leaves, trained) if d]

  def with_need(w):
    it = iter(w)
    return [next(it) if d else v for v, d in zip(leaves, trained)]

  logits = _logits_fn(static, rng)
  h_U, t_U, m_U = _blocks(h_BTD, targets_BT, mask_BT, chunk, shards=static[3])

  def block(acc, xs):
    h, t, m, i = xs
    out, pull = jax.vjp(lambda w, x: logits(with_need(w), x, i), need, h)
    nll, correct, dlogits = _stats(out, t, m)
    dw, dh = pull(dlogits)
    return [a + g.astype(jnp.float32) for a, g in zip(acc, dw)], (nll, correct, dh)

  acc = [jnp.zeros(v.shape, jnp.float32) for v in need]
  xs = (h_U, t_U, m_U, jnp.arange(h_U.shape[0]))
  dw, (nll, correct, dh_U) = jax.lax.scan(block, acc, xs)
  dh_BTD = _unblock(dh_U, targets_BT.shape[1], chunk, shards=static[3])
  it = iter(dw)
  dw = [next(it).astype(v.dtype) if d else None for v, d in zip(leaves, trained)]
  return (nll.sum(), correct.sum()), (dh_BTD, dw)


def _head_ce_bwd(static, chunk, res, g):
  dh_BTD, dw = res
  g_nll = vjp.dense(g[0])
  scale = lambda x: None if x is None else (x * g_nll).astype(x.dtype)
  return [scale(w) for w in dw], scale(dh_BTD), None, None, None


_head_ce.defvjp(_head_ce_fwd, _head_ce_bwd, symbolic_zeros=True)

# The loss over a head given as (leaves, static): the fast path keeps no logits for the backward
# (each block's weight and input gradients are formed in the forward pass, while its logits
# exist); the reference is the same scan of blocks differentiated by autodiff.
head_ce = Kernel('head_ce', _head_ce, _head_ce_primal)


def head_token_logprobs(
  head: nnx.Module, h_BTD, targets_BT, chunk: int, rng=None, rules=None, context: int = 1
) -> tuple[jax.Array, jax.Array]:
  """(log-probability of each target [B, T], whether it holds the top logit [B, T]) under
  head(h), float32, in blocks of `chunk` positions (0 = one block): per-sequence objectives
  (preference tuning) need the log-probabilities apart, not their sum. Each block's logits are
  recomputed in the backward pass, so the [B, T, V] logits never exist whole. Differentiable
  in h and the head's float weights by autodiff."""
  graphdef, state = nnx.split(head)
  leaves, treedef = jax.tree.flatten(state)
  logits = _logits_fn((graphdef, treedef, rules or Rules()), rng)
  mask_BT = jnp.ones(targets_BT.shape, jnp.float32)
  h_U, t_U, _ = _blocks(h_BTD, targets_BT, mask_BT, chunk, context)

  @jax.checkpoint
  def block(leaves, h, t, i):
    logits_BTV = logits(leaves, h, i)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    gold_BT = jnp.take_along_axis(logits_BTV, t[..., None], axis=-1)[..., 0]
    top = jax.lax.stop_gradient(gold_BT >= jnp.max(logits_BTV, axis=-1))
    return gold_BT - lse_BT, top

  def step(_, xs):
    return None, block(leaves, *xs)

  _, (logp_U, top_U) = jax.lax.scan(step, None, (h_U, t_U, jnp.arange(h_U.shape[0])))
  t = targets_BT.shape[1]
  return _unblock(logp_U, t, chunk, context), _unblock(top_U, t, chunk, context)

"""The model's log-probability of each of a batch's targets: the per-token term of preference
tuning's and RL's objectives.

Under a context split's load balance (docs/context.md) the hidden states stay in the shards'
order and the targets move to them: a [B, T] array of ids crosses the shards, not the [B, T, D]
hidden states; the log-probabilities return in the rows' order.
"""

import jax
import jax.numpy as jnp

from moetrain.kernels.cross_entropy import head_token_logprobs
from moetrain.model import context


def slot_features(model, batch, rng=None, routes=None):
  """(the final hidden states [B, T, D] in the context shards' order, the forward's aux, that
  order: context.slot_order's index, None where the rows keep theirs); the loss moves its
  per-token arrays to it (context.in_slots). routes: routing replay's forced top-k ids."""
  h_BTD, aux = model.features(
    batch['inputs'], batch['positions'], batch['segment_ids'], rng, routes, slots=True
  )
  return h_BTD, aux, context.slot_order(model.cfg, batch['inputs'].shape[1])


def token_logprobs(model, batch, rng, temperature: float = 1.0, routes=None):
  """(log pi of each target at the sampling temperature [B, T], whether it holds the top logit
  [B, T], the forward's aux). routes: routing replay's forced top-k ids [B, T, L, K]."""
  h_BTD, aux, index = slot_features(model, batch, rng, routes)
  if temperature != 1.0:  # the head is linear: head(h / T) = logits / T
    h_BTD = h_BTD / jnp.asarray(temperature, h_BTD.dtype)
  e = model.cfg.engine
  targets_BT = context.in_slots(batch['targets'], index)
  with jax.named_scope('lm_head'):
    logp, top = head_token_logprobs(
      model.lm_head, h_BTD, targets_BT, e.loss_chunk, rng, e.rules, e.context_shards
    )
  return context.in_slots(logp, index, back=True), context.in_slots(top, index, back=True), aux

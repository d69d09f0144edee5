"""Preference tuning's objectives: DPO (sigmoid, with label smoothing), IPO, hinge, SimPO, ORPO
and KTO, as TRL implements them (docs/preference.md), on the sequences of packed preference
rows (moetrain/data/preference.py: segment 3 (s - 1) + role, role 1 chosen or desirable,
2 rejected or undesirable, 3 KTO's mismatched completion).

The reference is the same network: under LoRA its adapters off (their weights zero in a second
forward pass, outside the gradient: no second copy of the model); in full fine-tuning the
frozen copy the state holds as its `teacher`. SimPO and ORPO need none.
"""

import dataclasses

import jax
import jax.numpy as jnp

from moetrain.core.fields import check, field
from moetrain.data.preference import ROLES, SEGMENTS_PER_ELEMENT
from moetrain.training.logprobs import token_logprobs

LOSSES = ('', 'sigmoid', 'ipo', 'hinge', 'simpo', 'orpo', 'kto')
REFERENCE_FREE = ('simpo', 'orpo')


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
  """The `preference` section: preference tuning's objective (docs/preference.md)."""

  # '' = off (next-token training); 'sigmoid' (DPO), 'ipo', 'hinge', 'simpo', 'orpo' on pairs
  # {prompt, chosen, rejected}; 'kto' on unpaired {prompt, completion, label}.
  loss: str = field('', choices=LOSSES)
  # DPO's beta (the reward's scale; IPO: its target margin is 1 / (2 beta)); ORPO's lambda, the
  # odds-ratio term's weight.
  beta: float = field(0.1, check='positive')
  label_smoothing: float = field(0.0, check='non_negative')  # sigmoid and simpo: robust DPO's eps
  gamma: float = field(0.5, check='non_negative')  # simpo: the target margin of the rewards
  # An added NLL on the chosen completions (token mean), weighted: RPO's alpha (0 = off).
  sft_weight: float = field(0.0, check='non_negative')
  desirable_weight: float = field(1.0, check='positive')  # kto: weight of desirable examples
  undesirable_weight: float = field(1.0, check='positive')  # kto: of undesirable ones

  @property
  def enabled(self) -> bool:
    return bool(self.loss)

  @property
  def records(self) -> str:
    """The data's records (data.records) this loss reads."""
    return 'unpaired' if self.loss == 'kto' else 'paired'

  @property
  def needs_reference(self) -> bool:
    return self.enabled and self.loss not in REFERENCE_FREE

  def validate(self) -> None:
    check(self, 'preference')
    if self.label_smoothing >= 0.5:
      raise ValueError(
        f'preference.label_smoothing={self.label_smoothing} must be below 0.5 (the share of '
        'pairs assumed mislabelled)'
      )


def max_elements(seq_len: int) -> int:
  """An upper bound on the elements (pairs or unpaired examples) one row holds: each has two
  sequences of at least one token."""
  return seq_len // 2 + 1


def _per_sequence(x_BT, segment_ids_BT):
  """Sums of x over each row's sequences, [B, P, 3] (the last axis: role 1, 2, 3)."""
  b, t = x_BT.shape
  n = SEGMENTS_PER_ELEMENT * max_elements(t) + 1
  ids = (jnp.arange(b)[:, None] * n + segment_ids_BT).reshape(-1)
  total = jax.ops.segment_sum(x_BT.reshape(-1), ids, num_segments=b * n).reshape(b, n)
  return total[:, 1:].reshape(b, -1, SEGMENTS_PER_ELEMENT)


def sequence_sums(logp_BT, batch):
  """Per row and element: the sums of the scored tokens' log-probabilities and their counts,
  [B, P, 3] each (the last axis: role 1, 2, 3)."""
  mask_BT = batch['loss_mask'].astype(jnp.float32)
  seg_BT = batch['segment_ids']
  return _per_sequence(logp_BT * mask_BT, seg_BT), _per_sequence(mask_BT, seg_BT)


def counts(batch):
  """(elements with a scored sequence, scored chosen tokens) of a batch: the denominators of
  the means over elements and of the chosen NLL."""
  n = _per_sequence(batch['loss_mask'].astype(jnp.float32), batch['segment_ids'])
  present = (n[..., 0] > 0) | (n[..., 1] > 0)
  return jnp.maximum(present.sum().astype(jnp.float32), 1.0), jnp.maximum(n[..., 0].sum(), 1.0)


def _logsig(x):
  return jax.nn.log_sigmoid(x)


def pair_losses(cfg: PreferenceConfig, policy, reference, lengths):
  """Per element: (loss, reward of chosen, reward of rejected), from the sums of log-
  probabilities [..., 3] of the policy and the reference (None: reference-free) and the scored
  tokens [..., 3]. KTO's per-element loss is of its one completion (chosen or rejected); the
  mismatched sequences give its KL estimate, over the elements given."""
  beta, eps = cfg.beta, cfg.label_smoothing
  pc, pr = policy[..., 0], policy[..., 1]
  lc, lr = jnp.maximum(lengths[..., 0], 1.0), jnp.maximum(lengths[..., 1], 1.0)
  if cfg.loss in ('simpo', 'orpo'):
    c, r = pc / lc, pr / lr  # length-averaged
    if cfg.loss == 'simpo':
      z = beta * (c - r) - cfg.gamma
      loss = -(1 - eps) * _logsig(z) - eps * _logsig(-z)
    else:  # the log odds ratio of the averaged likelihoods
      log_odds = (c - r) - (jnp.log1p(-jnp.exp(c)) - jnp.log1p(-jnp.exp(r)))
      loss = -beta * _logsig(log_odds)
    return loss, beta * c, beta * r
  rc, rr = reference[..., 0], reference[..., 1]
  if cfg.loss == 'kto':
    present_kl = lengths[..., 2] > 0
    kl_each = policy[..., 2] - reference[..., 2]
    kl = jnp.sum(jnp.where(present_kl, kl_each, 0.0)) / jnp.maximum(present_kl.sum(), 1)
    kl = jax.lax.stop_gradient(jnp.maximum(kl, 0.0))
    good = cfg.desirable_weight * (1 - jax.nn.sigmoid(beta * ((pc - rc) - kl)))
    bad = cfg.undesirable_weight * (1 - jax.nn.sigmoid(beta * (kl - (pr - rr))))
    loss = jnp.where(lengths[..., 0] > 0, good, bad)
    return loss, beta * (pc - rc), beta * (pr - rr)
  if cfg.loss == 'ipo':  # on length-averaged log-probabilities, as TRL
    z = (pc / lc - pr / lr) - (rc / lc - rr / lr)
    loss = (z - 1 / (2 * beta)) ** 2
  else:
    z = beta * ((pc - rc) - (pr - rr))
    if cfg.loss == 'hinge':
      loss = jax.nn.relu(1 - z)
    else:  # sigmoid
      loss = -(1 - eps) * _logsig(z) - eps * _logsig(-z)
  return loss, beta * (pc - rc), beta * (pr - rr)


def reference_sums(reference_model, batch):
  """The reference's sequence sums, outside the gradient (no dropout)."""
  logp, _, _ = token_logprobs(reference_model, batch, None)
  return jax.lax.stop_gradient(sequence_sums(logp, batch)[0])


def objective(cfg: PreferenceConfig, model, reference_model, batch, rng, totals):
  """(the loss's share of this (micro-)batch, aux of the policy's forward, sums for the
  metrics). totals: (elements, scored chosen tokens) of the whole batch (counts)."""
  n_pairs, n_chosen = totals
  logp_BT, top_BT, aux = token_logprobs(model, batch, rng)
  policy, lengths = sequence_sums(logp_BT, batch)
  reference = None if reference_model is None else reference_sums(reference_model, batch)
  loss_P, reward_c, reward_r = pair_losses(cfg, policy, reference, lengths)
  if cfg.loss == 'kto':
    present = (lengths[..., 0] > 0) | (lengths[..., 1] > 0)
    paired = jnp.zeros_like(present)
  else:
    present = (lengths[..., 0] > 0) & (lengths[..., 1] > 0)
    paired = present
  chosen_mask = batch['loss_mask'] * (
    batch['segment_ids'] % SEGMENTS_PER_ELEMENT == ROLES['chosen']
  )
  nll_chosen = -jnp.sum(logp_BT * chosen_mask)
  sft = cfg.sft_weight + (cfg.loss == 'orpo')  # ORPO's own NLL term has weight 1
  loss = jnp.sum(jnp.where(present, loss_P, 0.0)) / n_pairs + sft * nll_chosen / n_chosen
  pair = lambda x: jnp.sum(jnp.where(paired, x, 0.0))
  has_c, has_r = lengths[..., 0] > 0, lengths[..., 1] > 0
  margin = reward_c - reward_r
  sums = {
    'loss': jnp.sum(jnp.where(present, loss_P, 0.0)),
    'pairs': pair(1.0),
    'elements': present.sum().astype(jnp.float32),
    'margin': pair(margin),
    'accuracy': pair((margin > 0).astype(jnp.float32)),
    'reward_chosen': jnp.sum(jnp.where(has_c, reward_c, 0.0)),
    'reward_rejected': jnp.sum(jnp.where(has_r, reward_r, 0.0)),
    'logp_chosen': jnp.sum(jnp.where(has_c, policy[..., 0], 0.0)),
    'logp_rejected': jnp.sum(jnp.where(has_r, policy[..., 1], 0.0)),
    'chosen': has_c.sum().astype(jnp.float32),
    'rejected': has_r.sum().astype(jnp.float32),
    # Next-token statistics of the chosen completions (the task's own accuracy).
    'nll_chosen': nll_chosen,
    'correct_chosen': jnp.sum(top_BT * chosen_mask),
    'tokens_chosen': jnp.sum(chosen_mask),
  }
  return loss, aux, sums


def metrics(sums) -> dict:
  """The pref/* metrics from summed statistics (objective's sums over a batch or an eval)."""
  per = lambda k, n: sums[k] / jnp.maximum(sums[n], 1.0)
  return {
    'pref/loss': per('loss', 'elements'),
    'pref/reward_chosen': per('reward_chosen', 'chosen'),
    'pref/reward_rejected': per('reward_rejected', 'rejected'),
    # (KTO has no pairs: the difference of the mean rewards)
    'pref/margin': jnp.where(
      sums['pairs'] > 0,
      per('margin', 'pairs'),
      per('reward_chosen', 'chosen') - per('reward_rejected', 'rejected'),
    ),
    'pref/accuracy': per('accuracy', 'pairs'),
    'pref/logp_chosen': per('logp_chosen', 'chosen'),
    'pref/logp_rejected': per('logp_rejected', 'rejected'),
  }

"""Reinforcement learning's objectives: GRPO (token-level clipped ratio), GSPO (sequence-level,
length-normalised ratio), DAPO (asymmetric clip, token mean, no KL) and Dr. GRPO (no std
normalisation, no length division), on rows of sampled completions (run/rollouts.py), with
routing replay (docs/rl.md).

A rollout batch holds, beside a training batch's inputs, targets, positions, segment ids and
loss mask (1 on the generated tokens): 'advantages' [B] (per completion), 'old_logp' [B, T]
(the policy before this batch's updates, from old_policy_pass), 'ref_logp' [B, T] (with a KL
term), 'routes' [B, T, L, K] (with replay: the ids forced in every MoE layer), 'rewards' [B, F]
and the per-row sums of the sampler's agreement with the trainer ('sampler_k3', 'extreme',
'flips' [B, L]) that the metrics report.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.core.fields import check, field
from moetrain.model import sampler
from moetrain.training.logprobs import token_logprobs
from moetrain.training.train_state import graphdef_of, merge_model

ALGORITHMS = ('', 'grpo', 'gspo', 'dapo', 'dr_grpo')
REPLAY = ('none', 'r2', 'r3')
# How token losses become the batch's: the mean over all scored tokens; the mean over completions
# of each one's token mean; Dr. GRPO's token sum over (completions x max_new_tokens).
AGGREGATIONS = ('token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum-norm')
OWN_AGGREGATION = {
  'grpo': 'seq-mean-token-mean',
  'gspo': 'seq-mean-token-mean',
  'dapo': 'token-mean',
  'dr_grpo': 'seq-mean-token-sum-norm',
}
EXTREME = math.log(2.0)  # |log pi_train - log pi_sampler| above this: an extreme token


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """The `rl` section: reinforcement learning on sampled completions (docs/rl.md)."""

  algorithm: str = field('', choices=ALGORITHMS)  # '' = off (docs/rl.md, "The algorithms")
  group_size: int = field(8, check='positive')  # completions per prompt (a group)
  # Prompts per rollout; 0 = data.global_batch_size / group_size (a row a completion)
  prompts_per_step: int = field(0, check='non_negative', zero='0 = the batch / group_size')
  # Optimizer updates per batch of rollouts (the ratio to the old policy differs from 1 after
  # the first)
  num_iterations: int = field(1, check='positive')
  clip_low: float = field(0.2, check='non_negative')  # the ratio's lower clip: 1 - clip_low
  clip_high: float = field(0.2, check='non_negative')  # its upper clip: 1 + clip_high
  # The k3 KL term to the reference (LoRA: the adapters off); 0 = none, and no reference pass.
  kl_coef: float = field(0.0, check='non_negative', zero='0 = no KL term, no reference pass')
  # '' = the algorithm's own (grpo, gspo: seq-mean-token-mean; dapo: token-mean; dr_grpo:
  # seq-mean-token-sum-norm)
  loss_agg: str = field('', choices=('', *AGGREGATIONS))
  temperature: float = field(1.0, check='positive')  # sampling (the trainer's logits too)
  top_p: float = field(1.0, check='positive')  # nucleus sampling's mass (1 = off)
  top_k: int = field(0, check='non_negative', zero='0 = off')  # sample among the k most likely
  max_new_tokens: int = field(32, check='positive')  # a completion's tokens at most (eos included)
  stop: str = ''  # stop strings, '|'-separated: a completion ends after the first (and at eos)
  # Reward functions, ','-separated 'module:function' or 'module:function=weight' (weight 1);
  # each is logged as rl/reward/<function>, the advantage uses the weighted sum
  rewards: str = 'moetrain.data.demo_task:reversal_exact'
  # Routing replay: 'none'; 'r2' replays the trainer's own old-policy routes in the updates;
  # 'r3' replays the sampler's routes in the old-policy pass and the updates
  routing_replay: str = field('none', choices=REPLAY)
  # The sampler's compute dtype; '' = engine.dtype
  sampler_dtype: str = field('', choices=('', 'bfloat16', 'float32', 'float16'))
  dynamic_sampling: bool = False  # drop groups whose rewards are all equal (dapo: always)

  @property
  def enabled(self) -> bool:
    return bool(self.algorithm)

  @property
  def aggregation(self) -> str:
    return self.loss_agg or OWN_AGGREGATION[self.algorithm]

  @property
  def filters_groups(self) -> bool:
    return self.dynamic_sampling or self.algorithm == 'dapo'

  @property
  def reward_specs(self) -> tuple[tuple[str, str, float], ...]:
    """(name, 'module:function', weight) per reward function."""
    out = []
    for item in (s.strip() for s in self.rewards.split(',') if s.strip()):
      spec, _, weight = item.partition('=')
      try:
        w = float(weight) if weight else 1.0
      except ValueError:
        raise ValueError(f'rl.rewards: {item!r}: the weight after = is not a number') from None
      if spec.count(':') != 1 or not all(spec.split(':')):
        raise ValueError(f"rl.rewards: {item!r} is not 'module:function' (or =weight)")
      out.append((spec.split(':')[1], spec, w))
    return tuple(out)

  def validate(self) -> None:
    check(self, 'rl')
    if not self.enabled:
      return
    if self.group_size < 2:
      raise ValueError(f'rl.group_size={self.group_size}: a group needs 2 completions at least')
    if not self.top_p <= 1:
      raise ValueError(f'rl.top_p={self.top_p} must be in (0, 1]')
    if self.algorithm == 'dapo' and self.kl_coef:
      raise ValueError('rl.algorithm=dapo has no KL term: set rl.kl_coef=0')
    names = [n for n, _, _ in self.reward_specs]
    if not names:
      raise ValueError("rl.rewards is empty: name at least one 'module:function'")
    if len(set(names)) < len(names):
      raise ValueError(f'rl.rewards: two functions share a name ({names})')


def batch_fields(cfg: RLConfig, model, seq_len: int) -> dict:
  """The fields a rollout batch adds to the packed rows, {name: (shape after the row axis,
  dtype)}: what the update steps read (the train step is compiled for exactly these)."""
  f32, layers = jnp.float32, len(model.moe_layer_indices)
  out = {
    'advantages': ((), f32),
    'rewards': ((len(cfg.reward_specs),), f32),
    'old_logp': ((seq_len,), f32),
    'sampler_k3': ((), f32),
    'extreme': ((), f32),
    'flips': ((layers,), f32),
  }
  if cfg.kl_coef:
    out['ref_logp'] = ((seq_len,), f32)
  if cfg.routing_replay != 'none':
    out['routes'] = ((seq_len, layers, model.moe_topk), jnp.int32)
  return out


def sampler_model(cfg: 'RLConfig', model):
  """The model config the sampler runs: rl.sampler_dtype's compute dtype, no remat."""
  if cfg.sampler_dtype:
    model = model.with_engine(dtype=cfg.sampler_dtype)
  return model.with_engine(remat='none')


def sample_with(
  params, moe_bias, frozen, prompt_BS, length_B, rng, opts, prefill=0, *, graphdef, max_new
):
  """sampler.sample on the train state's weights (the same arrays, no copy), jitted by the
  caller with graphdef (sampler_model's) and max_new bound; prefill (static): the tokens every
  prompt has, run at once."""
  g, state = nnx.split(merge_model(graphdef, params, moe_bias, frozen))
  return sampler.sample(g, state, prompt_BS, length_B, rng, opts, max_new=max_new, prefill=prefill)


def jit_sampler(cfg: 'RLConfig', model):
  """sample_with, jitted for the RL section and the policy's config."""
  fn = functools.partial(
    sample_with, graphdef=graphdef_of(sampler_model(cfg, model)), max_new=cfg.max_new_tokens
  )
  return jax.jit(fn, static_argnames=('prefill',))


def prefill_length(shortest: int) -> int:
  """The tokens the sampler runs at once for prompts of `shortest` tokens at least: a power of
  two (one compilation per bucket), 0 below 4."""
  return 0 if shortest < 4 else 1 << (shortest.bit_length() - 1)


def group_advantages(rewards_B, group_size: int, algorithm: str, eps: float = 1e-6):
  """Each completion's advantage from its group's rewards (consecutive rows of group_size):
  (r - mean) / (std + eps), or r - mean for Dr. GRPO. NumPy or JAX arrays."""
  r = rewards_B.reshape(-1, group_size)
  centred = r - r.mean(axis=1, keepdims=True)
  if algorithm != 'dr_grpo':
    centred = centred / (r.std(axis=1, keepdims=True) + eps)
  return centred.reshape(-1)


def counts(batch):
  """(scored tokens, completions with a scored token) of the batch, each at least 1: the
  aggregations' denominators over the whole batch (micro-batches share them)."""
  mask = batch['loss_mask'].astype(jnp.float32)
  seqs = jnp.sum(jnp.sum(mask, axis=1) > 0).astype(jnp.float32)
  return jnp.maximum(mask.sum(), 1.0), jnp.maximum(seqs, 1.0)


def token_losses(cfg: RLConfig, logp_BT, batch):
  """(per-token loss [B, T], whether the clip was active [B, T]): the clipped policy-gradient
  term plus kl_coef times k3 to the reference."""
  mask_BT = batch['loss_mask'].astype(jnp.float32)
  adv_B1 = batch['advantages'][:, None]
  log_ratio = logp_BT - batch['old_logp']
  if cfg.algorithm == 'gspo':  # the sequence's length-normalised ratio, with its gradient
    n_B = jnp.maximum(mask_BT.sum(axis=1), 1.0)
    seq_B = jnp.sum(log_ratio * mask_BT, axis=1) / n_B
    ratio = jnp.exp(seq_B)[:, None] * jnp.ones_like(logp_BT)
  else:
    ratio = jnp.exp(log_ratio)
  unclipped = ratio * adv_B1
  clipped = jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv_B1
  loss = -jnp.minimum(unclipped, clipped)
  if cfg.kl_coef:
    d = batch['ref_logp'] - logp_BT
    loss = loss + cfg.kl_coef * (jnp.exp(d) - d - 1.0)
  return loss, jax.lax.stop_gradient(clipped < unclipped)


def aggregate(cfg: RLConfig, loss_BT, mask_BT, totals):
  """This (micro-)batch's share of the batch's loss under cfg.aggregation; totals: counts()
  of the whole batch."""
  n_tokens, n_seqs = totals
  if cfg.aggregation == 'token-mean':
    return jnp.sum(loss_BT * mask_BT) / n_tokens
  if cfg.aggregation == 'seq-mean-token-mean':
    per_seq = jnp.sum(loss_BT * mask_BT, axis=1) / jnp.maximum(mask_BT.sum(axis=1), 1.0)
    return jnp.sum(per_seq) / n_seqs
  return jnp.sum(loss_BT * mask_BT) / (n_seqs * cfg.max_new_tokens)


def objective(cfg: RLConfig, model, batch, rng, totals):
  """(the loss's share of this micro-batch, the forward's aux, sums for the metrics)."""
  logp, top, aux = token_logprobs(model, batch, rng, cfg.temperature, batch.get('routes'))
  if cfg.num_iterations == 1:  # the old policy is this one: the ratio is exactly 1
    batch = {**batch, 'old_logp': jax.lax.stop_gradient(logp)}
  mask = batch['loss_mask'].astype(jnp.float32)
  loss_BT, clipped_BT = token_losses(cfg, logp, batch)
  sums = {
    'nll': -jnp.sum(logp * mask),
    'correct': jnp.sum(top * mask),
    'clipped': jnp.sum(clipped_BT * mask),
    'tokens': mask.sum(),
  }
  if cfg.kl_coef:
    d = jax.lax.stop_gradient(batch['ref_logp'] - logp)
    sums['kl_ref'] = jnp.sum((jnp.exp(d) - d - 1.0) * mask)
  return aggregate(cfg, loss_BT, mask, totals), aux, sums


def old_policy_pass(model, reference, batch, cfg: RLConfig):
  """What the updates of a rollout batch compare with, before them (no gradient): the policy's
  log-probabilities 'old_logp' (r3: with the sampler's routes forced), the reference's
  'ref_logp' (with a KL term), the routes the trainer's routers chose 'trainer_routes', and per
  row the sampler's agreement with it over the scored tokens: 'sampler_k3' (sum of e^d - 1 - d,
  d = log pi_train - log pi_sampler), 'extreme' (|d| > ln 2) and 'flips' [B, L] (tokens whose
  top-k set in layer l differs from the sampler's, the trainer's own routing, before replay)."""
  forced = batch['sampler_routes'] if cfg.routing_replay == 'r3' else None
  logp, _, aux = token_logprobs(model, batch, None, cfg.temperature, forced)
  mask = batch['loss_mask'].astype(jnp.float32)
  out = {'old_logp': logp, **sampler_agreement(logp, batch['sampler_logp'], mask)}
  if reference is not None:
    out['ref_logp'] = token_logprobs(reference, batch, None, cfg.temperature, forced)[0]
  if aux['routes'] is not None:
    out['flips'] = route_flips(aux['routes'], batch['sampler_routes'], mask)
    out['trainer_routes'] = aux['routes']
  return out


def sampler_agreement(logp_BT, sampler_logp_BT, mask_BT) -> dict:
  """Per row over the scored tokens, with d = log pi_train - log pi_sampler: 'sampler_k3', the
  sum of e^d - 1 - d (k3, an estimate of KL(sampler || trainer)), and 'extreme', the count of
  tokens with |d| > ln 2."""
  d = (logp_BT - sampler_logp_BT) * mask_BT
  return {
    'sampler_k3': jnp.sum((jnp.exp(d) - d - 1.0) * mask_BT, axis=1),
    'extreme': jnp.sum((jnp.abs(d) > EXTREME) * mask_BT, axis=1),
  }


def route_flips(live_BTLK, sampled_BTLK, mask_BT):
  """[B, L]: per row and MoE layer, the scored tokens whose set of top-k experts differs
  between two passes (the order within the set does not matter)."""
  live, sampled = (jnp.sort(r, axis=-1) for r in (live_BTLK, sampled_BTLK))
  differ_BTL = jnp.any(live != sampled, axis=-1)
  return jnp.sum(differ_BTL * mask_BT[..., None], axis=1)


def metrics(sums, batch, cfg: RLConfig, moe_layers: tuple[int, ...]) -> dict:
  """rl/* of a step: the rollouts' rewards and lengths, the sampler's agreement with the
  trainer, and the objective's clip fraction and KL (sums: objective's, summed over the batch;
  moe_layers: the MoE layers' indices, which name the per-layer flip rates)."""
  tokens = jnp.maximum(sums['tokens'], 1.0)
  rewards_BF = batch['rewards']
  weights_F = jnp.asarray([w for _, _, w in cfg.reward_specs], jnp.float32)
  total_B = rewards_BF @ weights_F
  out = {
    'rl/reward_mean': total_B.mean(),
    'rl/reward_std': total_B.std(),
    **{f'rl/reward/{n}': rewards_BF[:, i].mean() for i, (n, _, _) in enumerate(cfg.reward_specs)},
    'rl/response_length': batch['loss_mask'].astype(jnp.float32).sum(axis=1).mean(),
    'rl/clip_fraction': sums['clipped'] / tokens,
    'rl/sampler_kl_k3': batch['sampler_k3'].sum() / tokens,
    'rl/extreme_token_fraction': batch['extreme'].sum() / tokens,
  }
  if cfg.kl_coef:
    out['rl/kl_ref'] = sums['kl_ref'] / tokens
  if 'flips' in batch:
    per_layer = batch['flips'].sum(axis=0) / tokens
    out['rl/router_flip_rate'] = per_layer.mean()
    out |= {f'rl/router_flip_rate/layer_{n}': per_layer[i] for i, n in enumerate(moe_layers)}
  return out

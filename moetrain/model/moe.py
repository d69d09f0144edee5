"""The MoE block of every family: a float32 router (softmax or sigmoid scores, correction bias,
group-limited top-k, renormalised gates), routed experts, LongCat's zero-computation experts and
DeepSeek's shared experts. (Design: docs/design.md, "moetrain/model/moe.py".)"""

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.core import axes
from moetrain.kernels import quant
from moetrain.model import expert_parallel
from moetrain.model.config import ModelConfig
from moetrain.model.layers import MLP, Linear, dtype_of, normal


class RouterBias(nnx.Variable):
  """The router's e_score_correction_bias (LongCat, DeepSeek-V3): a buffer updated by the
  balancing controller."""


class Experts(nnx.Module):
  """Stacked routed-expert SwiGLU weights [E, D, F] / [E, F, D] and their per-expert LoRA."""

  NAMES = ('gate', 'up', 'down')
  LETTERS = expert_parallel.EXPERT_LETTERS

  def __init__(self, cfg: ModelConfig, path: str, rngs: nnx.Rngs):
    e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.expert_ffn_hidden_size
    shapes = {'gate': (e, d, f), 'up': (e, d, f), 'down': (e, f, d)}
    f_name = {'F': axes.EXPERT_MLP}
    names = {n: axes.names(letters, **f_name) for n, letters in self.LETTERS.items()}
    self.lora_names = tuple(n for n in self.NAMES if cfg.lora.matches(f'{path}.{n}'))
    self.lora_scale = cfg.lora.scale
    for n in self.NAMES:
      setattr(
        self, n, quant.drawn_param(rngs, shapes[n], cfg.engine.init_std, names[n], cfg.engine, 1)
      )
    if cfg.expert_bias:  # [E, 1, out]: a weight of one input, the constant 1 (kernels/experts.py)
      pdt = dtype_of(cfg.engine.param_dtype)
      for n in self.NAMES:
        letters = expert_parallel.EXPERT_LETTERS[f'{n}_bias']
        bias = jnp.zeros((e, 1, shapes[n][2]), pdt)
        setattr(self, f'{n}_bias', nnx.Param(bias, axes=axes.names(letters, **f_name)))
    r, ldt = cfg.lora.rank, dtype_of(cfg.lora.param_dtype)
    for n in self.lora_names:
      _, din, dout = shapes[n]
      a = normal(rngs, (e, din, r), din**-0.5, ldt)
      a_axes = axes.names(self.LETTERS[n][:2] + 'J', **f_name)
      setattr(self, f'{n}_lora_a', nnx.LoRAParam(a, axes=a_axes))
      b = jnp.zeros((e, r, dout), ldt)
      b_axes = axes.names(self.LETTERS[n][0] + 'J' + self.LETTERS[n][2], **f_name)
      setattr(self, f'{n}_lora_b', nnx.LoRAParam(b, axes=b_axes))

  def weights(self) -> dict:
    """Raw arrays (or quantised tensors) keyed 'gate', 'gate_lora_a', ... for the engine."""
    w = {n: quant.raw(getattr(self, n)) for n in self.NAMES}
    if hasattr(self, 'gate_bias'):
      w.update({f'{n}_bias': getattr(self, f'{n}_bias')[...] for n in self.NAMES})
    for n in self.lora_names:
      w[f'{n}_lora_a'] = getattr(self, f'{n}_lora_a')[...]
      w[f'{n}_lora_b'] = getattr(self, f'{n}_lora_b')[...]
    return w


def route(x_MD, w_DX, bias_X, cfg: ModelConfig, linear_bias_X=None, forced_MA=None):
  """float32 router: scores (softmax or sigmoid of the logits), top-k over score + bias within
  the best expert groups, gates = the chosen scores (renormalised with cfg.norm_topk_prob) times
  routed_scaling_factor. The bias (None: none) and the group limit steer selection only.
  gpt-oss ('topk_softmax'): logits plus linear_bias_X, top-k over them, gates = the softmax of
  the chosen logits.

  Returns (logits, scores, ids, gates, live ids). forced_MA (routing replay: ids recorded in
  another pass) replaces the top-k's choice: the gates are the live scores (or logits) gathered
  at the forced ids, so the router keeps its gradient; the live ids are the top-k's own."""
  logits_MX = jnp.dot(x_MD.astype(jnp.float32), w_DX.astype(jnp.float32))
  if linear_bias_X is not None:
    logits_MX = logits_MX + linear_bias_X.astype(jnp.float32)[None, :]
  if cfg.router_score == 'topk_softmax':
    _, live_MA = jax.lax.top_k(logits_MX, cfg.moe_topk)
    idx_MA = live_MA if forced_MA is None else forced_MA
    top_MA = jnp.take_along_axis(logits_MX, idx_MA, axis=-1)
    gates_MA = jax.nn.softmax(top_MA, axis=-1) * cfg.routed_scaling_factor
    return logits_MX, jax.nn.softmax(logits_MX, axis=-1), idx_MA, gates_MA, live_MA
  if cfg.router_score == 'softmax':
    scores_MX = jax.nn.softmax(logits_MX, axis=-1)
  else:
    scores_MX = jax.nn.sigmoid(logits_MX)
  choice_MX = jax.lax.stop_gradient(scores_MX)
  if bias_X is not None:
    choice_MX = choice_MX + bias_X[None, :]
  if cfg.n_group > 1:
    choice_MX = best_groups(choice_MX, cfg.n_group, cfg.topk_group, cfg.router_group_score)
  _, live_MA = jax.lax.top_k(choice_MX, cfg.moe_topk)
  idx_MA = live_MA if forced_MA is None else forced_MA
  gates_MA = jnp.take_along_axis(scores_MX, idx_MA, axis=-1)
  if cfg.norm_topk_prob:
    gates_MA = gates_MA / (jnp.sum(gates_MA, axis=-1, keepdims=True) + 1e-20)
  return logits_MX, scores_MX, idx_MA, gates_MA * cfg.routed_scaling_factor, live_MA


def best_groups(choice_MX, n_group: int, topk_group: int, score: str = 'top2'):
  """The group limit: experts in n_group consecutive groups, each scored by the sum of its best
  two choice scores (score 'top2', DeepSeek-V3) or by its best ('max', DeepSeek-V2); the experts
  outside a token's topk_group best groups score 0 (as in transformers, so not below a negative
  score of a kept one)."""
  m, x = choice_MX.shape
  grouped_MGX = choice_MX.reshape(m, n_group, x // n_group)
  if score == 'max':
    score_MG = jnp.max(grouped_MGX, axis=-1)
  else:
    score_MG = jnp.sum(jax.lax.top_k(grouped_MGX, 2)[0], axis=-1)
  _, best_MA = jax.lax.top_k(score_MG, topk_group)
  keep_MG = jnp.sum(jax.nn.one_hot(best_MA, n_group, dtype=jnp.int32), axis=1) > 0
  return jnp.where(keep_MG[:, :, None], grouped_MGX, 0.0).reshape(m, x)


class MoE(nnx.Module):
  def __init__(self, cfg: ModelConfig, path: str, rngs: nnx.Rngs):
    self.cfg = cfg
    x = cfg.num_experts_total
    self.router = nnx.Param(
      normal(rngs, (cfg.hidden_size, x), cfg.engine.init_std, jnp.float32), axes=axes.names('DX')
    )
    if cfg.router_bias:
      self.router_bias = RouterBias(jnp.zeros((x,), jnp.float32), axes=axes.names('X'))
    if cfg.router_linear_bias:  # gpt-oss: trained with the router (lora.train_router)
      self.router_linear_bias = nnx.Param(jnp.zeros((x,), jnp.float32), axes=axes.names('X'))
    self.experts = Experts(cfg, f'{path}.experts', rngs)
    if cfg.n_shared_experts:
      self.shared = MLP(cfg, f'{path}.shared', rngs, cfg.shared_width)
    if cfg.n_shared_experts and cfg.shared_expert_gate:  # Qwen2-MoE: sigmoid(x @ w) per token
      self.shared_gate = Linear(
        'BTD,DO->BTO', (cfg.hidden_size, 1), cfg, f'{path}.shared_gate', rngs
      )

  def __call__(self, x_BTD, valid_BT, rng=None, routes_BTK=None):
    """(output [B, T, D], routing stats). routes_BTK: routing replay's forced top-k ids (int32;
    None: the router chooses). The stats' 'routes' [B, T, K] are the router's own choice (the
    live top-k, before any replay), padding's the id past every expert."""
    cfg = self.cfg
    b, t, d = x_BTD.shape
    x_MD = x_BTD.reshape(b * t, d)
    valid_M = valid_BT.reshape(b * t).astype(jnp.float32)
    bias_X = self.router_bias[...] if cfg.router_bias else None
    linear_X = self.router_linear_bias[...] if cfg.router_linear_bias else None
    forced_MA = None if routes_BTK is None else routes_BTK.reshape(b * t, -1).astype(jnp.int32)
    logits_MX, scores_MX, idx_MA, gates_MA, live_MA = route(
      x_MD, self.router[...], bias_X, cfg, linear_X, forced_MA
    )
    # Padding (segment id 0) goes to no expert: it takes no capacity, buffer rows or compute,
    # and gets a zero output. The id past every expert keeps it out of dispatch and of the zero
    # experts' sum alike.
    pad_M1 = valid_M[:, None] == 0
    idx_MA = jnp.where(pad_M1, cfg.num_experts_total, idx_MA)
    gates_MA = jnp.where(pad_M1, 0.0, gates_MA)
    y_MD, dropped = expert_parallel.routed_experts(
      x_MD, idx_MA, gates_MA, self.experts.weights(), cfg, rng
    )
    is_zero_MA = (idx_MA >= cfg.n_routed_experts) & (idx_MA < cfg.num_experts_total)
    zero_gate_M = jnp.sum(jnp.where(is_zero_MA, gates_MA, 0.0), axis=-1)
    y_MD = y_MD + zero_gate_M[:, None] * x_MD.astype(jnp.float32)  # float32, rounded once
    probs_MX = scores_MX
    if cfg.router_score == 'sigmoid':  # a distribution, for the entropy and the balance loss
      probs_MX = scores_MX / jnp.sum(scores_MX, axis=-1, keepdims=True)
    stats = routing_stats(logits_MX, probs_MX, idx_MA, valid_M, dropped, cfg, rows=b)
    live_MA = jnp.where(pad_M1, cfg.num_experts_total, live_MA).astype(jnp.int32)
    stats['routes'] = live_MA.reshape(b, t, -1)
    y_BTD = y_MD.reshape(b, t, d).astype(x_BTD.dtype)
    if cfg.n_shared_experts:
      s_BTD = self.shared(x_BTD, rng)
      if cfg.shared_expert_gate:
        s_BTD = jax.nn.sigmoid(self.shared_gate(x_BTD, rng)) * s_BTD
      y_BTD = y_BTD + s_BTD
    return y_BTD, stats


def routing_stats(
  logits_MX, probs_MX, idx_MA, valid_M, dropped_MA, cfg: ModelConfig, rows: int = 1
) -> dict:
  """Per-layer routing statistics and the raw balancing loss of cfg.balance_loss_kind
  (coefficient applied later); the M tokens are `rows` sequences of equal length."""
  e, x = cfg.n_routed_experts, cfg.num_experts_total
  n_valid = jnp.maximum(valid_M.sum(), 1.0)
  onehot_MX = jnp.sum(jax.nn.one_hot(idx_MA, x, dtype=jnp.float32), axis=1)
  load_X = jnp.sum(onehot_MX * valid_M[:, None], axis=0)
  ffn_M = jnp.sum(onehot_MX[:, :e], axis=-1)
  ent_M = -jnp.sum(probs_MX * jnp.log(probs_MX + 1e-20), axis=-1)
  lse_M = jax.nn.logsumexp(logits_MX, axis=-1)
  stats = {
    'load': load_X,
    'dropped': jnp.sum(dropped_MA * valid_M[:, None]),
    'ffn_experts_mean': jnp.sum(ffn_M * valid_M) / n_valid,
    'ffn_experts_sq': jnp.sum(ffn_M**2 * valid_M) / n_valid,
    'router_entropy': jnp.sum(ent_M * valid_M) / n_valid,
    'router_z_loss': jnp.sum(lse_M**2 * valid_M) / n_valid,
    'balance_loss': balance_loss(onehot_MX, probs_MX, valid_M, rows, cfg),
  }
  return finish_routing_stats(stats, cfg)


# Counts: summed over micro-batches as they are. The other statistics are means over the valid
# tokens, which micro-batches add up to when weighted by their share of those tokens.
ROUTING_COUNTS = ('load', 'dropped')


def finish_routing_stats(stats: dict, cfg: ModelConfig) -> dict:
  """The statistics that are not means over tokens, from those that are (or counts), so that
  they come out exact after gradient accumulation adds micro-batches: the std of the FFN experts
  per token, and the dropped fraction of the FFN assignments. Works per layer ([L]-shaped
  statistics, [L, X] load) as well."""
  mean = stats['ffn_experts_mean']
  ffn_load = jnp.sum(stats['load'][..., : cfg.n_routed_experts], axis=-1)
  return {
    **stats,
    'ffn_experts_std': jnp.sqrt(jnp.maximum(stats['ffn_experts_sq'] - mean**2, 0.0)),
    'dropped_frac': stats['dropped'] / jnp.maximum(ffn_load, 1.0),
  }


def balance_loss(onehot_MX, probs_MX, valid_M, rows: int, cfg: ModelConfig):
  """The balance loss of cfg.balance_loss_kind from each token's choices (one-hot [M, X]) and
  router distribution, over the valid tokens."""
  k, n_valid = cfg.moe_topk, jnp.maximum(valid_M.sum(), 1.0)
  v_M1 = valid_M[:, None]
  frac_X = jnp.sum(onehot_MX * v_M1, axis=0) / (k * n_valid)  # share of the assignments
  mean_p_X = jnp.sum(probs_MX * v_M1, axis=0) / n_valid
  kind = cfg.balance_loss_kind
  if kind == 'device':
    return device_balance_loss(frac_X, mean_p_X, cfg)
  e = cfg.n_routed_experts
  if kind == 'switch':  # transformers: E * sum_e (tokens to e / tokens) * mean prob of e
    return e * k * jnp.sum(frac_X[:e] * mean_p_X[:e])
  # 'sequence' (DeepSeek-V3 eq. 17-20): per row, f_e = E / (K T) * (tokens to e),
  # P_e = mean normalised score; sum_e f_e P_e, averaged over the rows with tokens.
  x = onehot_MX.shape[1]
  count_BX = jnp.sum((onehot_MX * v_M1).reshape(rows, -1, x), axis=1)
  p_BX = jnp.sum((probs_MX * v_M1).reshape(rows, -1, x), axis=1)
  t_B = jnp.sum(valid_M.reshape(rows, -1), axis=1)
  t_B1 = jnp.maximum(t_B, 1.0)[:, None]
  per_row = jnp.sum((e / (k * t_B1) * count_BX[:, :e]) * (p_BX[:, :e] / t_B1), axis=-1)
  return jnp.sum(per_row) / jnp.maximum(jnp.sum(t_B > 0), 1.0)


def device_balance_loss(frac_X, mean_p_X, cfg: ModelConfig):
  """Device-level balance loss (LongCat TR 2.1.2): the FFN experts in D groups (the devices that
  hold them: engine.moe_balance_groups, by default the expert-parallel shards) plus all zero
  experts as one more group; sum_j F_j * P_j / tau_j, where tau_j is the group's target share of
  assignments (K_e/K split over the FFN groups, (K-K_e)/K for the zero group). Equals 1 at target."""
  e, z = cfg.n_routed_experts, cfg.zero_expert_num
  k, groups = cfg.moe_topk, cfg.engine.moe_balance_groups or cfg.engine.expert_shards
  k_e = cfg.expected_ffn_experts if z else k
  f_G = jnp.sum(frac_X[:e].reshape(groups, e // groups), axis=-1)
  p_G = jnp.sum(mean_p_X[:e].reshape(groups, e // groups), axis=-1)
  loss = jnp.sum(f_G * p_G / (k_e / k / groups))
  if z:
    loss += jnp.sum(frac_X[e:]) * jnp.sum(mean_p_X[e:]) / ((k - k_e) / k)
  return loss

"""Pure step functions: loss, train step (accumulation, clipping, non-finite guard, MoE bias
update) and eval step. No I/O and no config dicts."""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from moetrain.core.fields import check, field
from moetrain.core.sharding import replicated
from moetrain.kernels.cross_entropy import head_cross_entropy
from moetrain.kernels.distill import Divergence, head_distillation
from moetrain.model import context, stages
from moetrain.model.config import ModelConfig
from moetrain.model.moe import ROUTING_COUNTS, finish_routing_stats
from moetrain.training import preference as preference_lib
from moetrain.training import rl as rl_lib
from moetrain.training.logprobs import slot_features
from moetrain.training.train_state import TrainState, graphdef_of, merge_model, merge_teacher

off = functools.partial(field, check='non_negative', zero='0 = off')


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The `config.loss` section: auxiliary losses and the expert-bias controller."""

  router_z_loss: float = off(0.0)  # coefficient of mean(logsumexp(router logits)^2)
  balance_loss: float = off(0.0)  # coefficient of the device-level balance loss
  hidden_z_loss: float = off(0.0)  # coefficient of LongCat's hidden z-loss on the last hidden state
  # coefficient of the sparse attention indexer's KL loss towards the main attention (DeepSeek-V3.2;
  # model/indexer.py kl_loss), per token and indexer layer; > 0 trains the indexer (full
  # fine-tuning), whose input is detached: the rest of the model sees the LM loss alone.
  indexer_kl: float = off(0.0)
  bias_update_rate: float = off(1e-3)  # mu of the proportional expert-bias update
  # Cosine-decay mu to 0 over this many steps; 0 = constant, -1 (in a config) = over train.steps.
  bias_update_decay_steps: int = field(0, check='non_negative', zero='0 = constant')

  def validate(self) -> None:
    check(self, 'loss')


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig(LossConfig):
  """What the step function computes: the model, the loss terms and the micro-batches."""

  model: ModelConfig
  grad_accum_steps: int = 1
  distill: Divergence | None = None  # distillation's loss (None: cross entropy alone)
  teacher: ModelConfig | None = None  # the online teacher (None: cached logits in the batch)
  preference: preference_lib.PreferenceConfig | None = None  # preference tuning's objective
  rl: rl_lib.RLConfig | None = None  # reinforcement learning's objective (rollout batches)

  def validate(self) -> None:
    super().validate()
    m, where = self.model, f'loss.indexer_kl={self.indexer_kl}'
    if self.indexer_kl and not m.index_n_heads:
      raise ValueError(f'{where}: the model has no sparse attention indexer (index_n_heads=0)')
    if self.indexer_kl and m.lora.enabled:
      raise ValueError(
        f"{where} trains the indexer's weights, which LoRA keeps frozen and its adapters do not "
        'carry: use full fine-tuning (lora.rank=0), or loss.indexer_kl=0'
      )
    if self.indexer_kl and m.engine.pipeline_stages > 1:
      raise ValueError(f'{where} under pipeline stages (engine.pipeline_stages > 1)')
    if bool(self.indexer_kl) != m.train_indexer:
      raise ValueError(f'{where} but model.train_indexer={m.train_indexer}: set one from the other')


def forward_loss(params, moe_bias, frozen, graphdef, batch, rng=None, head_loss=None):
  """(masked NLL sum, correct count, aux) of the model on a batch, the loss chunked along the
  sequence by engine.loss_chunk so that the [B, T, V] logits never exist whole. head_loss
  (distillation: distill_head's) adds aux['objective'] and aux['divergence'] (sums)."""
  model = merge_model(graphdef, params, moe_bias, frozen)
  if head_loss is not None:
    h_BTD, aux = model.features(batch['inputs'], batch['positions'], batch['segment_ids'], rng)
    with jax.named_scope('lm_head'):
      objective, nll, divergence, correct = head_loss(model, h_BTD, batch, rng)
    return nll, correct, {**aux, 'objective': objective, 'divergence': divergence}
  # The hidden states stay in a context split's slot order; the targets and mask move instead.
  h_BTD, aux, index = slot_features(model, batch, rng)
  with jax.named_scope('lm_head'):
    nll, correct = head_cross_entropy(
      model.lm_head,
      h_BTD,
      context.in_slots(batch['targets'], index),
      context.in_slots(batch['loss_mask'], index),
      model.cfg.engine.loss_chunk,
      rng,
      model.cfg.engine.rules,
      model.cfg.engine.reference_kernels,
      model.cfg.engine.context_shards,
    )
  return nll, correct, aux


def distill_head(cfg: StepConfig, teacher_state):
  """The head loss of distillation: the divergence from the teacher (its head on the hidden
  states with_teacher put in the batch, or the batch's cached top-k) beside the NLL, per block
  of the chunked loss."""

  def head_loss(model, h_BTD, batch, rng):
    if cfg.teacher is None:
      teacher = ('offline', batch['teacher_ids'], batch['teacher_logprobs'])
    else:
      head = merge_teacher(cfg.teacher, teacher_state).lm_head
      teacher = ('online', head, batch['teacher_h'])
    m = model.cfg
    args = (batch['targets'], batch['loss_mask'], teacher, cfg.distill, m.engine.loss_chunk, rng)
    return head_distillation(
      model.lm_head, h_BTD, *args, m.engine.rules, m.engine.reference_kernels
    )

  return head_loss


def with_teacher(state: TrainState, batch, cfg: StepConfig):
  """The batch with the online teacher's final hidden states: its forward pass runs outside the
  differentiated function, so none of its activations is kept for the backward pass."""
  if cfg.distill is None or cfg.teacher is None:
    return batch
  teacher = merge_teacher(cfg.teacher, jax.lax.stop_gradient(state.teacher))
  with jax.named_scope('teacher'):
    h_BTD, _ = teacher.features(batch['inputs'], batch['positions'], batch['segment_ids'])
  return {**batch, 'teacher_h': jax.lax.stop_gradient(h_BTD)}


def token_counts(batch, cfg: 'StepConfig | None' = None):
  """(loss tokens, routed tokens) of a batch: the denominators of the loss and the MoE terms;
  with preference tuning, then (elements, scored chosen tokens) (preference.counts); with RL
  (scored tokens, completions) (rl.counts)."""
  n_loss = jnp.maximum(batch['loss_mask'].astype(jnp.float32).sum(), 1.0)
  n_routed = jnp.maximum((batch['segment_ids'] > 0).astype(jnp.float32).sum(), 1.0)
  if cfg is not None and cfg.preference is not None:
    return (n_loss, n_routed, *preference_lib.counts(batch))
  if cfg is not None and cfg.rl is not None:
    return (n_loss, n_routed, *rl_lib.counts(batch))
  return n_loss, n_routed


def needs_reference(cfg: 'StepConfig') -> bool:
  """Whether the objective compares with a reference: preference tuning's (but SimPO, ORPO), or
  RL's KL term."""
  pref = cfg.preference is not None and cfg.preference.needs_reference
  return pref or (cfg.rl is not None and cfg.rl.kl_coef > 0)


def reference_model(params, moe_bias, frozen, graphdef, cfg: 'StepConfig', teacher):
  """Preference tuning's and RL's reference: under LoRA the same weights with the adapters zero
  (their delta exactly 0, no copy of the base), in full fine-tuning the frozen copy in
  `teacher`; None where the objective needs none (needs_reference)."""
  if not needs_reference(cfg):
    return None
  if cfg.model.lora.enabled:
    off = jax.tree.map(jnp.zeros_like, jax.lax.stop_gradient(params))
    return merge_model(graphdef, off, moe_bias, frozen)
  return merge_teacher(cfg.teacher, jax.lax.stop_gradient(teacher))


def preference_forward(params, moe_bias, frozen, graphdef, batch, rng, totals, cfg, teacher=None):
  """forward_loss's counterpart for preference tuning: (the objective's share of the batch,
  aux of the policy's forward, the sums of preference.objective). totals: the whole batch's
  (elements, scored chosen tokens), preference.counts."""
  model = merge_model(graphdef, params, moe_bias, frozen)
  ref = reference_model(params, moe_bias, frozen, graphdef, cfg, teacher)
  return preference_lib.objective(cfg.preference, model, ref, batch, rng, totals)


def loss_fn(params, moe_bias, frozen, graphdef, batch, rng, totals, cfg: StepConfig, teacher=None):
  """Token-mean cross entropy (with distillation: alpha T^2 divergence + (1 - alpha) cross
  entropy) over the whole (global) batch plus the weighted aux losses. `totals` are the full
  batch's token counts, so micro-batch losses add up to the full-batch loss."""
  n_tokens, n_routed = totals[:2]
  pref = rl = None
  if cfg.preference is not None:
    args = (params, moe_bias, frozen, graphdef, batch, rng, totals[2:], cfg, teacher)
    objective, aux, pref = preference_forward(*args)
    nll, correct = pref['nll_chosen'], pref['correct_chosen']
  elif cfg.rl is not None:
    model = merge_model(graphdef, params, moe_bias, frozen)
    objective, aux, rl = rl_lib.objective(cfg.rl, model, batch, rng, totals[2:])
    nll, correct = rl['nll'], rl['correct']
  else:
    head_loss = None if cfg.distill is None else distill_head(cfg, teacher)
    nll, correct, aux = forward_loss(params, moe_bias, frozen, graphdef, batch, rng, head_loss)
  mask = batch['loss_mask'].astype(jnp.float32)
  moe = aux['moe']
  # This micro-batch's share of the routed tokens, so per-micro-batch MoE means average correctly.
  frac = token_counts(batch)[1] / n_routed
  # Over every token the model reads (prompts included), not only the loss tokens; not padding.
  valid = (batch['segment_ids'] > 0).astype(jnp.float32)
  hidden_z = jnp.sum(aux['hidden_lse_BT'] ** 2 * valid) / n_routed
  # Per token and indexer layer (the layers' sums over this micro-batch's tokens).
  kl_L = aux.get('indexer_kl')
  indexer_kl = jnp.zeros(()) if kl_L is None else kl_L.mean() / n_routed
  aux_loss = (
    cfg.router_z_loss * moe['router_z_loss'].mean() * frac
    + cfg.balance_loss * moe['balance_loss'].mean() * frac
    + cfg.hidden_z_loss * hidden_z
    + cfg.indexer_kl * indexer_kl
  )
  own = pref is None and rl is None
  loss = (aux.get('objective', nll) / n_tokens if own else objective) + aux_loss
  stats = {
    'nll_sum': nll,
    'divergence_sum': aux.get('divergence', jnp.zeros(())),
    'correct': correct,
    'tokens': mask.sum() if pref is None else pref['tokens_chosen'],
    'hidden_z': hidden_z,
    'indexer_kl': indexer_kl,
    'moe': {k: v if k in ROUTING_COUNTS else v * frac for k, v in moe.items()},
  }
  if pref is not None:
    stats['pref'] = pref
  if rl is not None:
    stats['rl'] = rl
  return loss, stats


def _microbatches(batch, n: int):
  return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)


def grads_and_stats(state: TrainState, graphdef, batch, rng, cfg: StepConfig, scale=None):
  """(loss, stats, grads) of the batch, over cfg.grad_accum_steps micro-batches. With `scale`
  (float16's loss scale) the backward pass runs on scale * loss, so that small gradients do not
  underflow in float16; the loss and gradients returned are unscaled."""
  totals = token_counts(batch, cfg)

  def objective(p, b, r):
    args = (state.moe_bias, state.frozen, graphdef, b, r, totals, cfg, state.teacher)
    loss, stats = loss_fn(p, *args)
    return (loss if scale is None else loss * scale), stats

  grad_fn = jax.value_and_grad(objective, has_aux=True)
  # In each leaf's own dtype: the float32 scale would promote bfloat16 gradients (param_dtype
  # bfloat16) to float32, which the optimizer state then took on.
  unscale = lambda t: t if scale is None else jax.tree.map(lambda x: (x / scale).astype(x.dtype), t)
  n = cfg.grad_accum_steps
  if n == 1:
    (loss, stats), grads = grad_fn(state.params, with_teacher(state, batch, cfg), rng)
    return unscale(loss), stats, unscale(grads)

  # The sums run in float32 at least (bfloat16 gradients of param_dtype bfloat16 would lose
  # precision with every micro-batch), and the gradients go back to their own dtype at the end.
  wide = lambda d: jnp.promote_types(d, jnp.float32) if jnp.issubdtype(d, jnp.floating) else d

  def micro(carry, xs):
    mb, i = xs
    new = grad_fn(state.params, with_teacher(state, mb, cfg), jax.random.fold_in(rng, i))
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), carry, new), None

  micro_batches = _microbatches(batch, n)
  first = jax.tree.map(lambda x: x[0], micro_batches)
  shapes = jax.eval_shape(lambda b: grad_fn(state.params, with_teacher(state, b, cfg), rng), first)
  zero = jax.tree.map(lambda s: jnp.zeros(s.shape, wide(s.dtype)), shapes)
  ((loss, stats), grads), _ = jax.lax.scan(micro, zero, (micro_batches, jnp.arange(n)))
  grads = jax.tree.map(lambda g, s: g.astype(s.dtype), unscale(grads), shapes[1])
  stats = {**stats, 'moe': finish_routing_stats(stats['moe'], cfg.model)}
  return unscale(loss), stats, grads


LOSS_SCALE_PERIOD = 2000  # finite float16 steps in a row before the loss scale doubles


def next_loss_scale(loss_scale, finite):
  """Dynamic loss scaling: halve the scale (not below 1) on a non-finite step, which the step
  skips; double it after LOSS_SCALE_PERIOD finite steps in a row."""
  scale, run = loss_scale[0], loss_scale[1]
  run = jnp.where(finite, run + 1, 0.0)
  grow = run >= LOSS_SCALE_PERIOD
  scale = jnp.where(finite, jnp.where(grow, 2 * scale, scale), jnp.maximum(scale / 2, 1.0))
  return jnp.stack([scale, jnp.where(grow, 0.0, run)])


def bias_update(moe_bias, load_LX, step, cfg: StepConfig):
  """The expert-bias controller on FFN experts, per MoE layer: with the load error
  err_i = K_e/(K*N) - T_i/(K*T_all), b_i += mu * err_i (LongCat's proportional rule) or
  mu * sign(err_i) (DeepSeek-V3's). Zero-expert biases are never changed. load_LX: the MoE
  layers' loads in layer order; the groups of layers hold their biases in stored order
  (stages.layer_order; a tree of one MoE module's biases, not keyed by group, takes them all)."""
  mc = cfg.model
  e, k = mc.n_routed_experts, mc.moe_topk
  mu = cfg.bias_update_rate
  if cfg.bias_update_decay_steps:
    mu = mu * 0.5 * (1 + jnp.cos(jnp.pi * jnp.minimum(step / cfg.bias_update_decay_steps, 1.0)))
  t_all = jnp.maximum(load_LX.sum(-1, keepdims=True) / k, 1.0)
  err = mc.expected_ffn_experts / (k * e) - load_LX[:, :e] / (k * t_all)
  if mc.bias_rule == 'sign':
    err = jnp.sign(err)
  delta_LX = jnp.pad(mu * err, ((0, 0), (0, mc.zero_expert_num)))
  offsets, at = {}, 0
  for group in (g for g in mc.layer_groups() if g.kind == 'moe'):
    offsets[group.name], at = (at, group.count), at + group.count

  def update(path, b):
    start, count = offsets.get(path[0].key, (0, load_LX.shape[0]))
    delta = delta_LX[start : start + count]
    if stages.layout(mc) != (1, 1):  # the biases' stored order
      delta = delta[stages.layer_order(count, stages.layout(mc))]
    return b + delta.astype(b.dtype)

  return jax.tree_util.tree_map_with_path(update, moe_bias)


def train_step(
  state: TrainState,
  batch,
  *,
  graphdef,
  optimizer: optax.GradientTransformation,
  lr_fn: Callable,
  cfg: StepConfig,
):
  rng, step_rng = jax.random.split(jax.random.wrap_key_data(state.rng))
  scale = None if state.loss_scale is None else state.loss_scale[0]  # float16 compute only
  loss, stats, grads = grads_and_stats(state, graphdef, batch, step_rng, cfg, scale)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  # Updates applied before this one: the schedules (learning rate, bias decay) count these, and a
  # skipped (non-finite) step applies none.
  applied = state.step - state.skipped

  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  moe_bias = state.moe_bias
  if cfg.bias_update_rate:
    moe_bias = bias_update(moe_bias, stats['moe']['load'], applied, cfg)
  # A non-finite loss or gradient skips the update: each new value is selected against the old
  # one, element by element. XLA fuses the select into the update's own loop over each weight,
  # in place in the donated state. (A lax.cond between the two states kept the whole state
  # twice at the peak on TPU: bench/RESULTS.md, "Peer comparison".)
  new = (optax.apply_updates(state.params, updates), opt_state, moe_bias)
  old = (state.params, state.opt_state, state.moe_bias)
  params, opt_state, moe_bias = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_state = dataclasses.replace(
    state,
    step=state.step + 1,
    params=params,
    opt_state=opt_state,
    moe_bias=moe_bias,
    rng=jax.random.key_data(rng),
    skipped=state.skipped + (~finite).astype(jnp.int32),
    loss_scale=None if scale is None else next_loss_scale(state.loss_scale, finite),
  )
  tokens = jnp.maximum(stats['tokens'], 1.0)
  metrics = {
    'loss': stats['nll_sum'] / tokens,
    'total_loss': loss,
    'accuracy': stats['correct'] / tokens,
    'grad_norm': grad_norm,
    'learning_rate': lr_fn(applied),  # the rate this step's update used
    'tokens': stats['tokens'],
    **({'divergence': stats['divergence_sum'] / tokens} if cfg.distill else {}),
    **(preference_lib.metrics(stats['pref']) if cfg.preference else {}),
    **(rl_lib.metrics(stats['rl'], batch, cfg.rl, cfg.model.moe_layer_indices) if cfg.rl else {}),
    'hidden_z_loss': stats['hidden_z'],
    **({'indexer_kl': stats['indexer_kl']} if cfg.indexer_kl else {}),
    'skipped': new_state.skipped,
    'moe': stats['moe'],
  }
  if scale is not None:
    metrics['loss_scale'] = scale
  return new_state, metrics


def jit_train_step(
  cfg: StepConfig, optimizer, lr_fn, shardings=None, batch_sharding=None, donate: bool = True
):
  """train_step jitted for cfg.model (graphdef, optimizer and schedule bound). With shardings
  (the state's), the state keeps them and the batch arrives in batch_sharding (or a dict of
  them, a field each). The donated state is updated in place."""
  fn = functools.partial(
    train_step, graphdef=graphdef_of(cfg.model), optimizer=optimizer, lr_fn=lr_fn, cfg=cfg
  )
  placed = {}
  if shardings is not None:
    # The metrics whole on every device: each process fetches them (a pipeline's per-layer
    # routing stats would otherwise stay split over 'stage', across hosts).
    mesh = None if batch_sharding is None else jax.tree.leaves(batch_sharding)[0].mesh
    metrics = None if mesh is None else replicated(mesh)
    placed = dict(in_shardings=(shardings, batch_sharding), out_shardings=(shardings, metrics))
  options = compiler_options(cfg.model)
  return jax.jit(fn, donate_argnums=0 if donate else (), compiler_options=options, **placed)


def compiler_options(cfg: ModelConfig) -> dict | None:
  """XLA options of the model's steps (engine.tpu_scoped_vmem_kib on TPU); None: the defaults."""
  if cfg.engine.platform == 'tpu' and cfg.engine.tpu_scoped_vmem_kib:
    return {'xla_tpu_scoped_vmem_limit_kib': int(cfg.engine.tpu_scoped_vmem_kib)}
  return None


def eval_step(state: TrainState, batch, *, graphdef, micro_rows: int = 0, cfg=None):
  """Sums of the NLL, correct predictions and scored tokens of `batch`, in forward passes of
  `micro_rows` rows (the train step's micro-batch, so that evaluating needs no more activation
  memory than training) where they divide the batch; 0 = the whole batch at once. With
  preference tuning (cfg: the StepConfig), the objective's sums too (of the chosen completions:
  the NLL, correct and tokens)."""
  weights = (state.params, state.moe_bias, state.frozen, graphdef)
  if cfg is not None and cfg.preference is not None:

    def forward(b):  # (the sums only: the objective's denominators do not matter)
      return preference_forward(*weights, b, None, (1.0, 1.0), cfg, state.teacher)[2]

  else:

    def forward(b):
      nll, correct = forward_loss(*weights, b)[:2]
      return {'nll_sum': nll, 'correct': correct, 'tokens': b['loss_mask'].sum()}

  rows = batch['inputs'].shape[0]
  if micro_rows and rows > micro_rows and rows % micro_rows == 0:
    sums = jax.lax.map(forward, _microbatches(batch, rows // micro_rows))
    sums = jax.tree.map(lambda x: x.sum(0), sums)
  else:
    sums = forward(batch)
  if 'nll_chosen' in sums:
    names = {'nll_chosen': 'nll_sum', 'correct_chosen': 'correct', 'tokens_chosen': 'tokens'}
    sums = {names.get(k, k): v for k, v in sums.items()}
  return {k: v.astype(jnp.float32) for k, v in sums.items()}

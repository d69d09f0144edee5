"""Train step: gradient accumulation equals one big batch; the non-finite guard; dry-run counts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moetrain.core.sharding import Rules
from moetrain.model.config import LONGCAT_PRESETS
from moetrain.planner.sizes import dry_run, ep_exchange, loss_block, param_counts
from moetrain.training.train_state import graphdef_of, init_state
from moetrain.training.train_step import StepConfig, eval_step, grads_and_stats, jit_train_step
from tests.helpers import tiny, with_lora
from tests.test_sharding import batch

CFG = with_lora(tiny(init_std=0.05))


def step_fn(cfg, accum, opt, balance_loss=0.0, lr_fn=lambda s: 1e-2):
  # The balance loss is defined per micro-batch (TR: P_j averaged over the micro-batch), so it
  # is not additive across micro-batches; every other term is.
  step_cfg = StepConfig(
    model=cfg,
    grad_accum_steps=accum,
    router_z_loss=1e-3,
    balance_loss=balance_loss,
    hidden_z_loss=1e-4,
    bias_update_rate=1e-2,
  )
  return jit_train_step(step_cfg, opt, lr_fn, donate=False)


def poisoned(state, value=jnp.nan):
  """A copy of `state` with `value` in every trainable array: its step is non-finite."""
  bad = jax.tree.map(lambda x: x, state)
  bad.params = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(value), state.params)
  return bad


def skip_then_step(fn, state):
  """A non-finite step from `state`, then a clean one from where it left off (state's params):
  (the skipped step's state, the clean step's state and metrics)."""
  skipped, _ = fn(poisoned(state), batch())
  skipped.params = state.params
  return skipped, *fn(skipped, batch())


def test_gradient_accumulation_equals_full_batch():
  opt = optax.sgd(1.0)  # the update is the gradient itself
  state = init_state(CFG, opt, 0)
  b = batch()
  b['loss_mask'][:4, :5] = 0  # uneven token counts across micro-batches
  one, m1 = step_fn(CFG, 1, opt)(state, b)
  two, m2 = step_fn(CFG, 4, opt)(state, b)
  np.testing.assert_allclose(m2['total_loss'], m1['total_loss'], rtol=1e-5)
  np.testing.assert_allclose(m2['grad_norm'], m1['grad_norm'], rtol=1e-4)
  for a, c in zip(jax.tree.leaves(two.params), jax.tree.leaves(one.params)):
    np.testing.assert_allclose(a, c, atol=1e-6)
  for a, c in zip(jax.tree.leaves(two.moe_bias), jax.tree.leaves(one.moe_bias)):
    np.testing.assert_allclose(a, c, atol=1e-7)
  # The routing statistics too, those that are not token means included (std, dropped share).
  for key in ('load', 'ffn_experts_mean', 'ffn_experts_std', 'router_entropy', 'dropped_frac'):
    np.testing.assert_allclose(m2['moe'][key], m1['moe'][key], rtol=1e-5, atol=1e-7, err_msg=key)


@pytest.mark.parametrize('micro_rows', [2, 3])  # 3 does not divide 8 rows: one pass
def test_evaluation_in_micro_batches_equals_the_whole_batch(micro_rows):
  """The eval step runs the train step's micro-batches one forward pass at a time (the eval
  batch needs no more activation memory than training): the same sums as one pass."""
  state = init_state(CFG, optax.sgd(1.0), 0)
  graphdef = graphdef_of(CFG)
  whole = jax.jit(lambda s, b: eval_step(s, b, graphdef=graphdef))(state, batch())
  fn = lambda s, b: eval_step(s, b, graphdef=graphdef, micro_rows=micro_rows)
  # The micro-batch loop: the only scan at the top (the layers' scan runs inside it).
  top = [
    e.params['length'] for e in jax.make_jaxpr(fn)(state, batch()).eqns if 'length' in e.params
  ]
  assert top == ([4] if micro_rows == 2 else [CFG.num_layers])
  parts = jax.jit(fn)(state, batch())
  for k in whole:
    np.testing.assert_allclose(parts[k], whole[k], rtol=1e-5)


def test_gradient_accumulation_sums_bfloat16_gradients_in_float32():
  lora = dataclasses.replace(CFG.lora, param_dtype='bfloat16')  # (float32 by default)
  cfg = dataclasses.replace(CFG, lora=lora).with_engine(param_dtype='bfloat16')
  state = init_state(cfg, optax.sgd(1.0), 0)
  sc = StepConfig(model=cfg, grad_accum_steps=4)
  fn = lambda s, b, r: grads_and_stats(s, graphdef_of(cfg), b, r, sc)
  jaxpr = jax.make_jaxpr(fn)(state, batch(), jax.random.key(0))
  (scan,) = [e for e in jaxpr.eqns if e.primitive.name == 'scan']
  # The carry: the outputs shaped as the body's (a stacked output has the extra scan dim).
  body = scan.params['jaxpr'].out_avals
  carry = [v.aval for v, b in zip(scan.outvars, body) if v.aval.shape == b.shape]
  assert carry and not any(a.dtype == jnp.bfloat16 for a in carry)
  _, _, grads = jax.eval_shape(fn, state, batch(), jax.random.key(0))
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}


def _eqns(jaxpr):
  """Every equation of `jaxpr`, those of its inner jaxprs (scan bodies, remat, jit) included."""
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      inner = getattr(v, 'jaxpr', v)
      if hasattr(inner, 'eqns'):
        yield from _eqns(inner)


def test_full_training_stacks_the_layers_weight_gradients_in_the_compute_dtype():
  """engine.cast_weights_once (float32 weights, bfloat16 compute, no LoRA): the backward layer
  loop stacks the routed experts' weight gradients in bfloat16, half the bytes, and the step
  still returns them in float32. The loss is the same; each gradient is its per-layer cast's
  within bfloat16 rounding."""
  base = tiny(num_layers=2, dtype='bfloat16', param_dtype='float32')
  got = {}
  for once in (False, True):
    cfg = base.with_engine(cast_weights_once=once)
    state = init_state(cfg, optax.sgd(1.0), 0)
    sc = StepConfig(model=cfg)
    fn = lambda s, b, r, sc=sc, cfg=cfg: grads_and_stats(s, graphdef_of(cfg), b, r, sc)
    jaxpr = jax.make_jaxpr(fn)(state, batch(), jax.random.key(0)).jaxpr
    up = state.params['layers']['moe']['experts']['up'][...].shape  # [L, E, D, F]
    stacked = {
      v.aval.dtype
      for e in _eqns(jaxpr)
      if e.primitive.name == 'scan'
      for v in e.outvars
      if v.aval.shape == up
    }
    assert stacked == {jnp.dtype(jnp.bfloat16 if once else jnp.float32)}, (once, stacked)
    loss, _, grads = jax.jit(fn)(state, batch(), jax.random.key(0))
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    got[once] = float(loss), jax.tree.map(np.asarray, grads)
  assert got[True][0] == got[False][0]
  for g, w in zip(jax.tree.leaves(got[True][1]), jax.tree.leaves(got[False][1])):
    assert np.max(np.abs(g - w)) <= 2**-7 * np.max(np.abs(w)) + 1e-12


def test_the_non_finite_guard_holds_no_second_state():
  """The skip is a select per element, fused into the update, not a branch between two whole
  states (which XLA:TPU kept alive together at the peak: a copy of the state)."""
  opt = optax.adam(1e-2)
  state = init_state(CFG, opt, 0)
  (call,) = jax.make_jaxpr(step_fn(CFG, 1, opt))(state, batch()).eqns
  step = call.params['jaxpr'].jaxpr
  assert 'cond' not in {e.primitive.name for e in step.eqns}


def test_non_finite_update_is_skipped_and_counted():
  opt = optax.adam(1e-2)
  state = init_state(CFG, opt, 0)
  bad = poisoned(state)
  new, m = step_fn(CFG, 1, opt, balance_loss=1e-2)(bad, batch())
  assert int(new.skipped) == 1 and int(new.step) == 1
  for a, c in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(bad.opt_state)):
    np.testing.assert_array_equal(a, c)


def test_logged_learning_rate_is_the_one_applied_after_a_skip():
  """A skipped step applies no update, so the optimizer's schedule does not advance: the rate
  logged for the next step is the one its update uses (the schedule at the applied count)."""
  lr_fn = optax.linear_schedule(0.0, 1.0, 10)
  opt = optax.sgd(lr_fn)
  fn = step_fn(CFG, 1, opt, lr_fn=lr_fn)
  state, m1 = fn(init_state(CFG, opt, 0), batch())
  skipped, _, m3 = skip_then_step(fn, state)
  count = int(optax.tree.get(skipped.opt_state, 'count'))
  assert (int(skipped.step), int(skipped.skipped), count) == (2, 1, 1)
  np.testing.assert_allclose([m1['learning_rate'], m3['learning_rate']], [0.0, lr_fn(count)])


@pytest.mark.parametrize('quant', ['none', 'int4'])  # a QLoRA base: the same parameters
def test_flash_dry_run_parameter_counts(quant):
  counts = param_counts(LONGCAT_PRESETS['flash'].with_engine(quant=quant))
  assert round(counts['total'] / 1e9, 2) == 560.66
  assert [round(counts['active'][k] / 1e9, 2) for k in (0, 8, 12)] == [18.69, 27.15, 31.38]


def test_dry_run_reports_expert_parallel_receive_buffers():
  """Per MoE layer and shard: 4096 tokens x top-12 local assignments; dropless buffers are ep
  times that; moe_ep_recv_factor bounds the ragged one."""
  cfg = LONGCAT_PRESETS['flash']
  mesh = (1, 2, 4, 1)  # 8 shards of a 16 x 2048-token batch
  ex = ep_exchange(cfg, mesh, 2048, 16)
  assert ex['fixed']['local_rows'] == ex['ragged']['local_rows'] == 4096 * 12
  assert ex['fixed']['recv_rows'] == ex['ragged']['recv_rows'] == 4 * 4096 * 12
  assert ex['ragged']['recv_bytes'] == 4 * 4096 * 12 * cfg.hidden_size * 2  # bfloat16
  bounded = ep_exchange(cfg.with_engine(moe_ep_recv_factor=1.5), mesh, 2048, 16)
  assert bounded['ragged']['recv_rows'] == 1.5 * 4096 * 12
  assert ep_exchange(cfg, (8, 1, 1, 1), 2048, 16) == {}


def test_dry_run_reports_the_loss_block_per_device():
  """16 x 8192 tokens, LongCat's vocabulary: batch over data x fsdp x expert (8), vocab over
  tensor (2) with fsdp_ep_tp; blocks of 256 positions instead of the whole 8192."""
  cfg = LONGCAT_PRESETS['flash'].with_engine(rules=Rules.preset('fsdp_ep_tp'), loss_chunk=256)
  lb = loss_block(cfg, (1, 2, 4, 2), 8192, 16)
  assert lb['block_shape'] == (2, 256, 131072 // 2)
  assert lb['block_bytes'] == 2 * 256 * 65536 * 4
  assert lb['whole_bytes'] == lb['block_bytes'] * 32
  whole = loss_block(cfg.with_engine(loss_chunk=0), (1, 2, 4, 2), 8192, 16)
  assert whole['block_shape'] == (2, 8192, 65536) and whole['block_bytes'] == lb['whole_bytes']


def test_dry_run_sizes_buffers_for_a_micro_batch():
  """Under gradient accumulation a forward pass sees global_batch_size / grad_accum_steps rows:
  the exchange and loss-block reports are for that micro-batch, not the whole batch."""
  from configs import longcat_lora

  c = longcat_lora.get_config('variant=tiny')
  c.mesh.shape, c.data.global_batch_size = (1, 2, 4, 1), 32
  reports = {}
  for n in (1, 4):
    c.optim.grad_accum_steps = n
    reports[n] = dry_run(c)
  rows = lambda r: r['ep_exchange']['ragged']['local_rows']
  assert rows(reports[4]) * 4 == rows(reports[1]) > 0
  assert (
    reports[4]['loss_block']['block_shape'][0] * 4 == reports[1]['loss_block']['block_shape'][0]
  )


def test_hidden_z_loss_counts_prompts_but_not_padding():
  """LongCat's hidden z-loss averages over every token the model reads: masking prompt tokens
  out of the cross entropy leaves it unchanged; padding (segment 0) is left out of it."""
  opt = optax.sgd(1.0)
  state, fn = init_state(CFG, opt, 0), step_fn(CFG, 1, opt)  # one compilation for all four
  run = lambda b: float(fn(state, b)[1]['hidden_z_loss'])
  full = batch()
  prompts = batch()
  prompts['loss_mask'][:, :5] = 0
  padded = batch()
  padded['segment_ids'][:, -4:] = 0
  padded['loss_mask'][:, -4:] = 0
  assert run(full) > 0
  np.testing.assert_allclose(run(prompts), run(full), rtol=1e-6)
  assert abs(run(padded) - run(full)) > 1e-6 * run(full)


def test_bias_decay_schedule_counts_applied_updates():
  """A skipped step moves neither the biases nor their decay schedule: the first applied update
  after it uses the full rate, as the first update of a run does."""
  opt = optax.sgd(1e-2)
  step_cfg = StepConfig(model=CFG, bias_update_rate=1e-2, bias_update_decay_steps=2)
  fn = jit_train_step(step_cfg, opt, lambda s: 1e-2, donate=False)
  state = init_state(CFG, opt, 0)
  first, _ = fn(state, batch())
  _, after, _ = skip_then_step(fn, state)
  for a, b, c in zip(*(jax.tree.leaves(s.moe_bias) for s in (first, after, state))):
    assert np.abs(a - c).max() > 0
    np.testing.assert_allclose(b - c, a - c, rtol=1e-5, atol=1e-9)


def test_weight_decay_spares_norms_of_stacked_layers():
  """scan_layers stacks every layer variable on a leading 'layers' axis: a norm scale is then
  [L, D] but still a scale, not a matrix."""
  from flax import nnx

  from moetrain.training import optim

  cfg = tiny(scan_layers=True)
  mask = optim.decay_mask(init_state(cfg, optax.sgd(0.1), 0).params)
  flat = {'.'.join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(mask)}
  assert flat['layers.input_norm_0.scale'] is False and flat['final_norm.scale'] is False
  assert flat['layers.attn_0.q_a.kernel'] is True and flat['layers.moe.experts.up'] is True
  assert flat['embed.embedding'] is True
  # optim.weight_decay_exclude spares parameters by path, as the config's comment names them.
  mask = optim.decay_mask(init_state(cfg, optax.sgd(0.1), 0).params, r'embed|router|experts\.up')
  flat = {'.'.join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(mask)}
  assert not flat['embed.embedding'] and not flat['layers.moe.router']
  assert not flat['layers.moe.experts.up'] and flat['layers.moe.experts.down']
  assert flat['layers.attn_0.q_a.kernel'] and not flat['final_norm.scale']


def test_float16_trains_with_a_dynamic_loss_scale():
  """float16 gradients underflow without a loss scale: the step scales the loss for the
  backward pass and unscales the gradients; an overflow skips the step and halves the scale; a
  run of finite steps doubles it."""
  from moetrain.training import train_state, train_step

  opt = optax.sgd(1e-2)
  f16, f32 = (CFG.with_engine(dtype=d) for d in ('float16', 'float32'))
  want, _ = step_fn(f32, 1, opt)(init_state(f32, opt, 0), batch())
  state = init_state(f16, opt, 0)
  assert init_state(f32, opt, 0).loss_scale is None and 'loss_scale' not in want.saved()
  np.testing.assert_array_equal(state.loss_scale, [train_state.LOSS_SCALE_INIT, 0])
  fn = step_fn(f16, 1, opt)
  new, m = fn(state, batch())
  assert float(m['loss_scale']) == train_state.LOSS_SCALE_INIT and int(new.skipped) == 0
  np.testing.assert_array_equal(new.loss_scale, [train_state.LOSS_SCALE_INIT, 1])
  for a, c in zip(jax.tree.leaves(new.params), jax.tree.leaves(want.params)):
    np.testing.assert_allclose(a, c, atol=2e-4)  # the unscaled update, to float16 precision
  bad = poisoned(state, jnp.inf)
  over, _ = fn(bad, batch())
  assert int(over.skipped) == 1
  np.testing.assert_array_equal(over.loss_scale, [train_state.LOSS_SCALE_INIT / 2, 0])
  state.loss_scale = jnp.asarray([4.0, train_step.LOSS_SCALE_PERIOD - 1])
  grown, _ = fn(state, batch())
  np.testing.assert_array_equal(grown.loss_scale, [8.0, 0.0])


@pytest.mark.slow  # ~11 s; float16 training stays in the default suite
def test_float16_loss_scale_keeps_bfloat16_parameters_and_state():
  """Unscaling the float16 gradients by the float32 loss scale promoted bfloat16 ones
  (param_dtype bfloat16) to float32: the updated optimizer state no longer matched the skip
  branch's, and the step failed to trace."""
  opt = optax.adam(1e-2)
  cfg = CFG.with_engine(dtype='float16', param_dtype='bfloat16')
  state = init_state(cfg, opt, 0)
  new, m = step_fn(cfg, 1, opt)(state, batch())
  assert int(new.skipped) == 0 and np.isfinite(float(m['loss']))
  before = jax.tree.leaves((state.params, state.opt_state))
  after = jax.tree.leaves((new.params, new.opt_state))
  assert [x.dtype for x in after] == [x.dtype for x in before]

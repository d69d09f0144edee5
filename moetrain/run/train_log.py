"""The training loop's progress records: a line on stdout, a metrics.jsonl record and TensorBoard
scalars per log point, each summing up the steps since the previous one."""

import functools
import math

import jax
import jax.numpy as jnp

from moetrain.core import multihost, runtime
from moetrain.run import metrics as metrics_lib


class TrainLog:
  """Progress records, each summing up the steps since the previous one (a metrics.Window),
  marked at its step's dispatch and reported one step later, after the next step is dispatched,
  so that logging never stalls the host. Fetching the step's metrics waits for the step:
  tokens/s and the ETA are timed then, at its completion. The non-finite streak is fetched with
  them, and NonFiniteStreak raised once it reaches `max_nonfinite` (0: never)."""

  def __init__(self, report, meter, window, max_nonfinite: int = 0):
    self.report, self.meter, self.window = report, meter, window
    self.streak, self.max_nonfinite = Streak(), max_nonfinite
    self.pending, self.last = None, {}

  @classmethod
  def create(cls, setup, meter, writer) -> 'TrainLog':
    """The records of a run of `setup` (log_train), with routing stats per expert shard."""
    # Without engine.moe_expert_parallel the experts are not split by shard (nor are the
    # balance-loss groups), so there is no shard imbalance to show.
    expert_shards = setup.model.engine.expert_shards
    report = functools.partial(
      log_train,
      cfg=setup.model,
      expert_shards=expert_shards,
      seq_len=setup.data.seq_len,
      writer=writer,
      hosts=multihost.Exchange('truncated_examples'),
    )
    window = metrics_lib.Window(setup.model.n_routed_experts, expert_shards)
    return cls(report, meter, window, setup.train.max_nonfinite_steps)

  def add(self, m) -> None:
    self.window.add(m)
    self.streak.add(m)

  def mark(self, step: int, truncated: int) -> None:
    self.flush()  # one record pending at a time
    done = _ready(self.window.last)
    steps = self.window.steps
    record, tokens = self.window.take(), self.meter.take_tokens()
    # A step that has already finished (a backend that runs steps as they are dispatched, such
    # as several CPU devices) is timed now: later, the next step's time would be in its window.
    timed = self.meter.mark(step, tokens) if done else None
    self.pending = (step, record, tokens, truncated, timed, self.streak.take(), steps)

  def flush(self) -> None:
    if self.pending is not None:
      step, m, tokens, truncated, timed, streak, steps = self.pending
      m, (_, longest) = jax.device_get((m, streak))
      timed = timed or self.meter.mark(step, tokens)
      self.last = self.report(step, m, *timed, truncated, window_steps=steps)
      self.pending = None
      self._check(step, int(longest))

  def nonfinite_streak(self, step: int) -> int:
    """The skipped steps in a row up to `step`, the latest dispatched (this waits for it: call
    it where the loop waits anyway)."""
    if self.streak.counts is None:  # no step yet
      return 0
    current, longest = map(int, jax.device_get(self.streak.counts))
    self._check(step, longest)
    return current

  def _check(self, step: int, longest: int) -> None:
    if self.max_nonfinite and longest >= self.max_nonfinite:
      raise NonFiniteStreak(
        f'{longest} steps in a row up to step {step} had a non-finite loss or gradient norm and '
        f'were skipped (train.max_nonfinite_steps={self.max_nonfinite}): stopping. Checkpoints '
        'are saved only after a finite step, so the newest one precedes the streak; lower '
        'optim.learning_rate (or check the data) and rerun to resume from it, or set '
        'train.max_nonfinite_steps=0 never to stop.'
      )


class NonFiniteStreak(runtime.UserError):
  """train.max_nonfinite_steps steps in a row were skipped: the run cannot recover by itself."""


class Streak:
  """Steps in a row whose update was skipped (a non-finite loss or gradient norm, as the train
  step decides), counted on the device as the steps are dispatched: (current, the longest since
  the last `take`), two device scalars."""

  def __init__(self):
    self.counts, self._fns = None, None

  def add(self, m) -> None:
    if self._fns is None:  # both compiled at the first step, whose time is kept apart
      first = jax.jit(_streak_first).lower(m).compile()
      counts = jax.eval_shape(_streak_first, m)
      self._fns = (first, jax.jit(_streak_next).lower(counts, m).compile())
    first, next_ = self._fns
    self.counts = first(m) if self.counts is None else next_(self.counts, m)

  def take(self):
    """The counts as of the latest step; the longest starts over from the current streak."""
    counts = self.counts
    if counts is None:  # no step yet
      return 0, 0
    self.counts = (counts[0], counts[0])
    return counts


def _skipped(m) -> jax.Array:
  return (~metrics_lib.finite_step(m)).astype(jnp.int32)


def _streak_first(m):
  return _skipped(m), _skipped(m)


def _streak_next(counts, m):
  current = jnp.where(_skipped(m) > 0, counts[0] + 1, 0)
  return current, jnp.maximum(counts[1], current)


def log_train(
  step,
  m,
  tokens_per_sec,
  eta,
  truncated,
  *,
  cfg,
  expert_shards,
  seq_len,
  writer,
  hosts,
  window_steps=None,
) -> dict:
  """window_steps: the steps the record's means are over (fewer than train.log_every in the
  first window after a resume from a step between log points, and at a stop)."""
  scalars = {k: float(v) for k, v in m.items() if k != 'moe'}
  if window_steps is not None:
    scalars['window_steps'] = window_steps
  scalars.update(metrics_lib.routing_summary(m['moe'], cfg, expert_shards))
  scalars['tokens_per_sec'] = tokens_per_sec
  # Examples longer than seq_len + 1 tokens lose their tail (a completion may lose its loss).
  scalars['data/truncated_examples'] = hosts.sum(truncated, step)
  peak = metrics_lib.peak_flops(jax.devices()[0])
  if peak:
    flops = metrics_lib.flops_per_token(cfg, seq_len, scalars['moe/ffn_experts_mean'])
    scalars['mfu'] = tokens_per_sec * flops / (peak * jax.device_count())
  writer.write(step, scalars, load=m['moe']['load'])
  writer.progress(
    f'step {step}  loss {scalars["loss"]:.4f}  lr {scalars["learning_rate"]:.2e}  '
    f'grad_norm {scalars["grad_norm"]:.3f}  tok/s {_count(tokens_per_sec)}  '
    f'ffn_experts {scalars["moe/ffn_experts_mean"]:.2f}  eta {metrics_lib.format_eta(eta)}'
    + (f'  skipped {scalars["skipped"]:,.0f} (non-finite)' if scalars['skipped'] else '')
    + (f'  loss_scale {scalars["loss_scale"]:g}' if 'loss_scale' in scalars else '')
    + (
      f'  reward {scalars["rl/reward_mean"]:.3f}  sampler_kl {scalars["rl/sampler_kl_k3"]:.2e}'
      + (
        f'  flips {scalars["rl/router_flip_rate"]:.3f}' if 'rl/router_flip_rate' in scalars else ''
      )
      if 'rl/reward_mean' in scalars
      else ''
    )
    + (
      f'  truncated {scalars["data/truncated_examples"]:,.0f} (longer than data.seq_len + 1)'
      if scalars['data/truncated_examples']
      else ''
    )
  )
  return scalars


def _ready(tree) -> bool:
  """Whether a step's metrics (device arrays) are computed already."""
  leaves = jax.tree.leaves(tree)
  return bool(leaves) and all(getattr(x, 'is_ready', lambda: False)() for x in leaves)


def _count(x: float) -> str:
  return '-' if math.isnan(x) else f'{x:,.0f}'  # '-': no timed step yet (the first compiles)

"""The training loop's progress records: a line on stdout, a metrics.jsonl record and TensorBoard
scalars per log point, each summing up the steps since the previous one."""

import functools
import math

import jax

from moetrain import metrics as metrics_lib
from moetrain import multihost


class TrainLog:
  """Progress records, each summing up the steps since the previous one (a metrics.Window),
  marked at its step's dispatch and reported one step later, after the next step is dispatched,
  so that logging never stalls the host. Fetching the step's metrics waits for the step:
  tokens/s and the ETA are timed then, at its completion."""

  def __init__(self, report, meter, window):
    self.report, self.meter, self.window = report, meter, window
    self.pending, self.last = None, {}

  @classmethod
  def create(cls, setup, meter, writer, mesh) -> 'TrainLog':
    """The records of a run of `setup` (log_train), with routing stats per expert shard of `mesh`."""
    # As expert_parallel.expert_shards: without model.moe_expert_parallel the experts are not
    # split by shard (nor are the balance-loss groups), so there is no shard imbalance to show.
    expert_shards = dict(mesh.shape)['expert'] if setup.model.moe_expert_parallel else 1
    report = functools.partial(
      log_train,
      cfg=setup.model,
      expert_shards=expert_shards,
      seq_len=setup.data.seq_len,
      writer=writer,
      hosts=multihost.Exchange('truncated_examples'),
    )
    window = metrics_lib.Window(setup.model.n_routed_experts, expert_shards)
    return cls(report, meter, window)

  def add(self, m) -> None:
    self.window.add(m)

  def mark(self, step: int, truncated: int) -> None:
    self.flush()  # one record pending at a time
    done = _ready(self.window.last)
    record, tokens = self.window.take(), self.meter.take_tokens()
    # A step that has already finished (a backend that runs steps as they are dispatched, such
    # as several CPU devices) is timed now: later, the next step's time would be in its window.
    timed = self.meter.mark(step, tokens) if done else None
    self.pending = (step, record, tokens, truncated, timed)

  def flush(self) -> None:
    if self.pending is not None:
      step, m, tokens, truncated, timed = self.pending
      m = jax.device_get(m)
      self.last = self.report(step, m, *(timed or self.meter.mark(step, tokens)), truncated)
      self.pending = None


def log_train(
  step, m, tokens_per_sec, eta, truncated, *, cfg, expert_shards, seq_len, writer, hosts
) -> dict:
  scalars = {k: float(v) for k, v in m.items() if k != 'moe'}
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

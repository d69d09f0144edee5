"""Evaluation over a list of host-local batches: the loop's and the evaluate tool's."""

import jax
import numpy as np

from moetrain.core.sharding import batch_sharding
from moetrain.training import preference


def to_global(batch: dict, sharding) -> dict:
  """A host-local batch as global arrays (each host holds its rows of the batch sharding); an
  array that is global already stays as it is."""

  def place(v):
    if isinstance(v, jax.Array):
      return v
    s = sharding if v.ndim == len(sharding.spec) else batch_sharding(sharding.mesh, v.ndim)
    return jax.make_array_from_process_local_data(s, v)

  return {k: place(v) for k, v in batch.items()}


def evaluate(state, batches, eval_fn, batch_sharding) -> dict:
  """Loss, perplexity and accuracy over every scored token of `batches`."""
  totals = {'nll_sum': 0.0, 'correct': 0.0, 'tokens': 0.0}
  outs = [eval_fn(state, to_global(b, batch_sharding)) for b in batches]
  for out in jax.device_get(outs):
    for k in out:
      totals[k] = totals.get(k, 0.0) + float(out[k])
  if totals['tokens'] == 0:
    raise ValueError(
      'the eval batches hold no scored tokens: every example was cut before its completion '
      '(raise data.seq_len) or the eval split is empty'
    )
  n = totals['tokens']
  loss = totals['nll_sum'] / n
  out = {
    'loss': loss,
    'perplexity': float(np.exp(min(loss, 50.0))),
    'accuracy': totals['correct'] / n,
    'tokens': totals['tokens'],
  }
  if 'margin' in totals:  # preference tuning's sums (the loss above: of the chosen completions)
    out |= {k: float(v) for k, v in preference.metrics(totals).items()}
  return out

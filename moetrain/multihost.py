"""Agreement between the processes (hosts) of one job. All of these are collective: every process
must call them, in the same order. With one process they return at once."""

import json

import jax
import numpy as np
from jax.experimental import multihost_utils

# How long a host waits for the others at a host-side agreement: they are in lockstep through
# the step's collectives anyway, so a long wait means a host died (or is still compiling).
AGREE_TIMEOUT_MS = 60 * 60 * 1000


def gather_json(obj) -> list:
  """[obj of process 0, obj of process 1, ...] on every process (a device all-gather)."""
  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(
    json.dumps({'process': jax.process_index(), 'value': obj}).encode(), np.uint8
  )
  sizes = multihost_utils.process_allgather(np.array([data.size], np.int32))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[: data.size] = data
  rows = multihost_utils.process_allgather(padded)
  entries = [json.loads(bytes(row[:n]).decode()) for row, n in zip(rows, sizes.ravel())]
  return [e['value'] for e in sorted(entries, key=lambda e: e['process'])]


def hosts_sum(value: int) -> int:
  """The sum of a host-local count over all processes (a device all-gather)."""
  if jax.process_count() == 1:
    return value
  return int(multihost_utils.process_allgather(np.array([value], np.int64)).sum())


class AnyHost:
  """`any(flag over hosts)` through the coordination service's key-value store: host network
  only, so it does not wait for the device queue to drain as a device all-gather would (which
  would idle the accelerator once per call in a training loop). Call `__call__` with increasing
  `round` numbers on every process."""

  def __init__(self, name: str):
    self.name = name

  def __call__(self, flag: bool, round_: int) -> bool:
    if jax.process_count() == 1:
      return flag
    from orbax.checkpoint import multihost as ocp_multihost

    client = ocp_multihost.get_jax_distributed_client()
    key = lambda r, p: f'moetrain/{self.name}/{r}/{p}'
    client.key_value_set(key(round_, jax.process_index()), '1' if flag else '0')
    seen = [
      client.blocking_key_value_get(key(round_, p), AGREE_TIMEOUT_MS)
      for p in range(jax.process_count())
    ]
    # Every host has read round - 2's keys before setting round - 1's, which this host has read.
    if round_ >= 2:
      client.key_value_delete(key(round_ - 2, jax.process_index()))
    return '1' in seen

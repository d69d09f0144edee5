"""Agreement between the processes (hosts) of one job, through the coordination service's
key-value store that jax.distributed.initialize starts: host network only. A device all-gather
would instead wait for the device queue to drain, idling the accelerator once per call in a
training loop. Every process must make the same calls in the same order; with one process they
return at once."""

import json

import jax

# How long a host waits for the others: they are in lockstep through the step's collectives
# anyway, so a long wait means a host died (or is still compiling).
TIMEOUT_MS = 60 * 60 * 1000


class Exchange:
  """exchange(value, round) -> every process's string value of that round, in process order.
  Rounds must increase from call to call (e.g. the step number)."""

  def __init__(self, name: str):
    self.name = name
    self._previous = None

  def _key(self, round_: int, process: int) -> str:
    return f'moetrain/{self.name}/{round_}/{process}'

  def __call__(self, value: str, round_: int) -> list[str]:
    if jax.process_count() == 1:
      return [value]
    from orbax.checkpoint import multihost as ocp_multihost

    client = ocp_multihost.get_jax_distributed_client()
    me = jax.process_index()
    client.key_value_set(self._key(round_, me), value)
    values = [
      client.blocking_key_value_get(self._key(round_, p), TIMEOUT_MS)
      for p in range(jax.process_count())
    ]
    # Each host set this round's key after reading all of the previous round's, so this host's
    # previous key has been read everywhere.
    if self._previous is not None:
      client.key_value_delete(self._key(self._previous, me))
    self._previous = round_
    return values

  def json(self, obj, round_: int) -> list:
    """Every process's JSON-serialisable `obj`, in process order."""
    return [json.loads(v) for v in self(json.dumps(obj), round_)]

  def sum(self, count: int, round_: int) -> int:
    return sum(int(v) for v in self(str(int(count)), round_))

  def any(self, flag: bool, round_: int) -> bool:
    return '1' in self('1' if flag else '0', round_)

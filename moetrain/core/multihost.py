"""Agreement between the processes (hosts) of one job, through the coordination service's
key-value store that jax.distributed.initialize starts: host network only. A device all-gather
would instead wait for the device queue to drain, idling the accelerator once per call in a
training loop. Every process must make the same calls in the same order; with one process they
return at once. Also the peer watch: a process that dies stops the others, naming it."""

import atexit
import json
import os
import sys
import threading
import time

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

    from orbax.checkpoint import multihost as ocp_multihost  # (orbax: slow to import)

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


# Peers that die: JAX's own coordination service notices a process that stopped sending
# heartbeats only after jax.distributed.initialize's heartbeat_timeout_seconds (100), and then
# aborts the others from C++ ("Fatal Python error: Aborted", no word of which process); one that
# dies before joining leaves the others inside initialize for its initialization_timeout (300 s)
# before the same abort. So each process also beats in the key-value store, and a watcher thread
# ends the process with one `Error:` line naming a peer that has been silent for PEER_TIMEOUT
# seconds (runtime.initialize_distributed; --peer_timeout).
BEAT = 5.0
PEER_TIMEOUT = 45.0


def _say_and_exit(message: str) -> None:
  """Ends this process from any thread: the main thread may be blocked in a collective."""

  sys.stdout.flush()
  print(
    f'Error: {message}; this process stops too. Rerun the job to resume from its last checkpoint.',
    file=sys.stderr,
    flush=True,
  )
  os._exit(1)


class _Watch:
  def __init__(self, timeout: float):

    from orbax.checkpoint import multihost as ocp_multihost  # (orbax: slow to import)

    self.client = ocp_multihost.get_jax_distributed_client()
    self.me, self.count, self.timeout = jax.process_index(), jax.process_count(), timeout
    self.stopped = threading.Event()
    self.thread = threading.Thread(target=self._run, name='moetrain-peer-watch', daemon=True)

  def _key(self, process: int) -> str:
    return f'moetrain/alive/{process}'

  def _read(self, process: int) -> str | None:
    try:
      return self.client.key_value_try_get(self._key(process))
    except Exception as e:  # (jaxlib's XlaRuntimeError)
      if 'NOT_FOUND' in str(e):
        return None
      raise

  def _run(self) -> None:
    now = time.monotonic()
    seen = {p: (None, now) for p in range(self.count) if p != self.me}
    unreachable_since, beat = None, 0
    while not self.stopped.wait(BEAT):
      beat, now = beat + 1, time.monotonic()
      try:
        self.client.key_value_set(self._key(self.me), str(beat), allow_overwrite=True)
        values = {p: self._read(p) for p in seen}
        unreachable_since = None
      except Exception as e:
        unreachable_since = unreachable_since or now
        if now - unreachable_since > self.timeout and not self.stopped.is_set():
          _say_and_exit(
            f"the job's coordinator (process 0 of {self.count}) has been unreachable for "
            f'{self.timeout:.0f} s ({str(e).splitlines()[0][:200]})'
          )
        continue
      for p, value in values.items():
        if value == 'done':
          del seen[p]
        elif value != seen[p][0]:
          seen[p] = (value, now)
        elif now - seen[p][1] > self.timeout and not self.stopped.is_set():
          _say_and_exit(
            f'process {p} of {self.count} stopped responding (no heartbeat for '
            f'{self.timeout:.0f} s: it died, or its host did)'
          )

  def stop(self, done: bool) -> None:
    """Stops beating and watching; `done`: tells the others this process finished (it is no
    longer waited for), else they take it for dead once its beats are old."""
    if self.stopped.is_set():
      return
    self.stopped.set()
    try:
      if done:
        self.client.key_value_set(self._key(self.me), 'done', allow_overwrite=True)
    except Exception:  # (the coordinator is gone: nothing to tell)
      pass


_WATCH: list[_Watch] = []


def watch_peers(timeout: float = PEER_TIMEOUT) -> None:
  """Starts watching the job's other processes (after jax.distributed.initialize). A process
  that finishes says so at exit; one that fails stops beating (`stop_watching(False)`)."""
  if jax.process_count() == 1 or _WATCH:
    return

  _WATCH.append(_Watch(timeout))
  _WATCH[0].thread.start()
  atexit.register(stop_watching, True)  # (before JAX's own shutdown, registered earlier)


def stop_watching(done: bool = True) -> None:
  if _WATCH:
    _WATCH[0].stop(done)


def watching() -> bool:
  return bool(_WATCH) and not _WATCH[0].stopped.is_set()


def await_dead_peer() -> None:
  """Waits long enough for the watch to find a peer that died (it then ends the process naming
  it); returns when none did."""
  if watching():
    _WATCH[0].thread.join(_WATCH[0].timeout + 2 * BEAT)


def join_deadline(timeout: float, where: str) -> threading.Timer:
  """A timer (started; cancel it once joined) that ends the process with one line when the job's
  processes have not all joined within `timeout` seconds: one of them died at start-up, or has
  not started."""
  timer = threading.Timer(
    timeout,
    _say_and_exit,
    [
      f'not every process of the job joined within {timeout:.0f} s ({where}): one died at '
      'start-up or has not started (--peer_timeout gives them longer)'
    ],
  )
  timer.daemon = True
  timer.start()
  return timer

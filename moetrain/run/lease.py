"""One run per directory: a lease file in the run directory, held by the training job.
(Design: docs/design.md, "moetrain/run/lease.py".)"""

import datetime
import json
import os
import socket
import threading
import time

from moetrain.core import runtime, storage

LEASE = 'lease.json'
HEARTBEAT = 30.0  # seconds between renewals
STALE = 300.0  # a heartbeat older than this frees the lease (holders on other hosts)


class LeaseHeld(runtime.UserError):
  """The run directory is in use by another run; the message names it."""


def pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  return True


def _read(path: str) -> dict | None:
  try:
    return json.loads(storage.read_text(path))
  except FileNotFoundError:
    return None
  except ValueError:  # half-written by a holder killed while creating it: its mtime tells
    return {'host': '?', 'pid': -1, 'start': 0, 'heartbeat': storage.getmtime(path)}


def _describe(holder: dict) -> str:
  start = datetime.datetime.fromtimestamp(holder.get('start', 0)).isoformat(' ', 'seconds')
  return f'process {holder.get("pid")} on host {holder.get("host")!r}, started {start}'


def stale(holder: dict, now: float | None = None) -> bool:
  now = time.time() if now is None else now
  if holder.get('host') == socket.gethostname() and holder.get('pid', -1) > 0:
    return not pid_alive(holder['pid'])
  return now - holder.get('heartbeat', 0) > STALE


class Lease:
  """Held from acquire() to release(); a daemon thread renews the heartbeat meanwhile."""

  def __init__(self, run_dir: str):
    self.path = storage.join(run_dir, LEASE)
    self.me = {'host': socket.gethostname(), 'pid': os.getpid(), 'start': time.time()}
    self._stop = threading.Event()
    self._thread = None

  def acquire(self) -> 'Lease':
    storage.makedirs(storage.dirname(self.path))
    for _ in range(3):
      if self._create():
        self._thread = threading.Thread(target=self._renew, daemon=True, name='run-lease')
        self._thread.start()
        return self
      holder = _read(self.path)
      if holder is None:  # released meanwhile
        continue
      if holder.get('host') == self.me['host'] and holder.get('pid') == self.me['pid']:
        return self  # this process holds it already (train.run called twice)
      if not stale(holder):
        raise LeaseHeld(
          f'{storage.dirname(self.path)} is in use by another run ({_describe(holder)}; '
          f'{self.path}). Wait for it to finish, stop it, or give this run its own --workdir. '
          f'If that run is dead on another host, its lease frees itself {STALE:.0f} s after '
          'its last heartbeat.'
        )
      self._clear_stale(holder)
    raise LeaseHeld(f'could not take the lease {self.path}: other runs keep taking it')

  def _clear_stale(self, holder: dict) -> None:
    """Moves the stale lease `holder` aside, so that one taker's create wins. Another taker may
    have replaced it since it was read: a lease moved aside that is not `holder` goes back."""
    aside = f'{self.path}.stale.{os.getpid()}'
    try:
      storage.move(self.path, aside)
    except FileNotFoundError:
      return
    taken = _read(aside)
    if taken is not None and taken != holder:  # a new holder's: put it back (unless a third
      storage.create_exclusive(self.path, json.dumps(taken))  # taker has created one since)
    storage.remove(aside)

  def _create(self) -> bool:
    return storage.create_exclusive(self.path, json.dumps(self.me | {'heartbeat': time.time()}))

  def _renew(self) -> None:
    while not self._stop.wait(HEARTBEAT):
      holder = _read(self.path)
      if holder is None:  # moved aside for a moment by a taker of an older lease (_clear_stale)
        continue
      if holder.get('pid') != self.me['pid'] or holder.get('host') != self.me['host']:
        return  # taken over (we were presumed dead): never write over the new holder's lease
      storage.write_atomic(self.path, json.dumps(self.me | {'heartbeat': time.time()}))

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
      holder = _read(self.path)
      if holder and holder.get('pid') == self.me['pid'] and holder.get('host') == self.me['host']:
        storage.remove(self.path)

  def __enter__(self) -> 'Lease':
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()

"""The run directory's lease (moetrain/run/lease.py): held, refused, released, taken over when stale."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from moetrain.run import lease


def write(path, **holder):
  with open(path, 'w') as f:
    json.dump(
      {'host': socket.gethostname(), 'pid': os.getpid(), 'start': 0, 'heartbeat': 0} | holder, f
    )


def test_a_held_lease_is_refused_naming_its_holder_and_released(tmp_path):
  held = lease.Lease(str(tmp_path)).acquire()
  path = tmp_path / lease.LEASE
  assert json.loads(path.read_text())['pid'] == os.getpid()
  # Another live process of this host holds it: refused, naming it.
  other = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
  try:
    held.release()
    assert not path.exists()
    write(path, pid=other.pid, start=time.time(), heartbeat=time.time())
    with pytest.raises(lease.LeaseHeld, match=f'in use by another run \\(process {other.pid} on'):
      lease.Lease(str(tmp_path)).acquire()
  finally:
    other.kill()
    other.wait()
  # Its process dead: the lease is stale and taken over.
  mine = lease.Lease(str(tmp_path)).acquire()
  assert json.loads(path.read_text())['pid'] == os.getpid()
  mine.release()


def test_a_lease_of_another_host_frees_itself_after_its_heartbeat(tmp_path):
  path = tmp_path / lease.LEASE
  write(path, host='elsewhere', pid=1, heartbeat=time.time())
  with pytest.raises(lease.LeaseHeld, match="host 'elsewhere'"):
    lease.Lease(str(tmp_path)).acquire()
  write(path, host='elsewhere', pid=1, heartbeat=time.time() - lease.STALE - 1)
  lease.Lease(str(tmp_path)).acquire().release()
  assert not path.exists()


def test_the_heartbeat_renews_and_never_writes_over_a_new_holder(tmp_path, monkeypatch):
  monkeypatch.setattr(lease, 'HEARTBEAT', 0.05)
  held = lease.Lease(str(tmp_path)).acquire()
  path = tmp_path / lease.LEASE
  first = json.loads(path.read_text())['heartbeat']
  time.sleep(0.3)
  assert json.loads(path.read_text())['heartbeat'] > first
  write(path, host='elsewhere', pid=7, heartbeat=time.time())  # taken over meanwhile
  time.sleep(0.3)
  held.release()
  assert json.loads(path.read_text())['host'] == 'elsewhere'  # neither renewed nor removed


def test_of_two_runs_taking_over_a_stale_lease_one_wins(tmp_path):
  path = tmp_path / lease.LEASE
  write(path, host='elsewhere', pid=1, heartbeat=0)
  code = (
    'import sys, time; from moetrain.run import lease\n'
    'try:\n'
    '  lease.Lease(sys.argv[1]).acquire(); print("won", flush=True); time.sleep(5)\n'
    'except lease.LeaseHeld:\n'
    '  print("refused", flush=True)\n'
  )
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root)
  procs = [
    subprocess.Popen([sys.executable, '-c', code, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    for _ in range(4)
  ]
  outs = sorted(p.communicate()[0].decode().strip() for p in procs)
  # The winner holds it (alive, 5 s) while the others try: exactly one takes it over.
  assert outs == ['refused', 'refused', 'refused', 'won']


def test_a_taker_that_read_an_older_stale_lease_puts_a_new_holders_back(tmp_path, monkeypatch):
  """Two runs find the same stale lease; the first takes it over. The second, acting on what it
  read before, moves the first's new lease aside: it must put it back and be refused."""
  path = tmp_path / lease.LEASE
  old = {'host': 'elsewhere', 'pid': 1, 'start': 0, 'heartbeat': 0}
  write(path, **old)
  first = lease.Lease(str(tmp_path)).acquire()  # took the stale lease over
  new = json.loads(path.read_text())
  second = lease.Lease(str(tmp_path))
  second.me = second.me | {'pid': second.me['pid'] + 100000}  # another process
  reads = iter([old])  # its first read: the lease as it was before the first run took it
  real = lease._read
  monkeypatch.setattr(lease, '_read', lambda p: next(reads, None) or real(p))
  with pytest.raises(lease.LeaseHeld, match='in use by another run'):
    second.acquire()
  assert json.loads(path.read_text()) == new
  first.release()
  assert not path.exists()

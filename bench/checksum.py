"""Checkpoint checksum cost (train.verify_checkpoints): MB/s of writing a manifest and of checking
one, for a checkpoint-like directory of random files, read from disk (cold) and from the page
cache (warm).

  python -m bench.checksum [--mb 1024] [--files 16] [--repeats 3] [--dir DIR]

A save computes the manifest in Orbax's background finalisation (process 0, every process's
files); a restore checks it before reading any array (each process a share of the files). Cold:
the files are dropped from the page cache first (posix_fadvise), as on a restore after a reboot.
"""

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import tempfile
import time

from moetrain.run import integrity


def make(directory: str, mb: int, files: int) -> int:
  d = os.path.join(directory, 'state', 'ocdbt.process_0', 'd')
  os.makedirs(d, exist_ok=True)
  size = (mb << 20) // files
  for i in range(files):
    path = os.path.join(d, f'{i:032x}')
    if not os.path.exists(path) or os.path.getsize(path) != size:
      with open(path, 'wb') as f:
        f.write(os.urandom(size))
  return size * files


def drop_cache(directory: str) -> None:
  for f in integrity.item_files(directory):
    fd = os.open(os.path.join(directory, f), os.O_RDONLY)
    os.fsync(fd)  # (dirty pages stay cached)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def timed(fn, directory: str, cold: bool, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    if cold:
      drop_cache(directory)
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--mb', type=int, default=1024)
  ap.add_argument('--files', type=int, default=16)
  ap.add_argument('--repeats', type=int, default=3)
  ap.add_argument('--dir', default='')
  args = ap.parse_args()
  directory = args.dir or os.path.join(tempfile.gettempdir(), 'moetrain_checksum_bench')
  total = make(directory, args.mb, args.files)
  record = {
    'bench': 'checksum',
    'date': datetime.date.today().isoformat(),
    'host': platform.processor() or platform.machine(),
    'cpus': os.cpu_count(),
    'mb': round(total / 1e6),
    'threads': integrity.THREADS,
  }
  for cold in (True, False):
    write = timed(
      functools.partial(integrity.write_manifest, directory), directory, cold, args.repeats
    )
    check = functools.partial(integrity.problems, directory, integrity.read_manifest(directory))
    check = timed(check, directory, cold, args.repeats)
    which = 'cold' if cold else 'warm'
    record[f'write_{which}_mb_per_s'] = round(total / 1e6 / write)
    record[f'check_{which}_mb_per_s'] = round(total / 1e6 / check)
  print(json.dumps(record), flush=True)


if __name__ == '__main__':
  main()

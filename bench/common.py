"""Shared timing helpers for the benchmarks (medians of repeated, blocked runs)."""

import datetime
import json
import os
import platform
import statistics
import time

import jax

from moetrain import runtime

# Every benchmark is an entry point: run it (and the transformers subprocess it may start, which
# inherits the environment) with huge-page malloc, as `python -m moetrain.main` does.
runtime.reexec_with_hugepages()


def time_fn(fn, *args, repeats: int = 5, warmup: int = 1) -> dict:
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return {'median_s': statistics.median(times), 'min_s': min(times), 'runs': len(times)}


def machine() -> dict:
  d = jax.devices()[0]
  return {
    'date': datetime.date.today().isoformat(),
    'device': getattr(d, 'device_kind', str(d)),
    'platform': d.platform,
    'devices': jax.device_count(),
    'host': platform.processor() or platform.machine(),
    'glibc_tunables': os.environ.get('GLIBC_TUNABLES', ''),
    'jax': jax.__version__,
  }


def emit(record: dict) -> None:
  print(json.dumps(record), flush=True)

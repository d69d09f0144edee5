"""Shared timing helpers for the benchmarks (medians of repeated, blocked runs)."""

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import jax

from moetrain.core import runtime

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


def matmul_probe() -> float:
  """The machine's current float32 matmul rate (GFLOP/s, 2048x512x1024, median of 7): these VMs
  share their host, and this says how fast the machine was when a record was taken."""
  a = jax.numpy.ones((2048, 512), jax.numpy.float32)
  b = jax.numpy.ones((512, 1024), jax.numpy.float32)
  f = jax.jit(lambda a, b: a @ b)
  t = time_fn(f, a, b, repeats=7, warmup=2)['median_s']
  return round(2 * 2048 * 512 * 1024 / t / 1e9, 1)


def machine() -> dict:
  d = jax.devices()[0]
  return {
    'matmul_gflops': matmul_probe(),
    'date': datetime.date.today().isoformat(),
    'device': getattr(d, 'device_kind', str(d)),
    'platform': d.platform,
    'devices': jax.device_count(),
    'host': platform.processor() or platform.machine(),
    'glibc_tunables': os.environ.get('GLIBC_TUNABLES', ''),
    'jax': jax.__version__,
  }


def emit(record: dict) -> None:
  """One JSON line; with what tokamax's kernel choice was for each expert product traced so far
  (moetrain.kernels.experts.TOKAMAX_CHOICES), where any went through tokamax."""
  experts = sys.modules.get('moetrain.kernels.experts')
  if experts is not None and experts.TOKAMAX_CHOICES:
    record = {**record, 'tokamax_kernels': dict(experts.TOKAMAX_CHOICES)}
  print(json.dumps(record), flush=True)


class RunFailed(RuntimeError):
  """A benchmarked command exited non-zero; the message ends with its standard error's tail."""


def run_main(args: list[str]) -> str:
  """`python -m ARGS...` from the repository root in a subprocess (a fresh JAX each run); its
  standard output, or RunFailed naming the command with the last lines of its standard error."""
  env = {**os.environ, 'PYTHONPATH': '.'}
  done = subprocess.run([sys.executable, '-m', *args], env=env, capture_output=True, text=True)
  if done.returncode:
    tail = '\n'.join(done.stderr.strip().splitlines()[-5:])
    raise RunFailed(f'python -m {" ".join(args)} exited {done.returncode}:\n{tail}')
  return done.stdout


def run_result(workdir: str) -> dict:
  """A finished run's last evaluation (loss, accuracy) and its median seconds per step from its
  metrics.jsonl (the median skips the windows an evaluation or the first compile fell in)."""
  records = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  train = [r for r in records if r.get('kind') == 'train']
  last = [r for r in records if r.get('kind') == 'eval'][-1]
  times = [(b['time'] - a['time']) / b['window_steps'] for a, b in zip(train, train[1:])]
  return {
    'eval_loss': last['loss'],
    'eval_accuracy': last['accuracy'],
    'step_seconds': statistics.median(times),
  }

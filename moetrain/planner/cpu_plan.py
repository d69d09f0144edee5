"""The CPU host planner behind `moetrain.tools.plan --topology=cpu`: compile, predict, search."""

import dataclasses
import json
import math
import os
import pathlib
import platform
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.convert.stacked_io import CHUNK_BYTES
from moetrain.core import sharding
from moetrain.data import packing
from moetrain.model.transformer import Transformer
from moetrain.planner import tpu_plan
from moetrain.run.startup import build
from moetrain.training import aot, optim
from moetrain.training.train_state import init_state, state_shardings

# This host's measured baseline and matmul rates (MOETRAIN_HOST_CACHE moves it).
HOST_CACHE = os.environ.get('MOETRAIN_HOST_CACHE', '~/.cache/moetrain/host.json')
# Batches the data pipeline holds ahead of the step (grain's read-ahead and the loop's prefetch).
READ_AHEAD = 16
# What a run holds beyond the imports' baseline and its arrays: its threads' stacks and malloc
# arenas, Orbax, TensorBoard, grain and the tokenizer. Runs on a 2-core machine peaked 35-155 MiB
# above the plan without it (bench/RESULTS.md, "CPU host plans").
RUNTIME = 128 * 2**20


@dataclasses.dataclass(frozen=True)
class Host:
  name: str  # as asked: 'cpu', 'cpu:64GB', 'cpu:64GB:16'
  ram_bytes: int
  cores: int
  this_host: bool  # RAM and cores are this machine's


def this_ram() -> int:
  try:
    with open('/proc/meminfo') as f:
      kib = next(int(ln.split()[1]) for ln in f if ln.startswith('MemTotal:'))
    return kib * 1024
  except (OSError, StopIteration):
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


def this_cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()


def parse(name: str) -> Host:
  """'cpu' (this host), 'cpu:64GB' (a host of 64 GiB RAM and this host's cores), 'cpu:64GB:16'
  (and 16 cores); 'cpu::16' keeps this host's RAM."""
  m = re.fullmatch(r'cpu(?::(\d+(?:\.\d+)?)?\s*(?:GB|GiB|G)?)?(?::(\d+))?', name.strip())
  if not m:
    raise ValueError(
      f'--topology={name!r}: a CPU host is cpu (this one), cpu:64GB (its RAM) or cpu:64GB:16 '
      '(RAM and cores)'
    )
  ram = int(float(m.group(1)) * 2**30) if m.group(1) else this_ram()
  cores = int(m.group(2)) if m.group(2) else this_cores()
  if cores < 1 or ram <= 0:
    raise ValueError(f'--topology={name!r}: RAM and cores must be positive')
  return Host(name.strip(), ram, cores, not m.group(1) and not m.group(2))


def _rss() -> int:
  """This process's resident bytes now."""
  with open('/proc/self/status') as f:
    return next(int(ln.split()[1]) for ln in f if ln.startswith('VmRSS:')) * 1024


def _fingerprint() -> str:

  cpu = platform.processor() or platform.machine()
  try:
    with open('/proc/cpuinfo') as f:
      cpu = next((ln.split(':', 1)[1].strip() for ln in f if ln.startswith('model name')), cpu)
  except OSError:
    pass
  return (
    f'{cpu}|{this_cores()} cores|{this_ram()}|python {sys.version.split()[0]}|jax {jax.__version__}'
  )


def baseline_rss() -> int:
  """Peak resident bytes of a fresh Python that imports the training loop and starts JAX's CPU
  backend: what every run holds before its first array."""
  code = (
    'import jax, moetrain.run.train, moetrain.main; jax.devices(); '
    "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"
  )
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'MOETRAIN_NO_REEXEC': '1'}
  done = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, env=env, check=True
  )
  return int(done.stdout.split()[-1]) * 1024


def matmul_rate(dtype: str, n: int = 2048, repeats: int = 5) -> float:
  """This host's best FLOP/s over `repeats` n x n x n matmuls in `dtype` (all its cores)."""

  with jax.default_device(jax.devices('cpu')[0]):
    a = jnp.ones((n, n), dtype)
  f = jax.jit(lambda a, b: a @ b)
  f(a, a).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    t = time.perf_counter()
    f(a, a).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2 * n**3 / best


def host_measurements(cache: str = HOST_CACHE) -> dict:
  """{'baseline_rss', 'matmul_flops': {dtype: FLOP/s}} of this host, measured once and kept in
  `cache` (keyed by CPU, cores, RAM, Python and jax)."""
  path = pathlib.Path(os.path.expanduser(cache))
  key = _fingerprint()
  try:
    known = json.loads(path.read_text()) if path.exists() else {}
  except ValueError:
    known = None
  if not isinstance(known, dict):  # only lost time: measured again
    print(f'Note: {cache} is not a host cache (damaged?): it is rebuilt', file=sys.stderr)
    known = {}
  if key in known and not _measured(known[key]):
    print(f'Note: {cache}: the entry of this host is damaged: measured again', file=sys.stderr)
    del known[key]
  if key not in known:
    known[key] = {
      'baseline_rss': baseline_rss(),
      'matmul_flops': {d: matmul_rate(d) for d in ('float32', 'bfloat16')},
      'measured': time.strftime('%Y-%m-%d'),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f'.{os.getpid()}.tmp')
    tmp.write_text(json.dumps(known, indent=1))
    tmp.replace(path)
  return known[key]


def _measured(entry) -> bool:
  """Whether a host cache entry holds what host_measurements measures."""
  if not isinstance(entry, dict) or not _positive(entry.get('baseline_rss')):
    return False
  flops = entry.get('matmul_flops')
  return isinstance(flops, dict) and all(_positive(flops.get(d)) for d in ('float32', 'bfloat16'))


def _positive(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def one_device(config) -> dict:
  """A run on a CPU host has one device: a mesh that names more becomes (1, -1, 1, 1)."""
  if math.prod(s for s in config.mesh.shape if s > 0) > 1:
    return {'mesh.shape': (1, -1, 1, 1)}
  return {}


def _bytes(tree) -> int:

  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def start_up(setup, mesh) -> tuple[str, int]:
  """What start-up holds beside the state it makes: a random init's compiled temporaries, or an
  import's largest per-layer piece (moetrain/convert/stacked_io.load_row: the float32 blocks
  read, their device copy and the quantiser's float32 temporaries; without quantisation the
  blocks and their copy; the embedding and head are read in chunks of CHUNK_BYTES)."""

  cfg = setup.model
  if setup.hf_checkpoint:
    plain = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=0)).with_engine(
      quant='none'
    )
    model = nnx.eval_shape(lambda: Transformer(plain, nnx.Rngs(0)))

    piece = 0
    for _, v in nnx.to_flat_state(nnx.state(model)):
      x = v.get_value()
      stacked = v.get_metadata().get('axes', ('',))[0] == 'layers'
      piece = max(piece, x.size // x.shape[0] if stacked else min(x.size, CHUNK_BYTES // 4))
    return 'import', piece * 4 * (3 if cfg.engine.quant != 'none' else 2)
  opt = optim.make_optimizer(setup.optim, setup.train.steps)
  init = lambda: init_state(cfg, opt, setup.seed)
  out = state_shardings(jax.eval_shape(init), mesh, cfg.engine.rules)
  with jax.set_mesh(mesh):
    m = jax.jit(init, out_shardings=out).lower().compile().memory_analysis()
  return 'random init', m.temp_size_in_bytes


def host_bytes(setup, mesh, steps: dict, start: tuple, measured: dict, compiled: int) -> dict:
  """The parts of the run's peak resident memory, and 'peak' (their sum at the worst moment):
  the baseline, what the allocator keeps after compiling, the state, the data read ahead, and
  the largest of the train step's and the eval step's buffers, start-up's, and the checkpoint's
  staged copy (on top of the step's where an asynchronous save is still writing while the next
  steps run)."""

  d, t = setup.data, setup.train
  train = steps['train'].memory
  ev = steps['eval'].memory if 'eval' in steps else {}
  state, _ = aot.abstract_state(setup, mesh)
  saved = _bytes(state.saved())
  batch = d.global_batch_size * d.seq_len * len(packing.ROW_KEYS) * 4
  parts = {
    'baseline': measured['baseline_rss'] + RUNTIME,
    'compilation': compiled,
    'state': train['arguments'],
    'data': READ_AHEAD * batch,
    'train step': train['temporaries'] + train['outputs'] - train['aliased'] + train['code'],
    'eval step': ev.get('temporaries', 0) + ev.get('outputs', 0) + ev.get('code', 0),
    start[0]: start[1],
    'checkpoint': saved,
  }
  overlap = t.async_checkpoint and t.steps > t.checkpoint_every
  moments = {
    'train step': parts['train step'] + (saved if overlap else 0),
    'eval step': parts['eval step'],
    start[0]: start[1],
    'checkpoint': saved,
  }
  worst = max(moments, key=moments.get)
  fixed = sum(parts[k] for k in ('baseline', 'compilation', 'state', 'data'))
  return {'parts': parts, 'worst': worst, 'overlap': overlap, 'peak': fixed + moments[worst]}


def rate_of(setup, host: Host, measured: dict) -> float:
  """FLOP/s of this host's matmuls in the step's compute dtype, scaled by cores for another."""
  dtype = 'float32' if setup.model.engine.dtype == 'float32' else 'bfloat16'
  return measured['matmul_flops'][dtype] * host.cores / this_cores()


def plan(config, topology: str, overrides: dict | None = None, progress=None) -> dict:
  """Compile `config` (with `overrides`) for a CPU host; the report, in a TPU plan's fields
  (per_chip_bytes.total: the predicted peak resident memory). progress(line)."""

  host = parse(topology)
  overrides = dict(overrides or {})
  config = tpu_plan.with_overrides(config, overrides)
  overrides |= one_device(config)
  config = tpu_plan.with_overrides(config, overrides)
  setup = build(config, num_devices=1, process_count=1, platform='cpu')
  mesh = setup.make_mesh(jax.devices('cpu')[:1])
  measured = host_measurements()
  before = _rss()
  steps = aot.compile_steps(setup, mesh, progress=progress)
  start = start_up(setup, mesh)
  mem = host_bytes(setup, mesh, steps, start, measured, max(_rss() - before, 0))
  train = steps['train']
  flops, formula = tpu_plan.model_flops(setup)
  again, again_what = tpu_plan.recompute_flops(setup)
  rate = rate_of(setup, host, measured)
  # The compiled count misses the grouped engine's loops (data-dependent trip counts).
  step_s, peak = max(flops + again, train.cost.flops) / rate, mem['peak']
  return {
    'topology': host.name,
    'topology_name': f'cpu:{host.ram_bytes / 2**30:.1f}GiB:{host.cores}',
    'this_host': host.this_host,
    'chips': 1,
    'devices': 1,
    'cores': host.cores,
    'mesh': dict(zip(sharding.MESH_AXES, setup.mesh_shape)),
    'overrides': overrides,
    'engine': tpu_plan.engine_of(setup.model),
    'hbm_bytes': host.ram_bytes,
    'ram_bytes': host.ram_bytes,
    'fits': peak <= host.ram_bytes,
    'headroom': 1 - peak / host.ram_bytes,
    'need_bytes': peak,
    'need_step': mem['worst'],
    'per_chip_bytes': {**train.memory, 'step_total': train.memory['total'], 'total': peak},
    'eval_per_chip_bytes': steps['eval'].memory if 'eval' in steps else None,
    'host_bytes': mem,
    'compile_seconds': sum(c.seconds for c in steps.values()),
    'model_flops_per_step': flops,
    'model_flops_formula': formula,
    'recompute_flops_per_step': again,
    'recompute_what': f'engine.remat={setup.engine.remat!r}: {again_what}',
    'hlo_flops_per_chip': train.cost.flops,
    'xla_cost_analysis_flops_per_chip': train.xla_flops,
    'matmul_flops': rate,
    'matmul_dtype': 'float32' if setup.model.engine.dtype == 'float32' else 'bfloat16',
    'est_step_seconds': step_s,
    'est_bound_by': 'compute',
    'est_seconds_by_part': {'compute': step_s},
    'est_tokens_per_sec': setup.data.global_batch_size * setup.data.seq_len / step_s,
    'est_mfu': flops / (step_s * rate),
  }


PART_NAMES = {
  'baseline': "Python, JAX, moetrain and the run's threads and libraries",
  'compilation': 'what the allocator keeps after compiling the steps',
  'state': 'the train state (frozen base, adapters or weights, optimizer)',
  'data': 'batches read ahead',
}


def print_plan(r: dict) -> None:
  g = tpu_plan._gib
  over = tpu_plan._flags(r['overrides'])
  where = 'this host' if r['this_host'] else 'a host'
  print(
    f'{r["topology"]} ({where}: {g(r["ram_bytes"])} RAM, {r["cores"]} cores): one CPU device'
    + (f'  [{over}]' if over else '')
  )
  print('engine: ' + ', '.join(f'{k}={v}' for k, v in r['engine'].items()))
  m = r['per_chip_bytes']
  print(
    'train step: '
    + ', '.join(f'{k} {g(m[k])}' for k in ('arguments', 'temporaries', 'outputs', 'aliased'))
    + (f'; eval step {g(r["eval_per_chip_bytes"]["total"])}' if r['eval_per_chip_bytes'] else '')
  )
  h = r['host_bytes']
  fixed = ' + '.join(f'{g(h["parts"][k])} {v}' for k, v in PART_NAMES.items())
  with_ckpt = (
    ' with an asynchronous save still staging'
    if h['overlap'] and h['worst'] == 'train step'
    else ''
  )
  print(f'peak resident memory (predicted): {fixed}')
  print(
    f'  + {g(h["peak"] - sum(h["parts"][k] for k in PART_NAMES))} at the worst moment, the '
    f'{h["worst"]}{with_ckpt} ('
    + ', '.join(f'{k} {g(v)}' for k, v in h['parts'].items() if k not in PART_NAMES)
    + ')'
  )
  verdict = 'fits' if r['fits'] else 'DOES NOT FIT'
  low = r['fits'] and r['headroom'] < tpu_plan.HEADROOM
  print(
    f'needs {g(r["need_bytes"])} of {g(r["ram_bytes"])} RAM: {verdict}, headroom '
    f'{100 * r["headroom"]:.1f}%'
    + (' (under 10%: other processes need some)' if low else '')
    + f' (compile {r["compile_seconds"]:.0f} s)'
  )
  print(
    f'ESTIMATE (not a measurement): step {r["est_step_seconds"]:.3g} s, '
    f'{r["est_tokens_per_sec"]:.3g} tokens/s at the measured {r["matmul_dtype"]} matmul rate '
    f'{r["matmul_flops"] / 1e9:.0f} GFLOP/s (every FLOP at that rate: a lower bound of the step time)'
  )
  again = r.get('recompute_flops_per_step')
  print(
    f'model FLOPs {r["model_flops_per_step"]:.3e} per step ({r["model_flops_formula"]})'
    + (f', + {again:.3e} recomputed ({r["recompute_what"]})' if again is not None else '')
    + f'; compiled FLOPs {r["hlo_flops_per_chip"]:.3e}'
  )


def neighbours(config, base: dict) -> list[dict]:
  """Settings one change away from `base` (overrides of `config`): remat policy,
  micro-batches, half the sequence length and, under LoRA, the base's storage."""
  now = tpu_plan.with_overrides(config, base)
  out = [{'engine.remat': r} for r in ('full', 'save_moe', 'save_dots', 'none')]
  rows = now.data.global_batch_size
  out += [{'optim.grad_accum_steps': a} for a in (1, 2, 4, 8) if rows % a == 0]
  if now.data.seq_len >= 256:
    out.append({'data.seq_len': now.data.seq_len // 2})
  if now.lora.rank:
    out += [{'engine.quant': q} for q in ('none', 'int8', 'int4')]
  value = lambda c, k: c[k.split('.')[0]][k.split('.')[1]]  # noqa: E731
  out = [base | o for o in out if any(value(now, k) != v for k, v in o.items())]
  # Keys back at the config's own value are dropped: the same plan is then cached once.
  return [{k: v for k, v in o.items() if value(config, k) != v} for o in out]


def _better(r: dict, than: dict) -> bool:
  """Among plans that keep tpu_plan.HEADROOM of the RAM free, those at the configured sequence
  length first, then the most tokens/s; while none does, the smallest."""
  ok = tpu_plan._ok
  if ok(r) != ok(than):
    return ok(r)
  if ok(r):
    rank = lambda x: ('data.seq_len' not in x['overrides'], x['est_tokens_per_sec'])  # noqa: E731
    return rank(r) > rank(than)
  size = lambda x: (x.get('per_chip_bytes') or {}).get('total') or math.inf  # noqa: E731
  return size(r) < size(than)


def search(config, topology: str, workers: int, rounds: int = 3, cache=tpu_plan.CACHE) -> dict:
  """Coordinate search from the config as given, each plan compiled in a fresh process (what the
  allocator keeps after compiling is measured per plan)."""
  many = lambda jobs: tpu_plan.plan_many(  # noqa: E731
    config, jobs, workers, cache, plan_fn=plan, fresh=True, key=_fingerprint()
  )
  best_o = {}
  (best,) = many([(topology, best_o)])
  for _ in range(rounds):
    cands = neighbours(config, best_o)
    start = best
    for o, r in zip(cands, many([(topology, o) for o in cands])):
      if 'error' not in r and _better(r, best):
        best, best_o = r, o
    if best is start:
      break
  return best


def main(
  config, topology: str, do_search: bool, json_path: str, workers: int, cache=tpu_plan.CACHE
):
  """The CPU planner's CLI behind tools/plan.py; plans are cached as TPU plans are."""
  if do_search:
    best = search(config, topology, workers, cache=cache)
    print_plan(best)
    if tpu_plan._ok(best):
      print(f'the most tokens/s that leaves {tpu_plan.HEADROOM:.0%} of the RAM free, as flags:')
      print('  ' + (tpu_plan._flags(best['overrides']) or '(the config as it is)'))
    else:
      print(
        f'no setting tried leaves {tpu_plan.HEADROOM:.0%} of the RAM free; the smallest is above'
      )
    tpu_plan._write(json_path, best)
    return
  say = lambda line: print(f'[{topology}] {line}', flush=True)  # noqa: E731
  key = tpu_plan._cache_key(config, topology, {}, _fingerprint())
  r = tpu_plan._load_cache(cache).get(key)
  if r is None:
    r = plan(config, topology, progress=say)
    tpu_plan._save_cache(tpu_plan._load_cache(cache) | {key: r}, cache)
  else:
    say(f'answered from the plan cache ({cache}: same config, code, jax and host)')
  print_plan(r)
  tpu_plan._write(json_path, r)

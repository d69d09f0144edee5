"""The TPU planner behind `moetrain.tools.plan --topology`: compile, estimate, search."""

import concurrent.futures
import hashlib
import json
import math
import multiprocessing
import os
import pathlib
import sys

import jax

from moetrain.core import hlo_cost, hlo_memory, sharding
from moetrain.core.engine import REMAT_POLICIES
from moetrain.core.sharding import full_shape
from moetrain.model import dispatch, expert_parallel, stages
from moetrain.planner import sizes
from moetrain.planner import topology as topology_lib
from moetrain.planner.sizes import bytes_text
from moetrain.run import metrics
from moetrain.run.startup import build, model_config
from moetrain.training import aot

HEADROOM = 0.10  # --search and --smallest keep plans that leave this much of the HBM free
# Where plans are cached (MOETRAIN_PLAN_CACHE moves it).
CACHE = os.environ.get('MOETRAIN_PLAN_CACHE', '~/.cache/moetrain/plans.json')


def with_overrides(config, overrides: dict):
  """A copy of `config` with {'section.key': value} set, as --config.section.key=value would."""
  c = config.copy_and_resolve_references()
  for key, value in overrides.items():
    section, name = key.split('.', 1)
    if isinstance(c[section][name], tuple):
      value = tuple(value)
    c[section][name] = value
  return c


def model_flops(setup) -> tuple[float, str]:
  """Model FLOPs of one training step (all devices), and the formula: matmul FLOPs per token
  k * N_active (k = 6 with weight gradients, 4 for a frozen LoRA base, whose adapters add
  6 * N_adapters), N_active = parameters a token activates with K_e FFN experts (embedding lookup
  excluded, lm head included), plus causal attention 6 * heads * (d_qk + d_v) * T/2 per token and
  attention block (two per LongCat layer, one per standard layer; forward 2 FLOPs per
  multiply-add, backward twice that, frozen base or not: attention has no weights to skip):
  metrics.attention_params_equivalent (the selected keys under DeepSeek Sparse Attention), plus
  the indexer's scoring (metrics.indexer_flops_per_token), as the training log's MFU. Remat recomputation is not
  model work."""

  cfg = setup.model
  counts = sizes.param_counts(cfg)
  n_active = counts['active'][sizes.balance_target(cfg)]
  lora = cfg.lora.enabled
  t = setup.data.seq_len
  attn = 6 * metrics.attention_params_equivalent(cfg, t)
  index = metrics.indexer_flops_per_token(cfg, t)
  per_token = (4 if lora else 6) * n_active + 6 * counts['adapters'] * lora + attn + index
  tokens = setup.data.global_batch_size * t
  formula = (
    f'{"4" if lora else "6"} x {sizes.count_text(n_active)} active'
    + (f' + 6 x {sizes.count_text(counts["adapters"])} adapters' if lora else '')
    + f' + attention {attn:.3g}'
    + (f' + indexer {index:.3g}' if index else '')
    + f' FLOP, per token, x {tokens} tokens'
  )
  return per_token * tokens, formula


def recompute_flops(setup) -> tuple[float, str]:
  """The forward FLOPs the backward pass runs again under engine.remat (all devices), which
  model_flops leaves out, and what they are: 'full' reruns every layer's forward (the lm head's
  chunked loss is not in a layer), 'save_moe' and 'offload' all of it but the routed experts,
  'save_dots' on a CPU (whose grouped engine is a loop, not a dot) the routed experts and the
  attention core, 'none' nothing. The compiled step counts them where its loops have static
  trip counts (a TPU plan's estimate reads them there); the CPU plan adds them to model_flops."""

  cfg = setup.model
  counts = sizes.param_counts(cfg)
  k_e = sizes.balance_target(cfg)
  routed = 2 * k_e * counts['routed_experts'] / cfg.n_routed_experts
  attention = 2 * metrics.attention_params_equivalent(cfg, setup.data.seq_len)
  adapters = 2 * counts['adapters'] if cfg.lora.enabled else 0
  layers = 2 * (counts['active'][k_e] - cfg.vocab_size * cfg.hidden_size) + attention + adapters
  per_token, what = {
    'full': (layers, "every layer's forward"),
    'save_moe': (layers - routed, 'the layers but the routed experts'),
    'offload': (layers - routed, 'the layers but the routed experts'),
    'save_dots': (routed + attention, 'the routed experts and the attention core'),
  }.get(cfg.engine.remat, (0.0, 'nothing'))
  return per_token * setup.data.global_batch_size * setup.data.seq_len, what


def plan(config, topology: str, overrides: dict | None = None, progress=None) -> dict:
  """Compile `config` (with `overrides`) for `topology`; the per-device report. progress(line)."""

  topo = topology_lib.parse(topology)
  config = with_overrides(config, overrides or {})
  devices = topo.devices()
  setup = build(config, num_devices=len(devices), process_count=1, platform='tpu')
  mesh = setup.make_mesh(devices)
  chip = topo.chip
  report = base_report(setup, topo, overrides)
  try:
    steps = aot.compile_steps(setup, mesh, progress=progress)
  except aot.OutOfMemory as e:
    need = e.required_bytes
    return report | {
      'fits': False,
      'error': f'{e.name}: {e.message}',
      'compile_seconds': e.seconds,
      'per_chip_bytes': {'total': need} if need else {},
    }
  train_c = steps['train']
  micro = setup.data.global_batch_size // setup.optim.grad_accum_steps
  buffers = sizes.step_buffers(setup.model, setup.mesh_shape, setup.data.seq_len, micro)
  worst = max(steps.values(), key=lambda c: c.memory['total'])
  total = worst.memory['total']
  flops, formula = model_flops(setup)
  # Grouped expert matmuls priced by the rows routing sends them, not by their buffers.
  routed = sizes.routed_rows(setup.model, setup.mesh_shape, setup.data.seq_len, micro)
  cost = hlo_cost.routed_rows(train_c.cost, routed)
  # Bytes per chip and step the train step sends between slices (None on one slice).
  dcn = hlo_cost.dcn_bytes(cost, topo.slices) if topo.slices > 1 else None
  est = estimate(cost, chip, flops / len(devices), setup.data, dcn)
  return report | {
    'fits': total <= chip.hbm_bytes,
    'headroom': 1 - total / chip.hbm_bytes,
    # What must fit: the larger of the two steps.
    'need_bytes': total,
    'need_step': worst.name,
    'per_chip_bytes': train_c.memory,
    'eval_per_chip_bytes': steps['eval'].memory if 'eval' in steps else None,
    # An RL run's sampler (its KV cache and the recorded routes beside the weights).
    'sampler_per_chip_bytes': steps['sampler'].memory if 'sampler' in steps else None,
    'compile_seconds': sum(c.seconds for c in steps.values()),
    'model_flops_per_step': flops,
    'model_flops_formula': formula,
    'hlo_flops_per_chip': cost.flops,
    # The grouped matmuls' FLOPs over their buffers' rows past the routed ones (not in the
    # estimate; what an unbalanced routing may add, at most).
    'grouped_padding_flops_per_chip': cost.grouped_padding_flops,
    'routed_rows_per_device': routed,
    'xla_cost_analysis_flops_per_chip': train_c.xla_flops,
    'loops': sorted({n for n in train_c.cost.loops.values() if n}, reverse=True),
    # Overflow rounds of a bounded expert exchange: counted zero times in the estimate.
    'data_dependent_loops': len(train_c.cost.unknown_loops),
    'buffers': buffers,
    'peak_buffers': peak_buffers(train_c),
    'dcn_bytes_per_chip': dcn,
    **est,
  }


def base_report(setup, topo, overrides) -> dict:
  """What a plan reports before compiling: the slice, the mesh, the engine, the pipeline."""

  return {
    'topology': topo.cloud_name,
    'topology_name': topo.topology_name,
    'chips': topo.chips,
    'devices': topo.num_devices,
    'mesh': dict(zip(sharding.MESH_AXES, setup.mesh_shape)),
    'overrides': dict(overrides or {}),
    'engine': engine_of(setup.model)
    | {'frozen_layout': 'compiler' if aot.compiler_layouts(setup) else 'default'},
    'hbm_bytes': topo.chip.hbm_bytes,
    'pipeline': sizes.pipeline_traffic(setup),
  }


def peak_buffers(compiled, top: int = 6) -> dict:
  """What is alive at the train step's peak, by a liveness walk over its scheduled HLO
  (moetrain.core.hlo_memory: a lower estimate of the compiler's temporaries)."""

  p = hlo_memory.peak(compiled.executable.as_text())
  floor = max(2**20, compiled.memory['temporaries'] // 100)
  return {'bytes': p.bytes, 'live': hlo_memory.summary(p, top, floor)}


def engine_of(cfg) -> dict:

  return {
    'moe_backend': dispatch.resolve_backend(cfg),
    'moe_ep_comm': expert_parallel.resolve_ep_comm(cfg),
    'moe_dispatch': cfg.engine.moe_dispatch,
    'remat': cfg.engine.remat,
  }


def estimate(cost, chip, model_flops_per_chip: float, data, dcn_bytes=None) -> dict:
  """Roofline step time per chip: the slowest of compute (the compiled FLOPs at peak), HBM
  traffic, collective traffic over the ICI and, across slices, the bytes sent over the
  data-center network (`dcn_bytes`, per chip), as if each overlapped the others perfectly."""
  parts = {
    'compute': cost.flops / chip.peak_flops,
    'hbm': cost.hbm_bytes / chip.hbm_bandwidth,
    'ici': cost.collective_bytes / chip.ici_bandwidth,
  }
  if dcn_bytes is not None:
    parts['dcn'] = dcn_bytes / chip.dcn_bandwidth
  step = max(parts.values())
  return {
    'est_step_seconds': step,
    'est_bound_by': max(parts, key=parts.get),
    'est_seconds_by_part': parts,
    'est_tokens_per_sec': data.global_batch_size * data.seq_len / step,
    'est_mfu': model_flops_per_chip / (step * chip.peak_flops),
  }


def _gib(n) -> str:

  return bytes_text(n) if n is not None else '?'


def _print_other_programs(r: dict) -> None:
  """The eval step's memory, and an RL run's sampler's (its KV cache, the routes recorded)."""
  for name, label in (('eval', 'eval step'), ('sampler', 'sampler')):
    if r.get(f'{name}_per_chip_bytes'):
      print(f'{label} per device: total {_gib(r[f"{name}_per_chip_bytes"]["total"])}')


def print_plan(r: dict) -> None:
  over = _flags(r['overrides'])
  print(
    f'{r["topology"]} ({r["topology_name"]}): {r["chips"]} chips, {r["devices"]} devices, '
    f'mesh {r["mesh"]}' + (f'  [{over}]' if over else '')
  )
  print('engine: ' + ', '.join(f'{k}={v}' for k, v in r['engine'].items()))
  if r.get('pipeline'):
    _print_pipeline(r['pipeline'])
  if 'error' in r:
    print(f'DOES NOT FIT: {r["error"]} (compile {r["compile_seconds"]:.0f} s)')
    return
  m = r['per_chip_bytes']
  print(
    'train step per device: '
    + ', '.join(f'{k} {_gib(m[k])}' for k in ('arguments', 'temporaries', 'outputs', 'aliased'))
    + f', generated code {_gib(m["code"])}, host offload {_gib(m["host"])}'
  )
  if r.get('buffers'):
    b = r['buffers']
    moe = ', '.join(f'{k} {_gib(v)}' for k, v in b['moe_layer'].items())
    print(
      f'arithmetic of the largest buffers: one MoE layer backward {_gib(b["moe_layer_bytes"])} '
      f'(R = {b["recv_rows"]} rows, r = {b["local_rows"]}: {moe}); layer inputs kept '
      f'{_gib(b["layer_inputs_bytes"])}; attention block {_gib(b["attention_block_bytes"])}, '
      f"loss block {_gib(b['loss_block_bytes'])}: {_gib(b['total_bytes'])}, the compiler's "
      f'temporaries are {m["temporaries"] / b["total_bytes"]:.2f}x that'
    )
  if r.get('peak_buffers'):
    _print_peak(r['peak_buffers'], m['temporaries'])
  _print_other_programs(r)
  verdict = 'fits' if r['fits'] else 'DOES NOT FIT'
  print(
    f'needs {_gib(r["need_bytes"])} ({r["need_step"]}, the larger) of '
    f'{_gib(r["hbm_bytes"])} HBM: {verdict}, headroom {100 * r["headroom"]:.1f}% '
    f'(compile {r["compile_seconds"]:.0f} s)'
  )
  if r.get('dcn_bytes_per_chip') is not None:
    print(
      f'over the data-center network: {_gib(r["dcn_bytes_per_chip"])} per chip and step (the '
      "compiled step's cross-slice collectives; the estimate's dcn part)"
    )
  parts = ', '.join(f'{k} {v * 1e3:.0f} ms' for k, v in r['est_seconds_by_part'].items())
  print(
    f'ESTIMATE (roofline, not a measurement): step {r["est_step_seconds"]:.2f} s '
    f'({r["est_bound_by"]}-bound; {parts}), {r["est_tokens_per_sec"]:.0f} tokens/s, '
    f'MFU {100 * r["est_mfu"]:.1f}%'
  )
  _print_flops(r)


def _print_flops(r: dict) -> None:
  """The model's FLOPs beside the compiled step's, and how the grouped matmuls were priced."""
  print(
    f'model FLOPs {r["model_flops_per_step"]:.3e} per step ({r["model_flops_formula"]}); '
    f'compiled FLOPs per device {r["hlo_flops_per_chip"]:.3e} with loop trip counts '
    f'{r["loops"]} (XLA cost_analysis, loop bodies once: {r["xla_cost_analysis_flops_per_chip"]:.3e})'
    + (
      f"; {r['data_dependent_loops']} loops of data-dependent trip count (the exchange's overflow "
      'rounds) counted zero times: the estimate is of a step whose routing fits the buffer'
      if r.get('data_dependent_loops')
      else ''
    )
  )
  if r.get('grouped_padding_flops_per_chip'):
    print(
      f'grouped expert matmuls priced by the {r["routed_rows_per_device"]:.0f} rows routing '
      f'sends each per forward pass; over their whole buffers they would add '
      f"{r['grouped_padding_flops_per_chip']:.3e} FLOPs per device (an unbalanced routing's "
      'upper bound)'
    )


def _print_pipeline(p: dict) -> None:
  print(
    f'pipeline: {p["stages"]} stages, {p["microbatches"]} micro-batches x {p["repeats"]} '
    f'repeats: bubble (S - 1) / (M * R + S - 1) = {100 * p["bubble"]:.1f}% of each stage; '
    f'activations per step {_gib(p["boundary_bytes_per_step"])} over each stage boundary, '
    f'{_gib(p["dcn_bytes_per_step"])} over the data-center network (the train step per device '
    'below is that of one stage)'
  )


def _print_peak(pb: dict, temporaries: int) -> None:

  print(
    f'alive at the peak (a liveness walk over the scheduled HLO finds {_gib(pb["bytes"])} of '
    f'the {_gib(temporaries)} reported; moetrain.core.hlo_memory):'
  )
  for e in pb['live']:
    label = hlo_memory.short_label(e['label'], 90) or e['name']
    print(f'  {"  " * e["depth"]}{_gib(e["bytes"]):>10} {e["op"]}: {label}')


def _arg(v) -> str:
  """A value as a --config flag takes it (a JSON-cached tuple comes back as a list)."""
  return f"'{tuple(v)}'" if isinstance(v, (tuple, list)) else str(v)


# ---------------------------------------------------------------------------------------------
# The plan cache (every plan, keyed by its inputs); --search and --smallest: many compiles in
# worker processes.


def _cache_key(config, topology: str, overrides: dict, host: str = '') -> str:
  """host: what else the plan depends on (a CPU plan: the host it was measured on)."""

  src = pathlib.Path(__file__).resolve().parents[1]
  code = hashlib.sha256()
  for p in sorted(src.rglob('*.py')):
    code.update(p.read_bytes())
  blob = json.dumps(
    [
      config.to_json_best_effort(sort_keys=True),
      topology,
      sorted(overrides.items()),
      jax.__version__,
      *([host] if host else []),
    ],
    default=str,
  )
  return hashlib.sha256(blob.encode() + code.digest()).hexdigest()


def _digest(plan: dict) -> str:
  return hashlib.sha256(json.dumps(plan, sort_keys=True, default=str).encode()).hexdigest()


def _load_cache(path: str) -> dict:
  """{key: plan} of the cache file `path`. Each plan is stored with the digest of its JSON: one
  that is not as this code wrote it (edited, of another shape, a key missing) is dropped and
  planned again, as is a file that is no JSON object ([], null, cut short). A damaged cache is
  only lost time: it is rebuilt, with a note naming it."""
  file = pathlib.Path(os.path.expanduser(path))
  if not file.exists():
    return {}
  try:
    stored = json.loads(file.read_text())
  except ValueError:
    stored = None
  if not isinstance(stored, dict):
    print(f'Note: {path} is not a plan cache (damaged?): it is rebuilt', file=sys.stderr)
    _save_cache({}, path)
    return {}
  plans = {
    k: e['plan']
    for k, e in stored.items()
    if isinstance(e, dict)
    and isinstance(e.get('plan'), dict)
    and e.get('sha256') == _digest(e['plan'])
  }
  if len(plans) < len(stored):
    n = len(stored) - len(plans)
    print(
      f'Note: {path}: {n} of its {len(stored)} plans are not as written (damaged?): dropped, '
      'they are planned again',
      file=sys.stderr,
    )
    _save_cache(plans, path)
  return plans


def _save_cache(cache: dict, path: str) -> None:
  path = pathlib.Path(os.path.expanduser(path))
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f'.{os.getpid()}.tmp')
  sealed = {k: {'plan': r, 'sha256': _digest(r)} for k, r in cache.items()}
  tmp.write_text(json.dumps(sealed, default=str))
  tmp.replace(path)


def _worker(args):
  config, topology, overrides, plan_fn = args
  try:
    return (plan_fn or plan)(config, topology, overrides)
  except ValueError as e:  # settings the build refuses (a mesh that does not divide, ...)
    return {'overrides': overrides, 'topology': topology, 'fits': False, 'error': str(e)}


def plan_many(
  config,
  jobs: list[tuple[str, dict]],
  workers: int,
  cache: str = CACHE,
  plan_fn=None,
  fresh: bool = False,
  key: str = '',
) -> list[dict]:
  """plan_fn() (default plan()) of each (topology, overrides), cached in the JSON file `cache`
  across invocations (keyed by the config, the overrides, jax's version, moetrain's source and
  `key`), `workers` spawned processes at a time (1: in this process, unless `fresh` asks for a
  new process per plan). Each result is saved as it arrives, so an interrupted search resumes
  where it stopped."""
  done = _load_cache(cache)
  keys = [_cache_key(config, t, o, key) for t, o in jobs]
  todo = list(
    {k: (config, t, o, plan_fn) for (t, o), k in zip(jobs, keys) if k not in done}.items()
  )
  if todo:
    print(f'compiling {len(todo)} plans ({len(jobs) - len(todo)} cached), {workers} at a time...')
    pool = None
    if workers <= 1 and not fresh:
      results = map(_worker, [job for _, job in todo])
    else:
      ctx = multiprocessing.get_context('spawn')
      once = {'max_tasks_per_child': 1} if fresh else {}
      pool = concurrent.futures.ProcessPoolExecutor(max(workers, 1), mp_context=ctx, **once)
      results = pool.map(_worker, [job for _, job in todo])
    for (k, (_, t, o, _)), r in zip(todo, results):
      done = _load_cache(cache) | {k: r}  # another planner may have added plans meanwhile
      _save_cache(done, cache)
      print(f'  {t} {_flags(o) or "(as configured)"}: {_verdict(r)}', flush=True)
    if pool:
      pool.shutdown()
  return [done[k] for k in keys]


def _verdict(r: dict) -> str:
  if r.get('fits'):
    return (
      f'{_gib(r["need_bytes"])} per device, '
      f'{100 * r["headroom"]:.0f}% free, '
      f'est. {r["est_step_seconds"]:.3g} s/step'
    )
  return 'does not fit' if 'HBM' in r.get('error', '') else f'refused: {r.get("error", "?")}'


def _flags(overrides: dict) -> str:
  return ' '.join(f'--config.{k}={_arg(v)}' for k, v in overrides.items())


def _divisors_pow2(n: int, limit: int) -> list[int]:
  return [2**i for i in range(int(math.log2(limit)) + 1) if n % 2**i == 0]


def neighbours(config, devices: int, base: dict, slices: int = 1) -> list[dict]:
  """Settings one change away from `base` (overrides of `config`): the expert axis, the context
  axis, the experts' backend, dispatch (dropless unbounded or with a bounded receive buffer, or
  capacity), remat, micro-batches, under LoRA the base's storage, and across `slices` slices a
  pipeline stage per slice. Changes to what `base` already has are left out."""

  m = config.model
  now = with_overrides(config, base)
  stage, context = full_shape(now.mesh.shape)[0], full_shape(now.mesh.shape)[4]
  out = []
  room = devices // (stage * context)
  for e in _divisors_pow2(m.n_routed_experts, min(room, m.n_routed_experts)):
    out.append(
      {'mesh.shape': mesh_shape(stage, e, context), 'mesh.rules': 'fsdp_ep' if e > 1 else 'fsdp'}
    )
  out += context_neighbours(now, devices)
  out += backend_neighbours(now)
  out += [
    {'engine.moe_dispatch': 'dropless', 'engine.moe_ep_recv_factor': f} for f in (0.0, 2.0, 1.25)
  ]
  out.append({'engine.moe_dispatch': 'capacity', 'engine.moe_capacity_factor': 1.25})
  out += [{'engine.remat': r} for r in ('full', 'save_moe', 'save_dots', 'none')]
  rows = config.data.global_batch_size
  out += [{'optim.grad_accum_steps': a} for a in (1, 2, 4, 8) if rows % a == 0]
  if config.lora.rank:
    out += [{'engine.quant': q} for q in ('none', 'int8', 'int4')]
  out += pipeline_neighbours(config, now, slices)
  current = lambda k: tuple(now[k]) if isinstance(now[k], tuple) else now[k]  # noqa: E731
  return [base | o for o in out if any(current(k) != v for k, v in o.items())]


def mesh_shape(stage: int, expert: int, context: int) -> tuple:
  """A mesh.shape of the search: fsdp takes the devices the other axes leave (-1); the short
  forms while stage or context is 1."""
  if context > 1:
    return (stage, 1, -1, expert, context, 1)
  return (stage, 1, -1, expert, 1) if stage > 1 else (1, -1, expert, 1)


def context_neighbours(now, devices: int) -> list[dict]:
  """Each row's tokens split over 'context' in 2, 4, ... shards (docs/context.md), within what
  the stage and expert axes leave and while the row cuts into the load balance's 2C chunks;
  from a split row, back to whole ones; on a split row, the other way to its keys (the ring,
  whose shards hold one other shard's keys and values at a time, or the all-gather). What a row
  too long for a chip needs."""
  shape = full_shape(now.mesh.shape)
  stage, expert, context = shape[0], shape[3], shape[4]
  free = devices // (stage * expert)
  out = [
    {'mesh.shape': mesh_shape(stage, expert, c)}
    for c in _divisors_pow2(free, free)
    if c != context and now.data.seq_len % (2 * c) == 0
  ]
  if context > 1:
    other = 'all_gather' if now.engine.context_attention == 'ring' else 'ring'
    out.append({'engine.context_attention': other})
  return out


def backend_neighbours(now) -> list[dict]:
  """The routed experts' other TPU backend: megablox (each batch shard's own rows against the
  experts gathered whole) where 'auto' runs ragged_dot (under LoRA), and back. Without an
  expert axis XLA partitions ragged_dot itself, and it ran every chip's routed rows on each chip
  against the experts split on their input axis: HBM and ICI bytes that an expert axis, or
  megablox's local rows, avoid (bench/RESULTS.md, "Context parallelism"). Megablox gathers
  each layer's experts whole, which large experts without an expert axis cannot afford."""
  cfg = model_config(now).laid_out('tpu', full_shape(now.mesh.shape))
  backend = dispatch.resolve_backend(cfg)
  if backend not in ('ragged_dot', 'megablox'):
    return []
  return [{'engine.moe_backend': 'megablox' if backend == 'ragged_dot' else 'ragged_dot'}]


def pipeline_neighbours(config, now, slices: int) -> list[dict]:
  """Across slices, the layers pipelined with one stage per slice (the stage axis over the
  data-center network, docs/pipeline.md) in S, 2S or 4S micro-batches, keeping the expert axis;
  from a pipelined setting, the circular schedule with 2 repeats (or back to 1) and no pipeline
  (the config's own mesh.dcn_shape)."""

  if slices < 2:
    return []
  shape = full_shape(now.mesh.shape)
  rows = now.data.global_batch_size // now.optim.grad_accum_steps
  staged = {
    'mesh.shape': mesh_shape(slices, shape[3], shape[4]),
    'mesh.dcn_shape': (slices, 1, 1, 1, 1),
  }
  out = [
    staged | {'engine.pipeline_microbatches': k * slices}
    for k in (1, 2, 4)
    if rows % (k * slices) == 0
  ]
  if shape[0] > 1:
    repeats = 1 if now.engine.pipeline_repeats > 1 else 2
    cfg = model_config(now).laid_out('tpu', shape)
    try:
      stages.check(cfg.with_engine(pipeline_repeats=repeats))
      out.append({'engine.pipeline_repeats': repeats})
    except ValueError:  # layer runs the repeats do not split
      pass
    unstaged = mesh_shape(1, shape[3], shape[4])
    dcn = tuple(config.mesh.dcn_shape)
    out.append(
      {
        'mesh.shape': unstaged,
        'mesh.dcn_shape': dcn,
        'engine.pipeline_microbatches': 1,
        'engine.pipeline_repeats': 1,
      }
    )
  return out


def drops_tokens(overrides: dict, config) -> bool:
  """Whether these settings bound the tokens an expert receives (overflow is dropped and
  reported as moe/dropped_frac): capacity dispatch, or a bounded receive buffer that drops its
  overflow (engine.moe_ep_overflow='drop'; 'rounds' exchanges it in further rounds)."""
  m = with_overrides(config, overrides).model
  bounded = m.engine.moe_ep_recv_factor > 0 and m.engine.moe_ep_overflow == 'drop'
  return m.engine.moe_dispatch == 'capacity' or bounded


def _ok(r: dict) -> bool:
  return r.get('fits') and r.get('headroom', 0) >= HEADROOM


def search(config, topology: str, workers: int, rounds: int = 3, cache: str = CACHE) -> dict:
  """Coordinate search from the config as given: each round compiles every setting one change
  away from the best so far; the best is the fastest estimate among plans that keep HEADROOM
  free, or while none does, the smallest."""
  topo = topology_lib.parse(topology)
  best_o = {}
  (best,) = plan_many(config, [(topology, best_o)], workers, cache)
  for _ in range(rounds):
    cands = neighbours(config, topo.num_devices, best_o, topo.slices)
    results = plan_many(config, [(topology, o) for o in cands], workers, cache)
    start = best
    for o, r in zip(cands, results):
      if _better(r, best):
        best, best_o = r, o
    if best is start:  # no neighbour improves on it
      break
  return best


def _better(r: dict, than: dict) -> bool:
  if _ok(r) != _ok(than):
    return _ok(r)
  if _ok(r):
    return r['est_step_seconds'] < than['est_step_seconds']
  size = lambda x: (x.get('per_chip_bytes') or {}).get('total') or math.inf
  return size(r) < size(than)


METHODS = {
  'lora': {'engine.quant': 'none'},
  'qlora-int8': {'engine.quant': 'int8'},
  'qlora-int4': {'engine.quant': 'int4'},
  'full': {'lora.rank': 0, 'engine.quant': 'none', 'lora.train_router': False},
}


def slice_overrides(config, devices: int) -> dict:
  """The config's settings scaled to a slice of `devices`: the expert axis as configured where
  it fits, else the slice; the batch rounded up to a multiple of the batch shards (every device
  needs a row), in micro-batches of one row per device (the least activation memory)."""
  m = config.model
  e = config.mesh.shape[2] if config.mesh.shape[2] > 0 else 1
  e = max(d for d in _divisors_pow2(m.n_routed_experts, min(devices, e, m.n_routed_experts)))
  rows = -(-config.data.global_batch_size // devices) * devices
  return {
    'mesh.shape': (1, -1, e, 1),
    'mesh.rules': 'fsdp_ep' if e > 1 else 'fsdp',
    'data.global_batch_size': rows,
    'data.eval_batch_size': -(-config.data.eval_batch_size // devices) * devices,
    'optim.grad_accum_steps': rows // devices,
  }


def smallest(config, generations, workers: int, max_chips: int = 4096, cache: str = CACHE):
  """For each generation and method (LoRA, QLoRA int8/int4 under a LoRA config; full training
  always), the smallest power-of-two slice whose plan keeps HEADROOM free: a bisection over
  slice sizes (memory per device falls as the slice grows), each compile cached."""
  rows = []
  for gen in generations:
    chip = topology_lib.CHIPS[gen]
    for method, over in METHODS.items():
      if method != 'full' and not config.lora.rank:
        continue
      lo, hi, found = 0, int(math.log2(max_chips)), None
      while lo <= hi:
        mid = (lo + hi) // 2
        chips = 2**mid
        topo = f'{gen}:{topology_lib._torus(chips, chip.dims)}'
        devices = chips * chip.devices_per_chip
        job = (topo, over | slice_overrides(config, devices))
        (r,) = plan_many(config, [job], workers, cache)
        if _ok(r):
          found, hi = r, mid - 1
        else:
          lo = mid + 1
      rows.append({'generation': gen, 'method': method, 'plan': found})
  return rows


def generations(names: str) -> list[str]:
  """--topology for --smallest: generations ('v5p,v6e') or slices of them ('v5p-128')."""
  out = []
  for name in names.split(','):
    name = topology_lib.ALIASES.get(name.strip(), name.strip())
    out.append(name if name in topology_lib.CHIPS else topology_lib.parse(name).chip.generation)
  return out


def remat_table(config, topology: str, workers: int, cache: str = CACHE) -> list[dict]:
  """The step compiled under every remat policy: what each keeps per device and what it
  recomputes, against `none` (nothing recomputed, every activation kept) and the configured one.
  One row per policy: the plan, and for those that compiled their bytes and FLOPs as ratios."""

  plans = plan_many(
    config, [(topology, {'engine.remat': p}) for p in REMAT_POLICIES], workers, cache
  )
  by = dict(zip(REMAT_POLICIES, plans))
  ref = by['none'] if 'hlo_flops_per_chip' in by['none'] else None
  rows = []
  for policy, r in by.items():
    row = {'remat': policy, 'plan': r}
    if 'hlo_flops_per_chip' in r and ref:
      row['flops_vs_none'] = r['hlo_flops_per_chip'] / ref['hlo_flops_per_chip']
    need = r.get('per_chip_bytes', {}).get('total')
    if need and ref:
      row['bytes_vs_none'] = need / ref['per_chip_bytes']['total']
    rows.append(row)
  return rows


def print_remat_table(rows: list[dict], configured: str) -> None:
  hbm = next(r['plan']['hbm_bytes'] for r in rows)
  print(f'remat policies ({_gib(hbm)} HBM per device; compiled FLOPs include the recomputation):')
  print(
    f'  {"remat":<10}{"per device":>12}{"temporaries":>13}{"host offload":>14}'
    f'{"vs none":>9}{"FLOPs vs none":>15}{"est. s/step":>13}  fits'
  )
  for row in rows:
    r, mark = row['plan'], '*' if row['remat'] == configured else ' '
    m = r.get('per_chip_bytes', {})
    if 'hlo_flops_per_chip' not in r:
      need = f'needs {_gib(m["total"])}' if m.get('total') else r.get('error', '?')[:60]
      print(f'{mark} {row["remat"]:<10}{need}')
      continue
    vs = {k: f'{row[k]:.2f}x' if k in row else '-' for k in ('bytes_vs_none', 'flops_vs_none')}
    print(
      f'{mark} {row["remat"]:<10}{_gib(m["total"]):>12}{_gib(m["temporaries"]):>13}'
      f'{_gib(m["host"]):>14}{vs["bytes_vs_none"]:>9}{vs["flops_vs_none"]:>15}'
      f'{r["est_step_seconds"]:>13.3g}  {"yes" if r["fits"] else "NO"}'
    )
  print('  (* the configured policy; est. = roofline estimate, not a measurement)')


def main(
  config,
  topology: str,
  do_search: bool,
  do_smallest: bool,
  json_path: str,
  workers,
  remat=False,
  cache: str = CACHE,
):
  """The planner's CLI behind tools/plan.py. Every plan is cached by its inputs in `cache`."""
  if remat:
    rows = remat_table(config, topology, workers, cache)
    print_remat_table(rows, config.engine.remat)
    _write(json_path, rows)
    return
  if do_smallest:
    rows = smallest(config, generations(topology), workers, cache=cache)
    for row in rows:
      r = row['plan']
      where = (
        f'{r["topology"]} ({r["chips"]} chips): {_gib(r["per_chip_bytes"]["total"])} per '
        f'device, est. {r["est_step_seconds"]:.2f} s/step, MFU {100 * r["est_mfu"]:.0f}%\n'
        f'    {_flags(r["overrides"])}'
        if r
        else 'none up to 4096 chips'
      )
      print(f'{row["generation"]:>6} {row["method"]:<11} smallest slice: {where}')
    _write(json_path, rows)
    return
  if do_search:
    best = search(config, topology, workers, cache=cache)
    print_plan(best)
    if _ok(best):
      print(f'fastest plan that leaves {HEADROOM:.0%} of the HBM free, as flags to paste:')
      print('  ' + (_flags(best['overrides']) or '(the config as it is)'))
      if drops_tokens(best['overrides'], config):
        print('  (it bounds the tokens per expert: overflow is dropped, see moe/dropped_frac)')
    else:
      print(f'no setting tried leaves {HEADROOM:.0%} of the HBM free; the smallest is above')
    _write(json_path, best)
    return
  say = lambda line: print(f'[{topology}] {line}', flush=True)
  key = _cache_key(config, topology, {})
  r = _load_cache(cache).get(key)
  if r is None:
    r = plan(config, topology, progress=say)
    _save_cache(_load_cache(cache) | {key: r}, cache)
  else:
    say(f'answered from the plan cache ({cache}: same config, code and jax version)')
  print_plan(r)
  _write(json_path, r)


def _write(path: str, obj) -> None:
  if path:
    pathlib.Path(path).write_text(json.dumps(obj, indent=1, default=str))

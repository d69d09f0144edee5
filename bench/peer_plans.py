"""moetrain's training step beside MaxText's on the same work, compiled for a TPU slice on this
host (libtpu, no TPU), both read by one estimator.

  python -m bench.peer_plans [--points mixtral_8x7b,qwen3_30b_a3b,mixtral_8x7b_ep8] [--write]
  python -m bench.peer_plans --calibrate [--json FILE]     # MaxText's published recipes

Each point is full training (float32 weights and Adam moments, bfloat16 compute, remat full,
dropless experts, scanned layers) of one model with the same batch, mesh and slice on both
sides. The peer, maxtext[tpu]==0.2.5, is installed on first use into .peer/maxtext (its own
Python 3.12 venv: about 235 packages), and compiled there by bench/peer_maxtext_compile.py. Both
optimized HLO modules go through moetrain.core.hlo_cost (FLOPs with loop trip counts, splash and
grouped-matmul kernels priced by the rows a balanced routing sends them, whatever buffer each
side runs them over; HBM and collective bytes) and the planner's roofline with the chip's peak
rates; MFU divides the same model FLOPs (moetrain's formula for the model) on both. --write
replaces the table in bench/RESULTS.md ("Peer comparison: MaxText on the same TPU step").

--calibrate compiles MaxText's published MoE recipes (bench/peer_recipes.py: the runs whose step
times Google published, with their configs) and moetrain's plans of the same work, and turns the
estimates into predictions: measured / MaxText's estimate, times moetrain's estimate. Every
compile is kept in .peer/plans/NAME/SIDE; --reuse reads them back instead of compiling again."""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

from bench import peer_recipes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = os.path.join(ROOT, '.peer', 'maxtext')
PEER_PACKAGE = 'maxtext[tpu]==0.2.5'
OUT = os.path.join(ROOT, '.peer', 'plans')


@dataclasses.dataclass(frozen=True)
class Point:
  """One piece of work, as each side spells it."""

  topology: str
  config: str  # moetrain's config file and variant
  overrides: dict  # moetrain config overrides
  maxtext: tuple  # MaxText key=value overrides
  note: str  # where the two sides' settings differ, in words
  # moetrain compiled again with these overrides too, a column each: {label: overrides}
  variants: dict = dataclasses.field(default_factory=dict)


_FULL_TRAINING = {
  'lora.rank': 0,
  'engine.param_dtype': 'float32',
  'engine.remat': 'full',
  'engine.moe_dispatch': 'dropless',
  'mesh.shape': (1, -1, 1, 1),
}
_MAXTEXT_COMMON = (
  'compile_topology_num_slices=1',
  'remat_policy=full',
  'weight_dtype=float32',
  'dtype=bfloat16',
  'ici_fsdp_parallelism=-1',
  'dataset_type=synthetic',
  'enable_checkpointing=false',
  'base_output_directory=/tmp/maxtext_peer',
  'run_name=peer',
)
POINTS = {
  'mixtral_8x7b': Point(
    'v5p-32',
    'configs/mixtral_lora.py:variant=mixtral_8x7b',
    _FULL_TRAINING | {'data.global_batch_size': 32, 'data.seq_len': 4096},
    (
      'compile_topology=v5p-32',
      'model_name=mixtral-8x7b',
      'per_device_batch_size=2',
      'max_target_length=4096',
      *_MAXTEXT_COMMON,
    ),
    'MaxText defaults kept: splash attention (block 512), megablox, capacity_factor=-1 '
    '(dropless), AdamW with weight decay 0.1 and clipping 1.0.',
    {'gather_weights=False': {'engine.gather_weights': False}},
  ),
  'qwen3_30b_a3b': Point(
    'v5p-32',
    'configs/qwen3_moe_lora.py:variant=qwen3_30b_a3b',
    _FULL_TRAINING | {'data.global_batch_size': 32, 'data.seq_len': 4096},
    (
      'compile_topology=v5p-32',
      'model_name=qwen3-30b-a3b',
      'per_device_batch_size=2',
      'max_target_length=4096',
      *_MAXTEXT_COMMON,
    ),
    'As Mixtral; Qwen3-30B-A3B: 48 layers, 128 experts top-8, GQA 32/4 heads with qk-norm.',
  ),
  'mixtral_8x7b_ep8': Point(
    'v5p-32',
    'configs/mixtral_lora.py:variant=mixtral_8x7b',
    _FULL_TRAINING
    | {
      'data.global_batch_size': 32,
      'data.seq_len': 4096,
      'mesh.shape': (1, -1, 8, 1),
      'engine.moe_ep_recv_factor': 2.0,
    },
    (
      'compile_topology=v5p-32',
      'model_name=mixtral-8x7b',
      'per_device_batch_size=2',
      'max_target_length=4096',
      'ici_expert_parallelism=8',
      *_MAXTEXT_COMMON,
    ),
    'The Mixtral point with the experts over 8 chips and FSDP over 2 (MaxText: '
    'ici_expert_parallelism=8, its ragged all-to-all and megablox); moetrain bounds its '
    'receive buffer at twice the balanced rows (overflow in further rounds, still dropless).',
  ),
}


def ensure_peer() -> str:
  """The peer venv's Python, installing maxtext[tpu] there first if it is not yet."""
  python = os.path.join(PEER, 'bin', 'python')
  probe = [python, '-c', 'import maxtext.trainers.pre_train.train_compile']
  if os.path.exists(python) and subprocess.run(probe, capture_output=True).returncode == 0:
    return python
  print(f'installing {PEER_PACKAGE} into {PEER} (several minutes)...', flush=True)
  base = next(
    p
    for p in (sys.executable, 'python3.12', 'python3.13')
    if subprocess.run([p, '-c', 'import sys; sys.exit(sys.version_info < (3, 12))']).returncode == 0
  )
  subprocess.run([base, '-m', 'venv', PEER], check=True)
  subprocess.run([python, '-m', 'pip', 'install', '-q', PEER_PACKAGE], check=True)
  return python


def compile_peer(name: str, point, python: str, libtpu_args: str = '', reuse: bool = False) -> dict:
  """MaxText's step for the point (or recipe): its memory and optimized HLO text, via the peer
  venv; libtpu_args: XLA options for libtpu (LIBTPU_INIT_ARGS); reuse: read a compile written
  to OUT/name/maxtext before instead of compiling again."""
  out = os.path.join(OUT, name, 'maxtext')
  if reuse and (saved := _saved(out)):
    return saved
  env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'XLA_FLAGS')}
  env |= {'JAX_PLATFORMS': 'cpu', 'TPU_SKIP_MDS_QUERY': '1'}
  if libtpu_args:
    env['LIBTPU_INIT_ARGS'] = libtpu_args
  start = time.time()
  run = subprocess.run(
    [python, os.path.join(ROOT, 'bench', 'peer_maxtext_compile.py'), out, *point.maxtext],
    capture_output=True,
    text=True,
    env=env,
  )
  if run.returncode:
    tail = '\n'.join((run.stdout + run.stderr).splitlines()[-20:])
    raise RuntimeError(f'MaxText compile for {name} failed:\n{tail}')
  with open(os.path.join(out, 'memory.json')) as f:
    memory = json.load(f)['memory']
  with open(os.path.join(out, 'train_step.hlo.txt')) as f:
    text = f.read()
  return {'memory': memory, 'hlo': text, 'seconds': time.time() - start}


def compile_ours(name: str, point, label: str = 'moetrain', reuse: bool = False) -> dict:
  """moetrain's step for the point, as the planner compiles it: memory and HLO text (also
  written beside MaxText's, in OUT/name/label), plus the setup (for the model FLOPs, the chip
  and the batch). reuse: read a compile written there before instead of compiling again."""
  import importlib

  from moetrain.planner import topology, tpu_plan
  from moetrain.run.startup import build
  from moetrain.training import aot

  path, arg = point.config.split(':')
  module = importlib.import_module(path.removesuffix('.py').replace('/', '.'))
  topo = topology.parse(point.topology)
  config = tpu_plan.with_overrides(module.get_config(arg), point.overrides)
  devices = topo.devices()
  setup = build(config, num_devices=len(devices), process_count=1, platform='tpu')
  out = os.path.join(OUT, name, label.replace(' ', '_').replace(',', ''))
  side = {'setup': setup, 'chip': topo.chip, 'engine': tpu_plan.engine_of(setup.model)}
  if reuse and (saved := _saved(out)):
    return side | saved
  start = time.time()
  steps = aot.compile_steps(setup, setup.make_mesh(devices), evaluate=False)
  train = steps['train']
  os.makedirs(out, exist_ok=True)
  text = train.executable.as_text()
  with open(os.path.join(out, 'train_step.hlo.txt'), 'w') as f:
    f.write(text)
  seconds = time.time() - start
  with open(os.path.join(out, 'memory.json'), 'w') as f:
    json.dump({'memory': train.memory, 'seconds': seconds, 'overrides': point.overrides}, f)
  return side | {'memory': train.memory, 'hlo': text, 'seconds': seconds}


def _saved(out: str) -> dict | None:
  """A compile written to `out` before (train_step.hlo.txt and memory.json), or None."""
  paths = [os.path.join(out, f) for f in ('train_step.hlo.txt', 'memory.json')]
  if not all(os.path.exists(p) for p in paths):
    return None
  with open(paths[1]) as f:
    saved = json.load(f)
  with open(paths[0]) as f:
    return {'memory': saved['memory'], 'hlo': f.read(), 'seconds': saved.get('seconds', 0.0)}


def read(side: dict, setup, chip) -> dict:
  """One estimator over a side's optimized HLO: hlo_cost's counts and the planner's roofline
  (`setup`: the work, whose tokens and micro-batches price the grouped matmuls)."""
  from moetrain.core import hlo_cost
  from moetrain.planner import sizes, tpu_plan

  m = side['memory']
  total = m['arguments'] + m['outputs'] - m['aliased'] + m['temporaries'] + m['code']
  # Both sides' grouped expert matmuls priced by the rows a balanced routing sends them (the
  # same work: each device's tokens x top-k), whatever buffer each side runs them over.
  micro = setup.data.global_batch_size // setup.optim.grad_accum_steps
  rows = sizes.routed_rows(setup.model, setup.mesh_shape, setup.data.seq_len, micro)
  # Overflow rounds of a bounded exchange (data-dependent loops) counted zero times, as the
  # planner does: the estimate is of a step whose routing fits the buffer.
  cost = hlo_cost.routed_rows(hlo_cost.analyse(side['hlo'], unknown_trips=0), rows)
  grouped = sum(f for f, _ in cost.grouped) - cost.grouped_padding_flops
  flops, _ = tpu_plan.model_flops(setup)
  est = tpu_plan.estimate(cost, chip, flops / chip_count(setup), setup.data)
  return {
    'arguments': m['arguments'],
    'temporaries': m['temporaries'],
    'total': total,
    'flops': cost.flops,
    'grouped_flops': grouped,
    'grouped_padding_flops': cost.grouped_padding_flops,
    'hbm_bytes': cost.hbm_bytes,
    'collective_bytes': cost.collective_bytes,
    'step': est['est_step_seconds'],
    'bound': est['est_bound_by'],
    'parts': est['est_seconds_by_part'],
    'mfu': est['est_mfu'],
    'compile_seconds': side['seconds'],
  }


def chip_count(setup) -> int:
  import math

  return math.prod(setup.mesh_shape)


def table(name: str, point: Point, columns: dict, hbm: int) -> str:
  """The side-by-side table: columns {heading: read(...)}, moetrain's first."""
  gib = lambda b: f'{b / 2**30:.2f}'
  rows = [
    ('arguments / temporaries GiB', lambda r: f'{gib(r["arguments"])} / {gib(r["temporaries"])}'),
    ('total GiB (of ' + gib(hbm) + ')', lambda r: gib(r['total'])),
    ('compiled FLOPs', lambda r: f'{r["flops"]:.4g}'),
    ('grouped expert-matmul FLOPs (routed rows)', lambda r: f'{r["grouped_flops"]:.4g}'),
    ("their buffers' padding (not in the estimate)", lambda r: f'{r["grouped_padding_flops"]:.3g}'),
    ('counted HBM bytes', lambda r: f'{r["hbm_bytes"]:.3g}'),
    ('collective bytes', lambda r: f'{r["collective_bytes"]:.3g}'),
    (
      'est. step (compute / HBM / ICI)',
      lambda r: (
        f'**{r["step"]:.2f} s** ({r["bound"]}; '
        + ' / '.join(f'{v:.2f}' for v in r['parts'].values())
        + ')'
      ),
    ),
    ('est. MFU', lambda r: f'{100 * r["mfu"]:.1f}%'),
    ('compile s', lambda r: f'{r["compile_seconds"]:.0f}'),
  ]
  lines = [
    f'**{name}** on {point.topology}: moetrain `{point.config}` '
    + ' '.join(f'--config.{k}={v}' for k, v in point.overrides.items()),
    f'against MaxText `{" ".join(point.maxtext)}`. {point.note}',
    '',
    '| per chip | ' + ' | '.join(columns) + ' |',
    '|---' * (len(columns) + 1) + '|',
    *['| ' + ' | '.join([label, *(fn(c) for c in columns.values())]) + ' |' for label, fn in rows],
  ]
  return '\n'.join(lines)


def versions() -> str:
  import importlib.metadata as md

  pkgs = ('jax', 'jaxlib', 'libtpu', 'flax')
  return ', '.join(f'{p} {md.version(p)}' for p in pkgs)


MARK = ('<!-- peer_plans:begin -->', '<!-- peer_plans:end -->')


def write_results(text: str) -> None:
  path = os.path.join(ROOT, 'bench', 'RESULTS.md')
  with open(path) as f:
    doc = f.read()
  start, end = doc.index(MARK[0]) + len(MARK[0]), doc.index(MARK[1])
  with open(path, 'w') as f:
    f.write(doc[:start] + '\n' + text + '\n' + doc[end:])


def best_of(name: str, recipe, found: dict, reuse: bool = False) -> tuple[str, dict]:
  """moetrain's fastest estimate among `found` ({label: read(...)}, the recipe's own setting)
  and the recipe's candidates, of those that fit the chip: (label, read(...) of it). Each
  candidate is read with its own setup (micro-batches change the rows a grouped matmul sees)."""
  from moetrain.training import aot

  for label, over in recipe.candidates.items():
    print(f'{name}: compiling moetrain, {label}...', flush=True)
    try:
      variant = dataclasses.replace(recipe, overrides=recipe.overrides | over)
      side = compile_ours(name, variant, label, reuse)
    except aot.OutOfMemory as e:
      print(f'  does not fit: {e.message}', flush=True)
      continue
    r = read(side, side['setup'], side['chip']) | {'setup': side['setup'], 'chip': side['chip']}
    print(f'  {r["total"] / 2**30:.2f} GiB, est. {r["step"]:.3f} s', flush=True)
    if r['total'] <= side['chip'].hbm_bytes:
      found[label] = r
  if not found:
    raise RuntimeError(f'{name}: no moetrain setting of the work fits {recipe.topology}')
  label = min(found, key=lambda k: found[k]['step'])
  return label, found[label]


def calibrate_recipe(name: str, python: str, reuse: bool = False) -> dict:
  """Both sides of one published recipe compiled for its slice, and the calibrated record."""
  recipe = peer_recipes.RECIPES[name]
  from moetrain.training import aot

  print(f'{name}: compiling moetrain, the same work...', flush=True)
  try:
    ours = compile_ours(name, recipe, reuse=reuse)
    same = read(ours, ours['setup'], ours['chip']) | {'setup': ours['setup'], 'chip': ours['chip']}
    refused = None
  except aot.OutOfMemory as e:  # the candidates may still fit
    same, refused = None, e.message
    print(f'  does not fit: {refused}', flush=True)
  fits = same is not None and same['total'] <= recipe.chip.hbm_bytes
  label, best = best_of(name, recipe, {'as the recipe': same} if fits else {}, reuse)
  # The work's setup (its tokens, for the model FLOPs and the routed rows): the best plan's.
  setup, chip = best['setup'], best['chip']
  print(f'{name}: compiling MaxText...', flush=True)
  maxtext = read(compile_peer(name, recipe, python, recipe.libtpu_args, reuse), setup, chip)
  tokens = setup.data.global_batch_size * setup.data.seq_len
  record = {
    'recipe': name,
    'topology': recipe.topology,
    'published': recipe.published,
    'maxtext_measured_s': recipe.measured_s,
    'maxtext_est_s': maxtext['step'],
    'moetrain_est_s': same['step'] if same else None,
    'moetrain_refused': refused,
    'moetrain_best_est_s': best['step'],
    'moetrain_best': label,
    'moetrain_best_overrides': recipe.overrides
    | ({} if label == 'as the recipe' else recipe.candidates[label]),
    'tokens_per_step': tokens,
    'maxtext': maxtext,
    'moetrain': _plain(same),
    'moetrain_best_plan': _plain(best),
    'maxtext_command': ' '.join(recipe.maxtext),
    'libtpu_args': recipe.libtpu_args,
    'versions': versions(),
  }
  return record | peer_recipes.calibrate(
    recipe.measured_s,
    maxtext['step'],
    same['step'] if same else None,
    best['step'],
    tokens,
    recipe.chips,
  )


def _plain(r: dict | None) -> dict | None:
  return None if r is None else {k: v for k, v in r.items() if k not in ('setup', 'chip')}


def _s(seconds: float | None) -> str:
  return 'does not fit' if seconds is None else f'{seconds:.2f}'


def calibration_table(records: list[dict]) -> str:
  """bench/RESULTS.md's calibration table."""
  rows = [
    '| recipe | MaxText measured | MaxText estimated | factor | moetrain estimated (same work / '
    'best) | moetrain predicted (same work / best) | tokens/s/chip: MaxText measured, moetrain '
    'best predicted |',
    '|---|---|---|---|---|---|---|',
  ]
  for r in records:
    rows.append(
      f'| {r["recipe"]} ({r["topology"]}) | {r["maxtext_measured_s"]:.3f} s | '
      f'{r["maxtext_est_s"]:.2f} s | {r["factor"]:.2f} | {_s(r["moetrain_est_s"])} / '
      f'{r["moetrain_best_est_s"]:.2f} s ({r["moetrain_best"]}) | '
      f'{_s(r["moetrain_predicted_s"])} / {r["moetrain_best_predicted_s"]:.2f} s | '
      f'{r["maxtext_measured_tokens_per_chip"]:,.0f}, '
      f'{r["moetrain_best_predicted_tokens_per_chip"]:,.0f} '
      f'({r["best_over_measured"]:.2f}x) |'
    )
  return '\n'.join(rows)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--points', default=','.join(POINTS))
  parser.add_argument('--write', action='store_true', help='update bench/RESULTS.md')
  parser.add_argument(
    '--calibrate',
    nargs='?',
    const=','.join(peer_recipes.RECIPES),
    help="compile MaxText's published recipes (bench/peer_recipes.py) and moetrain's plans of "
    'the same work; print measured / estimated and the calibrated predictions',
  )
  parser.add_argument('--json', help='--calibrate: write the records to this file')
  parser.add_argument(
    '--reuse',
    action='store_true',
    help='read compiles written to .peer/plans before instead of compiling again',
  )
  args = parser.parse_args()
  python = ensure_peer()
  if args.calibrate:
    records = [calibrate_recipe(n, python, args.reuse) for n in args.calibrate.split(',')]
    print(calibration_table(records), flush=True)
    if args.json:
      with open(args.json, 'w') as f:
        json.dump(records, f, indent=1, default=str)
    return
  sections = []
  for name in args.points.split(','):
    point = POINTS[name]
    print(f'{name}: compiling MaxText...', flush=True)
    peer = compile_peer(name, point, python, reuse=args.reuse)
    print(f'{name}: compiling moetrain...', flush=True)
    ours = compile_ours(name, point, reuse=args.reuse)
    setup, chip = ours['setup'], ours['chip']
    columns = {'moetrain': read(ours, setup, chip)}
    for label, over in point.variants.items():
      variant = dataclasses.replace(point, overrides=point.overrides | over)
      columns[f'moetrain, {label}'] = read(
        compile_ours(name, variant, label, args.reuse), setup, chip
      )
    columns['MaxText 0.2.5'] = read(peer, setup, chip)
    rows = table(name, point, columns, chip.hbm_bytes)
    print(rows, flush=True)
    sections.append(rows)
  text = '\n\n'.join(
    [
      f'{time.strftime("%Y-%m-%d")}, this 2-core CPU host compiling for the slice with libtpu '
      f'(no TPU); both sides on {versions()}.',
      *sections,
    ]
  )
  if args.write:
    write_results(text)


if __name__ == '__main__':
  main()

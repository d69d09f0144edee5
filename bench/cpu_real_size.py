"""Fine-tuning at released shapes on this CPU host: a training run in a subprocess (default:
Moonlight-16B-A3B with a random int4 base and LoRA, 1 x 1024 tokens, two steps and the end's
evaluation), its peak resident memory (the child's getrusage), start-up time, step time, tokens/s
and the step's model FLOPs as a fraction of the host's measured matmul rate; with --plan, the CPU
plan of the same command first and its prediction beside the measurement. One JSON record.

  python -m bench.cpu_real_size --plan --out=bench/cpu_real_size.jsonl   # minutes, ~13 GiB
  python -m bench.cpu_real_size --preset=tiny --plan                     # a smoke test

Extra --config.* flags after `--` are added to the run's command (and the plan's).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # a CPU measurement (and no TPU plugin's warnings)

from bench.common import machine  # noqa: E402

RUN = (
  '--config.mesh.shape=(1,-1,1,1)',
  '--config.data.global_batch_size=1',
  '--config.data.eval_batch_size=1',
  '--config.train.steps=2',
  '--config.optim.warmup_steps=0',
)
PRESETS = {
  'moonlight_int4': (
    '--config=configs/deepseek_v3_lora.py:variant=moonlight_16b_a3b',
    '--config.engine.quant=int4',
    '--config.data.seq_len=1024',
    *RUN,
  ),
  # bench/hf_real_size.py's work (transformers + PEFT): OLMoE-1B-7B, LoRA over a bfloat16 base.
  'olmoe_bf16': (
    '--config=configs/olmoe_lora.py:variant=olmoe_1b_7b',
    '--config.engine.quant=none',
    '--config.engine.param_dtype=bfloat16',
    '--config.data.seq_len=1024',
    *RUN,
  ),
  'tiny': ('--config=configs/deepseek_v3_lora.py', '--config.engine.quant=int4', *RUN),
}
START_DONE = ('Initialising the model: done', 'Importing')


def run(module: str, args: list[str], env: dict | None = None, cores: int = 0) -> dict:
  """`python -m module args` in a subprocess (on the first `cores` CPUs only, with taskset,
  when given): its output lines with the seconds since its start, its peak resident bytes and
  its wall time."""
  pin = ['taskset', '-c', f'0-{cores - 1}'] if cores else []
  t0 = time.perf_counter()
  p = subprocess.Popen(
    [*pin, sys.executable, '-m', module, *args],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env={**os.environ, **(env or {})},
  )
  lines = [(time.perf_counter() - t0, line.rstrip()) for line in p.stdout]
  _, status, usage = os.wait4(p.pid, 0)
  code = os.waitstatus_to_exitcode(status)
  if code:
    tail = '\n'.join(ln for _, ln in lines[-30:])
    raise SystemExit(f'python -m {module} failed ({code}):\n{tail}')
  return {'lines': lines, 'peak_rss': usage.ru_maxrss * 1024, 'seconds': time.perf_counter() - t0}


def timings(done: dict, workdir: str, steps: int) -> dict:
  """Start-up (the process's start to its state made), the mean step (from the step-0
  evaluation's record to the last step's) and whether the end's evaluation ran."""
  start = next(t for t, ln in done['lines'] if ln.startswith(START_DONE) and 'done in' in ln)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(ln) for ln in f]
  evals = {r['step']: r for r in records if r['kind'] == 'eval'}
  train = [r for r in records if r['kind'] == 'train']
  step_s = (train[-1]['time'] - evals[0]['time']) / steps
  return {'startup_s': start, 'step_s': step_s, 'end_eval': steps in evals, 'last': train[-1]}


def model_flops(flags: list[str]) -> tuple[float, str, str, int]:
  """The step's model FLOPs (planner/tpu_plan.model_flops), their formula, the compute dtype and
  the tokens of a step."""
  from absl import flags as absl_flags
  from ml_collections import config_flags

  from moetrain.core import runtime
  from moetrain.planner import cpu_plan, tpu_plan
  from moetrain.run.startup import build

  argv = ['bench', *flags]  # (the override flags are found in the argv given at definition)
  config_flags.DEFINE_config_file('config', None, '', lock_config=True, sys_argv=argv)
  runtime.parse_flags(argv)
  config = absl_flags.FLAGS.config
  config = tpu_plan.with_overrides(config, cpu_plan.one_device(config))
  setup = build(config, num_devices=1, process_count=1, platform='cpu')
  flops, formula = tpu_plan.model_flops(setup)
  dtype = 'float32' if setup.model.engine.dtype == 'float32' else 'bfloat16'
  return flops, formula, dtype, setup.data.global_batch_size * setup.data.seq_len


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--preset', default='moonlight_int4', choices=sorted(PRESETS))
  ap.add_argument('--plan', action='store_true', help='plan the command first (--topology=cpu)')
  ap.add_argument('--out', default='', help='append the JSON record to this file')
  ap.add_argument('--workdir', default='', help="the run's directory (default: a temporary one)")
  ap.add_argument('--cores', type=int, default=0, help='run on the first N CPUs only (taskset)')
  ap.add_argument('extra', nargs='*', help='further --config.* flags (after --)')
  a = ap.parse_args()
  from moetrain.planner import cpu_plan

  flags = [*PRESETS[a.preset], *a.extra]
  record = {'bench': 'cpu_real_size', 'preset': a.preset, 'flags': flags, **machine()}
  record['cores'] = a.cores or os.cpu_count()
  measured = cpu_plan.host_measurements()
  if a.plan:
    with tempfile.TemporaryDirectory() as d:
      plan_json = os.path.join(d, 'plan.json')
      done = run('moetrain.tools.plan', [*flags, '--topology=cpu', f'--json={plan_json}'])
      with open(plan_json) as f:
        p = json.load(f)
    record['plan'] = {k: p[k] for k in ('need_bytes', 'need_step', 'fits', 'headroom')}
    record['plan'] |= {'host_bytes': p['host_bytes'], 'est_step_seconds': p['est_step_seconds']}
    print('plan: ' + next(ln for _, ln in done['lines'] if ln.startswith('needs ')), flush=True)
  workdir = a.workdir or tempfile.mkdtemp(prefix='cpu_real_size_')
  args = [*flags, f'--workdir={workdir}', '--config.train.compilation_cache=']
  done = run('moetrain.main', args, cores=a.cores)
  steps = int(next(f.split('=')[1] for f in flags[::-1] if f.startswith('--config.train.steps=')))
  t = timings(done, workdir, steps)
  flops, formula, dtype, tokens = model_flops(flags)
  rate = measured['matmul_flops'][dtype]
  record |= {
    'peak_rss_bytes': done['peak_rss'],
    'wall_s': done['seconds'],
    'startup_s': t['startup_s'],
    'step_s': t['step_s'],
    'tokens_per_sec': tokens / t['step_s'],
    'end_eval': t['end_eval'],
    'loss': t['last']['loss'],
    'model_flops_per_step': flops,
    'model_flops_formula': formula,
    'matmul_dtype': dtype,
    'matmul_flops': rate,
    'fraction_of_matmul_rate': flops / t['step_s'] / rate,
  }
  if 'plan' in record:
    record['plan_over_measured'] = record['plan']['need_bytes'] / done['peak_rss']
  print(json.dumps(record), flush=True)
  if a.out:
    with open(a.out, 'a') as f:
      f.write(json.dumps(record) + '\n')


if __name__ == '__main__':
  main()

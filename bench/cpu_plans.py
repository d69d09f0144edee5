"""What fits a CPU host of 32, 64 and 128 GiB: the CPU plan (--topology=cpu) of each family's LoRA
run at its released shapes, one 1024-token row per step, with a bfloat16, int8 or int4 base, and
the table of predicted peaks against those RAM sizes (fits: 10% of the RAM left free). The peak
does not depend on the host's RAM, so one compile per row serves the three sizes. Each plan is
cached (planner/tpu_plan.CACHE), so a rerun prints at once.

  python -m bench.cpu_plans [--only moonlight_16b_a3b,olmoe_1b_7b] [--storage int4,int8]
"""

import argparse
import json
import subprocess
import sys
import tempfile

from bench import common  # noqa: F401  (huge-page malloc, as the plan CLI re-executes for it)

FAMILIES = {
  'moonlight_16b_a3b': 'configs/deepseek_v3_lora.py',
  'olmoe_1b_7b': 'configs/olmoe_lora.py',
  'qwen3_30b_a3b': 'configs/qwen3_moe_lora.py',
  'mixtral_8x7b': 'configs/mixtral_lora.py',
}
STORAGE = {'bf16': 'none', 'int8': 'int8', 'int4': 'int4'}
ROW = (
  '--config.mesh.shape=(1,-1,1,1)',
  '--config.data.global_batch_size=1',
  '--config.data.eval_batch_size=1',
  '--config.data.seq_len=1024',
)
HOSTS = (32, 64, 128)
HEADROOM = 0.10


def plan(variant: str, storage: str) -> dict:
  flags = [f'--config={FAMILIES[variant]}:variant={variant}', *ROW]
  flags.append(f'--config.engine.quant={STORAGE[storage]}')
  with tempfile.NamedTemporaryFile(suffix='.json') as f:
    cmd = [
      sys.executable,
      '-m',
      'moetrain.tools.plan',
      *flags,
      '--topology=cpu',
      f'--json={f.name}',
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
      return {'error': done.stderr.strip().splitlines()[-1]}
    return json.load(f) | {'command': ' '.join(cmd[1:-1])}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--only', default=','.join(FAMILIES))
  ap.add_argument('--storage', default=','.join(STORAGE))
  a = ap.parse_args()
  print(
    '| model | base | predicted peak GiB | est. tokens/s here | '
    + ' | '.join(f'{h} GiB' for h in HOSTS)
    + ' |'
  )
  print('|---|---|---|---|' + '---|' * len(HOSTS))
  for variant in a.only.split(','):
    for storage in a.storage.split(','):
      r = plan(variant, storage)
      if 'error' in r:
        print(f'| {variant} | {storage} | {r["error"]} |', flush=True)
        continue
      peak = r['need_bytes']
      fits = ['yes' if peak <= (1 - HEADROOM) * h * 2**30 else 'no' for h in HOSTS]
      print(
        f'| {variant} | {storage} | {peak / 2**30:.1f} | {r["est_tokens_per_sec"]:.0f} | '
        + ' | '.join(fits)
        + ' |',
        flush=True,
      )
      print(json.dumps({'variant': variant, 'storage': storage, **r}), file=sys.stderr, flush=True)


if __name__ == '__main__':
  main()

"""The README's flash commands compiled for the slices they are planned for (minutes each, on any
host with libtpu): python -m bench.tpu_plans [--only NAME,...] [--json DIR]. Prints the README table's
rows; bench/RESULTS.md "TPU plans" holds the results."""

import argparse
import json
import os

from configs import longcat_lora, longcat_pretrain
from moetrain.tools import tpu_plan

PLANS = {
  # name: (config module, topology, overrides): every flash command of the README, each on the
  # slice it names. QLoRA takes fewer chips for the same 64 rows of 8192 tokens, in micro-batches
  # of one row per chip.
  'lora': (longcat_lora, 'v5p-128', {}),
  'qlora-int8': (longcat_lora, 'v5p-64', {'model.quant': 'int8', 'optim.grad_accum_steps': 2}),
  'qlora-int4': (longcat_lora, 'v5p-32', {'model.quant': 'int4', 'optim.grad_accum_steps': 4}),
  # Pretraining: 1024 rows on 256 chips, four micro-batches.
  'pretrain': (longcat_pretrain, 'v5p-512', {'optim.grad_accum_steps': 4}),
  # Full fine-tuning of the LoRA command's model, batch and slice: expected not to fit.
  'full-same-slice': (
    longcat_pretrain,
    'v5p-128',
    {'data.global_batch_size': 64, 'data.eval_batch_size': 64},
  ),
}


def row(name: str, r: dict) -> str:
  if 'error' in r:
    need = (r.get('per_chip_bytes') or {}).get('total')
    need = f'temporaries alone {need / 2**30:.1f}' if need else 'refused'
    return f'| LongCat-Flash | {name} | {r["topology"]} | does not fit ({need}) | - | - | - |'
  m = r['per_chip_bytes']['total'] / 2**30
  return (
    f'| LongCat-Flash | {name} | {r["topology"]} | {m:.1f} ({r["hbm_bytes"] / 2**30:.1f}) | '
    f'{r["est_step_seconds"]:.1f} s | {r["est_tokens_per_sec"]:,.0f} | '
    f'{100 * r["est_mfu"]:.0f}% |'
  )


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--only', default='', help='comma-separated names of PLANS')
  p.add_argument('--json', default='')
  args = p.parse_args()
  for name, (module, topo, over) in PLANS.items():
    if args.only and name not in args.only.split(','):
      continue
    r = tpu_plan.plan(module.get_config('variant=flash'), topo, over)
    tpu_plan.print_plan(r)
    print(row(name, r), flush=True)
    if args.json:
      os.makedirs(args.json, exist_ok=True)
      with open(os.path.join(args.json, f'{name}.json'), 'w') as f:
        json.dump(r, f, indent=1, default=str)


if __name__ == '__main__':
  main()

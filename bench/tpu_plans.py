"""The TPU commands of docs/tpu.md compiled for the slices they are planned for (minutes each, on
any host with libtpu): python -m bench.tpu_plans [--only NAME,...] [--json DIR]. Prints the rows of
docs/tpu.md's plan table; bench/RESULTS.md "TPU plans" holds the results."""

import argparse
import json
import os

from configs import (
  deepseek_v2_lora,
  deepseek_v3_lora,
  deepseek_v32_lora,
  glm4_moe_lora,
  gpt_oss_lora,
  longcat_lora,
  longcat_pretrain,
  minimax_m2_lora,
  mixtral_lora,
  olmoe_lora,
  qwen2_moe_lora,
  qwen3_moe_lora,
  qwen3_next_lora,
)
from moetrain.planner import tpu_plan

INT8 = {'engine.quant': 'int8'}
INT4 = {'engine.quant': 'int4'}


def flash(module, topology: str, overrides: dict) -> tuple:
  return ('LongCat-Flash', module, 'variant=flash', topology, overrides)


def _kaggle(expert: int) -> dict:
  return {
    **INT4,
    'mesh.shape': (1, -1, expert, 1),
    'engine.moe_ep_recv_factor': 2.0,
    'data.global_batch_size': 8,
    'data.eval_batch_size': 8,
  }


PLANS = {
  # name: (model, config module, config argument, topology, overrides): every TPU command of
  # docs/tpu.md, each on the slice it names. QLoRA takes fewer chips for the same 64 rows of 8192
  # tokens, in micro-batches of one row per chip.
  'lora': flash(longcat_lora, 'v5p-128', {}),
  'qlora-int8': flash(longcat_lora, 'v5p-64', {**INT8, 'optim.grad_accum_steps': 2}),
  # Four micro-batches of 16 rows are one row per batch shard already. Float32 adapters leave
  # 14.3% of the HBM free (9.1% before the attention backward's fix, when it kept bfloat16 ones).
  'qlora-int4': flash(longcat_lora, 'v5p-32', {**INT4, 'optim.grad_accum_steps': 4}),
  # With the frozen base in compiler-chosen layouts int8 fits the int4 slice too.
  'qlora-int8-v5p-32': flash(longcat_lora, 'v5p-32', {**INT8, 'optim.grad_accum_steps': 4}),
  # Pretraining: 1024 rows on 256 chips, four micro-batches.
  'pretrain': flash(longcat_pretrain, 'v5p-512', {'optim.grad_accum_steps': 4}),
  # Full fine-tuning of the LoRA command's model, batch and slice: expected not to fit.
  'full-same-slice': flash(
    longcat_pretrain, 'v5p-128', {'data.global_batch_size': 64, 'data.eval_batch_size': 64}
  ),
  # The other families' real shapes, each on the slice its config's PODS names.
  **{
    name: (model, module, f'variant={variant}', module.PODS[variant].slice, {})
    for name, model, module, variant in (
      ('qwen3-30b', 'Qwen3-30B-A3B', qwen3_moe_lora, 'qwen3_30b_a3b'),
      ('qwen3-235b', 'Qwen3-235B-A22B', qwen3_moe_lora, 'qwen3_235b_a22b'),
      ('mixtral-8x7b', 'Mixtral-8x7B', mixtral_lora, 'mixtral_8x7b'),
      ('moonlight', 'Moonlight-16B-A3B', deepseek_v3_lora, 'moonlight_16b_a3b'),
      ('deepseek-v3', 'DeepSeek-V3', deepseek_v3_lora, 'deepseek_v3_671b'),
      ('olmoe', 'OLMoE-1B-7B', olmoe_lora, 'olmoe_1b_7b'),
      ('qwen1.5-moe', 'Qwen1.5-MoE-A2.7B', qwen2_moe_lora, 'qwen1_5_moe_a2_7b'),
      ('qwen2-57b', 'Qwen2-57B-A14B', qwen2_moe_lora, 'qwen2_57b_a14b'),
      ('deepseek-v2-lite', 'DeepSeek-V2-Lite', deepseek_v2_lora, 'deepseek_v2_lite'),
      ('deepseek-v2', 'DeepSeek-V2 236B', deepseek_v2_lora, 'deepseek_v2_236b'),
      ('glm4.5-air', 'GLM-4.5-Air', glm4_moe_lora, 'glm4_5_air'),
      ('glm4.5', 'GLM-4.5', glm4_moe_lora, 'glm4_5'),
      ('gpt-oss-20b', 'gpt-oss-20b', gpt_oss_lora, 'gpt_oss_20b'),
      ('gpt-oss-120b', 'gpt-oss-120b', gpt_oss_lora, 'gpt_oss_120b'),
      ('qwen3.5-35b', 'Qwen3.5-35B-A3B', qwen3_next_lora, 'qwen3_5_35b_a3b'),
      ('qwen3-next-80b', 'Qwen3-Next-80B-A3B', qwen3_next_lora, 'qwen3_next_80b_a3b'),
      ('minimax-m2', 'MiniMax-M2 (QLoRA int4)', minimax_m2_lora, 'minimax_m2'),
      ('deepseek-v3.2', 'DeepSeek-V3.2', deepseek_v32_lora, 'deepseek_v32_671b'),
      ('glm-5', 'GLM-5 (QLoRA int4)', deepseek_v32_lora, 'glm_5'),
    )
  },
  # QLoRA int4 of the families' smaller models on a Kaggle-sized slice (v5e-8: 8 chips of 16 GB),
  # one row per chip.
  'qwen3-30b-int4-v5e': (
    'Qwen3-30B-A3B',
    qwen3_moe_lora,
    'variant=qwen3_30b_a3b',
    'v5litepod-8',
    {
      **INT4,
      'mesh.shape': (1, -1, 8, 1),
      'engine.moe_ep_recv_factor': 2.0,
      'data.global_batch_size': 8,
      'data.eval_batch_size': 8,
    },
  ),
  # The small families added later: QLoRA int4 on a Kaggle-sized v5e-8 (experts over 8, or 4
  # where 8 does not divide them), one 4096-token row per chip; and OLMoE-1B-7B on one Colab
  # v5e-1 chip, one 2048-token row.
  **{
    f'{name}-int4-v5e': (model, module, f'variant={variant}', 'v5litepod-8', _kaggle(expert))
    for name, model, module, variant, expert in (
      ('olmoe', 'OLMoE-1B-7B', olmoe_lora, 'olmoe_1b_7b', 8),
      ('qwen1.5-moe', 'Qwen1.5-MoE-A2.7B', qwen2_moe_lora, 'qwen1_5_moe_a2_7b', 4),
      ('deepseek-v2-lite', 'DeepSeek-V2-Lite', deepseek_v2_lora, 'deepseek_v2_lite', 8),
    )
  },
  # XLA:TPU's ragged_dot over gpt-oss's 2880-wide int4 expert rows asks 16.94 of the 16 MiB of
  # scoped VMEM a v5e fusion gets by default: the limit is raised to 32 MiB (of 128).
  'gpt-oss-20b-int4-v5e': (
    'gpt-oss-20b',
    gpt_oss_lora,
    'variant=gpt_oss_20b',
    'v5litepod-8',
    {**_kaggle(8), 'engine.moe_backend': 'megablox'},
  ),
  'olmoe-int4-v5e-1': (
    'OLMoE-1B-7B',
    olmoe_lora,
    'variant=olmoe_1b_7b',
    'v5litepod-1',
    {
      **INT4,
      'mesh.shape': (1, 1, 1, 1),
      'data.seq_len': 2048,
      'data.global_batch_size': 1,
      'data.eval_batch_size': 1,
    },
  ),
}


def row(model: str, name: str, r: dict) -> str:
  if 'error' in r:
    need = (r.get('per_chip_bytes') or {}).get('total')
    need = f'temporaries alone {need / 2**30:.1f}' if need else 'refused'
    return f'| {model} | {name} | {r["topology"]} | does not fit ({need}) | - | - | - |'
  m = r['need_bytes'] / 2**30  # the larger of the train and the eval step
  return (
    f'| {model} | {name} | {r["topology"]} | {m:.1f} ({r["hbm_bytes"] / 2**30:.1f}) | '
    f'{r["est_step_seconds"]:.1f} s | {r["est_tokens_per_sec"]:,.0f} | '
    f'{100 * r["est_mfu"]:.0f}% |'
  )


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--only', default='', help='comma-separated names of PLANS')
  p.add_argument('--json', default='')
  args = p.parse_args()
  for name, (model, module, arg, topo, over) in PLANS.items():
    if args.only and name not in args.only.split(','):
      continue
    r = tpu_plan.plan(module.get_config(arg), topo, over, progress=print)
    tpu_plan.print_plan(r)
    print(row(model, name, r), flush=True)
    if args.json:
      os.makedirs(args.json, exist_ok=True)
      with open(os.path.join(args.json, f'{name}.json'), 'w') as f:
        json.dump(r, f, indent=1, default=str)


if __name__ == '__main__':
  main()

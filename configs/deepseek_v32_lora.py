"""LoRA fine-tuning of the DeepSeek Sparse Attention families (DeepSeek-V3.2-Exp, V3.2; GLM-5),
routed and shared experts included; GLM-5 on a QLoRA int4 base.

  python -m moetrain.main --config=configs/deepseek_v32_lora.py               # tiny, CPU, demo data
  python -m moetrain.main --config=configs/deepseek_v32_lora.py:variant=deepseek_v32_671b \
    --config.init.hf_checkpoint=/path/to/DeepSeek-V3.2 ...

Changes from base: DeepSeek-V3's parts (MLA, YaRN where the model has it, dense first layers,
sigmoid router with a correction bias moved by the sign rule, shared experts, the sequence-wise
balance loss) with a lightning indexer in every layer choosing the index_topk keys each query
attends to (GLM-5: one expert group, the indexer's RoPE on adjacent pairs); LoRA rank 8 on every
MLA projection, dense MLP, shared and routed expert and the head; frozen base, router and
indexer. Variants: 'deepseek_v32_tiny' (the default) and 'glm_5_tiny' (each query keeps 8 keys,
fewer than any demo example's tokens: the demos run the selection); 'deepseek_v32_671b' (on
DeepSeek-V3's v5p-64) and 'glm_5' (a QLoRA int4 base on a v5p-32), both planned to fit
(docs/tpu.md; a run from init.hf_checkpoint takes the shapes from its config.json). FP8
releases are read as they are. The MTP layer is not loaded.
"""

from configs import base

VARIANTS = (*base.family_variants('deepseek_v32_tiny'), *base.family_variants('glm_5_tiny'))
# The real models' slices: DeepSeek-V3.2 on DeepSeek-V3's (its indexers add 0.85B to 671B).
# GLM-5's 744B are 372 GB of int4 codes and 47 GB of float32 scales: 26 GB a chip over a
# v5p-32's 16, beside the 43 GiB of temporaries DeepSeek-V3's step takes per chip in micro-batches
# of one 4096-token row (bench/RESULTS.md, "Choosing each plan's slice"); over a v5p-16's 8 chips
# the base alone takes 52 GB. `python -m bench.tpu_plans --only deepseek-v3.2,glm-5` compiles
# them.
PODS = {
  'deepseek_v32_671b': base.Pod('v5p-64', 16, 4096, 64, recv_factor=2, micro_batches=2),
  'glm_5': base.Pod('v5p-32', 16, 4096, 32, recv_factor=2, micro_batches=2),
}


def get_config(arg: str | None = None):
  path = 'configs/deepseek_v32_lora.py'
  config, variant = base.family_lora(arg, path, 'deepseek_v32_tiny', PODS, choices=VARIANTS)
  if variant == 'glm_5':
    config.engine.quant = 'int4'
  return config

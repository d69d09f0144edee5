"""LoRA fine-tuning of OLMoE, routed experts included.

  python -m moetrain.main --config=configs/olmoe_lora.py                      # tiny, CPU, demo data
  python -m moetrain.main --config=configs/olmoe_lora.py:variant=olmoe_1b_7b \
    --config.init.hf_checkpoint=/path/to/OLMoE-1B-7B-0924 ...

Changes from base: the OLMoE parts (GQA with q/k norm over the whole projections, softmax top-8
router without renormalisation, the Switch balance loss); LoRA rank 8 on every attention
projection, routed expert and the head; frozen base and router. Variants: 'olmoe_tiny' (the
default), 'olmoe_1b_7b' (the published shapes; a run from init.hf_checkpoint takes them from its
config.json).
"""

from configs import base

# The real model on the TPU slice it is planned for (README "Model families").
PODS = {'olmoe_1b_7b': base.Pod('v5p-8', expert=4, seq_len=4096, rows=32)}


def get_config(arg: str | None = None):
  return base.family_lora(arg, 'configs/olmoe_lora.py', 'olmoe_tiny', PODS)[0]

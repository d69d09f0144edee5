"""LoRA fine-tuning of GLM-4.5-family models (GLM-4.5-Air, GLM-4.5, GLM-4.6), routed and shared
experts included.

  python -m moetrain.main --config=configs/glm4_moe_lora.py                   # tiny, CPU, demo data
  python -m moetrain.main --config=configs/glm4_moe_lora.py:variant=glm4_5_air \
    --config.init.hf_checkpoint=/path/to/GLM-4.5-Air ...

Changes from base: the GLM-4.5 parts (GQA with q/k/v biases, optional per-head q/k norm and RoPE
on half of each head; dense first layers; sigmoid router with a correction bias moved by the
sign rule, optional expert groups, one shared expert; the sequence-wise balance loss); LoRA rank
8 on every attention projection, dense MLP, shared and routed expert and the head; frozen base
and router. Variants: 'glm4_moe_tiny' (the default), 'glm4_5_air', 'glm4_5' (GLM-4.6's shapes
too; a run from init.hf_checkpoint takes them from its config.json). The MTP layer is skipped
on load and copied into exports.
"""

from configs import base

# The real models on the TPU slices they are planned for (README "Model families").
PODS = {
  'glm4_5_air': base.Pod('v5p-16', expert=8, seq_len=4096, rows=32, recv_factor=2),
  'glm4_5': base.Pod('v5p-64', 16, 4096, 64, recv_factor=2, micro_batches=2),
}


def get_config(arg: str | None = None):
  return base.family_lora(arg, 'configs/glm4_moe_lora.py', 'glm4_moe_tiny', PODS)[0]

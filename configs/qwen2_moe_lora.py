"""LoRA fine-tuning of Qwen1.5-MoE / Qwen2-MoE, routed and shared experts included.

  python -m moetrain.main --config=configs/qwen2_moe_lora.py                  # tiny, CPU, demo data
  python -m moetrain.main --config=configs/qwen2_moe_lora.py:variant=qwen1_5_moe_a2_7b \
    --config.init.hf_checkpoint=/path/to/Qwen1.5-MoE-A2.7B ...

Changes from base: the Qwen2-MoE parts (GQA with q/k/v biases, softmax top-k router without
renormalisation, a shared expert behind a sigmoid gate, the Switch balance loss); LoRA rank 8 on
every attention projection, shared and routed expert, dense MLP and the head; frozen base and
router. Variants: 'qwen2_moe_tiny' (the default), 'qwen1_5_moe_a2_7b', 'qwen2_57b_a14b' (the
published shapes; a run from init.hf_checkpoint takes them from its config.json).
"""

from configs import base

# The real models on the TPU slices they are planned for (README "Model families").
PODS = {
  'qwen1_5_moe_a2_7b': base.Pod('v5p-8', expert=4, seq_len=4096, rows=32),
  'qwen2_57b_a14b': base.Pod('v5p-16', expert=8, seq_len=4096, rows=32, recv_factor=2),
}


def get_config(arg: str | None = None):
  return base.family_lora(arg, 'configs/qwen2_moe_lora.py', 'qwen2_moe_tiny', PODS)[0]

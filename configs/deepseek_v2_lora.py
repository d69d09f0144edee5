"""LoRA fine-tuning of DeepSeek-V2-family models (DeepSeek-V2-Lite, DeepSeek-V2, Coder-V2), routed
and shared experts included.

  python -m moetrain.main --config=configs/deepseek_v2_lora.py                # tiny, CPU, demo data
  python -m moetrain.main --config=configs/deepseek_v2_lora.py:variant=deepseek_v2_lite \
    --config.init.hf_checkpoint=/path/to/DeepSeek-V2-Lite ...

Changes from base: the DeepSeek-V2 parts (MLA with YaRN, dense first layer, softmax router with
greedy or group-limited top-k and scaled gates, shared experts, the sequence-wise balance loss);
LoRA rank 8 on every MLA projection, dense MLP, shared and routed expert and the head; frozen
base and router. Variants: 'deepseek_v2_tiny' (the default), 'deepseek_v2_lite',
'deepseek_v2_236b'.
"""

from configs import base

# The real models on the TPU slices they are planned for (README "Model families").
PODS = {
  'deepseek_v2_lite': base.Pod('v5p-8', expert=4, seq_len=4096, rows=32),
  'deepseek_v2_236b': base.Pod('v5p-64', 16, 4096, 64, recv_factor=2, micro_batches=2),
}


def get_config(arg: str | None = None):
  return base.family_lora(arg, 'configs/deepseek_v2_lora.py', 'deepseek_v2_tiny', PODS)[0]

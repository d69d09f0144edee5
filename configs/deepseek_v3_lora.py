"""LoRA fine-tuning of DeepSeek-V3-family models (DeepSeek-V3/R1, Moonlight, Kimi-K2 and the
language model of Kimi-K2.5/K2.6), routed and shared experts included.

  python -m moetrain.main --config=configs/deepseek_v3_lora.py                # tiny, CPU, demo data
  python -m moetrain.main --config=configs/deepseek_v3_lora.py:variant=moonlight_16b_a3b \
    --config.init.hf_checkpoint=/path/to/Moonlight-16B-A3B ...

Changes from base: the DeepSeek-V3 parts (MLA, YaRN where the model has it, dense first layers,
sigmoid router over expert groups with a correction bias moved by the sign rule, shared experts,
the sequence-wise balance loss); LoRA rank 8 on every MLA projection, dense MLP, shared and
routed expert and the head; frozen base and router. Variants: 'deepseek_tiny' (the default),
'moonlight_16b_a3b', 'deepseek_v3_671b', 'kimi_k2_5' (no slice planned; its int4 experts carry
into an int4 base unchanged with --config.engine.quant=int4 --config.engine.quant_group_size=32).
"""

from configs import base

# The real models on the TPU slices they are planned for (README "Model families").
PODS = {
  'moonlight_16b_a3b': base.Pod('v5p-8', expert=4, seq_len=4096, rows=32),
  'deepseek_v3_671b': base.Pod('v5p-64', 16, 4096, 64, recv_factor=2, micro_batches=2),
}


def get_config(arg: str | None = None):
  return base.family_lora(arg, 'configs/deepseek_v3_lora.py', 'deepseek_tiny', PODS)[0]

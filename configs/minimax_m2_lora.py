"""LoRA fine-tuning of MiniMax-M2-family models (MiniMax-M2, M2.1, M2.5: the same shapes), routed
experts included; the real model on a QLoRA int4 base.

  python -m moetrain.main --config=configs/minimax_m2_lora.py                 # tiny, CPU, demo data
  python -m moetrain.main --config=configs/minimax_m2_lora.py:variant=minimax_m2 \
    --config.init.hf_checkpoint=/path/to/MiniMax-M2 ...

Changes from base: the MiniMax-M2 parts (GQA with q/k norms over the whole projections, RoPE on
half of each head; a sigmoid router with a correction bias, top-8 of 256 experts renormalised;
no shared expert, no dense layer); LoRA rank 8 on every attention projection, routed expert and
the head; frozen base and router. Variants: 'minimax_m2_tiny' (the default) and 'minimax_m2' (a
QLoRA int4 base on a v5p-16: 53.30 GiB a chip as planned, docs/tpu.md; a run from
init.hf_checkpoint takes the shapes from its config.json). The release's FP8 weights with block
scales are read as they are, dequantised a slice at a time. The MTP modules are not loaded.
"""

from configs import base

# The real model's slice (`python -m bench.tpu_plans --only minimax-m2` compiles it).
PODS = {'minimax_m2': base.Pod('v5p-16', expert=8, seq_len=4096, rows=32, recv_factor=2)}


def get_config(arg: str | None = None):
  config, variant = base.family_lora(arg, 'configs/minimax_m2_lora.py', 'minimax_m2_tiny', PODS)
  if variant == 'minimax_m2':
    config.engine.quant = 'int4'  # 229B: 115 GB of int4 base over 8 chips
  return config

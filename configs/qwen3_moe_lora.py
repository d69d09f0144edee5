"""LoRA fine-tuning of Qwen3-MoE, routed experts included.

  python -m moetrain.main --config=configs/qwen3_moe_lora.py                  # tiny, CPU, demo data
  python -m moetrain.main --config=configs/qwen3_moe_lora.py:variant=qwen3_30b_a3b \
    --config.init.hf_checkpoint=/path/to/Qwen3-30B-A3B ...

Changes from base: the Qwen3-MoE parts (GQA with q/k norm, softmax top-8 router renormalised,
the Switch balance loss); LoRA rank 8 on every attention projection, routed expert and the head;
frozen base and router. Variants: 'qwen3_tiny' (the default), 'qwen3_30b_a3b', 'qwen3_235b_a22b'
(the published shapes; a run from init.hf_checkpoint takes them from its config.json).
"""

from configs import base

# The real models on the TPU slices they are planned for (README "Model families").
PODS = {
  # 1.5x: with 2x, the overflow round's buffers beside the first round's left 9.4% of the HBM
  # free (bench/RESULTS.md, "Dropless under a bounded receive buffer").
  'qwen3_30b_a3b': base.Pod('v5p-8', expert=4, seq_len=4096, rows=32, recv_factor=1.5),
  'qwen3_235b_a22b': base.Pod('v5p-32', 16, 4096, 64, recv_factor=2, micro_batches=2),
}


def get_config(arg: str | None = None):
  return base.family_lora(arg, 'configs/qwen3_moe_lora.py', 'qwen3_tiny', PODS)[0]

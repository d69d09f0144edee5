"""LoRA fine-tuning of Qwen3-Next-family models (Qwen3-Next-80B-A3B: Instruct, Thinking; and
Qwen3.5-MoE's language model, Qwen3.5-35B-A3B), Gated DeltaNet and routed experts included.

  python -m moetrain.main --config=configs/qwen3_next_lora.py                 # tiny, CPU, demo data
  python -m moetrain.main --config=configs/qwen3_next_lora.py:variant=qwen3_next_80b_a3b \
    --config.init.hf_checkpoint=/path/to/Qwen3-Next-80B-A3B-Instruct ...

Changes from base: the Qwen3-Next parts (three Gated DeltaNet layers to each gated-attention
layer, by layer_types; norms that store their offset from 1; a softmax router with a gated shared
expert); LoRA rank 8 on the attention and Gated DeltaNet projections (in_qkvz, out), the shared
and routed experts and the head; frozen base and router. Variants: 'qwen3_next_tiny' (the
default), 'qwen3_next_80b_a3b' and 'qwen3_5_35b_a3b' (a run from init.hf_checkpoint takes the
shapes from its config.json; a multimodal Qwen3.5 checkpoint gives its language model). The delta rule trains chunk by chunk (model.delta_chunk tokens, 64).
"""

from configs import base

VARIANTS = (*base.family_variants('qwen3_next_tiny'), *base.family_variants('qwen3_5_35b_a3b'))
# The real models' slices (bf16 bases: 159 GB and 69 GB), as Qwen3-30B-A3B's but in 2
# micro-batches: in one pass Qwen3.5-35B-A3B's step needs 97.35 GiB of temporaries alone, over a
# v5p chip's 95.73 (bench.tpu_plans, 2026-11-29). `python -m bench.tpu_plans --only
# qwen3.5-35b,qwen3-next-80b` compiles them.
# Qwen3-Next-80B-A3B needs 98.82 GB of temporaries on a v5p-8; over 8 experts on a v5p-16, 54.64 GiB.
PODS = {
  'qwen3_next_80b_a3b': base.Pod('v5p-16', 8, 4096, 32, recv_factor=1.5, micro_batches=2),
  'qwen3_5_35b_a3b': base.Pod('v5p-8', 4, 4096, 32, recv_factor=1.5, micro_batches=2),
}


def get_config(arg: str | None = None):
  path = 'configs/qwen3_next_lora.py'
  return base.family_lora(arg, path, 'qwen3_next_tiny', PODS, choices=VARIANTS)[0]

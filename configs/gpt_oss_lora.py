"""LoRA fine-tuning of gpt-oss (gpt-oss-20b, gpt-oss-120b), routed experts included.

  python -m moetrain.main --config=configs/gpt_oss_lora.py                    # tiny, CPU, demo data
  python -m moetrain.main --config=configs/gpt_oss_lora.py:variant=gpt_oss_20b \
    --config.init.hf_checkpoint=/path/to/gpt-oss-20b ...

Changes from base: the gpt-oss parts (GQA with q/k/v/o biases and attention sinks, sliding-window
and full layers alternating, YaRN; a router with a logit bias taking the top-k before its softmax;
experts with biases and a clamped SwiGLU; the Switch balance loss); LoRA rank 8 on every attention
projection, routed expert and the head; frozen base and router. The released MXFP4 experts are
dequantised on load (to the run's dtype, or to int8/int4 with engine.quant). Variants:
'gpt_oss_tiny' (the default), 'gpt_oss_20b', 'gpt_oss_120b'. PEFT adapters cannot hold the
experts' LoRA (fused parameters): export those merged.
"""

from configs import base

# The real models on the TPU slices they are planned for (README "Model families").
PODS = {
  'gpt_oss_20b': base.Pod('v5p-8', expert=4, seq_len=4096, rows=32),
  'gpt_oss_120b': base.Pod('v5p-16', expert=8, seq_len=4096, rows=32, recv_factor=2),
}


def get_config(arg: str | None = None):
  return base.family_lora(arg, 'configs/gpt_oss_lora.py', 'gpt_oss_tiny', PODS)[0]

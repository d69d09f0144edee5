"""LoRA fine-tuning of Mixtral, routed experts included.

  python -m moetrain.main --config=configs/mixtral_lora.py                    # tiny, CPU, demo data
  python -m moetrain.main --config=configs/mixtral_lora.py:variant=mixtral_8x7b \
    --config.init.hf_checkpoint=/path/to/Mixtral-8x7B-v0.1 ...

Changes from base: the Mixtral parts (GQA, softmax top-2 router renormalised, the Switch balance
loss); LoRA rank 8 on every attention projection, routed expert and the head; frozen base and
router. Variants: 'mixtral_tiny' (the default), 'mixtral_8x7b', 'mixtral_8x22b'.
"""

from configs import base

# The real model on the TPU slice it is planned for (README "Model families").
PODS = {'mixtral_8x7b': base.Pod('v5p-16', expert=8, seq_len=4096, rows=32, recv_factor=2)}


def get_config(arg: str | None = None):
  return base.family_lora(arg, 'configs/mixtral_lora.py', 'mixtral_tiny', PODS)[0]

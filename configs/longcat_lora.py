"""LoRA fine-tuning of LongCat-Flash, routed experts included.

  python -m moetrain.main --config=configs/longcat_lora.py                    # tiny, CPU, demo data
  python -m moetrain.main --config=configs/longcat_lora.py:variant=flash ...  # the released 560B shapes

Changes from base: LoRA rank 8 on MLA projections, dense MLPs and routed experts; frozen base and
router; the variant picks the model shape ('tiny', 'medium' or 'flash').
"""

from configs import base


def get_config(arg: str | None = None):
  variant = base.variant_of(arg, 'configs/longcat_lora.py')
  config = base.get_config()
  base.set_model(config, variant)
  config.lora.rank = 8
  config.lora.alpha = 16.0
  if variant == 'tiny':
    config.optim.learning_rate = 1e-2  # adapters on a small random base move quickly
  elif variant == 'flash':
    base.set_flash_pod(config, global_batch_size=64, eval_batch_size=64)
  return config

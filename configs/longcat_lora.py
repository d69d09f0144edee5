"""LoRA fine-tuning of LongCat-Flash, routed experts included.

  python -m moetrain.main --config=configs/longcat_lora.py                    # the CPU demo
  python -m moetrain.main --config=configs/longcat_lora.py:variant=flash ...  # the released 560B shapes

Changes from base: LoRA rank 8 on MLA projections, dense MLPs and routed experts; frozen base and
router; the variant picks the model: 'demo' (the default: the tiny shapes, starting from the
shipped base pretrained to copy word lists, moetrain/data/demo_base.py, which the adapters teach
to reverse them), 'tiny' (the same shapes, random base), 'medium' or 'flash'.
"""

from configs import base
from moetrain.data import demo_base


def get_config(arg: str | None = None):
  demo = ('demo', *base.family_variants('tiny'))
  variant = base.variant_of(arg, 'configs/longcat_lora.py', default='demo', choices=demo)
  config = base.get_config()
  base.set_model(config, 'tiny' if variant == 'demo' else variant)
  if variant == 'demo':
    config.init.hf_checkpoint = str(demo_base.DIR)
  config.lora.rank = 8
  config.lora.alpha = 16.0
  # The tiny demo keeps the base's learning rate (3e-3). At 1e-2 its adapters inflated the
  # residual stream that the final norm hides from the loss (logged hidden_z_loss 37 -> 4e7,
  # grad-norm spikes of 131; the same with engine.kernels=reference); at 3e-3 it peaks near 1.6e3
  # with the same eval loss (bench/RESULTS.md, "The LoRA demo's hidden z-loss climb").
  if variant == 'flash':
    base.set_flash_pod(config, global_batch_size=64, eval_batch_size=64)
  return config

"""LoRA fine-tuning of LongCat-Flash, routed experts included.

  python -m moetrain.main --config=configs/longcat_lora.py                    # tiny, CPU, demo data
  python -m moetrain.main --config=configs/longcat_lora.py:variant=flash ...  # the released 560B shapes

Changes from base: LoRA rank 8 on MLA projections, dense MLPs and routed experts; frozen base and
router; the variant picks the model shape ('tiny', 'medium' or 'flash').
"""

import dataclasses

from configs import base
from moetrain.model.config import PRESETS


def parse_arg(arg: str | None) -> dict:
  """big_vision-style 'variant=flash,foo=bar' -> dict."""
  return dict(kv.split('=', 1) for kv in (arg or '').split(',') if kv)


def set_model(config, variant: str) -> None:
  if variant not in PRESETS:
    raise ValueError(f'variant={variant!r} is unknown; choose one of {sorted(PRESETS)}')
  for k, v in dataclasses.asdict(PRESETS[variant]).items():
    if k in config.model:
      config.model[k] = v


def get_config(arg: str | None = None):
  args = parse_arg(arg)
  unknown = set(args) - {'variant'}
  if unknown:
    raise ValueError(
      f'configs/longcat_lora.py: unknown argument(s) {sorted(unknown)}; use variant='
    )
  variant = args.get('variant', 'tiny')
  config = base.get_config()
  set_model(config, variant)
  config.lora.rank = 8
  config.lora.alpha = 16.0
  if variant == 'tiny':
    config.model.vocab_size = 512
    config.optim.learning_rate = 1e-2  # adapters on a small random base move quickly
  elif variant == 'flash':
    # On a TPU pod: experts over 16 devices, FSDP over the rest; bf16 weights.
    config.model.param_dtype = 'bfloat16'
    config.mesh.shape = (1, -1, 16, 1)
    config.data.seq_len = 8192
    config.data.global_batch_size = 64
    config.data.tokenizer = ''  # set to the checkpoint directory holding tokenizer.json
  return config

"""Device bytes per frozen base parameter, measured from the live arrays of the medium config.

  python -m bench.qlora_memory

bf16 storage is the reference (2.0 bytes); int8 keeps one float32 scale per output channel, int4
packs two codes per byte plus one float32 scale per group of quant_group_size input rows.
"""

import dataclasses

import jax
from flax import nnx

from bench.common import emit, machine
from moetrain.core.engine import LoraConfig
from moetrain.model.config import LONGCAT_PRESETS
from moetrain.model.transformer import Transformer
from moetrain.training.train_state import split_model


def frozen_bytes(mode: str, group: int):
  lora = LoraConfig(rank=16, targets=r'attn|mlp|experts')
  dtype = 'bfloat16' if mode == 'none' else 'float32'
  cfg = dataclasses.replace(LONGCAT_PRESETS['medium'], lora=lora).with_engine(
    quant=mode, quant_group_size=group, param_dtype=dtype
  )
  frozen = jax.jit(lambda: split_model(Transformer(cfg, nnx.Rngs(0)), cfg)[3])()
  plain = cfg.with_engine(quant='none')
  n_params = sum(
    x.size
    for x in jax.tree.leaves(
      jax.eval_shape(lambda: split_model(Transformer(plain, nnx.Rngs(0)), plain)[3])
    )
  )
  n_bytes = sum(x.nbytes for x in jax.tree.leaves(frozen))  # live device arrays
  return n_params, n_bytes


def main():
  for mode, group in [('none', 0), ('int8', 0), ('int4', 64), ('int4', 128)]:
    n_params, n_bytes = frozen_bytes(mode, group or 64)
    emit(
      {
        'bench': 'qlora_memory',
        'storage': 'bf16' if mode == 'none' else mode,
        'group': group or None,
        'frozen_params': n_params,
        'bytes': n_bytes,
        'bytes_per_param': n_bytes / n_params,
        **machine(),
      }
    )


if __name__ == '__main__':
  main()

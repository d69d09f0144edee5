"""Dry run: build the model abstractly (no weights allocated) and report its size."""

import math

import jax
from flax import nnx

from moetrain import train
from moetrain.model.transformer import Transformer


def _size(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


def param_counts(cfg) -> dict:
  """Base parameters (LoRA adapters apart) and those a token activates, by FFN experts used."""
  model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
  adapters = _size(nnx.state(model, nnx.LoRAParam))
  base = _size(nnx.state(model, nnx.Param)) - adapters
  embed = cfg.vocab_size * cfg.hidden_size
  per_expert = 3 * cfg.hidden_size * cfg.expert_ffn_hidden_size * cfg.num_layers
  routed = per_expert * cfg.n_routed_experts
  active = {k: base - embed - routed + k * per_expert for k in (0, 8, cfg.moe_topk)}
  return {'total': base, 'routed_experts': routed, 'adapters': adapters, 'active': active}


def dry_run(config) -> dict:
  # The mesh is validated for the smallest device count it fits, not this machine's devices.
  setup = train.build(config, num_devices=math.prod(s for s in config.mesh.shape if s > 0))
  counts = param_counts(setup.model)
  b = 1e9
  print(
    f'parameters: total {counts["total"] / b:.2f}B '
    f'(routed experts {counts["routed_experts"] / b:.2f}B), LoRA adapters '
    f'{counts["adapters"] / 1e6:.2f}M'
  )
  for k, v in counts['active'].items():
    print(f'activated per token with {k:2d} FFN experts (input embedding excluded): {v / b:.2f}B')
  return counts

"""LoRA bookkeeping: adapter deltas, merging adapters into the base, counting."""

import dataclasses

import jax.numpy as jnp
from flax import nnx

from moetrain.core.engine import LoraConfig
from moetrain.kernels import quant
from moetrain.model.layers import Linear
from moetrain.model.moe import Experts
from moetrain.model.transformer import Transformer


def linear_delta(layer: Linear):
  """scale * A @ B in the kernel's layout [..., in..., out...] (leading dims = stacked layers)."""
  a, b = layer.lora_a[...], layer.lora_b[...]
  n_in = a.ndim - 1 - _lead(layer)
  lead = 'abc'[: _lead(layer)]
  ins, outs = 'defg'[:n_in], 'hijk'[: b.ndim - 1 - len(lead)]
  return layer.lora_scale * jnp.einsum(f'{lead}{ins}r,{lead}r{outs}->{lead}{ins}{outs}', a, b)


def _lead(layer: Linear) -> int:
  axes = layer.lora_a.get_metadata().get('axes', ())
  return int(bool(axes) and axes[0] == 'layers')


def expert_delta(experts: Experts, name: str):
  a, b = getattr(experts, f'{name}_lora_a')[...], getattr(experts, f'{name}_lora_b')[...]
  return experts.lora_scale * jnp.einsum('...edr,...erf->...edf', a, b)


def merged(model: Transformer) -> Transformer:
  """A LoRA-free, unquantised float model equal to `model` with its adapters folded in."""
  cfg = model.cfg
  plain = dataclasses.replace(cfg, lora=LoraConfig()).with_engine(quant='none')
  out = nnx.eval_shape(lambda: Transformer(plain, nnx.Rngs(0)))
  dtype = jnp.dtype(cfg.engine.param_dtype)
  for path, node in nnx.iter_graph(model):
    if isinstance(node, Linear):
      w = quant.value(node.kernel, jnp.float32)
      if node.has_lora:
        w = w + linear_delta(node)
      _set(out, path + ('kernel',), w.astype(dtype))
    elif isinstance(node, Experts):
      for name in Experts.NAMES:
        w = quant.value(getattr(node, name), jnp.float32)
        if name in node.lora_names:
          w = w + expert_delta(node, name)
        _set(out, path + (name,), w.astype(dtype))
  # Everything else (norms, router, biases, embedding) is copied as is.
  for path, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Variable) and not isinstance(var, (nnx.LoRAParam, quant.QuantWeight)):
      if path[-1] not in ('kernel', *Experts.NAMES):
        _set(out, path, var[...])
  emb = model.embed.embedding
  if isinstance(emb, quant.QuantKernel):
    _set(out, ('embed', 'embedding'), quant.value(emb, dtype))
  return out


def _set(model, path, value):
  node = model
  for p in path[:-1]:
    node = getattr(node, p) if not isinstance(p, int) else node[p]
  getattr(node, path[-1]).set_value(jnp.asarray(value))

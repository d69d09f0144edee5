"""The GPU engine against the reference, on the machine it runs on: the MoE layer's output and
gradients (input, router, expert weights and their LoRA adapters) with engine.moe_backend=tokamax
(on a GPU: tokamax's kernel for the device) and with the dense per-row reference, on skewed
loads with empty experts and group sizes that no tile divides. One JSON record; exits non-zero
where they disagree.

  python -m bench.gpu_engine_check [--dtype float32] [--tokens 1000]
"""

import argparse
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.common import emit, machine
from moetrain.core.engine import LoraConfig
from moetrain.model import dispatch
from moetrain.model.config import ModelConfig
from moetrain.model.moe import MoE


def layer(backend: str, dtype: str, tokamax: str = 'auto') -> ModelConfig:
  lora = LoraConfig(rank=8, alpha=16.0, targets=r'experts\.(gate|up|down)$')
  return (
    ModelConfig(
      vocab_size=64,
      hidden_size=256,
      num_layers=1,
      num_heads=2,
      q_lora_rank=16,
      kv_lora_rank=16,
      qk_nope_head_dim=8,
      qk_rope_head_dim=8,
      v_head_dim=8,
      ffn_hidden_size=128,
      expert_ffn_hidden_size=384,
      n_routed_experts=8,
      zero_expert_num=2,
      moe_topk=3,
      lora=lora,
    )
    .with_engine(dtype=dtype, init_std=0.05, moe_backend=backend, tokamax_implementation=tokamax)
    .laid_out(jax.default_backend(), ())
  )


def outputs(cfg: ModelConfig, x, skew: float):
  moe = MoE(cfg, 'layers.moe', nnx.Rngs(0))
  e = cfg.n_routed_experts
  # Skewed loads: the first experts take most rows, the last two none.
  bias = jnp.concatenate([jnp.linspace(skew, 0.0, e - 2), jnp.full((2,), -1e3)])
  moe.router_bias[...] = moe.router_bias[...].at[:e].set(bias)
  for path, v in nnx.iter_graph(moe):
    if isinstance(v, nnx.LoRAParam):  # B starts at zero: give the adapters a product
      v[...] = (
        jax.random.normal(jax.random.key(zlib.crc32(str(path).encode())), v.shape, v.dtype) * 0.05
      )
  valid = jnp.ones(x.shape[:2], bool)
  gd, st = nnx.split(moe)

  def loss(st, x):
    y, stats = nnx.merge(gd, st)(x, valid)
    return jnp.sum(y.astype(jnp.float32) ** 2), (y, stats['load'])

  (_, (y, load)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(st, x)
  return y, grads, load


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--dtype', default='float32')
  ap.add_argument('--tokens', type=int, default=1000)
  ap.add_argument('--skew', type=float, default=0.05)
  ap.add_argument('--tokamax', default='auto', help='engine.tokamax_implementation')
  args = ap.parse_args()
  x = jax.random.normal(jax.random.key(1), (1, args.tokens, 256), jnp.float32)
  engine = layer('tokamax', args.dtype, args.tokamax)
  # float32 products in float32 on both sides (XLA:GPU's default for them is TF32).
  with jax.default_matmul_precision('highest' if args.dtype == 'float32' else 'default'):
    y, g, load = outputs(engine, x, args.skew)
    y_ref, g_ref, _ = outputs(layer('dense', args.dtype), x, args.skew)
  rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
  errors = jax.tree.map(rel, g, g_ref)
  worst = max(jax.tree.leaves(errors))
  tol = 1e-4 if args.dtype == 'float32' else 3e-2
  record = {
    'bench': 'gpu_engine_check',
    'engine': dispatch.resolve_backend(engine),
    'tokamax_implementation': args.tokamax,
    'platform': engine.platform,
    'dtype': args.dtype,
    'tokens': args.tokens,
    'group_rows': [int(n) for n in np.asarray(load[: engine.n_routed_experts])],
    'output_rel_error': rel(y, y_ref),
    'worst_gradient_rel_error': worst,
    'tolerance': tol,
    **machine(),
  }
  emit(record)
  sys.exit(0 if max(record['output_rel_error'], worst) <= tol else 1)


if __name__ == '__main__':
  main()

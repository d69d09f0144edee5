"""MoE layer forward+backward vs its ideal: the same FLOPs as dense matmuls of the active experts.

  python -m bench.moe_layer [--tokens 2048] [--backend auto] [--repeats 5]

Shapes are the medium config's MoE (D 512, expert F 256, 16 routed + 8 zero experts, top-4).
Both are timed in the same run. 'ideal' runs one SwiGLU over exactly the routed rows this batch
produced (R = assignments to FFN experts) with a single [D, F] weight set, i.e. no routing, no
dispatch and no padding. Two gradient modes: 'lora' (frozen experts: grads w.r.t. x only) and
'full' (grads w.r.t. x and the expert weights).
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from bench.common import emit, machine, time_fn
from moetrain.model.config import PRESETS
from moetrain.model.moe import MoE


def swiglu(x, wg, wu, wd):
  return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--tokens', type=int, default=2048)
  ap.add_argument('--backend', default='auto')
  ap.add_argument('--dtype', default='float32')
  ap.add_argument('--repeats', type=int, default=5)
  ap.add_argument('--block', type=int, default=0, help='moe_block_size (0 = automatic)')
  args = ap.parse_args()
  cfg = dataclasses.replace(
    PRESETS['medium'], dtype=args.dtype, moe_backend=args.backend, moe_block_size=args.block
  )
  moe = MoE(cfg, 'layers.moe', nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (1, args.tokens, cfg.hidden_size), jnp.float32)
  valid = jnp.ones((1, args.tokens), bool)
  gd, st = nnx.split(moe)
  _, stats = moe(x, valid)
  routed = int(stats['load'][: cfg.n_routed_experts].sum())
  dt = jnp.dtype(args.dtype)
  d, f = cfg.hidden_size, cfg.expert_ffn_hidden_size
  w = [
    jax.random.normal(jax.random.key(i), s, dt) * 0.02
    for i, s in enumerate([(d, f), (d, f), (f, d)])
  ]
  x_ideal = jax.random.normal(jax.random.key(1), (routed, d), dt)

  def moe_loss(st, x):
    return jnp.sum(nnx.merge(gd, st)(x, valid)[0].astype(jnp.float32))

  def ideal_loss(w, x):
    return jnp.sum(swiglu(x, *w).astype(jnp.float32))

  runs = {
    'lora': (jax.jit(jax.grad(moe_loss, argnums=1)), jax.jit(jax.grad(ideal_loss, argnums=1))),
    'full': (
      jax.jit(jax.grad(moe_loss, argnums=(0, 1))),
      jax.jit(jax.grad(ideal_loss, argnums=(0, 1))),
    ),
  }
  flops_fwd = 2 * routed * 3 * d * f
  for mode, (f_moe, f_ideal) in runs.items():
    # Interleave so both see the same machine state.
    t_moe, t_ideal = [], []
    for _ in range(args.repeats):
      t_moe.append(time_fn(f_moe, st, x, repeats=1)['median_s'])
      t_ideal.append(time_fn(f_ideal, w, x_ideal, repeats=1)['median_s'])
    med = lambda v: sorted(v)[len(v) // 2]
    emit(
      {
        'bench': 'moe_layer',
        'mode': mode,
        'backend': args.backend,
        'dtype': args.dtype,
        'tokens': args.tokens,
        'routed_rows': routed,
        'moe_s': med(t_moe),
        'ideal_s': med(t_ideal),
        'ratio': med(t_moe) / med(t_ideal),
        'expert_fwd_gflop': flops_fwd / 1e9,
        **machine(),
      }
    )


if __name__ == '__main__':
  main()

"""MoE layer forward+backward vs its ideal: the same FLOPs as dense matmuls of the active experts.

  python -m bench.moe_layer [--tokens 2048] [--backend auto] [--dispatch dropless|capacity]
                            [--dtype float32] [--repeats 5] [--block B] [--skew S]

Shapes are the medium config's MoE (D 512, expert F 256, 16 routed + 8 zero experts, top-4).
Both are timed in the same run. 'ideal' runs one SwiGLU over exactly the routed rows this batch
produced (R = assignments to FFN experts) with a single [D, F] weight set, i.e. no routing, no
dispatch and no padding. 'per_expert' is the literal reading of "dense matmuls of the active
experts": each FFN expert's own SwiGLU, with its own weights, over exactly its rows this batch, as
static-shape dense matmuls (what a perfect grouped GEMM would run; no routing or dispatch either).
The headline ratio is against 'ideal', the stricter of the two. Two gradient modes: 'lora' (frozen experts: grads w.r.t. x only) and
'full' (grads w.r.t. x and the expert weights). --skew makes the expert loads uneven (the record
gives the smallest and largest group).

Both sides return their forward output and their gradients for a fixed random cotangent, as in a
training step. (A `sum` loss would let XLA drop the ideal's forward down-projection: its output
value never reaches a gradient through a linear loss, while the MoE layer needs it for the gates.)
"""

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from bench.common import emit, machine, time_fn
from moetrain.model import dispatch
from moetrain.model.config import LONGCAT_PRESETS
from moetrain.model.moe import MoE


def swiglu(x, wg, wu, wd):
  return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--tokens', type=int, default=2048)
  ap.add_argument('--backend', default='auto')
  ap.add_argument('--tokamax', default='auto', help='engine.tokamax_implementation')
  ap.add_argument('--dtype', default='float32')
  ap.add_argument('--dispatch', default='dropless', choices=['dropless', 'capacity'])
  ap.add_argument('--repeats', type=int, default=5)
  ap.add_argument('--block', type=int, default=0, help='moe_block_size (0 = automatic)')
  ap.add_argument(
    '--skew',
    type=float,
    default=0.0,
    help="uneven expert loads: the routed experts' selection bias spans +-skew/(E+Z)",
  )
  args = ap.parse_args()
  cfg = (
    LONGCAT_PRESETS['medium']
    .with_engine(
      dtype=args.dtype,
      moe_backend=args.backend,
      tokamax_implementation=args.tokamax,
      moe_block_size=args.block,
      moe_dispatch=args.dispatch,
    )
    .laid_out(jax.default_backend(), ())
  )  # the engine 'auto' picks for this machine
  moe = MoE(cfg, 'layers.moe', nnx.Rngs(0))
  e, x_all = cfg.n_routed_experts, cfg.num_experts_total
  spread = args.skew / x_all * jnp.linspace(-1.0, 1.0, e)
  moe.router_bias[...] = moe.router_bias[...].at[:e].set(spread)
  x = jax.random.normal(jax.random.key(0), (1, args.tokens, cfg.hidden_size), jnp.float32)
  valid = jnp.ones((1, args.tokens), bool)
  gd, st = nnx.split(moe)
  _, stats = moe(x, valid)
  load = stats['load'][: cfg.n_routed_experts]
  routed = int(load.sum())
  dt = jnp.dtype(args.dtype)
  d, f = cfg.hidden_size, cfg.expert_ffn_hidden_size
  w = [
    jax.random.normal(jax.random.key(i), s, dt) * 0.02
    for i, s in enumerate([(d, f), (d, f), (f, d)])
  ]
  x_ideal = jax.random.normal(jax.random.key(1), (routed, d), dt)

  sizes = [int(n) for n in load]
  w_experts = [
    jax.random.normal(jax.random.key(10 + i), (e, *s), dt) * 0.02
    for i, s in enumerate([(d, f), (d, f), (f, d)])
  ]

  g_moe = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
  g_ideal = jax.random.normal(jax.random.key(3), (routed, d), jnp.float32)

  def fwd_bwd(f, full: bool, g):
    """f(w, x)'s output and its VJP for cotangent g, w.r.t. x only or (full) w and x: what is not
    differentiated gets no gradient work."""

    def run(w, x):
      if full:
        y, pull = jax.vjp(f, w, x)
      else:
        y, pull = jax.vjp(lambda x: f(w, x), x)
      return y, pull(g.astype(y.dtype))

    return jax.jit(run)

  moe_fn = lambda st, x: nnx.merge(gd, st)(x, valid)[0]
  ideal_fn = lambda w, x: swiglu(x, *w)

  def per_expert_fn(w, x):
    starts = [sum(sizes[:i]) for i in range(e)]
    parts = [
      swiglu(x[s : s + n], w[0][i], w[1][i], w[2][i])
      for i, (s, n) in enumerate(zip(starts, sizes))
      if n
    ]
    return jnp.concatenate(parts)

  runs = {
    mode: (
      fwd_bwd(moe_fn, mode == 'full', g_moe),
      fwd_bwd(ideal_fn, mode == 'full', g_ideal),
      fwd_bwd(per_expert_fn, mode == 'full', g_ideal),
    )
    for mode in ('lora', 'full')
  }
  flops_fwd = 2 * routed * 3 * d * f
  for mode, (f_moe, f_ideal, f_per_expert) in runs.items():
    # Interleave so all three see the same machine state.
    t_moe, t_ideal, t_per_expert = [], [], []
    for _ in range(args.repeats):
      t_moe.append(time_fn(f_moe, st, x, repeats=1)['median_s'])
      t_ideal.append(time_fn(f_ideal, w, x_ideal, repeats=1)['median_s'])
      t_per_expert.append(time_fn(f_per_expert, w_experts, x_ideal, repeats=1)['median_s'])
    med = lambda v: sorted(v)[len(v) // 2]
    emit(
      {
        'bench': 'moe_layer',
        'mode': mode,
        'backend': args.backend,
        'engine': dispatch.resolve_backend(cfg),
        'tokamax_implementation': args.tokamax,
        'dispatch': args.dispatch,
        'dtype': args.dtype,
        'tokens': args.tokens,
        'routed_rows': routed,
        'skew': args.skew,
        'group_rows': [int(load.min()), int(load.max())],
        'moe_s': med(t_moe),
        'ideal_s': med(t_ideal),
        'ratio': med(t_moe) / med(t_ideal),
        'per_expert_s': med(t_per_expert),
        'ratio_per_expert': med(t_moe) / med(t_per_expert),
        'expert_fwd_gflop': flops_fwd / 1e9,
        **machine(),
      }
    )


if __name__ == '__main__':
  main()

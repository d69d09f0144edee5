"""The gated delta rule (Gated DeltaNet layers: Qwen3-Next, Qwen3.5) against softmax attention
over one row of 4k-32k tokens: the forward and backward's time on this machine (median of
repeated runs) and the compiled step's temporary bytes, per layer at Qwen3-Next-80B-A3B's head
shapes cut to `--heads` heads (the delta rule: 128-wide keys and values; attention: 256-wide
heads, the model's causal chunked XLA path, moetrain's CPU attention).

  python -m bench.delta_rule [--lengths 4096,8192,16384,32768] [--heads 2] [--chunk 64]
      [--repeats 3] [--time_below_gib 6]

A length whose compiled step needs more temporary memory than --time_below_gib is compiled,
not run.
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from bench.common import emit, machine, time_fn
from moetrain.kernels import delta_rule
from moetrain.model.attention import causal_self_attention
from moetrain.model.families import MODEL_PRESETS


def delta_inputs(t: int, h: int):
  ks = jax.random.split(jax.random.key(0), 5)
  q = delta_rule.l2norm(jax.random.normal(ks[0], (1, t, h, 128))) * 128**-0.5
  k = delta_rule.l2norm(jax.random.normal(ks[1], (1, t, h, 128)))
  v = jax.random.normal(ks[2], (1, t, h, 128))
  g = -0.05 * jax.nn.softplus(jax.random.normal(ks[3], (1, t, h)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, t, h)))
  return q, k, v, g, beta


def attention_inputs(t: int, h: int):
  ks = jax.random.split(jax.random.key(1), 3)
  return tuple(jax.random.normal(k, (1, t, h, 256), jnp.float32) for k in ks)


def measure(name: str, fn, args, t: int, repeats: int, time_below_gib: float) -> dict:
  """The forward and backward's temporary bytes as compiled, and its time where those fit
  under time_below_gib (this VM's 24 GB are shared)."""
  step = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=tuple(range(len(args)))))
  compiled = step.lower(*args).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  out = {'kernel': name, 'tokens': t, 'temp_bytes': temp, 'temp_gib': temp / 2**30}
  if temp / 2**30 < time_below_gib:
    out |= time_fn(compiled, *args, repeats=repeats, warmup=1)
  return out


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--lengths', default='4096,8192,16384,32768')
  p.add_argument('--heads', type=int, default=2)
  p.add_argument('--chunk', type=int, default=64)
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--time_below_gib', type=float, default=6.0, help='compile only above this')
  a = p.parse_args()
  cfg = dataclasses.replace(
    MODEL_PRESETS['qwen3_next_80b_a3b'], num_heads=a.heads, num_kv_heads=a.heads
  ).with_engine(dtype='float32', param_dtype='float32')
  for t in (int(x) for x in a.lengths.split(',')):
    seg = jnp.ones((1, t), jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]

    def delta(q, k, v, g, beta, seg=seg):
      return delta_rule.chunked(q, k, v, g, beta, a.chunk, None, seg)[0]

    def attend(q, k, v, pos=pos, seg=seg):
      return causal_self_attention(q, k, v, pos, seg, cfg)

    for name, fn, args in (
      ('gated delta rule (chunked)', delta, delta_inputs(t, a.heads)),
      ('softmax attention (XLA, causal chunks)', attend, attention_inputs(t, a.heads)),
    ):
      emit(
        {
          'bench': 'delta_rule',
          'heads': a.heads,
          **measure(name, fn, args, t, a.repeats, a.time_below_gib),
        }
      )
  emit({'bench': 'delta_rule', 'chunk': a.chunk} | machine())


if __name__ == '__main__':
  main()

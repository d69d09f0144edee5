"""Decode throughput with the latent KV cache: tokens/s = decode steps per second x batch.

  python -m bench.generate [--presets tiny,medium] [--batches 1,8] [--prompt_len 32] [--steps 32]

Random float32 weights. Each record times `steps` greedy decode steps run by one jitted
lax.fori_loop (as generate() runs them, without per-step dispatch) after a prefill of
`prompt_len` tokens into a cache of prompt_len + steps slots, for both decode attentions:
'absorbed' (kv_b folded into q and o) and 'expanded' (kv_b applied to every cached latent).
"""

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from bench.common import emit, machine
from moetrain.model.config import LONGCAT_PRESETS
from moetrain.model.decode import decode_step, prefill
from moetrain.model.transformer import Transformer


@functools.partial(jax.jit, static_argnames=('graphdef', 'steps', 'absorb'), donate_argnums=2)
def decode_loop(graphdef, state, cache, tok_B, start, *, steps: int, absorb: bool):
  model = nnx.merge(graphdef, state)

  def body(i, carry):
    cache, tok_B = carry
    logits_BV, cache = decode_step(model, cache, tok_B, start + i, absorb=absorb)
    return cache, jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

  return jax.lax.fori_loop(0, steps, body, (cache, tok_B))


def run(preset: str, batch: int, prompt_len: int, steps: int, repeats: int) -> list[dict]:
  cfg = LONGCAT_PRESETS[preset].with_engine(dtype='float32', param_dtype='float32', remat='none')
  graphdef, state = nnx.split(Transformer(cfg, nnx.Rngs(0)))
  ids_BT = jax.random.randint(jax.random.key(1), (batch, prompt_len), 0, cfg.vocab_size)
  fill = jax.jit(lambda state, ids: prefill(nnx.merge(graphdef, state), ids, prompt_len + steps))
  logits_BV, cache = fill(state, ids_BT)
  tok_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

  def timed(absorb) -> float:
    """Median seconds of the decode loop alone: the loop donates (updates in place) the cache it
    is given, so each call gets a fresh copy, made before the clock starts."""
    times = []
    for i in range(repeats + 1):  # the first call compiles
      fresh = jax.block_until_ready(jax.tree.map(jnp.copy, cache))
      t = time.perf_counter()
      jax.block_until_ready(
        decode_loop(graphdef, state, fresh, tok_B, prompt_len, steps=steps, absorb=absorb)
      )
      if i:
        times.append(time.perf_counter() - t)
    return statistics.median(times)

  out = []
  for absorb in (True, False):
    t = timed(absorb)
    out.append(
      {
        'bench': 'generate',
        'preset': preset,
        'batch': batch,
        'dtype': 'float32',
        'attention': 'absorbed' if absorb else 'expanded',
        'prompt_len': prompt_len,
        'steps': steps,
        'step_ms': 1e3 * t / steps,
        'tokens_per_s': batch * steps / t,
        **machine(),
      }
    )
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--presets', default='tiny,medium')
  ap.add_argument('--batches', default='1,8')
  ap.add_argument('--prompt_len', type=int, default=32)
  ap.add_argument('--steps', type=int, default=32)
  ap.add_argument('--repeats', type=int, default=3)
  args = ap.parse_args()
  for preset in args.presets.split(','):
    for batch in (int(b) for b in args.batches.split(',')):
      for record in run(preset, batch, args.prompt_len, args.steps, args.repeats):
        emit(record)


if __name__ == '__main__':
  main()

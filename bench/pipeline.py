"""Pipeline parallelism on the 8-device CPU mesh: step time against no pipeline, and the bubble.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m bench.pipeline [--repeats 2]

The tiny LongCat (4 layers, float32) takes a forward and backward pass (the gradients of the
training loss) on meshes (S, 1, -1, 2, 1): S stages, experts over 2 devices in each. Every
micro-batch has the same rows (--micro_rows), and the batch has M of them. The stages are one
SPMD program, so every iteration costs the same, bubble iterations included. Over M, the step
time fits c + k * (M * R + S - 1), and the measured bubble is k * (S - 1) / (T - c), printed
beside the formula (S - 1) / (M * R + S - 1). No pipeline (1, 1, -1, 2, 1) runs the same rows
on the same 8 devices. Emulated devices share the host's cores, so an idle stage frees its core
for the others: the ratio to no pipeline measures the schedule's extra work, not a TPU's idle
time.
"""

import argparse
import functools

import jax
import numpy as np
import optax

from bench.common import emit, machine, time_fn
from moetrain.core import sharding
from moetrain.model import stages
from moetrain.model.config import ModelConfig
from moetrain.training.train_state import create_sharded, graphdef_of
from moetrain.training.train_step import StepConfig, loss_fn, token_counts

CFG = ModelConfig(num_layers=4).with_engine(dtype='float32', remat='full')


def batch(rows: int, t: int = 64, vocab: int = 512):
  rng = np.random.default_rng(0)
  ids = rng.integers(0, vocab, (rows, t + 1)).astype(np.int32)
  return {
    'inputs': ids[:, :-1],
    'targets': ids[:, 1:],
    'segment_ids': np.ones((rows, t), np.int32),
    'positions': np.broadcast_to(np.arange(t, dtype=np.int32), (rows, t)).copy(),
    'loss_mask': np.ones((rows, t), np.float32),
  }


@functools.lru_cache
def step_time(mesh_shape, m: int, r: int, rows: int, repeats: int) -> float:
  mesh = sharding.make_mesh(mesh_shape)
  rules = sharding.Rules.preset('fsdp_ep_tp')
  cfg = CFG.with_engine(pipeline_microbatches=m, pipeline_repeats=r, rules=rules)
  cfg = cfg.laid_out('cpu', mesh)
  stages.check(cfg)
  with jax.set_mesh(mesh):
    state = stages.store(create_sharded(cfg, optax.sgd(1.0), 0, mesh, cfg.engine.rules), cfg)
    b = {k: jax.device_put(v, sharding.batch_sharding(mesh)) for k, v in batch(rows).items()}
    step = StepConfig(model=cfg)

    def loss(params):
      args = (state.moe_bias, state.frozen, graphdef_of(cfg), b, None, token_counts(b), step)
      return loss_fn(params, *args)[0]

    grad = jax.jit(jax.grad(loss))
    return time_fn(grad, state.params, repeats=repeats)['median_s']


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--micro_rows', type=int, default=4)
  p.add_argument('--repeats', type=int, default=2)
  args = p.parse_args()
  emit({'machine': machine()})
  for s, r in ((2, 1), (4, 1), (2, 2)):
    ms = (s, 2 * s, 4 * s)
    times = [step_time((s, 1, -1, 2, 1), m, r, m * args.micro_rows, args.repeats) for m in ms]
    iters = [m * r + s - 1 for m in ms]
    k, c = np.polyfit(iters, times, 1)
    for m, t in zip(ms, times):
      rows = m * args.micro_rows
      base = step_time((1, 1, -1, 2, 1), 1, 1, rows, args.repeats)
      emit(
        {
          'stages': s,
          'repeats': r,
          'microbatches': m,
          'rows': rows,
          'step_s': round(t, 4),
          'no_pipeline_s': round(base, 4),
          'bubble_formula': round((s - 1) / (m * r + s - 1), 4),
          'bubble_measured': round(k * (s - 1) / (t - c), 4),
        }
      )


if __name__ == '__main__':
  main()

"""Small shared builders for tests."""

import dataclasses
import functools
import os
import subprocess
import sys

import jax
from flax import nnx

from moetrain.model.config import LoraConfig, ModelConfig
from moetrain.model.transformer import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_command(module: str, *args: str, **env: str) -> subprocess.CompletedProcess:
  """`python -m module args` from the repository root, as a user runs it (no huge-page
  re-execution); `env` adds environment variables."""
  return subprocess.run(
    [sys.executable, '-m', module, *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, 'MOETRAIN_NO_REEXEC': '1', 'PYTHONPATH': ROOT, **env},
  )


TINY = ModelConfig(
  dtype='float32',
  remat='none',
  vocab_size=64,
  hidden_size=32,
  num_layers=2,
  num_heads=2,
  q_lora_rank=16,
  kv_lora_rank=16,
  qk_nope_head_dim=8,
  qk_rope_head_dim=8,
  v_head_dim=8,
  ffn_hidden_size=48,
  expert_ffn_hidden_size=16,
  n_routed_experts=8,
  zero_expert_num=4,
  moe_topk=3,
  init_std=0.2,
)
ALL_TARGETS = (
  r'attn_\d\.(q_a|q_b|kv_a|kv_b|o)$|mlp_\d\.(gate|up|down)$|experts\.(gate|up|down)$|lm_head$'
)


def tiny(**kw) -> ModelConfig:
  return dataclasses.replace(TINY, **kw)


def with_lora(cfg: ModelConfig, rank=4, targets=ALL_TARGETS, **kw) -> ModelConfig:
  return dataclasses.replace(cfg, lora=LoraConfig(rank=rank, targets=targets, **kw))


def randomize(model: nnx.Module, seed: int, filt=nnx.Param, scale=0.2) -> None:
  """Non-trivial values for variables that start at constants (norm scales, LoRA B, biases)."""
  state = nnx.state(model, filt)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  new = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  nnx.update(model, jax.tree.unflatten(tree, new))


def model_and_ids(cfg: ModelConfig, seed=0, b=2, t=10):
  model = Transformer(cfg, nnx.Rngs(seed))
  ids = jax.random.randint(jax.random.key(seed + 100), (b, t), 0, cfg.vocab_size)
  return model, ids


def nonzero_bias(model, seed=1, scale=0.05):
  from moetrain.model.moe import RouterBias

  randomize(model, seed, RouterBias, scale)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _apply(fn, graphdef, state, *args):
  return fn(nnx.merge(graphdef, state), *args)


def jit_call(fn, module, *args):
  """fn(module, *args) under jit (eager NNX runs op by op and dominates test time)."""
  graphdef, state = nnx.split(module)
  return _apply(fn, graphdef, state, *args)


def _call(m, *args):
  return m(*args)


def forward(model, *args):
  return jit_call(_call, model, *args)


def expert_weights(key, e: int, d: int, f: int, rank: int = 2, scale: float = 0.3) -> dict:
  """Random routed-expert weights as the MoE engine takes them: 'gate', 'up' [E, D, F], 'down'
  [E, F, D] and each one's per-expert LoRA factors '<name>_lora_a' [E, in, rank] and
  '<name>_lora_b' [E, rank, out]."""
  shapes = dict(gate=(e, d, f), up=(e, d, f), down=(e, f, d))
  keys = iter(jax.random.split(key, 9))
  w = {name: scale * jax.random.normal(next(keys), s) for name, s in shapes.items()}
  for name, (_, i, o) in shapes.items():
    w[f'{name}_lora_a'] = scale * jax.random.normal(next(keys), (e, i, rank))
    w[f'{name}_lora_b'] = scale * jax.random.normal(next(keys), (e, rank, o))
  return w

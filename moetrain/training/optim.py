"""Optax optimizer and learning-rate schedule from a small frozen config."""

import dataclasses
import functools
import re

import jax
import optax
from flax import nnx

from moetrain.core.fields import check, field


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """The `config.optim` section: AdamW."""

  learning_rate: float = field(3e-3, check='positive')  # peak learning rate
  warmup_steps: int = 20  # linear warmup steps
  schedule: str = field('cosine', choices=('cosine', 'constant'))  # after the warmup
  min_lr_ratio: float = field(0.1, check='non_negative')  # cosine floor, a fraction of the peak
  b1: float = 0.9  # Adam beta1
  b2: float = 0.95  # Adam beta2
  eps: float = field(1e-8, check='non_negative')  # Adam epsilon (LongCat pretraining: 1e-16)
  weight_decay: float = field(0.0, check='non_negative')  # decoupled weight decay on matrices
  # Regex over parameter paths spared from weight decay, e.g. r'embed|router|lora_' (paths look
  # like 'embed.embedding', 'layers.moe.router', 'layers.attn_0.q_a.lora_a'); '' = none.
  weight_decay_exclude: str = ''
  grad_clip: float = field(1.0, check='non_negative', zero='0 = off')  # global-norm clipping
  grad_accum_steps: int = field(1, check='positive')  # micro-batches per step

  def validate(self, total_steps: int) -> None:
    check(self, 'optim')
    if self.warmup_steps < 0 or self.warmup_steps > total_steps:
      raise ValueError(
        f'optim.warmup_steps={self.warmup_steps} must lie in [0, train.steps={total_steps}]; '
        'for a short run lower it too (e.g. --config.optim.warmup_steps=0)'
      )
    for name in ('b1', 'b2'):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f'optim.{name}={getattr(self, name)} must lie in [0, 1)')
    try:
      re.compile(self.weight_decay_exclude)
    except re.error as e:
      raise ValueError(
        f'optim.weight_decay_exclude={self.weight_decay_exclude!r} is not a regex: {e}'
      ) from None
    if self.min_lr_ratio > 1:
      raise ValueError(
        f'optim.min_lr_ratio={self.min_lr_ratio} must be <= 1 (the floor as a fraction of the peak)'
      )


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  """The learning rate of the n-th update (n from 0). A warmup's first update already moves the
  weights (rate peak / warmup_steps, peak at update warmup_steps) and the cosine reaches its
  floor at the last update; without warmup the first update runs at the peak."""
  if cfg.schedule == 'constant':
    base = optax.join_schedules(
      [
        optax.linear_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1)),
        optax.constant_schedule(cfg.learning_rate),
      ],
      [cfg.warmup_steps],
    )
  elif cfg.warmup_steps == 0:  # full rate from the first update, the floor at the last
    return optax.cosine_decay_schedule(cfg.learning_rate, max(total_steps - 1, 1), cfg.min_lr_ratio)
  else:
    base = optax.warmup_cosine_decay_schedule(
      0.0,
      cfg.learning_rate,
      max(cfg.warmup_steps, 1),
      max(total_steps, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )
  if cfg.warmup_steps == 0:
    return base
  return lambda n: base(n + 1)  # a warmup's rate 0 would waste the first update


def decay_mask(params, exclude: str = ''):
  """Weight decay on matrices only (not norms, biases or 1-D scales), and not on the parameters
  whose path ('embed.embedding', 'layers.moe.router', 'layers.attn_0.q_a.lora_a', ...)
  the regex `exclude` finds. A Variable's leading 'layers' axis (scan_layers stacks) does not
  count: the mask is decided on the Variables, whose metadata says so, not on their bare
  arrays. The sparse attention indexer (model/indexer.py) is never decayed: unless
  loss.indexer_kl trains it no gradient reaches it, so decay would be its only update."""
  excluded = re.compile(exclude).search if exclude else lambda _: False
  spared = lambda name: '.indexer.' in name or excluded(name)

  def matrix(path, x):
    name = '.'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)
    if isinstance(x, nnx.Variable):
      return x.replace(x.get_value().ndim - _stacked(x) >= 2 and not spared(name))
    return x.ndim >= 2 and not spared(name)

  return jax.tree.map_with_path(matrix, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _stacked(x) -> int:
  axes = x.get_metadata().get('axes', ()) if isinstance(x, nnx.Variable) else ()
  return int(bool(axes) and axes[0] == 'layers')


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  lr = schedule(cfg, total_steps)
  parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
  parts.append(
    optax.adamw(
      lr,
      b1=cfg.b1,
      b2=cfg.b2,
      eps=cfg.eps,
      weight_decay=cfg.weight_decay,
      mask=functools.partial(decay_mask, exclude=cfg.weight_decay_exclude),
    )
  )
  return optax.chain(*parts)

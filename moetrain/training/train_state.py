"""TrainState: the pytree a step consumes and returns, and its sharded creation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moetrain.core import sharding
from moetrain.model.config import ModelConfig
from moetrain.model.moe import RouterBias
from moetrain.model.transformer import Transformer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  step: jax.Array
  params: nnx.State  # trainable: LoRA adapters (plus the router if asked), or everything
  frozen: nnx.State  # the base model under LoRA/QLoRA; restored from its source, never saved
  moe_bias: nnx.State  # router correction biases, updated by the balancing controller
  opt_state: optax.OptState
  rng: jax.Array
  skipped: jax.Array  # updates skipped because gradients were not finite
  # float16 compute only: [the dynamic loss scale, finite steps since it last changed].
  loss_scale: jax.Array | None = None
  # Online distillation only: the teacher's weights (every variable of it), read by the step,
  # never differentiated, updated or saved (moetrain/distill).
  teacher: nnx.State | None = None

  def saved(self) -> dict:
    """What a checkpoint holds: everything except the frozen base and the teacher (and an unused
    loss scale)."""
    # Not dataclasses.asdict: it deep-copies leaves and strips nnx Variables of their metadata.
    return {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.name not in ('frozen', 'teacher') and getattr(self, f.name) is not None
    }


LOSS_SCALE_INIT = 2.0**15  # float16 gradients: the first scale (halved at each overflow)


def initial_loss_scale(cfg: ModelConfig) -> jax.Array | None:
  """float16 compute needs a loss scale (its gradients underflow otherwise); bf16 and f32 none."""
  if cfg.engine.dtype != 'float16':
    return None
  return jnp.asarray([LOSS_SCALE_INIT, 0.0], jnp.float32)


def trainable_filter(cfg: ModelConfig):
  if not cfg.lora.enabled:
    return nnx.Param
  if cfg.lora.train_router:
    router = nnx.Any(nnx.PathContains('router'), nnx.PathContains('router_linear_bias'))
    return nnx.Any(nnx.LoRAParam, nnx.All(nnx.Param, router))
  return nnx.LoRAParam


def split_model(model: nnx.Module, cfg: ModelConfig):
  """graphdef, trainable, moe_bias, frozen (the rest: base Params and quantised weights)."""
  return nnx.split(model, trainable_filter(cfg), RouterBias, ...)


def merge_model(graphdef, params, moe_bias, frozen) -> Transformer:
  return nnx.merge(graphdef, params, moe_bias, frozen)


def init_state(cfg: ModelConfig, optimizer, seed: int, base: nnx.State | None = None) -> TrainState:
  model = Transformer(cfg, nnx.Rngs(seed))
  _, params, moe_bias, frozen = split_model(model, cfg)
  if base is not None:  # weights from a checkpoint replace the random base (same structure)
    frozen = base
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    frozen=frozen,
    moe_bias=moe_bias,
    opt_state=optimizer.init(params),
    rng=jax.random.key_data(jax.random.key(seed + 1)),
    skipped=jnp.zeros((), jnp.int32),
    loss_scale=initial_loss_scale(cfg),
  )


def graphdef_of(cfg: ModelConfig):
  return split_model(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), cfg)[0]


@functools.lru_cache(maxsize=4)
def teacher_graphdef(cfg: ModelConfig):
  """The graph of a teacher whose weights are one State (TrainState.teacher)."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))[0]


def abstract_teacher(cfg: ModelConfig) -> nnx.State:
  return nnx.state(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))


def merge_teacher(cfg: ModelConfig, teacher: nnx.State) -> Transformer:
  return nnx.merge(teacher_graphdef(cfg), teacher)


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def state_shardings(abstract, mesh, rules: sharding.Rules):
  """NamedShardings from the logical axes stored on each Variable; other leaves replicate."""
  sizes = dict(mesh.shape)

  def one(x):
    if _is_var(x) and 'axes' in x.get_metadata():
      spec = sharding.logical_to_spec(x.axes, x.get_value().shape, rules.weights, sizes)
      return x.replace(jax.sharding.NamedSharding(mesh, spec))
    if _is_var(x):
      return x.replace(sharding.replicated(mesh))
    return sharding.replicated(mesh)

  return jax.tree.map(one, abstract, is_leaf=_is_var)


def create_sharded(cfg: ModelConfig, optimizer, seed: int, mesh, rules) -> TrainState:
  """eval_shape -> shardings -> jit(init, out_shardings): nothing is materialised unsharded."""
  init = lambda: init_state(cfg, optimizer, seed)
  abstract = jax.eval_shape(init)
  out = state_shardings(abstract, mesh, rules)
  return jax.jit(init, out_shardings=out)()


def state_from_weights(
  params, moe_bias, frozen, optimizer, seed: int, mesh, rules, loss_scale=None
) -> TrainState:
  """A step-0 state around given (already sharded) weights, e.g. a Hugging Face checkpoint;
  loss_scale: initial_loss_scale of the model config."""
  opt_abstract = jax.eval_shape(optimizer.init, params)
  opt_state = jax.jit(optimizer.init, out_shardings=state_shardings(opt_abstract, mesh, rules))(
    params
  )
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    frozen=frozen,
    moe_bias=moe_bias,
    opt_state=opt_state,
    rng=jax.random.key_data(jax.random.key(seed + 1)),
    skipped=jnp.zeros((), jnp.int32),
    loss_scale=loss_scale,
  )

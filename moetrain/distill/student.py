"""The student's initial weights from the teacher (distill.init_from_teacher): each student layer
from a chosen teacher layer; with fewer routed experts, the teacher's experts that the training
data routes to most (or a random choice), with their router columns and correction biases;
embedding, norms, attention and head wherever the shapes allow. What could not be copied is
listed."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moetrain.core import runtime
from moetrain.core.sharding import batch_sharding
from moetrain.data import loader
from moetrain.model.config import ModelConfig
from moetrain.run.evaluation import to_global
from moetrain.training.train_state import merge_teacher


def layer_map(d, student: ModelConfig, teacher: ModelConfig) -> list[int]:
  """The teacher layer each student layer starts from: distill.init_layers, or spread evenly."""
  if not d.init_layers:
    return [i * teacher.num_layers // student.num_layers for i in range(student.num_layers)]
  layers = [int(x) for x in d.init_layers]
  if len(layers) != student.num_layers or not all(0 <= x < teacher.num_layers for x in layers):
    raise ValueError(
      f'distill.init_layers={tuple(layers)}: name one teacher layer (0..{teacher.num_layers - 1}) '
      f"for each of the student's {student.num_layers} layers"
    )
  return layers


def expert_load(setup, teacher_cfg: ModelConfig, teacher, batches: int, mesh) -> np.ndarray:
  """[teacher MoE layers, routed experts]: how many tokens of `batches` training batches the
  teacher routes to each expert (expert_load's statistic)."""

  tokenizer = loader.make_tokenizer(setup.data, None)
  it = loader.make_train_iterator(
    setup.data, tokenizer, process_index=jax.process_index(), process_count=jax.process_count()
  )

  @jax.jit
  def load(state, batch):
    model = merge_teacher(teacher_cfg, state)
    _, aux = model.features(batch['inputs'], batch['positions'], batch['segment_ids'])
    return aux['moe']['load'][:, : teacher_cfg.n_routed_experts]

  total, rows = 0.0, batch_sharding(mesh)
  for _ in range(batches):
    total = total + load(teacher, to_global(next(it), rows))
  it.close()
  return np.asarray(jax.device_get(total))


def choose_experts(d, setup, student: ModelConfig, teacher_cfg: ModelConfig, teacher, mesh) -> list:
  """Per teacher MoE layer, the teacher experts the student's experts start from (sorted)."""
  n_t, n_s = teacher_cfg.n_routed_experts, student.n_routed_experts
  n_moe = sum(g.count for g in teacher_cfg.layer_groups() if g.kind == 'moe')
  if n_s >= n_t:
    return [list(range(n_t))] * n_moe
  if d.init_from_teacher == 'random':
    rng = np.random.default_rng(setup.seed)
    return [sorted(rng.choice(n_t, n_s, replace=False).tolist()) for _ in range(n_moe)]
  with runtime.phase(f"Measuring the teacher's expert load on {d.init_batches} batches"):
    load_LE = expert_load(setup, teacher_cfg, teacher, d.init_batches, mesh)
  return [sorted(np.argsort(-row, kind='stable')[:n_s].tolist()) for row in load_LE]


def _groups(cfg: ModelConfig) -> dict:
  """{global layer: (group name, index in the group, MoE layer index or None)}."""
  out, moe = {}, 0
  for g in cfg.layer_groups():
    for i in range(g.count):
      out[g.start + i] = (g.name, i, moe if g.kind == 'moe' else None)
      moe += g.kind == 'moe'
  return out


def _take(value, names, experts, zero: int):
  """The chosen experts of one layer's value along its 'experts' axis, or its router columns
  ('router': the chosen routed experts, then the zero experts)."""
  for axis, name in enumerate(names):
    if name == 'experts':
      value = jnp.take(value, jnp.asarray(experts), axis=axis)
    elif name == 'router':
      n_routed = value.shape[axis] - zero
      idx = list(experts) + list(range(n_routed, n_routed + zero))
      value = jnp.take(value, jnp.asarray(idx), axis=axis)
  return value


def _teacher_row(path, j, group, names, ctx):
  """Student layer j of `group`'s value at `path`, from the teacher (None: nothing fits)."""
  s_cfg, t_cfg, layers, experts, t_flat = ctx
  t_name, t_index, t_moe = _groups(t_cfg)[layers[group.start + j]]
  t_var = t_flat.get((t_name, *path[1:]))
  if t_var is None or not isinstance(t_var.get_value(), jax.Array):
    return None
  row = t_var.get_value()[t_index]
  if t_moe is not None and group.kind == 'moe':
    row = _take(row, names[1:], experts[t_moe], t_cfg.zero_expert_num)
  return row


def copy_weights(state: nnx.State, ctx) -> tuple[nnx.State, list[str]]:
  """`state` (the student's params, moe_bias or frozen) with every value the teacher has in the
  same shape; and the paths it has not (with the layers, for stacked ones)."""
  s_cfg, _, _, _, t_flat = ctx
  groups = {g.name: g for g in s_cfg.layer_groups()}
  missed, out = [], {}
  for path, var in nnx.to_flat_state(state):
    value, names = var.get_value(), var.get_metadata().get('axes', ())
    where = '.'.join(map(str, path))
    if path[0] in groups:
      g = groups[path[0]]
      rows = [_teacher_row(path, j, g, names, ctx) for j in range(g.count)]
      fits = [r is not None and r.shape == value.shape[1:] for r in rows]
      new = jnp.stack(
        [r.astype(value.dtype) if ok else value[j] for j, (r, ok) in enumerate(zip(rows, fits))]
      )
      if not all(fits):
        missed.append(f'{where} (layers {[g.start + j for j, ok in enumerate(fits) if not ok]})')
    else:
      t_var = t_flat.get(path)
      t_value = None if t_var is None else t_var.get_value()
      ok = isinstance(t_value, jax.Array) and t_value.shape == value.shape
      new = t_value.astype(value.dtype) if ok else value
      if not ok:
        missed.append(where)
    # A copy: the student must not share a buffer with the teacher (both are donated).
    out[path] = var.replace(jax.device_put(jnp.array(new, copy=True), value.sharding))
  return nnx.from_flat_state(out), missed


def init_from_teacher(setup, state, teacher_cfg: ModelConfig, teacher: nnx.State, mesh):
  """The state with the student's weights copied from the teacher (module docstring)."""
  d, s_cfg = setup.distill, setup.model
  layers = layer_map(d, s_cfg, teacher_cfg)
  experts = choose_experts(d, setup, s_cfg, teacher_cfg, teacher, mesh)
  t_flat = dict(nnx.to_flat_state(teacher))
  ctx = (s_cfg, teacher_cfg, layers, experts, t_flat)
  parts, missed = {}, []
  for name in ('params', 'moe_bias', 'frozen'):
    parts[name], m = copy_weights(getattr(state, name), ctx)
    missed += m
  if runtime.is_primary():
    chosen = (
      {i: e for i, e in enumerate(experts)}
      if s_cfg.n_routed_experts < teacher_cfg.n_routed_experts
      else 'all'
    )
    print(
      f'  student layers from teacher layers {layers}; experts (per teacher MoE layer): {chosen}'
    )
    print(f'  not copied (initial values kept): {", ".join(missed) if missed else "nothing"}')
  return dataclasses.replace(state, **parts)

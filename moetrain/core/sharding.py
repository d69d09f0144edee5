"""Mesh construction, logical-axis rule presets and the shardings of state and batches."""

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

# 'stage' (pipeline parallelism, docs/pipeline.md) comes first; 'context' splits each row's
# tokens (docs/context.md). A mesh.shape or mesh.dcn_shape of 5 entries (stage, data, fsdp,
# expert, tensor) means context 1, of 4 (data, fsdp, expert, tensor) stage 1 too (full_shape).
MESH_AXES = ('stage', 'data', 'fsdp', 'expert', 'context', 'tensor')
SHAPE_LENGTHS = (4, 5, 6)
BATCH_AXES = ('data', 'fsdp', 'expert')
# A batch's rows split over the stages too: outside the pipelined layers each stage embeds and
# scores its own rows; inside them the rows of a stage's micro-batch split over BATCH_AXES.
ROW_AXES = ('stage', *BATCH_AXES)

# The axes weights are stored over (FSDP, gathered for each use): 'context' too, as in MaxText,
# since a row split over it leaves each context shard its tokens but, unsharded there, the whole
# model's weights: LongCat-Flash's 560B over 16 expert shards is 70 GB a chip before any token.
FSDP_AXES = ('fsdp', 'context')

# Rule tables: logical name -> mesh axes. Names absent from a table are replicated.
# Sections follow the model: attention / MoE / dense / vocab; weights and activations apart.
_WEIGHTS_FSDP = {
  # attention
  'heads': None,
  'head_dim': None,
  # q_b / kv_b's input: without it they (and their optimizer moments) sit whole on every device.
  # q_a / kv_a keep fsdp on 'embed' (an axis is used once per array).
  'q_lora': FSDP_AXES,
  'kv_lora': FSDP_AXES,
  # MoE
  'experts': None,
  'expert_mlp': None,
  'router': None,
  # dense
  'embed': FSDP_AXES,
  'mlp': None,
  # A pipeline's stage s stores its own layers (and their optimizer state): consecutive ones, or
  # under a circular schedule its R runs (model/pipeline.py, layer_order).
  'layers': 'stage',
  'lora_rank': None,
  # vocab
  'vocab': None,
}
_ACTS_FSDP = {
  'stage': 'stage',  # a pipeline's per-stage buffers (model/pipeline.py)
  'batch': ROW_AXES,
  # A row's tokens split over 'context'; keys and values are whole on every context shard (the
  # all-gather of context parallelism, model/context.py).
  'seq': 'context',
  'kv_seq': None,
  'embed': None,
  'heads': None,
  'mlp': None,
  'experts': None,
  'vocab': None,
}


def _preset(ep: bool, tp: bool) -> tuple[dict, dict]:
  w, a = dict(_WEIGHTS_FSDP), dict(_ACTS_FSDP)
  if ep:
    w['experts'] = 'expert'
    a['experts'] = 'expert'
    # Every other weight shards over the expert axis too (FSDP over fsdp x expert): replicated
    # over it, the dense, attention and embedding weights (and in full training their gradients
    # and moments) would sit on each expert shard whole, 16x at LongCat-Flash's mesh. Their
    # gradients are summed over every batch shard anyway. Expert weights keep 'embed' on fsdp
    # ('expert' already holds their first axis).
    for name in ('embed', 'q_lora', 'kv_lora'):
      w[name] = ('fsdp', 'expert', 'context')
  if tp:
    for name in ('heads', 'mlp', 'expert_mlp', 'vocab'):
      w[name] = 'tensor'
    for name in ('heads', 'mlp', 'vocab'):
      a[name] = 'tensor'
  return w, a


RULE_PRESETS = {
  'fsdp': _preset(ep=False, tp=False),
  'fsdp_ep': _preset(ep=True, tp=False),
  'fsdp_ep_tp': _preset(ep=True, tp=True),
}


@dataclasses.dataclass(frozen=True)
class Rules:
  """Logical-to-mesh rules, hashable so modules can hold them as static config."""

  weights: tuple[tuple[str, object], ...] = ()
  activations: tuple[tuple[str, object], ...] = ()

  @classmethod
  def preset(cls, name: str) -> 'Rules':
    if name not in RULE_PRESETS:
      raise ValueError(f'mesh.rules={name!r} is unknown; choose one of {sorted(RULE_PRESETS)}')
    w, a = RULE_PRESETS[name]
    return cls(tuple(w.items()), tuple(a.items()))


def check_axes_used(mesh_shape: Sequence[int], rules_name: str) -> None:
  """A 'tensor' axis > 1 that the rules shard nothing over would run the same step on each of
  its devices: refused, naming both settings. (An 'expert' axis without expert rules still
  splits the batch.)"""
  sizes = dict(zip(MESH_AXES, full_shape(mesh_shape)))
  weights, _ = RULE_PRESETS[rules_name]
  if sizes['tensor'] > 1 and 'tensor' not in weights.values():
    raise ValueError(
      f"mesh.shape={tuple(mesh_shape)} has a 'tensor' axis of {sizes['tensor']}, but "
      f'mesh.rules={rules_name!r} shards nothing over it (every device of it would repeat the '
      "same work): use mesh.rules='fsdp_ep_tp', or fold that axis into 'fsdp' or 'data'"
    )


def make_mesh(shape: Sequence[int], devices=None, dcn: Sequence[int] = ()) -> jax.sharding.Mesh:
  """Mesh over MESH_AXES; one entry of `shape` may be -1 (the remaining devices). `dcn`
  (mesh.dcn_shape) splits axes over slices: axis i spans dcn[i] slices of shape[i] / dcn[i]
  devices each, so its collectives cross the data-center network only between slices."""
  devices = list(devices if devices is not None else jax.devices())
  shape = resolve_mesh_shape(shape, len(devices))
  types = (AxisType.Auto,) * len(MESH_AXES)
  dcn = check_dcn_shape(dcn, shape)
  if math.prod(dcn) > 1:
    from jax.experimental import mesh_utils

    slices = {getattr(d, 'slice_index', None) for d in devices}
    if len(slices) != math.prod(dcn):
      raise ValueError(
        f'mesh.dcn_shape={tuple(dcn)} asks for {math.prod(dcn)} slices, but the '
        f'{len(devices)} devices are of {len(slices)} (a multislice TPU job: '
        'tpu_scripts/create.sh with NUM_SLICES)'
      )
    ici = [s // d for s, d in zip(shape, dcn)]
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    return jax.sharding.Mesh(grid, MESH_AXES, axis_types=types)
  try:
    return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
  except NotImplementedError:
    # A TPU torus whose sides no product of them matches an axis (v5p-512 is 4x8x8: fsdp 16 and
    # expert 16 each need a side split in two): let an axis span parts of physical sides.
    from jax.experimental import mesh_utils

    grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return jax.sharding.Mesh(grid, MESH_AXES, axis_types=types)


def check_dcn_shape(dcn: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
  """mesh.dcn_shape, all ones when empty; each entry must divide its axis of mesh.shape."""
  dcn = tuple(int(d) for d in dcn) or (1,) * len(MESH_AXES)
  if len(dcn) not in SHAPE_LENGTHS or any(d < 1 for d in dcn):
    raise ValueError(
      f'mesh.dcn_shape={dcn}: give {len(MESH_AXES)} slice counts >= 1 {MESH_AXES} (or 5, '
      'without context; or 4, without stage either), or () for one'
    )
  given, (dcn, shape) = dcn, (full_shape(dcn), full_shape(shape))
  if any(s % d for s, d in zip(shape, dcn)):
    raise ValueError(
      f'mesh.dcn_shape={given} must divide mesh.shape={tuple(shape)} axis by axis (an axis of '
      'size s over d slices has s / d devices in each)'
    )
  return dcn


def full_shape(shape: Sequence[int]) -> tuple[int, ...]:
  """A mesh shape over all of MESH_AXES: 5 entries (stage, data, fsdp, expert, tensor) mean
  context 1 and 4 entries (data, fsdp, expert, tensor) stage 1 too, so configs, checkpoints and
  run directories written before those axes keep working."""
  shape = tuple(int(s) for s in shape)
  if len(shape) == 4:
    shape = (1, *shape)
  return (*shape[:4], 1, shape[4]) if len(shape) == 5 else shape


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
  shape = [int(s) for s in shape]
  if len(shape) not in SHAPE_LENGTHS:
    raise ValueError(
      f'mesh.shape needs {len(MESH_AXES)} entries {MESH_AXES} (or 5, without context; or 4, '
      f'without stage either), got {shape}'
    )
  shape = list(full_shape(shape))
  if shape.count(-1) > 1:
    raise ValueError(f'mesh.shape={shape}: at most one entry may be -1')
  bad = [s for s in shape if s < 1 and s != -1]
  if bad:
    raise ValueError(f'mesh.shape={shape}: entries are axis sizes >= 1, or -1 for the rest')
  if -1 in shape:
    known = int(np.prod([s for s in shape if s != -1]))
    if num_devices % known:
      raise ValueError(f'mesh.shape={shape}: {num_devices} devices are not divisible by {known}')
    shape[shape.index(-1)] = num_devices // known
  if int(np.prod(shape)) != num_devices:
    raise ValueError(
      f'mesh.shape={shape} has {int(np.prod(shape))} devices but {num_devices} are present; '
      'make the product equal the device count or set one entry to -1'
    )
  return tuple(shape)


def logical_to_spec(names, shape, table, mesh_sizes: dict[str, int]) -> P:
  """Maps logical names to a PartitionSpec, dropping mesh axes that are size 1, reused or
  do not divide the dimension (so odd small shapes replicate instead of failing)."""
  table = dict(table)
  used, spec = set(), []
  for name, size in zip(names, shape):
    axes = table.get(name) if name is not None else None
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    kept = []
    for ax in axes:
      n = mesh_sizes.get(ax, 1)
      if n == 1 or ax in used or size % (int(np.prod([mesh_sizes[k] for k in kept])) * n):
        continue
      kept.append(ax)
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return P(*spec)


_WITHIN_STAGES = contextvars.ContextVar('within_stages', default=False)


@contextlib.contextmanager
def within_stages():
  """Traces the pipelined layers (model/pipeline.py), which the 'stage' axis already splits:
  constrain() leaves that axis to them (a batch's rows split over BATCH_AXES alone)."""
  token = _WITHIN_STAGES.set(True)
  try:
    yield
  finally:
    _WITHIN_STAGES.reset(token)


def constrain(x: jax.Array, names: tuple[str | None, ...], rules: Rules) -> jax.Array:
  """with_sharding_constraint by logical names; a no-op outside a mesh context."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not rules.activations:
    return x
  sizes = dict(mesh.shape) | ({'stage': 1} if _WITHIN_STAGES.get() else {})
  spec = logical_to_spec(names, x.shape, rules.activations, sizes)
  return jax.lax.with_sharding_constraint(x, spec)


def gather_weight(w: jax.Array, names: tuple[str | None, ...], rules: Rules) -> jax.Array:
  """A weight as its layer uses it: whole over the batch axes and 'context' (FSDP's gather),
  still split over 'tensor'; a no-op outside a mesh context. Left split over 'context', a
  weight's input axis made XLA sum each product's partial results over that axis (in the
  compute dtype: bfloat16 moved every token's projections by about an ulp) instead of
  gathering the weight."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not rules.weights:
    return w
  gathered = (*BATCH_AXES, *FSDP_AXES)
  table = {
    k: tuple(a for a in ((v,) if isinstance(v, str) else v or ()) if a not in gathered)
    for k, v in rules.weights
  }
  spec = logical_to_spec(names, w.shape, tuple(table.items()), dict(mesh.shape))
  return jax.lax.with_sharding_constraint(w, spec)


def tree_shardings(axes_tree, abstract_tree, mesh, rules: Rules):
  """NamedShardings for a tree of arrays whose logical names are given by `axes_tree`."""
  sizes = dict(mesh.shape)
  return jax.tree.map(
    lambda names, x: NamedSharding(mesh, logical_to_spec(names, x.shape, rules.weights, sizes)),
    axes_tree,
    abstract_tree,
    is_leaf=lambda n: isinstance(n, tuple),
  )


def batch_sharding(mesh, ndim: int = 2) -> NamedSharding:
  axes = tuple(a for a in ROW_AXES if mesh.shape[a] > 1)
  first = None if not axes else axes[0] if len(axes) == 1 else axes
  return NamedSharding(mesh, P(first, *([None] * (ndim - 1))))


def check_hosts_own_rows(sharding_, rows: int) -> None:
  """Each process loads its own rows of every batch (its 1/process_count slice of the data), so
  no two processes may hold the same batch rows. When they do (a 'context' or 'tensor' axis that
  spans hosts replicates the batch over them), the array the step sees would differ from host
  to host."""
  owner = {}  # batch row -> the first process seen holding it
  for device, index in sharding_.devices_indices_map((rows, 1)).items():
    for row in range(*index[0].indices(rows)):
      first = owner.setdefault(row, device.process_index)
      if first != device.process_index:
        raise ValueError(
          f'processes {first} and {device.process_index} would both hold batch row {row}: the '
          f'batch axes (stage, data, fsdp, expert) must split the batch over the hosts; keep the '
          "'context' and 'tensor' axes of mesh.shape within a host"
        )


def shift_stages(x_Y, stages: int, by: int = 1):
  """x_Y's entry s moved to stage s + by (mod stages): one collective permute over the 'stage'
  axis (jax.lax.ppermute inside a shard_map manual over that axis alone, so the other
  dimensions keep their sharding); a roll without a mesh or a stage axis."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or dict(mesh.shape).get('stage', 1) != stages or stages == 1:
    return jnp.roll(x_Y, by, axis=0)
  perm = [(i, (i + by) % stages) for i in range(stages)]
  return jax.shard_map(
    lambda a: jax.lax.ppermute(a, 'stage', perm),
    in_specs=P('stage'),
    out_specs=P('stage'),
    axis_names={'stage'},
    check_vma=False,
  )(x_Y)


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())

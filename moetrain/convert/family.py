"""What the families' config.json readers and weight tables share: the HF keys -> ModelConfig
fields mapping, the checks every config.json gets, and the rows of a group of layers."""

from moetrain.convert.stacked_io import Row
from moetrain.core.engine import ENGINE_FIELDS
from moetrain.model.config import LayerGroup

# (HF name, moetrain path, input dims of the kernel). HF stores a Linear as [prod(out), prod(in)],
# the transposed, flattened moetrain kernel [in..., out...]; None: the same layout on both sides.
GLOBAL = (
  ('model.embed_tokens.weight', 'embed.embedding', None),
  ('model.norm.weight', 'final_norm.scale', None),
  ('lm_head.weight', 'lm_head.kernel', 1),
)


def global_rows() -> list[Row]:
  return [Row(hf, path, n) for hf, path, n in GLOBAL]


def group_rows(group: LayerGroup, entries, experts: bool = False) -> list[Row]:
  """Rows of (HF name under model.layers.{l}., path under the group's module, n_in) for every
  layer of `group`."""
  layers = tuple(range(group.start, group.start + group.count))
  return [
    Row(f'model.layers.{{l}}.{hf}', f'{group.name}.{path}', n, layers, experts)
    for hf, path, n in entries
  ]


def read_fields(c: dict, model_type: str, required: dict, optional: dict, fixed: dict) -> dict:
  """ModelConfig keyword arguments from config.json `c`: `required` maps HF keys to fields,
  `optional` HF keys to (field, transformers' default), and `fixed` HF keys to the only value
  moetrain implements (the default applies when a key is absent). Errors name the key."""
  if c.get('model_type', model_type) != model_type:
    raise ValueError(f'config.json model_type={c["model_type"]!r}: expected {model_type!r}')
  missing = [k for k in required if c.get(k) is None]
  if missing:
    raise ValueError(f'config.json ({model_type}) lacks {missing}')
  wrong = {k: c[k] for k in required if type(c[k]) is not int}  # bool too: not a size
  if wrong:
    raise ValueError(f'config.json: {wrong} should be integers')
  for key, want in fixed.items():
    if c.get(key, want) != want:
      raise ValueError(
        f'config.json {key}={c[key]!r} is unsupported: moetrain implements {model_type} '
        f'with {key}={want!r}'
      )
  kw = {field: c[key] for key, field in required.items()}
  for key, (field, default) in optional.items():
    value = c.get(key)
    kw[field] = default if value is None else value
  return kw


def write_fields(cfg, required: dict, optional: dict) -> dict:
  """The config.json keys of `required` and `optional` (read_fields' tables) from cfg."""
  value = lambda f: getattr(cfg.engine if f in ENGINE_FIELDS else cfg, f)  # (init_std)
  out = {key: value(field) for key, field in required.items()}
  out.update({key: value(field) for key, (field, _) in optional.items()})
  return out

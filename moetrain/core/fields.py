"""Config keys declared once: each section of the config is a frozen dataclass, and each key a
field of it with its default, its checks and its role. configs/base.py, the resume checks and
the validation all read these declarations (moetrain.run.sections.SECTIONS lists the sections)."""

import dataclasses
import math

# What a key is to the rest of the system (how the model computes, which may change on a resume,
# is not a role but a section of its own: `engine`, moetrain/core/engine.py):
#   stream: shapes the training stream a checkpoint's data position points into;
#   path:   a local path, made absolute before anything reads it;
#   derived: a dataclass field that is not a config key (set by the code from other keys).
ROLES = ('stream', 'path', 'derived')
CHECKS = ('positive', 'non_negative')


def field(default, *, role=(), check: str = '', zero: str = '', choices=()):
  """A config key with its `default`. role: one of ROLES or a tuple of them; check: 'positive'
  (> 0) or 'non_negative' (>= 0; `zero` says what 0 means, for the error); choices: the values
  it may take."""
  roles = frozenset((role,) if isinstance(role, str) else role)
  if not roles <= set(ROLES):
    raise ValueError(f'role={role!r}: use some of {ROLES}')
  if check and check not in CHECKS:
    raise ValueError(f'check={check!r}: use one of {CHECKS}')
  meta = {'roles': roles, 'check': check, 'zero': zero, 'choices': tuple(choices)}
  return dataclasses.field(default=default, metadata=meta)


def _meta(f: dataclasses.Field, name: str):
  return f.metadata.get(name, {'choices': (), 'roles': frozenset()}.get(name, ''))


def keys(cls) -> tuple[str, ...]:
  """The config keys of a section's dataclass (its fields but the derived ones)."""
  return tuple(f.name for f in dataclasses.fields(cls) if 'derived' not in _meta(f, 'roles'))


def with_role(cls, role: str) -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(cls) if role in _meta(f, 'roles'))


def defaults(cls) -> dict:
  """{key: default} of a section's dataclass."""
  made = cls()
  return {k: getattr(made, k) for k in keys(cls)}


def check(obj, section: str) -> None:
  """The declared checks of every key of `obj`, an instance of a section's dataclass; the error
  names the key as `section.key`."""
  for f in dataclasses.fields(obj):
    value, what = getattr(obj, f.name), _meta(f, 'check')
    if what and isinstance(value, float) and not math.isfinite(value):
      raise ValueError(f'{section}.{f.name}={value!r}: must be a finite number')
    if what == 'positive' and not value > 0:
      raise ValueError(f'{section}.{f.name}={value!r}: must be positive')
    if what == 'non_negative' and not value >= 0:
      zero = f' ({_meta(f, "zero")})' if _meta(f, 'zero') else ''
      raise ValueError(f'{section}.{f.name}={value!r}: must be >= 0{zero}')
    if (choices := _meta(f, 'choices')) and value not in choices:
      raise ValueError(f'{section}.{f.name}={value!r} is unknown: use one of {choices}')

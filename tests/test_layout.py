"""The code's shape: functions a reader takes in at once, tools apart from the training loop,
and no ambient engine state in the model's math."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent / 'moetrain'
MAX_LINES = 60


def _modules(under: pathlib.Path = ROOT):
  for path in sorted(under.rglob('*.py')):
    yield path, ast.parse(path.read_text())


def test_no_function_is_longer_than_a_screen():
  long = [
    f'{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({lines} lines)'
    for path, tree in _modules()
    for node in ast.walk(tree)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    and (lines := node.end_lineno - node.lineno + 1) > MAX_LINES
  ]
  assert not long, long


def _imports(tree) -> set[str]:
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.update(f'{node.module}.{a.name}' for a in node.names)
      names.add(node.module)
  return names


def test_the_tools_import_setup_not_the_training_loop():
  for path, tree in _modules(ROOT / 'tools'):
    assert 'moetrain.run.train' not in _imports(tree), path


def test_the_model_reads_no_ambient_backend_or_mesh():
  """The engine is laid out by startup.build (ModelConfig.platform and mesh_shape)."""
  for path, tree in [*_modules(ROOT / 'model'), *_modules(ROOT / 'kernels')]:
    calls = {
      ast.unparse(node.func)
      for node in ast.walk(tree)
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    ambient = {c for c in calls if c.endswith(('default_backend', 'get_abstract_mesh'))}
    assert not ambient, (path, ambient)


SUFFIX = re.compile(r'^[a-z][a-z0-9]*_([A-Z][A-Za-z]*)$')
EINSUM = re.compile(r'^[A-Z]+(,[A-Z]+)*->[A-Z]*$')


def _shape_names(tree):
  """(name, letters) of every suffixed identifier and every upper-case einsum string."""
  for node in ast.walk(tree):
    name = None
    if isinstance(node, ast.Name):
      name = node.id
    elif isinstance(node, ast.arg):
      name = node.arg
    elif isinstance(node, ast.Attribute):
      name = node.attr
    if name and (m := SUFFIX.match(name)):
      yield name, m.group(1)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      if EINSUM.match(node.value):
        yield node.value, node.value.replace(',', '').replace('->', '')


def test_shape_letters_come_from_the_one_table():
  """Every array-name suffix (x_BTD) and einsum string in the model and its kernels uses only
  letters of moetrain/core/axes.py's table; the table names its logical axes once each."""
  from moetrain.core import axes

  unknown = [
    f'{path.relative_to(ROOT.parent)}: {name}'
    for under in ('model', 'kernels')
    for path, tree in _modules(ROOT / under)
    for name, letters in _shape_names(tree)
    if set(letters) - set(axes.LETTERS)
  ]
  assert not unknown, unknown
  names = [v.name for v in axes.LETTERS.values() if v.name]
  assert len(names) == len(set(names))
  assert axes.names('EDF', F=axes.EXPERT_MLP) == ('experts', 'embed', 'expert_mlp')


def test_the_sharding_rules_speak_the_tables_names():
  """Every logical name the rule presets map is one of axes.py's (a renamed letter cannot
  leave a rule behind that nothing uses)."""
  from moetrain.core import axes, sharding

  for preset in ('fsdp', 'fsdp_ep', 'fsdp_ep_tp'):
    rules = sharding.Rules.preset(preset)
    used = {name for name, _ in rules.weights + rules.activations}
    assert used <= axes.WEIGHT_NAMES, (preset, used - axes.WEIGHT_NAMES)


# The packages, lowest first: a module imports from its own package or a lower one only. run and
# distill are one layer (a distillation run reads a teacher's run directory; the run loop
# distils); the entry points sit above everything.
LAYERS = (
  ('core',),
  ('kernels',),
  ('model',),
  ('data',),
  ('training',),
  ('convert',),  # (load_model builds the train state's model from a checkpoint)
  ('run', 'distill'),
  ('planner',),
  ('tools', 'main'),
)


def _package(module: str) -> str | None:
  parts = module.split('.')
  return parts[1] if parts[0] == 'moetrain' and len(parts) > 1 else None


def test_the_tree_is_the_packages_of_the_layers():
  """`ls moetrain` shows the architecture: every package (and main.py) has its layer."""
  named = {p for layer in LAYERS for p in layer}
  found = {p.stem if p.is_file() else p.name for p in ROOT.iterdir() if p.name[0] not in '_.'}
  assert found == named, (sorted(found - named), sorted(named - found))


def test_packages_import_downwards_only():
  rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
  upward = []
  for path, tree in _modules():
    here = path.relative_to(ROOT).parts[0].removesuffix('.py')
    for name in _imports(tree):
      there = _package(name)
      if there in rank and rank[there] > rank[here]:
        upward.append(f'{path.relative_to(ROOT.parent)} imports {name}')
  assert not upward, upward


def test_kernels_import_nothing_from_the_model():
  """Kernels take the engine (moetrain/core/engine.py) and plain arguments, not a ModelConfig."""
  for path, tree in _modules(ROOT / 'kernels'):
    model = sorted(n for n in _imports(tree) if n.startswith('moetrain.model'))
    assert not model, (path, model)

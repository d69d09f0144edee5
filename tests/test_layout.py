"""The code's shape: functions a reader takes in at once, tools apart from the training loop,
and no ambient engine state in the model's math."""

import ast
import pathlib

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
    assert 'moetrain.train' not in _imports(tree), path


def test_the_model_reads_no_ambient_backend_or_mesh():
  """The engine is laid out by setup.build (ModelConfig.platform and mesh_shape)."""
  for path, tree in _modules(ROOT / 'model'):
    calls = {
      ast.unparse(node.func)
      for node in ast.walk(tree)
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    ambient = {c for c in calls if c.endswith(('default_backend', 'get_abstract_mesh'))}
    assert not ambient, (path, ambient)

"""The Colab and Kaggle notebooks run: every cell but the `tpu` ones, on CPU, in a kernel."""

import ast
import importlib.util
import os
import re
import shlex
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from moetrain.run import startup
from tests.test_configs import ROOT, load

# Each notebook and the chips of the runtime it is written for (its `tpu` commands build there).
NOTEBOOKS = {'colab_tpu.ipynb': 1, 'kaggle_tpu.ipynb': 8}
TPU = 'tpu'  # the tag of cells that need the TPU runtime and a real checkpoint


def read(name: str) -> nbformat.NotebookNode:
  return nbformat.read(os.path.join(ROOT, 'tpu_scripts', name), as_version=4)


def tags(cell) -> list[str]:
  return cell.metadata.get('tags', [])


def parameters(nb) -> dict:
  """The values of the notebook's `parameters` cell."""
  (cell,) = [c for c in nb.cells if 'parameters' in tags(c)]
  values = {}
  exec(cell.source, {}, values)
  return values


def commands(nb, params: dict, tagged: str | None = None) -> list[list[str]]:
  """The `!python -m ...` commands of the code cells (only those tagged `tagged`, if given), with
  continuations joined and `{expression}` filled in from `params`, as IPython does."""
  text = '\n'.join(
    c.source for c in nb.cells if c.cell_type == 'code' and (tagged is None or tagged in tags(c))
  )
  fill = lambda m: str(eval(m.group(1), {}, dict(params)))
  lines = text.replace('\\\n', ' ').splitlines()
  return [
    shlex.split(re.sub(r'\{([^{}]+)\}', fill, line.strip()[1:]))
    for line in lines
    if line.strip().startswith('!python -m ')
  ]


def cpu_cells(nb) -> list[str]:
  return [
    c.source for c in nb.cells if c.cell_type == 'code' and not {TPU, 'parameters'} & set(tags(c))
  ]


def test_the_notebooks_run_the_same_cells_on_cpu():
  """Every cell CI runs (the demo and its tools) is the same in both notebooks: the default
  suite executes one of them, `make test-slow` the other as well."""
  colab, kaggle = (cpu_cells(read(name)) for name in NOTEBOOKS)
  assert colab == kaggle and len(colab) >= 5


@pytest.mark.parametrize(
  'name', ['colab_tpu.ipynb', pytest.param('kaggle_tpu.ipynb', marks=pytest.mark.slow)]
)
def test_a_notebooks_cells_run_on_cpu(name, tmp_path):
  """The notebook with its parameters shortened (this checkout, installed already; a 4-step
  demo): the install cell, devices, the demo, evaluate, generate, export and the routing heatmap
  run, and the kernel itself never imports jax (libtpu gives the TPU to one process: the
  `!python` ones). A failed `!` command raises nothing in IPython: the outputs are checked."""
  runs, steps = tmp_path / 'runs', 4
  nb = read(name)
  nb.cells = [c for c in nb.cells if TPU not in tags(c)]
  (at,) = [i for i, c in enumerate(nb.cells) if 'parameters' in tags(c)]
  shortened = f'CHECKOUT = {ROOT!r}\nINSTALL = ""\nRUNS = {str(runs)!r}\nDEMO_STEPS = {steps}'
  nb.cells.insert(at + 1, nbformat.v4.new_code_cell(shortened))  # as papermill injects them
  nb.cells.append(
    nbformat.v4.new_code_cell("import sys\nprint('jax in the kernel:', 'jax' in sys.modules)")
  )
  env = {
    **os.environ,
    'PATH': os.pathsep.join([os.path.dirname(sys.executable), os.environ['PATH']]),
    'MOETRAIN_NO_REEXEC': '1',
    'JAX_PLATFORMS': 'cpu',
    # One CPU device and the test suite's compilation cache (the tools' compiles too).
    'XLA_FLAGS': '--xla_backend_optimization_level=0',
    'JAX_COMPILATION_CACHE_DIR': os.path.join(ROOT, '.jax_cache'),
    'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '1',
  }
  NotebookClient(nb, timeout=300, kernel_name='python3').execute(env=env)
  out = [
    ''.join(o.get('text', '') + str(o.get('data', '')) for o in c.get('outputs', []))
    for c in nb.cells
  ]
  text = '\n'.join(out)
  of = lambda command: ''.join(o for c, o in zip(nb.cells, out) if command in c.source)
  assert not re.search(r'Traceback|^Error', text, re.M), text
  assert out[-1].strip() == 'jax in the kernel: False'
  assert 'CpuDevice' in of('import jax')  # from the subprocess
  trained = re.search(
    rf'eval accuracy ([\d.]+) before training -> ([\d.]+) at step {steps}', of('moetrain.main')
  )
  before, after = map(float, trained.groups())
  assert 0 <= before <= 1 and 0 <= after <= 1
  demo = runs / 'demo'
  assert os.listdir(demo / 'checkpoints') == [str(steps)]
  evaluated = re.search(rf'^step {steps}: loss [\d.]+ .* accuracy ([\d.]+)', of('.evaluate'), re.M)
  assert float(evaluated[1]) == pytest.approx(after, abs=1e-4)  # the run's own last eval
  assert re.search(r'^reverse: red fox cup =.*\n# \d+ new tokens', of('.generate'), re.M)
  exported = set(os.listdir(runs / 'exports' / 'demo'))
  assert {'adapter_config.json', 'adapter_model.safetensors'} <= exported
  assert (demo / 'expert_load.png').stat().st_size > 0


@pytest.mark.parametrize('name', NOTEBOOKS)
def test_a_notebooks_tpu_commands_build(name):
  """The training commands, the `tpu` cell's included, build their configs (flags, mesh, batch)
  for the runtime's chips, and every tool command passes flags its tool defines. The real
  checkpoint is not here: the variant's preset shapes stand in for its config.json."""
  nb = read(name)
  params = parameters(nb)
  assert {'CHECKOUT', 'INSTALL', 'RUNS', 'DEMO_STEPS', 'HF_DIR', 'STEPS'} <= set(params)
  tpu = commands(nb, params, TPU)
  assert sum(argv[2] == 'moetrain.main' for argv in tpu) == 1  # the real model's run
  for argv in commands(nb, params):
    module, args = argv[2], dict(a.removeprefix('--').partition('=')[::2] for a in argv[3:])
    if module != 'moetrain.main':
      with open(importlib.util.find_spec(module).origin) as f:
        source = f.read()
      for flag in args:
        assert re.search(rf"DEFINE_\w+\(\s*'{flag}'", source), f'{module} has no --{flag}'
      continue
    path, _, arg = args.pop('config').partition(':')
    config = load(os.path.join(ROOT, path), arg or None)
    for key, value in args.items():
      if key.startswith('config.'):
        _, section, field = key.split('.')
        try:
          value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
          pass
        config[section][field] = value
    real = argv in tpu
    if real:
      assert config.init.hf_checkpoint == params['HF_DIR']
      config.init.hf_checkpoint = ''
    setup = startup.build(config, num_devices=NOTEBOOKS[name], process_count=1)
    assert setup.train.steps == (params['STEPS'] if real else params['DEMO_STEPS'])

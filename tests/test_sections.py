"""Every config key is declared once (a field of its section's dataclass): the base config, the
dataclasses a run builds and the derived key lists cannot disagree."""

import dataclasses
import json
import math

import pytest

from configs import base
from moetrain.core import fields, runtime
from moetrain.core.engine import ENGINE_FIELDS
from moetrain.model.config import LONGCAT_PRESETS, ModelConfig
from moetrain.run import rundir, sections, startup
from moetrain.run.startup import build


def test_the_base_config_is_the_dataclass_defaults():
  config = base.get_config()
  assert set(config.keys()) == {'seed', *sections.SECTIONS}
  for name, cls in sections.SECTIONS.items():
    assert set(config[name].keys()) == set(fields.keys(cls)), name
    for key, default in fields.defaults(cls).items():
      assert config[name][key] == default, f'{name}.{key}'


def test_a_run_of_the_base_config_builds_the_default_dataclasses():
  setup = build(base.get_config(), num_devices=1, process_count=1)
  assert setup.data == sections.SECTIONS['data']()
  assert setup.optim == sections.SECTIONS['optim']()
  assert setup.train == sections.SECTIONS['train']()
  for key, default in fields.defaults(sections.SECTIONS['loss']).items():
    assert getattr(setup.step, key) == default, f'loss.{key}'
  derived = fields.with_role(ModelConfig, 'derived')
  assert (
    dataclasses.replace(setup.model, **{k: getattr(ModelConfig(), k) for k in derived})
    == (LONGCAT_PRESETS['tiny'])
  )


def test_the_key_lists_are_derived_from_the_declarations():
  config = base.get_config()
  assert set(ENGINE_FIELDS) == set(config.engine.keys())
  assert not set(ENGINE_FIELDS) & set(config.model.keys())
  assert set(rundir.stream_fields()) < set(config.data.keys())
  paths = sections.path_fields()
  assert ('data', 'path') in paths and ('init', 'hf_checkpoint') in paths
  assert all(key in config[section] for section, key in paths)
  # lora and engine are set from their sections; rules and platform from the mesh and target.
  assert not {'lora', 'engine', 'rules', 'platform'} & set(config.model.keys())
  assert not {'rules', 'platform', 'mesh_shape'} & set(config.engine.keys())


def test_declared_checks_name_the_key():
  with pytest.raises(ValueError, match=r'model\.hidden_size=0: must be positive'):
    dataclasses.replace(ModelConfig(), hidden_size=0).validate()
  with pytest.raises(ValueError, match=r"engine\.remat='most' is unknown"):
    ModelConfig().with_engine(remat='most').validate()
  with pytest.raises(ValueError, match=r'engine\.loss_chunk=-1: must be >= 0 \(0 = no chunking\)'):
    ModelConfig().with_engine(loss_chunk=-1).validate()
  with pytest.raises(ValueError, match='role='):
    fields.field(0, role='shapes')
  from moetrain.training.optim import OptimConfig

  for bad in (math.inf, math.nan):
    with pytest.raises(
      ValueError, match=r'optim\.learning_rate=(inf|nan): must be a finite number'
    ):
      OptimConfig(learning_rate=bad).validate(10)


def test_an_older_runs_config_json_gets_the_keys_it_lacks_at_their_defaults():
  saved = {'seed': 3, 'model': {'hidden_size': 64}, 'model_from_checkpoint': {'x': 1}}
  full = sections.with_defaults(saved)
  assert full['seed'] == 3 and full['model']['hidden_size'] == 64
  assert full['model']['num_layers'] == ModelConfig().num_layers
  assert full['train'] == fields.defaults(sections.SECTIONS['train'])
  assert full['model_from_checkpoint'] == {'x': 1}


def test_the_config_reference_is_current():
  """docs/config.md is generated from the declarations: regenerate it with
  `python -m moetrain.run.sections > docs/config.md` after changing a key."""
  import pathlib

  path = pathlib.Path(__file__).parent.parent / 'docs' / 'config.md'
  assert path.read_text() == sections.reference()


def _older(config) -> dict:
  """config's config.json as runs wrote it before the `engine` section: its keys in `model`."""
  saved = json.loads(config.to_json_best_effort())
  saved['model'].update(saved.pop('engine'))
  return saved


def test_an_older_config_json_reads_its_engine_keys_into_the_engine_section(tmp_path):
  config = base.get_config()
  config.engine.remat = 'none'
  saved = _older(config)
  out = sections.with_defaults(saved)
  assert out['engine'] == json.loads(config.engine.to_json())
  assert out['model'] == json.loads(config.model.to_json())
  assert saved['model']['remat'] == 'none'  # (the dict read is not changed)
  # A run directory written so resumes, and a tool reads it.
  run = tmp_path / 'run'
  (run / 'checkpoints' / '5').mkdir(parents=True)
  (run / 'config.json').write_text(json.dumps(saved))
  rundir.check_resumable(config, str(run))
  assert rundir.tool_config(None, str(run)).engine.remat == 'none'
  config.model.hidden_size = 64  # the network still may not change
  with pytest.raises(ValueError, match=r'model\.hidden_size: 128 in the checkpointed run'):
    rundir.check_resumable(config, str(run))


def test_an_older_command_line_key_is_read_into_the_engine_section(capsys):
  argv = ['main', '--config=c.py', '--config.model.remat=none', '--config.model.hidden_size=64']
  assert runtime.engine_keys_moved(argv) == [
    'main',
    '--config=c.py',
    '--config.engine.remat=none',
    '--config.model.hidden_size=64',
  ]
  assert capsys.readouterr().err == 'Note: --config.model.remat is now --config.engine.remat\n'


def test_an_older_config_file_sets_engine_keys_through_model():
  config = base.get_config()
  config.model.remat = 'none'  # (a config file written before the engine section)
  assert startup.model_config(config).engine.remat == 'none'

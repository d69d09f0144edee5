"""Every config file loads and validates; bad settings fail early, naming the field."""

import glob
import importlib.util
import os

import jax.numpy as jnp
import numpy as np
import pytest

from moetrain.core.engine import ENGINE_FIELDS
from moetrain.run import rundir, startup

ROOT = os.path.join(os.path.dirname(__file__), '..')
CONFIGS = sorted(
  p
  for p in glob.glob(os.path.join(ROOT, 'configs', '*.py'))
  if not os.path.basename(p).startswith('__')
)
VARIANTS = {
  'longcat_lora.py': ['variant=demo', 'variant=tiny', 'variant=medium', 'variant=flash'],
  'longcat_pretrain.py': ['variant=tiny', 'variant=medium', 'variant=flash'],
  'deepseek_v32_lora.py': [
    None,
    'variant=glm_5_tiny',
    'variant=deepseek_v32_671b',
    'variant=glm_5',
  ],
}


def load(path, arg=None):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg) if arg is not None else mod.get_config()


@pytest.mark.parametrize('path', CONFIGS, ids=os.path.basename)
def test_config_loads_and_validates(path):
  for arg in VARIANTS.get(os.path.basename(path), [None]):
    config = load(path, arg)
    devices = 16 if 'flash' in str(arg) or config.mesh.shape[2] == 16 else 8
    setup = startup.build(config, num_devices=devices, process_count=1)
    assert setup.model.num_layers > 0


def test_bias_decay_follows_train_steps_without_tying_them():
  """The pretraining config decays mu over train.steps as overridden; setting the decay itself
  leaves train.steps alone (a shared FieldReference would set both)."""
  config = load(os.path.join(ROOT, 'configs', 'longcat_pretrain.py'), 'variant=tiny')
  config.train.steps, config.optim.warmup_steps = 10, 0
  assert startup.build(config, num_devices=8, process_count=1).step.bias_update_decay_steps == 10
  config.loss.bias_update_decay_steps = 4
  assert config.train.steps == 10
  assert startup.build(config, num_devices=8, process_count=1).step.bias_update_decay_steps == 4
  config.loss.bias_update_decay_steps = 0  # off: constant mu
  assert startup.build(config, num_devices=8, process_count=1).step.bias_update_decay_steps == 0


def test_config_engine_sets_every_engine_field():
  """Fine-tuning from a Hugging Face checkpoint takes these fields from config.engine (the shapes
  come from its config.json), so the base config must set each of them."""
  config = load(os.path.join(ROOT, 'configs', 'base.py'))
  missing = [k for k in ENGINE_FIELDS if k not in config.engine]
  assert not missing, f'configs/base.py: config.engine lacks {missing}'


def base_config(**overrides):
  config = load(os.path.join(ROOT, 'configs', 'longcat_lora.py'), 'variant=tiny')
  for key, value in overrides.items():
    section, name = key.split('.')
    config[section][name] = value
  return config


@pytest.mark.parametrize(
  'overrides, field',
  [
    ({'model.moe_topk': 99}, 'model.moe_topk'),
    ({'engine.remat': 'sometimes'}, 'engine.remat'),
    ({'engine.moe_dispatch': 'lossy'}, 'engine.moe_dispatch'),
    ({'mesh.shape': (1, 4, 3, 1)}, 'mesh.shape'),
    ({'mesh.shape': (1, 1, 8, 1), 'model.n_routed_experts': 12}, 'model.n_routed_experts'),
    ({'mesh.rules': 'nope'}, 'mesh.rules'),
    ({'mesh.shape': (1, 1, 1, 8), 'mesh.rules': 'fsdp_ep'}, "mesh.rules='fsdp_ep' shards nothing"),
    ({'lora.rank': -4}, 'lora.rank'),
    ({'lora.alpha': 0.0}, 'lora.alpha'),
    ({'optim.b2': 1.5}, 'optim.b2'),
    ({'optim.grad_clip': -1.0}, 'optim.grad_clip'),
    ({'data.seq_len': 0}, 'data.seq_len'),
    ({'data.global_batch_size': 12}, 'data.global_batch_size'),
    ({'optim.schedule': 'linear'}, 'optim.schedule'),
    ({'optim.warmup_steps': 10_000}, 'optim.warmup_steps'),
    ({'lora.targets': '(unclosed'}, 'lora.targets'),
    ({'engine.quant': 'int3'}, 'engine.quant'),
    ({'train.steps': 0}, 'train.steps'),
    ({'train.eval_batches': 0}, 'train.eval_batches'),
    ({'mesh.shape': (0, -1, 1, 1)}, 'mesh.shape'),
    ({'lora.targets': 'nothing_matches'}, 'lora.targets'),
    ({'engine.quant': 'int4', 'engine.quant_group_size': 0}, 'engine.quant_group_size'),
    ({'engine.moe_block_size': -3}, 'engine.moe_block_size'),
    ({'model.zero_expert_num': 0, 'engine.moe_expected_ffn_experts': 1.0}, 'moe_expected_ffn'),
    ({'engine.moe_expected_ffn_experts': -1.0}, 'engine.moe_expected_ffn_experts'),
    (  # more FFN experts per token than there are: the bias controller would never settle
      {'model.n_routed_experts': 2, 'engine.moe_expected_ffn_experts': 2.5},
      'engine.moe_expected_ffn_experts: 2.5 is more FFN experts',
    ),
    ({'engine.quant': 'int4', 'model.num_heads': 3}, 'model.num_heads: 3 is odd'),
    ({'model.rope_theta': 0.0}, 'model.rope_theta'),
    ({'loss.bias_update_decay_steps': -5}, 'loss.bias_update_decay_steps'),
    ({'loss.bias_update_rate': -1e-3}, 'loss.bias_update_rate'),
    ({'optim.min_lr_ratio': 5.0}, 'optim.min_lr_ratio'),
    ({'optim.weight_decay_exclude': 'embed|(router'}, 'optim.weight_decay_exclude'),
    ({'optim.weight_decay': 0.1, 'optim.weight_decay_exclude': 'embedd'}, 'matches no trainable'),
    ({'mesh.shape': (-2, -1, 1, 1)}, 'mesh.shape'),
    # an adapter wider than what it adapts (the tiny experts are 64 wide): named, with the bound
    ({'lora.rank': 100}, 'lora.rank=100 is larger than the smaller side .* lora.rank <= 32'),
  ],
)
def test_bad_config_names_the_field(overrides, field):
  with pytest.raises(ValueError, match=field.replace('.', r'\.').replace(r'\.*', '.*')):
    startup.build(base_config(**overrides), num_devices=8, process_count=1)


def test_tensor_axis_across_hosts_is_refused():
  """Each host loads its own rows: a tensor axis spanning hosts would replicate the batch."""
  config = base_config(**{'mesh.shape': (1, 1, 1, -1)})
  startup.build(config, num_devices=8, process_count=1)
  with pytest.raises(ValueError, match=r"'tensor' axis \(8\) must divide the 4 devices"):
    startup.build(config, num_devices=8, process_count=2)
  startup.build(base_config(**{'mesh.shape': (1, -1, 1, 2)}), num_devices=8, process_count=2)


def test_hosts_must_own_their_batch_rows():
  from collections import namedtuple

  from moetrain.core import sharding

  Device = namedtuple('Device', 'id process_index')

  class Layout:  # devices_indices_map of a 4-device batch sharding over 2 processes
    def __init__(self, rows_of_device):
      self.rows = rows_of_device

    def devices_indices_map(self, shape):
      return {Device(d, d // 2): (slice(*r), slice(None)) for d, r in enumerate(self.rows)}

  sharding.check_hosts_own_rows(Layout([(0, 2), (2, 4), (4, 6), (6, 8)]), 8)
  with pytest.raises(ValueError, match='processes 0 and 1 would both hold batch row 0'):
    sharding.check_hosts_own_rows(Layout([(0, 4), (4, 8), (0, 4), (4, 8)]), 8)


def test_missing_hf_checkpoint_names_the_field(tmp_path):
  config = base_config()
  config.init.hf_checkpoint = str(tmp_path / 'nowhere')
  with pytest.raises(FileNotFoundError, match=r'nowhere.*init\.hf_checkpoint'):
    startup.build(config, num_devices=8, process_count=1)
  (tmp_path / 'empty').mkdir()
  config.init.hf_checkpoint = str(tmp_path / 'empty')
  with pytest.raises(FileNotFoundError, match=r'empty/config\.json does not exist'):
    startup.build(config, num_devices=8, process_count=1)
  # A checkpoint without its tokenizer (only config.json and weights copied): data.tokenizer.
  config.init.hf_checkpoint = os.path.join(ROOT, 'tests', 'fixtures', 'longcat_two_layer')
  with pytest.raises(ValueError, match=r'longcat_two_layer.*holds neither.*point data\.tokenizer'):
    startup.build(config, num_devices=8, process_count=1)


def test_unknown_config_argument_is_refused():
  from configs import longcat_lora

  with pytest.raises(ValueError, match='varient'):
    longcat_lora.get_config('varient=flash')


def test_a_mistyped_variant_is_one_line_listing_that_configs_variants():
  from configs import qwen3_moe_lora
  from tests.helpers import run_command

  with pytest.raises(ValueError, match="variant='flash' is unknown; choose one of qwen3_tiny, "):
    qwen3_moe_lora.get_config('variant=flash')
  out = run_command('moetrain.main', '--config=configs/longcat_lora.py:variant=tiyn', '--dry_run')
  assert out.returncode == 1 and out.stdout == '', out.stderr
  assert out.stderr == (
    'Error: --config=configs/longcat_lora.py:variant=tiyn: configs/longcat_lora.py: '
    "variant='tiyn' is unknown; choose one of demo, tiny, medium, flash\n"
  )


def test_no_warmup_starts_at_the_full_rate():
  from moetrain.training import optim

  cfg = optim.OptimConfig(warmup_steps=0, learning_rate=1e-3, min_lr_ratio=0.1)
  fn = optim.schedule(cfg, 100)
  assert abs(float(fn(0)) - 1e-3) < 1e-9 and float(fn(1)) < 1e-3
  np.testing.assert_allclose(float(fn(99)), 1e-4, rtol=1e-6)  # the floor at the last update


@pytest.mark.parametrize('kind', ['cosine', 'constant'])
def test_warmup_moves_the_weights_from_the_first_update(kind):
  """Update n (from 0) runs at (n + 1) / warmup of the peak during the warmup, the peak at the
  end of it, and (cosine) the floor at the last of train.steps updates."""
  from moetrain.training import optim

  cfg = optim.OptimConfig(warmup_steps=4, learning_rate=1e-3, schedule=kind, min_lr_ratio=0.1)
  fn = optim.schedule(cfg, 100)
  np.testing.assert_allclose(
    [float(fn(n)) for n in range(4)], [2.5e-4, 5e-4, 7.5e-4, 1e-3], rtol=1e-6
  )
  assert abs(float(fn(4)) - 1e-3) < 1e-9 if kind == 'constant' else 1e-4 < float(fn(4)) < 1e-3
  np.testing.assert_allclose(float(fn(99)), 1e-4 if kind == 'cosine' else 1e-3, rtol=1e-6)


def test_compilation_cache_is_shared_on_several_hosts(monkeypatch):
  """JAX writes the persistent cache from process 0 only: on several hosts 'auto' puts it in the
  run directory, which they all share."""
  assert startup.compilation_cache_dir('auto', '/runs/a') == startup.HOST_CACHE
  assert startup.compilation_cache_dir('/cache', '/runs/a') == '/cache'
  monkeypatch.setattr(startup.jax, 'process_count', lambda: 2)
  assert startup.compilation_cache_dir('auto', '/runs/a') == '/runs/a/jax_cache'


def test_a_runs_paths_are_absolute(tmp_path, monkeypatch):
  """A run resolves its local paths against its working directory (config.json then holds them
  absolute, so the tools and a resume find the files from anywhere); URLs stay as they are. An
  older run's relative config.json still matches the same paths given relative."""
  import json

  monkeypatch.chdir(tmp_path)
  given = {'data.path': 'data/{split}.jsonl', 'init.hf_checkpoint': 'ckpt', 'lora.rank': 4}
  config = base_config(**given, **{'data.tfds_data_dir': 'gs://bucket/tfds'})
  resolved = rundir.with_absolute_paths(config)
  assert resolved.data.path == str(tmp_path / 'data' / '{split}.jsonl')
  assert resolved.init.hf_checkpoint == str(tmp_path / 'ckpt')
  assert resolved.data.tfds_data_dir == 'gs://bucket/tfds' and resolved.data.tokenizer == ''
  assert config.data.path == 'data/{split}.jsonl'  # a copy
  (tmp_path / 'run' / 'checkpoints' / '3').mkdir(parents=True)
  for saved in (resolved, config):  # written by this version, and by an older one
    (tmp_path / 'run' / 'config.json').write_text(saved.to_json_best_effort())
    rundir.check_resumable(resolved, str(tmp_path / 'run'))
  moved = json.loads(resolved.to_json_best_effort())
  moved['init']['hf_checkpoint'] = str(tmp_path / 'other')
  (tmp_path / 'run' / 'config.json').write_text(json.dumps(moved))
  with pytest.raises(ValueError, match='frozen base'):
    rundir.check_resumable(resolved, str(tmp_path / 'run'))


def test_a_lora_students_resume_refuses_another_teacher(tmp_path):
  """A LoRA student's frozen base is copied from its teacher on every start: a resume with
  another teacher, or other copy settings, would put the adapters on another base."""
  import json

  given = {
    'lora.rank': 4,
    'distill.teacher': '/runs/teacher',
    'distill.init_from_teacher': 'most_used',
  }
  config = base_config(**given)
  (tmp_path / 'run' / 'checkpoints' / '3').mkdir(parents=True)
  (tmp_path / 'run' / 'config.json').write_text(config.to_json_best_effort())
  rundir.check_resumable(config, str(tmp_path / 'run'))
  for key, other in (
    ('teacher', '/runs/other'),
    ('init_layers', [1]),
    ('init_from_teacher', 'random'),
  ):
    moved = json.loads(config.to_json_best_effort())
    moved['distill'][key] = other
    (tmp_path / 'run' / 'config.json').write_text(json.dumps(moved))
    with pytest.raises(ValueError, match='frozen base .*distill.teacher'):
      rundir.check_resumable(config, str(tmp_path / 'run'))


def test_a_tool_refuses_another_tokenizer_than_the_runs(tmp_path):
  """evaluate/generate/export --workdir with a --config naming another tokenizer (or none, for a
  run that had one) would score the weights on other token ids: refused by name. Other data is
  the tool's choice."""
  run = tmp_path / 'run'
  (run / 'checkpoints' / '3').mkdir(parents=True)
  trained = base_config(**{'data.tokenizer': str(tmp_path / 'tokenizer.json')})
  (run / 'config.json').write_text(trained.to_json_best_effort())
  rundir.check_resumable(trained, str(run), tool=True)
  other_data = base_config(**{'data.tokenizer': str(tmp_path / 'tokenizer.json')})
  other_data.data.source = 'jsonl'
  other_data.data.path = str(tmp_path / '{split}.jsonl')
  rundir.check_resumable(other_data, str(run), tool=True)
  with pytest.raises(ValueError, match=r"(?s)other settings.*data\.tokenizer: '.*tokenizer.json'"):
    rundir.check_resumable(base_config(), str(run), tool=True)
  rundir.check_resumable(base_config(), str(run))  # a resume only warns (data settings)
  # A run that trained its own (cached in the run directory): a tool without one reuses it, and
  # may name it.
  (run / 'config.json').write_text(base_config().to_json_best_effort())
  rundir.check_resumable(base_config(), str(run), tool=True)
  own = base_config(**{'data.tokenizer': str(run / 'tokenizer.model')})
  rundir.check_resumable(own, str(run), tool=True)


def test_the_demo_starts_from_a_shipped_base_that_copies_but_does_not_reverse():
  """configs/longcat_lora.py's default variant fine-tunes moetrain/data/demo/base (made by
  moetrain/data/demo_base.py): the tiny shapes, and a model that copies word lists, so the
  reversal the adapters learn is a new skill, not a first language."""
  from moetrain.convert import hf
  from moetrain.data import demo_base, tokenizer
  from moetrain.model.families import MODEL_PRESETS
  from moetrain.tools import generate

  config = load(os.path.join(ROOT, 'configs', 'longcat_lora.py'))
  assert config.init.hf_checkpoint == str(demo_base.DIR)
  setup = startup.build(config, num_devices=8, process_count=1)
  for name in ('hidden_size', 'num_layers', 'n_routed_experts', 'zero_expert_num', 'vocab_size'):
    assert getattr(setup.model, name) == getattr(MODEL_PRESETS['tiny'], name), name
  assert setup.data.tokenizer == str(demo_base.DIR)
  tok = tokenizer.load_tokenizer(demo_base.DIR)
  model = hf.load_model(str(demo_base.DIR))

  def complete(prompt: str) -> str:
    ids = [tok.bos_id, *tok.encode(prompt)]
    out = generate.generate(model, jnp.asarray([ids]), 8, eos_id=tok.eos_id)
    return generate.continuation(tok, ids, generate.new_tokens(out, len(ids), tok.eos_id))

  assert complete('copy: red fox cup =') == ' red fox cup'
  assert complete('reverse: red fox cup =') != ' cup fox red'


@pytest.mark.parametrize('variant', ['deepseek_v32_tiny', 'glm_5_tiny'])
def test_the_sparse_attention_demos_select_keys(variant):
  """configs/deepseek_v32_lora.py's tiny variants keep fewer keys per query (index_topk) than
  every demo example has tokens, so the demo runs the indexer's selection, not dense MLA."""
  from moetrain.data import demo_base, loader, tokenizer

  config = load(os.path.join(ROOT, 'configs', 'deepseek_v32_lora.py'), f'variant={variant}')
  setup = startup.build(config, num_devices=8, process_count=1)
  assert setup.model.index_n_heads > 0
  tok = tokenizer.load_tokenizer(demo_base.DIR)  # the demo task's own tokenizer
  ds = loader.open_source(setup.data, 'train')
  shortest = min(len(tok.encode(ds[i]['prompt'] + ds[i]['completion'])) for i in range(len(ds)))
  assert setup.model.index_topk < shortest < setup.data.seq_len

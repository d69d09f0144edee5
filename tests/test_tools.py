"""Command-line tools on a finished run: evaluate, export and the expert-load heatmap."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from moetrain.tools import evaluate, expert_load, export
from tests.test_train import small_config, uninterrupted  # noqa: F401 (fixture)


def test_evaluate_reproduces_the_final_eval(uninterrupted):  # noqa: F811
  workdir, out = uninterrupted
  ev = evaluate.evaluate_checkpoint(small_config(), workdir, max_batches=1)
  assert ev['step'] == 6
  assert abs(ev['loss'] - out['eval_loss']) < 1e-6
  assert abs(ev['accuracy'] - out['eval_accuracy']) < 1e-9


def test_expert_load_heatmap(uninterrupted, tmp_path):  # noqa: F811
  workdir, _ = uninterrupted
  steps, loads, start, layers = expert_load.read_loads(workdir)
  assert list(steps) == [1, 2, 3, 4, 5, 6] and loads.shape[1:] == (2, 12) and start == 0
  assert layers == [0, 1]
  np.testing.assert_array_equal(expert_load.cell_edges(steps, start), np.arange(7))
  out = expert_load.plot(steps, loads, str(tmp_path / 'load.png'), n_routed=8)
  with open(out, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  assert os.path.getsize(out) > 1000


def test_expert_load_after_a_resume(tmp_path):
  """A run resumed from step 2 after logging up to 4 logs 3 and 4 again: the heatmap keeps the
  resumed records, in step order, and each record's cell spans the steps it averages (uneven
  intervals keep their widths; the axis ends at the last step)."""
  rec = lambda step, v: {'step': step, 'kind': 'train', 'moe/load': [[v, 1.0, 0.0]]}
  resume = {'step': 2, 'kind': 'resume'}
  with open(tmp_path / 'metrics.jsonl', 'w') as f:
    for r in (
      rec(1, 1),
      rec(2, 2),
      rec(3, 3),
      rec(4, 4),
      resume,
      rec(3, 30),
      rec(4, 40),
      rec(10, 5),
    ):
      f.write(json.dumps(r) + '\n')
  steps, loads, start, layers = expert_load.read_loads(str(tmp_path))
  assert list(steps) == [1, 2, 3, 4, 10] and start == 0 and layers == [0]
  np.testing.assert_array_equal(loads[:, 0, 0], [1, 2, 30, 40, 5])
  np.testing.assert_array_equal(expert_load.cell_edges(steps, start), [0, 1, 2, 3, 4, 10])
  out = expert_load.plot(steps, loads, str(tmp_path / 'load.png'))
  assert os.path.getsize(out) > 1000
  # Records that begin with a resume (at 50): the first cell starts there.
  with open(tmp_path / 'metrics.jsonl', 'w') as f:
    for r in ({'step': 50, 'kind': 'resume'}, rec(60, 1), rec(70, 2)):
      f.write(json.dumps(r) + '\n')
  steps, loads, start, _ = expert_load.read_loads(str(tmp_path))
  np.testing.assert_array_equal(expert_load.cell_edges(steps, start), [50, 60, 70])
  out = expert_load.plot(steps, loads, str(tmp_path / 'load.png'), start=start)
  assert os.path.getsize(out) > 1000


def test_routing_statistics_and_the_heatmap_name_the_decoder_layers(tmp_path):
  """With dense layers first (DeepSeek-V3: first_k_dense_replace), the MoE layers' statistics
  are named by their decoder index, as the checkpoint names them, and so are the heatmap's rows."""
  from moetrain.model.families import MODEL_PRESETS
  from moetrain.run import metrics

  cfg = MODEL_PRESETS['deepseek_tiny']
  moe_layers = cfg.moe_layer_indices
  assert moe_layers[0] == cfg.first_k_dense_replace > 0
  n, e = len(moe_layers), cfg.num_experts_total
  stats = {k: np.full(n, 0.5) for k in metrics.ROUTING_STATS} | {'load': np.ones((n, e))}
  summary = metrics.routing_summary(stats, cfg, expert_shards=1)
  assert {f'moe/layer{i}/router_entropy' for i in moe_layers} <= set(summary)
  assert 'moe/layer0/router_entropy' not in summary
  record = {'step': 1, 'kind': 'train', 'moe/load': stats['load'].tolist(), **summary}
  (tmp_path / 'metrics.jsonl').write_text(json.dumps(record) + '\n')
  *_, layers = expert_load.read_loads(str(tmp_path))
  assert layers == list(moe_layers)


def test_tools_read_the_runs_own_config(uninterrupted, tmp_path):  # noqa: F811
  """Without --config a tool reads the run's config.json; a --config that differs from the run
  in what shapes its weights is refused by name; a --workdir without checkpoints is an error,
  not the initial weights (and it is not created)."""
  workdir, out = uninterrupted
  ev = evaluate.evaluate_checkpoint(None, workdir, max_batches=1)
  assert ev['step'] == 6 and abs(ev['loss'] - out['eval_loss']) < 1e-6
  other = small_config()
  other.lora.alpha = 32.0
  with pytest.raises(ValueError, match=r'(?s)leave --config out.*lora\.alpha: 16\.0 in the'):
    evaluate.evaluate_checkpoint(other, workdir, max_batches=1)
  typo = str(tmp_path / 'typo')
  with pytest.raises(ValueError, match='does not exist'):
    export.export(None, typo, str(tmp_path / 'out'))
  assert not os.path.exists(typo)
  with pytest.raises(ValueError, match='--max_batches=0'):
    evaluate.evaluate_checkpoint(None, workdir, max_batches=0)
  # A run whose settings a training run would now refuse (a data.path its source ignores, as
  # older versions allowed) still opens in the tools: they train nothing.
  older = tmp_path / 'older'
  shutil.copytree(workdir, older)
  with open(older / 'config.json') as f:
    saved = json.load(f)
  saved['data']['path'] = '/gone/{split}.jsonl'
  (older / 'config.json').write_text(json.dumps(saved))
  assert evaluate.evaluate_checkpoint(None, str(older), max_batches=1)['step'] == 6


def test_a_mistyped_workdir_is_said_not_to_exist(tmp_path):
  """A --workdir that is not there is named as missing, not as a run without checkpoints."""
  from moetrain.run import rundir

  typo = str(tmp_path / 'runs' / 'typo')
  with pytest.raises(ValueError, match=rf"^--workdir='{typo}' does not exist"):
    rundir.tool_config(None, typo)
  os.makedirs(typo)
  with pytest.raises(ValueError, match='holds no checkpoints'):
    rundir.tool_config(None, typo)


def test_export_guards_its_output(uninterrupted, tmp_path, monkeypatch):  # noqa: F811
  workdir, _ = uninterrupted
  with pytest.raises(ValueError, match='overlaps --workdir'):
    export.export(None, workdir, os.path.join(workdir, 'exported'))
  with pytest.raises(ValueError, match=r"--dtype='int8'"):
    export.export(None, workdir, str(tmp_path / 'x'), dtype='int8')
  # The merged export takes the run's tokenizer along: it loads on its own.
  merged = export.export(None, workdir, str(tmp_path / 'merged'))
  assert sorted(os.listdir(merged)) == [
    export.MARKER,
    'config.json',
    'model.safetensors',
    'tokenizer.model',
  ]
  from moetrain.data.tokenizer import load_tokenizer

  text = 'reverse: red fox ='
  assert load_tokenizer(merged).encode(text) == load_tokenizer(workdir).encode(text)
  out = str(tmp_path / 'adapter')
  export.export(None, workdir, out, adapter_only=True)
  before = {f: os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)}
  assert sorted(before) == [export.MARKER, 'adapter_config.json', 'adapter_model.safetensors']

  # A merged export over an adapter export takes --replace, and leaves no adapter file behind
  # (transformers would read the directory as an adapter); files no export wrote stay.
  again = str(tmp_path / 'again')
  export.export(None, workdir, again, adapter_only=True)
  (tmp_path / 'again' / 'notes.txt').write_text('mine')
  export.export(None, workdir, again, adapter_only=True)  # the same kind: replaced
  with pytest.raises(ValueError, match='holds a adapter export'.replace('a a', 'an? a')):
    export.export(None, workdir, again)
  export.export(None, workdir, again, replace=True)
  assert sorted(os.listdir(tmp_path / 'again')) == [
    export.MARKER,
    'config.json',
    'model.safetensors',
    'notes.txt',
    'tokenizer.model',
  ]

  # A failure half-way through writing leaves the earlier export as it was, and no debris.
  def fail(model, cfg, out_dir, **kw):
    with open(os.path.join(out_dir, 'adapter_model.safetensors'), 'wb') as f:
      f.write(b'partial')
    raise OSError('disk full')

  monkeypatch.setattr(export.peft_adapter, 'save', fail)
  with pytest.raises(OSError, match='disk full'):
    export.export(None, workdir, out, adapter_only=True)
  assert {f: os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)} == before
  assert sorted(os.listdir(tmp_path)) == ['adapter', 'again', 'merged']


def test_an_export_into_a_model_directory_deletes_nothing(uninterrupted, tmp_path):  # noqa: F811
  """--adapter_only into a copy of a Hugging Face model directory (which no export wrote) is
  refused in one line naming its files, and leaves them all."""
  import subprocess
  import sys

  workdir, _ = uninterrupted
  hub = tmp_path / 'hub'
  hub.mkdir()
  names = ['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.model']
  for name in [*names, 'notes.txt']:
    (hub / name).write_text(name)
  cmd = [sys.executable, '-m', 'moetrain.tools.export', f'--workdir={workdir}', f'--out={hub}']
  done = subprocess.run([*cmd, '--adapter_only'], capture_output=True, text=True, timeout=300)
  assert done.returncode == 1, done.stderr[-2000:]
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith(f'Error: --out={hub} is not empty and no export wrote it'), done.stderr
  assert all(n in last for n in names) and '--replace' in last
  assert sorted(os.listdir(hub)) == sorted([*names, 'notes.txt'])
  assert all((hub / n).read_text() == n for n in os.listdir(hub))


def test_remote_code_goes_along_or_its_auto_map_goes(tmp_path):
  """A base config.json's auto_map (trust_remote_code) names .py files: the merged export copies
  them, or drops the auto_map when the base lacks them."""
  auto_map = {
    'AutoConfig': 'configuration_longcat_flash.LongcatFlashConfig',
    'AutoModelForCausalLM': 'modeling_longcat_flash.LongcatFlashForCausalLM',
    'AutoTokenizer': ['other/repo--tokenization_x.XTokenizer', None],
  }
  (tmp_path / 'config.json').write_text(json.dumps({'auto_map': auto_map, 'vocab_size': 8}))
  code = ['configuration_longcat_flash.py', 'modeling_longcat_flash.py']
  assert export.remote_code_files({'auto_map': auto_map}) == code
  assert export.base_config(str(tmp_path)) == {'vocab_size': 8}
  for name in code:
    (tmp_path / name).write_text('# code')
  assert export.base_config(str(tmp_path))['auto_map'] == auto_map


def test_tools_refuse_a_tokenizer_larger_than_the_model(uninterrupted):  # noqa: F811
  """As training does: ids past the model's vocabulary would read NaN losses (evaluate) and
  garbage (generate), silently."""
  from moetrain.tools import generate

  workdir, _ = uninterrupted
  config = small_config()
  config.data.tokenizer = os.path.join(workdir, 'tokenizer.model')
  config.model.vocab_size = 256
  message = r'model\.vocab_size=256 is smaller than the tokenizer vocabulary \(\d+\)'
  with pytest.raises(ValueError, match=message):
    evaluate.evaluate_checkpoint(config, None, max_batches=1)
  with pytest.raises(ValueError, match=message):
    generate.load_run(config, None)


def test_an_export_removes_what_killed_exports_left_behind(tmp_path):
  """A kill -9 during an export leaves its staging directory beside --out; the next export to
  that --out removes it when its process is gone (a live export's, or another --out's, stay)."""
  import socket
  import subprocess

  from moetrain.tools import export

  out = tmp_path / 'hf'
  host = socket.gethostname()
  dead = subprocess.Popen(['true'])  # a process that has exited
  dead.wait()
  left = tmp_path / f'.hf.{host}.{dead.pid}.abc123'
  live = tmp_path / f'.hf.{host}.{os.getpid()}.def456'
  other = tmp_path / f'.hf2.{host}.{dead.pid}.ghi789'
  for d in (left, live, other):
    d.mkdir()
    (d / 'model.safetensors').write_bytes(b'partial')
  export.remove_dead_staging(str(out))
  assert not left.exists() and live.exists() and other.exists()


def test_a_tool_uses_the_runs_compilation_cache(uninterrupted, tmp_path, monkeypatch):  # noqa: F811
  """A tool compiles through the run's persistent cache (train.compilation_cache), so a random
  base's initialiser and the eval step compile once across calls, not on every call."""
  from moetrain.run import startup

  workdir, _ = uninterrupted
  seen = []
  monkeypatch.setattr(startup, 'enable_compilation_cache', seen.append)
  startup.tool_setup(None, workdir)
  assert not seen  # this process has its cache already (tests/conftest.py): it keeps it
  monkeypatch.setattr(startup, 'has_compilation_cache', lambda: False)  # a tool's process
  config = json.loads((Path(workdir) / 'config.json').read_text())
  assert config['train']['compilation_cache'] == ''  # (the test run's: none)
  startup.tool_setup(None, workdir)
  assert seen == ['']
  copy = tmp_path / 'run'
  shutil.copytree(workdir, copy)
  config['train']['compilation_cache'] = str(tmp_path / 'cache')
  (copy / 'config.json').write_text(json.dumps(config))
  startup.tool_setup(None, str(copy))
  assert seen[-1] == str(tmp_path / 'cache')

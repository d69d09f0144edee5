"""A Hugging Face LongCat directory: LoRA fine-tune it, export merged, reload (and in transformers)."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from moetrain.convert import hf
from moetrain.core import sharding
from moetrain.data.demo_task import WORDS
from moetrain.run import startup, train
from moetrain.tools import evaluate, export
from moetrain.training.train_state import graphdef_of, merge_model
from tests.test_configs import ROOT, load

FIXTURE = os.path.join(ROOT, 'tests', 'fixtures', 'longcat_two_layer')


def hf_dir_with_tokenizer(tmp_path) -> str:
  """The reference fixture plus a word-level tokenizer.json that fits its 128-token vocabulary."""
  out = str(tmp_path / 'hf')
  shutil.copytree(FIXTURE, out, ignore=shutil.ignore_patterns('reference.npz'))
  vocab = {t: i for i, t in enumerate(['<pad>', '<s>', '</s>', '<unk>', 'reverse:', '=', *WORDS])}
  tok = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(os.path.join(out, 'tokenizer.json'))
  with open(os.path.join(out, 'tokenizer_config.json'), 'w') as f:
    json.dump({'bos_token': '<s>', 'eos_token': '</s>', 'pad_token': '<pad>'}, f)
  return out


def hf_config(hf_dir, **train_kw):
  config = load(os.path.join(ROOT, 'configs', 'longcat_lora.py'), 'variant=tiny')
  config.init.hf_checkpoint = hf_dir
  config.engine.dtype = 'float32'
  config.data.seq_len = 32
  config.data.global_batch_size = 8
  config.data.eval_batch_size = 8
  config.train.update(
    dict(
      steps=4, log_every=1, checkpoint_every=4, eval_every=0, eval_batches=1, compilation_cache=''
    ),
    **train_kw,
  )
  config.optim.warmup_steps = 1
  return config


@pytest.fixture(scope='module')
def finetuned(tmp_path_factory):
  """LoRA-trains the fixture for 4 steps, exports it merged; returns (export dir, logits)."""
  tmp_path = tmp_path_factory.mktemp('hf')
  hf_dir = hf_dir_with_tokenizer(tmp_path)
  config = hf_config(hf_dir)
  workdir = str(tmp_path / 'run')
  out = train.run(config, workdir)
  assert np.isfinite(out['loss']) and out['eval_tokens'] > 0
  exported = export.export(config, workdir, str(tmp_path / 'merged'))
  # The base checkpoint's tokenizer and generation config travel with the merged export.
  for name in ('tokenizer.json', 'generation_config.json'):
    assert os.path.isfile(os.path.join(exported, name)), name
  setup = startup.build(config)
  mesh = sharding.make_mesh(setup.mesh_shape)
  ids = np.load(os.path.join(FIXTURE, 'reference.npz'))['input_ids']
  with jax.set_mesh(mesh):
    state = startup.load_latest(setup, workdir, mesh)
    tuned = merge_model(graphdef_of(setup.model), state.params, state.moe_bias, state.frozen)
    want, _ = jax.jit(lambda i: tuned(i))(ids)
  return exported, ids, np.asarray(want)


def test_lora_finetune_export_reload(finetuned):
  exported, ids, want = finetuned
  # the adapters moved the model away from the base checkpoint ...
  base = hf.load_model(FIXTURE, dtype=np.float32)
  assert np.abs(np.asarray(base(ids)[0]) - np.asarray(want)).max() > 1e-4
  # ... and the merged export reproduces the fine-tuned model
  got, _ = hf.load_model(exported, dtype=np.float32)(ids)
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_transformers_loads_the_export(finetuned):
  """Reference check where torch + transformers 4.57 are installed (not in the default env)."""
  exported, ids, want = finetuned
  transformers = pytest.importorskip('transformers')
  import torch

  hf = transformers.AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).eval()
  with torch.no_grad():
    ref = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(ref, want, atol=1e-5)


@pytest.mark.slow  # ~14 s; test_lora_finetune_export_reload exports too
def test_adapter_only_export(tmp_path):
  hf_dir = hf_dir_with_tokenizer(tmp_path)
  config = hf_config(hf_dir, steps=2, checkpoint_every=2)
  workdir = str(tmp_path / 'run')
  final = train.run(config, workdir)
  out = export.export(config, workdir, str(tmp_path / 'adapter'), adapter_only=True)
  files = sorted(os.listdir(out))
  assert files == [export.MARKER, 'adapter_config.json', 'adapter_model.safetensors']
  with open(os.path.join(out, 'adapter_config.json')) as f:  # for peft's AutoPeftModel
    assert json.load(f)['base_model_name_or_path'] == config.init.hf_checkpoint
  # The run's config.json says which shapes the checkpoint gave (not the preset's).
  with open(os.path.join(workdir, 'config.json')) as f:
    saved = json.load(f)
  with open(os.path.join(hf_dir, 'config.json')) as f:
    hf = json.load(f)
  assert saved['model_from_checkpoint']['hidden_size'] == hf['hidden_size']
  assert saved['model_from_checkpoint']['n_routed_experts'] == hf['n_routed_experts']
  # adapters are a small fraction of the base checkpoint
  assert os.path.getsize(os.path.join(out, files[1])) < 0.5 * os.path.getsize(
    os.path.join(FIXTURE, 'model.safetensors')
  )
  # Loaded back onto the base checkpoint, the adapter evaluates exactly like the run.
  config.init.peft_adapter = out
  ev = evaluate.evaluate_checkpoint(config, None, max_batches=1)
  assert ev['step'] == 0
  np.testing.assert_allclose(ev['loss'], final['eval_loss'], rtol=1e-6)

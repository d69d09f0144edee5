"""What a run directory's config.json allows: the checks before a resume, and the config the
tools read a run with."""

import json
import os

from absl import logging

from moetrain import runtime
from moetrain.data import tokenizer as tokenizer_lib

# ModelConfig fields that are training/engine choices, not checkpoint shapes: with
# init.hf_checkpoint the shapes come from its config.json and these from config.model.
ENGINE_FIELDS = (
  'init_std',
  'dtype',
  'param_dtype',
  'remat',
  'scan_layers',
  'attention_chunk',
  'attention_recompute',
  'loss_chunk',
  'moe_dispatch',
  'moe_capacity_factor',
  'moe_backend',
  'moe_block_size',
  'moe_expert_parallel',
  'moe_ep_comm',
  'moe_ep_recv_factor',
  'moe_expected_ffn_experts',
  'moe_balance_groups',
  'quant',
  'quant_group_size',
)


# DataConfig fields that shape the training stream a checkpoint's data position points into.
DATA_STREAM_FIELDS = (
  'source',
  'path',
  'tfds_name',
  'train_split',
  'text_key',
  'prompt_key',
  'completion_key',
  'messages_key',
  'tokenizer',
  'seq_len',
  'split_long_texts',
  'global_batch_size',
  'shuffle',
  'seed',
  'num_epochs',
  'worker_count',
)


# Config fields that hold local paths. A run resolves them against its working directory before
# anything reads them, so its config.json holds them absolute: the tools, which read that file,
# and a resume find the same files from any directory.
PATH_FIELDS = (
  ('data', 'path'),
  ('data', 'tokenizer'),
  ('data', 'tfds_data_dir'),
  ('init', 'hf_checkpoint'),
  ('init', 'peft_adapter'),
)


def absolute(path):
  """A local path made absolute; '' and URLs (gs://...) unchanged."""
  if not isinstance(path, str) or not path or '://' in path:
    return path
  return os.path.abspath(os.path.expanduser(path))


def with_absolute_paths(config):
  """A copy of `config` (a ConfigDict, or a config.json's dict) with its PATH_FIELDS absolute.
  (Older runs wrote them as given, relative to where they ran: taken here as the working
  directory.)"""
  if isinstance(config, dict):
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
  else:
    config = config.copy_and_resolve_references()
  for section, key in PATH_FIELDS:
    if section in config and key in config[section]:
      config[section][key] = absolute(config[section][key])
  return config


def tool_config(config, workdir: str | None):
  """`config` (--config), checked against the run in `workdir` as a resume is, or the run's own
  config.json when it is None. A workdir without checkpoints is refused: a tool would otherwise
  read the initial weights."""
  if workdir and not runtime.saved_steps(workdir):
    raise ValueError(
      f'--workdir={workdir!r} holds no checkpoints ({os.path.join(workdir, "checkpoints")}); '
      'leave --workdir out to use the initial weights of --config'
    )
  if config is not None:
    config = with_absolute_paths(config)
    if workdir:
      advice = "pass the run's settings, or leave --config out"
      check_resumable(config, workdir, advice, tool=True)
    return config
  if not workdir:
    raise ValueError('pass --config, or --workdir of a run (its config.json is then used)')
  import ml_collections

  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist: pass the run's --config")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def check_resumable(
  config, workdir: str, advice: str = 'resume with the same ones or use a new --workdir', tool=False
) -> None:
  """Before resuming from <workdir>/checkpoints, the model and LoRA settings that shape the saved
  state must equal those of the run that saved it (<workdir>/config.json); name any that differ
  instead of failing deep inside the restore. ENGINE_FIELDS (how the model computes) may change.
  Changed DATA_STREAM_FIELDS are allowed, with a warning naming them: the resume is not exact.
  A `tool` (evaluate, export, generate) reads the weights only: other data is its own choice,
  but not another tokenizer."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path) or not runtime.saved_steps(workdir):
    return
  with open(path) as f:
    saved = with_absolute_paths(json.load(f))
  now = with_absolute_paths(json.loads(config.to_json_best_effort()))
  diffs = _state_diffs(saved, now) + _base_diffs(saved, now)
  if tool:
    diffs += _tokenizer_diffs(saved, now, workdir)
  if diffs:
    raise ValueError(
      f'{workdir} holds checkpoints of a run with other settings; {advice}:\n  '
      + '\n  '.join(diffs)
    )
  if not tool:
    _warn_data_changes(saved, now, workdir)


def _was(what: str, saved, now, why: str = '') -> str:
  return f'{what}: {saved!r} in the checkpointed run, now {now!r}' + (f' ({why})' if why else '')


def _state_diffs(saved: dict, now: dict) -> list[str]:
  """The settings that shape the saved state: model and LoRA fields (not ENGINE_FIELDS),
  gradient clipping (a state of its own) and float16 (a loss scale in the state)."""
  diffs = [
    _was(f'{section}.{key}', saved[section].get(key), value)
    for section in ('model', 'lora')
    for key, value in now.get(section, {}).items()
    if section in saved
    and not (section == 'model' and key in ENGINE_FIELDS)
    and saved[section].get(key, value) != value
  ]
  clip = lambda c: c.get('optim', {}).get('grad_clip', 0) > 0
  if 'optim' in saved and clip(saved) != clip(now):
    grad_clip = lambda c: c['optim'].get('grad_clip')
    why = 'on and off keep different optimizer states'
    diffs.append(_was('optim.grad_clip', grad_clip(saved), grad_clip(now), why))
  half = lambda c: c.get('model', {}).get('dtype') == 'float16'
  if 'model' in saved and half(saved) != half(now):
    dtype = lambda c: c['model'].get('dtype')
    why = 'float16 keeps a loss scale in the checkpoint, others none'
    diffs.append(_was('model.dtype', dtype(saved), dtype(now), why))
  return diffs


def _base_diffs(saved: dict, now: dict) -> list[str]:
  """A LoRA checkpoint holds no frozen base: the run rebuilds it from init.hf_checkpoint, or from
  the seed, and the adapters belong to that base."""
  if now.get('lora', {}).get('rank', 0) <= 0 or 'model' not in saved:
    return []

  def base(c):  # what the frozen base is built from (model.param_dtype only rounds it)
    init_std = c.get('model', {}).get('init_std')
    return (
      c.get('init', {}).get('hf_checkpoint', '') or f'seed {c.get("seed")}, init_std {init_std}'
    )

  what = 'the frozen base (init.hf_checkpoint, or the seed and model.init_std without one)'
  return [] if base(saved) == base(now) else [_was(what, base(saved), base(now))]


def _tokenizer_diffs(saved: dict, now: dict, workdir: str) -> list[str]:
  """The weights know the run's token ids: another tokenizer makes them read other text (and
  with none given, a tool would train one into the run directory)."""
  if 'data' not in saved:
    return []

  def tokenizer(c):  # the file it reads: data.tokenizer, the checkpoint's or the run's own
    path = c.get('data', {}).get('tokenizer', '') or c.get('init', {}).get('hf_checkpoint', '')
    if not path:
      return os.path.join(absolute(workdir), tokenizer_lib.SPM_FILE)
    return str(tokenizer_lib.tokenizer_file(absolute(path)) or absolute(path))

  why = 'the weights were trained on its token ids'
  same = tokenizer(saved) == tokenizer(now)
  return [] if same else [_was('data.tokenizer', tokenizer(saved), tokenizer(now), why)]


def _warn_data_changes(saved: dict, now: dict, workdir: str) -> None:
  changed = [
    _was(f'data.{key}', saved['data'][key], now.get('data', {}).get(key))
    for key in DATA_STREAM_FIELDS
    if key in saved.get('data', {}) and saved['data'][key] != now.get('data', {}).get(key)
  ]
  if changed:  # legitimate (e.g. a bigger batch on a bigger slice), but no longer exact
    logging.warning(
      'Resuming %s with other data settings:\n  %s\nThe saved data position is applied to the '
      'new stream: examples around it may be skipped or read twice, and with another order or '
      'source the rest of the epoch is not what the checkpointed run would have read. Resume '
      'with the saved settings for an exact continuation.',
      workdir,
      '\n  '.join(changed),
    )

"""The run directory: its config.json (what a resume may change, the config the tools read a run
with), the marker of data that ran out, the steps saved in it and what a run says about it."""

import functools
import json
import os
import shutil

from absl import logging

from moetrain.core import fields, runtime, storage

# (JAX, the model and the data pipeline are imported where used: `python -m moetrain.main` reads
# the saved steps before it re-executes itself, runtime.start_command.)


@functools.cache
def stream_fields() -> tuple[str, ...]:
  """What shapes the training stream a checkpoint's data position points into."""

  from moetrain.data import loader

  return fields.with_role(loader.DataConfig, 'stream')


def absolute(path):
  """A local path made absolute; '' and URLs (gs://...) unchanged."""
  return storage.absolute(path) if isinstance(path, str) else path


def with_absolute_paths(config):
  """A copy of `config` (a ConfigDict, or a config.json's dict) with its paths absolute (role "path").
  (Older runs wrote them as given, relative to where they ran: taken here as the working
  directory.)"""
  from moetrain.run import sections

  if isinstance(config, dict):
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
  else:
    config = config.copy_and_resolve_references()

  for section, key in sections.path_fields():
    if section in config and key in config[section]:
      config[section][key] = absolute(config[section][key])
  return config


def tool_config(config, workdir: str | None):
  """`config` (--config), checked against the run in `workdir` as a resume is, or the run's own
  config.json when it is None. A workdir without checkpoints is refused: a tool would otherwise
  read the initial weights."""
  import ml_collections

  if workdir and not storage.isdir(workdir):
    raise ValueError(f'--workdir={workdir!r} does not exist (no run directory there)')
  if workdir and not saved_steps(workdir):
    raise ValueError(
      f'--workdir={workdir!r} holds no checkpoints ({storage.join(workdir, "checkpoints")}); '
      'leave --workdir out to use the initial weights of --config'
    )
  if config is not None:
    config = with_absolute_paths(config)
    if workdir:
      advice = "pass the run's settings, or leave --config out"
      check_resumable(config, workdir, advice, tool=True)
      check_tokenizer_content(workdir, read_tokenizer(config))
    return config
  if not workdir:
    raise ValueError('pass --config, or --workdir of a run (its config.json is then used)')

  path = storage.join(run_dir(workdir), 'config.json')
  if not storage.isfile(path):
    raise FileNotFoundError(f"{path} does not exist: pass the run's --config")
  with storage.open(path) as f:  # (an older run's lacks newer keys: they were at their defaults)
    config = ml_collections.ConfigDict(_with_defaults(json.load(f)))
  check_tokenizer_content(workdir, read_tokenizer(config))
  return config


def check_resumable(
  config, workdir: str, advice: str = 'resume with the same ones or use a new --workdir', tool=False
) -> None:
  """Before resuming from <workdir>/checkpoints, the model and LoRA settings that shape the saved
  state must equal those of the run that saved it (<workdir>/config.json); name any that differ
  instead of failing deep inside the restore. The engine section (how the model computes) may change.
  Changed stream_fields() are allowed, with a warning naming them: the resume is not exact.
  A `tool` (evaluate, export, generate) reads the weights only: other data is its own choice,
  but not another tokenizer."""
  path = storage.join(run_dir(workdir), 'config.json')
  if not storage.exists(path) or not saved_steps(workdir):
    return
  with storage.open(path) as f:  # (an older run's lacks newer keys: they were at their defaults)
    saved = with_absolute_paths(_with_defaults(json.load(f)))
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
    _warn_schedule_changes(
      saved, now, workdir, config.train.resume_step or saved_steps(workdir)[-1]
    )


def _was(what: str, saved, now, why: str = '') -> str:
  return f'{what}: {saved!r} in the checkpointed run, now {now!r}' + (f' ({why})' if why else '')


def _state_diffs(saved: dict, now: dict) -> list[str]:
  """The settings that shape the saved state: the model and LoRA sections (not the engine),
  gradient clipping (a state of its own) and float16 (a loss scale in the state)."""
  diffs = [
    _was(f'{section}.{key}', saved[section][key], now[section][key])
    for section in ('model', 'lora')
    for key in now[section]
    if saved[section][key] != now[section][key]
  ]
  clip = lambda c: c['optim']['grad_clip'] > 0
  if clip(saved) != clip(now):
    why = 'on and off keep different optimizer states'
    diffs.append(
      _was('optim.grad_clip', saved['optim']['grad_clip'], now['optim']['grad_clip'], why)
    )
  half = lambda c: c['engine']['dtype'] == 'float16'
  if half(saved) != half(now):
    why = 'float16 keeps a loss scale in the checkpoint, others none'
    diffs.append(_was('engine.dtype', saved['engine']['dtype'], now['engine']['dtype'], why))
  return diffs


def _base_diffs(saved: dict, now: dict) -> list[str]:
  """A LoRA checkpoint holds no frozen base: the run rebuilds it from init.hf_checkpoint, or from
  the seed, and the adapters belong to that base."""
  if now['lora']['rank'] <= 0:
    return []

  def base(c):  # what the frozen base is built from (engine.param_dtype only rounds it)
    d = c.get('distill', {})
    if d.get('init_from_teacher'):  # a student's, copied from the teacher on every start
      how = (d['init_from_teacher'], list(d.get('init_layers') or ()), d.get('init_batches'))
      return f'teacher {d["teacher"]} (experts, layers, batches {how}, seed {c["seed"]})'
    return c['init']['hf_checkpoint'] or f'seed {c["seed"]}, init_std {c["engine"]["init_std"]}'

  what = (
    'the frozen base (init.hf_checkpoint, or the seed and engine.init_std without one, or '
    'distill.teacher with distill.init_from_teacher)'
  )
  return [] if base(saved) == base(now) else [_was(what, base(saved), base(now))]


def read_tokenizer(c) -> str:
  """The tokenizer the settings `c` (a config, or its JSON) read, as build() resolves it:
  data.tokenizer, else init.hf_checkpoint's, else distill.teacher's; '' = the one trained into
  the run directory."""
  path = c['data']['tokenizer'] or c['init']['hf_checkpoint']
  if path or not c['distill']['teacher']:
    return path
  return checkpoint_tokenizer(c['distill']['teacher'])


def run_config(path: str) -> dict | None:
  """The saved config of a moetrain run directory `path`; None for a Hugging Face checkpoint."""
  file = storage.join(run_dir(path), 'config.json')
  if not storage.isfile(file):
    return None
  with storage.open(file) as f:
    saved = json.load(f)
  return saved if 'model' in saved and 'train' in saved else None


def checkpoint_tokenizer(path: str) -> str:
  """The tokenizer file of a checkpoint: a Hugging Face directory's own, or the one a moetrain
  run directory trained with (a distillation teacher's)."""

  from moetrain.data import tokenizer as tokenizer_lib

  saved = run_config(path)
  if saved is not None:  # as that run read it (a teacher that was itself distilled: its teacher's)
    given = read_tokenizer(_with_defaults(saved))
    if not given:
      return storage.join(run_dir(path), tokenizer_lib.SPM_FILE)
    path = given
  return str(tokenizer_lib.tokenizer_file(path) or path)


def _with_defaults(saved: dict) -> dict:

  from moetrain.run import sections

  return sections.with_defaults(saved)


def _tokenizer_diffs(saved: dict, now: dict, workdir: str) -> list[str]:
  """The weights know the run's token ids: another tokenizer makes them read other text (and
  with none given, a tool would train one into the run directory)."""

  from moetrain.data import tokenizer as tokenizer_lib

  def tokenizer(c):  # the file it reads: read_tokenizer's, or the run's own
    path = read_tokenizer(c)
    if not path:
      return storage.join(run_dir(workdir), tokenizer_lib.SPM_FILE)
    return str(tokenizer_lib.tokenizer_file(absolute(path)) or absolute(path))

  why = 'the weights were trained on its token ids'
  same = tokenizer(saved) == tokenizer(now)
  return [] if same else [_was('data.tokenizer', tokenizer(saved), tokenizer(now), why)]


def _warn_data_changes(saved: dict, now: dict, workdir: str) -> None:
  was, new = saved['data'], now['data']
  changed = [_was(f'data.{k}', was[k], new[k]) for k in stream_fields() if was[k] != new[k]]
  if changed:  # legitimate (e.g. a bigger batch on a bigger slice), but no longer exact
    logging.warning(
      'Resuming %s with other data settings:\n  %s\nThe saved data position is applied to the '
      'new stream: examples around it may be skipped or read twice, and with another order or '
      'source the rest of the epoch is not what the checkpointed run would have read. Resume '
      'with the saved settings for an exact continuation.',
      workdir,
      '\n  '.join(changed),
    )


SCHEDULE_FIELDS = (
  'train.steps',
  'optim.learning_rate',
  'optim.warmup_steps',
  'optim.schedule',
  'optim.min_lr_ratio',
)


def _warn_schedule_changes(saved: dict, now: dict, workdir: str, step: int) -> None:
  """The learning-rate schedule is a function of these settings: a resume that changes one
  (a longer train.steps stretches the cosine) moves the rate from the resumed step on."""

  from moetrain.training import optim

  get = lambda d, key: d[key.split('.')[0]][key.split('.')[1]]
  changed = [
    _was(k, get(saved, k), get(now, k)) for k in SCHEDULE_FIELDS if get(saved, k) != get(now, k)
  ]
  if not changed:
    return
  rate = lambda d: float(optim.schedule(optim.OptimConfig(**d['optim']), d['train']['steps'])(step))
  logging.warning(
    'Resuming %s at step %d with another learning-rate schedule:\n  %s\nThe rate there moves '
    'from %.3g to %.3g. Resume with the saved settings for an exact continuation.',
    workdir,
    step,
    '\n  '.join(changed),
    rate(saved),
    rate(now),
  )


def run_dir(workdir: str) -> str:
  """A run directory: a local path made absolute, or an object-store URL (gs://bucket/run, see
  moetrain/core/storage.py). On several hosts it must be one place they all reach (a bucket, or a
  shared filesystem), as Orbax's checkpoints are written by every host."""
  if storage.is_url(workdir):
    storage.check_url(workdir, f'--workdir={workdir}')
    return workdir.rstrip('/')
  return storage.absolute(workdir)


# Orbax commits a checkpoint on an object store by this file, written last into the step's
# directory (elsewhere by renaming a temporary directory to the step's name).
COMMITTED = 'commit_success.txt'


def saved_steps(workdir: str) -> list[int]:
  """The steps of <workdir>/checkpoints that were written completely, in order; no JAX needed."""
  directory = storage.join(run_dir(workdir), 'checkpoints')
  steps = [int(d) for d in storage.listdir(directory) if d.isdigit()]
  if storage.is_url(directory):
    steps = [s for s in steps if storage.exists(storage.join(directory, str(s), COMMITTED))]
  return sorted(steps)


# What a run's start writes into its directory before its first step, which a rerun writes
# again: its lease, config, input fingerprints, trained tokenizer, an empty records file.
STARTUP_FILES = ('lease.json', 'config.json', 'inputs.json', 'tokenizer.model', 'metrics.jsonl')


def created_here(workdir: str) -> bool:
  """Whether a run in `workdir` will create its directory (a local one, which process 0 makes)."""
  return not storage.is_url(workdir) and runtime.is_primary() and not os.path.exists(workdir)


def remove_unused(workdir: str) -> bool:
  """Removes the run directory that a failed run created, when it holds nothing but its start's
  files (STARTUP_FILES, metrics.jsonl empty) and an empty checkpoints/; anything else, a record
  or a checkpoint in the making among them, keeps it whole. Returns whether it was removed."""
  path = run_dir(workdir)
  try:
    names = set(os.listdir(path))
    ckpts, metrics = os.path.join(path, 'checkpoints'), os.path.join(path, 'metrics.jsonl')
    if 'checkpoints' in names and (not os.path.isdir(ckpts) or os.listdir(ckpts)):
      return False
    records = os.path.isfile(metrics) and os.path.getsize(metrics) > 0
    if names - {*STARTUP_FILES, 'checkpoints'} or records:
      return False
    shutil.rmtree(path)
  except OSError:
    return False
  return True


def config_json(config, setup) -> str:
  """The run's config.json: its settings, and with init.hf_checkpoint the model the checkpoint
  gave (`model_from_checkpoint`: its shapes replace those of the `model` section, which a resume
  is still checked against)."""
  saved = json.loads(config.to_json_best_effort())
  if setup.hf_checkpoint:
    keys = fields.keys(type(setup.model))
    saved['model_from_checkpoint'] = {k: getattr(setup.model, k) for k in keys}
  return json.dumps(saved, indent=1)


DATA_ENDED = 'data_ended.json'


def _data_stream(data) -> dict:
  return {k: getattr(data, k) for k in stream_fields()}


def mark_data_ended(workdir: str, step: int, data) -> None:
  """Records in the run directory that the training data ran out at `step` (saved and evaluated
  by then), with the data settings it ran out under."""
  marked = {'step': step, 'data': _data_stream(data)}
  storage.write_atomic(storage.join(run_dir(workdir), DATA_ENDED), json.dumps(marked, indent=1))


def data_ended_at(workdir: str, data) -> int | None:
  """The step at which this run's training data ran out, when the data settings are still the
  ones it ran out under (a resume with more data.num_epochs, say, goes on)."""
  path = storage.join(run_dir(workdir), DATA_ENDED)
  if not storage.exists(path):
    return None
  marked = json.loads(storage.read_text(path))
  return marked['step'] if marked['data'] == _data_stream(data) else None


def nothing_to_do(workdir: str, step: int, t, data_ended_epochs=None) -> str:
  if data_ended_epochs:
    return (
      f'Run in {workdir} stopped at step {step} when its training data ran out '
      f'(data.num_epochs={data_ended_epochs}, train.steps={t.steps}); nothing to do. Raise '
      'data.num_epochs to go on, or use a new --workdir to train again.'
    )
  if step >= t.steps:
    return (
      f'Run in {workdir} already finished at step {step} (train.steps={t.steps}); nothing to '
      'do. Use a new --workdir to train again.'
    )
  return (
    f'Run in {workdir} is at step {step}, already past train.stop_at_step={t.stop_at_step}; '
    f'nothing to do. Raise it (or set 0 to run to train.steps={t.steps}).'
  )


INPUTS = 'inputs.json'  # content fingerprints of the run's tokenizer and data files


def tokenizer_path(data, workdir: str) -> str:
  """The tokenizer a run reads: data.tokenizer (build() sets the checkpoint's for
  init.hf_checkpoint), else the one trained into the run directory."""

  from moetrain.data import tokenizer as tokenizer_lib

  return data.tokenizer or storage.join(run_dir(workdir), tokenizer_lib.SPM_FILE)


def data_files(data) -> list[str]:
  """The files the run's data is read from: its splits' files (jsonl, text; local copies of
  gs:// ones) and data.chat_template."""
  from moetrain.data import sources

  files = [data.chat_template] if data.chat_template else []
  if data.source in ('jsonl', 'text'):
    splits = [s for s in (data.train_split, data.eval_split) if s]
    files += [p for s in splits for p in sources.expand_paths(data.path, s)]
  return sorted(set(files))


def _recorded(workdir: str) -> dict:
  path = storage.join(run_dir(workdir), INPUTS)
  if not storage.exists(path):
    return {}
  try:
    return json.loads(storage.read_text(path))
  except ValueError:  # (cut short by a kill: written anew below)
    return {}


def _changed_tokenizer(was: dict, now: dict) -> str:
  """The first tokenizer file whose content differs from the recorded one of its name ('' when
  none): another path with the same bytes is the same tokenizer."""
  by_name = {os.path.basename(p): e['sha256'] for p, e in was.items()}
  for path, entry in now.items():
    if by_name.get(os.path.basename(path), entry['sha256']) != entry['sha256']:
      return path
  names = {os.path.basename(p) for p in now}
  return next((p for p in was if os.path.basename(p) not in names), '')


def _fingerprinted(workdir: str, data, resuming: bool) -> dict:
  """The run's input record (INPUTS), checked against the recorded one when `resuming`."""

  from moetrain.data import tokenizer as tokenizer_lib
  from moetrain.run import integrity

  was = _recorded(workdir) if resuming else {}
  tokenizer_now = tokenizer_lib.tokenizer_files(tokenizer_path(data, workdir))
  now = {
    'tokenizer': integrity.fingerprints(tokenizer_now, was.get('tokenizer')),
    'data': integrity.fingerprints(data_files(data), was.get('data')),
  }
  if was.get('tokenizer') and (changed := _changed_tokenizer(was['tokenizer'], now['tokenizer'])):
    raise ValueError(
      f'{changed}: the tokenizer is not the one the checkpointed run in {workdir} trained with '
      '(its content differs, and the weights were trained on its token ids); restore it, or '
      'use a new --workdir'
    )
  old = was.get('data', {})
  changed = [p for p, e in now['data'].items() if p in old and old[p]['sha256'] != e['sha256']]
  new, gone = sorted(set(now['data']) - set(old)), sorted(set(old) - set(now['data']))
  if old and (changed or new or gone):
    said = [f'{p} (content changed)' for p in changed]
    said += [f'{p} (not read before)' for p in new] + [f'{p} (no longer read)' for p in gone]
    logging.warning(
      'Resuming %s on other data files than the checkpointed run read:\n  %s\nThe saved data '
      'position is applied to them: examples around it may be skipped or read twice. Restore '
      'the files for an exact continuation.',
      workdir,
      '\n  '.join(said),
    )
  return now


def check_inputs(workdir: str, data, resuming: bool) -> dict | None:
  """Fingerprints the run's tokenizer and data files (process 0; files unchanged since the
  record are not read again, integrity.fingerprints). On a resume a tokenizer whose content
  changed stops the run naming the file, and changed data files are warned of by name. Returns
  the record for `record_inputs` (None on the other processes, which stop with process 0)."""
  from moetrain.core import multihost

  record, problem = None, ''
  if runtime.is_primary():
    try:
      record = _fingerprinted(workdir, data, resuming)
    except (OSError, ValueError) as e:
      problem = str(e)
  if problem := multihost.Exchange('run_inputs')(problem, 0)[0]:
    raise ValueError(problem)
  return record


def record_inputs(workdir: str, record: dict | None) -> None:
  if record is not None:
    storage.write_atomic(storage.join(run_dir(workdir), INPUTS), json.dumps(record, indent=1))


def check_tokenizer_content(workdir: str, tokenizer: str) -> None:
  """For a tool reading a run's weights: its tokenizer (data.tokenizer, else init.hf_checkpoint's,
  else the run's own: `tokenizer`='') must still be the one the run recorded."""

  from moetrain.data import tokenizer as tokenizer_lib
  from moetrain.run import integrity

  was = _recorded(workdir).get('tokenizer')
  if was:
    path = absolute(tokenizer) or storage.join(run_dir(workdir), tokenizer_lib.SPM_FILE)
    files = tokenizer_lib.tokenizer_files(path)
    if changed := _changed_tokenizer(was, integrity.fingerprints(files, was)):
      raise ValueError(
        f'{changed}: the tokenizer is not the one the run in {workdir} trained with (its '
        'content differs, and the weights were trained on its token ids); restore it'
      )

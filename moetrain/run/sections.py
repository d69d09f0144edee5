"""The config's sections. Every config key is declared once, as a field of its section's
dataclass (SECTIONS), with its default, its checks and its role (moetrain.core.fields); the ConfigDict
of configs/base.py, the resume checks and the tools' path handling are derived from them."""

import dataclasses
import functools
import importlib.util
import inspect

from absl import logging
from ml_collections import config_dict

from moetrain.core import fields, sharding
from moetrain.core.engine import EngineConfig, LoraConfig, split_engine_keys
from moetrain.core.fields import field
from moetrain.data import loader
from moetrain.distill.config import DistillConfig
from moetrain.model.config import ModelConfig
from moetrain.training import optim
from moetrain.training.preference import PreferenceConfig
from moetrain.training.rl import RLConfig
from moetrain.training.train_step import LossConfig

positive = functools.partial(field, check='positive')
non_negative = functools.partial(field, check='non_negative')


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """The `config.train` section: the loop, logging, evaluation and checkpoints."""

  steps: int = positive(200)  # optimizer steps (the schedule's length)
  # End this invocation after this step (e.g. a time-boxed session); 0 = train.steps.
  stop_at_step: int = non_negative(0)
  log_every: int = positive(10)  # progress line + metrics.jsonl record every N steps
  eval_every: int = non_negative(100, zero='0 = only at the end')  # (and always at the end)
  eval_batches: int = 8  # eval batches per evaluation (cap); no evals: data.eval_split = ''
  checkpoint_every: int = positive(50)  # save every N steps (and at the end)
  keep_checkpoints: int = positive(3)  # checkpoints kept
  async_checkpoint: bool = True  # write checkpoints in the background
  # Write the checksums of every checkpoint's files and check them before a restore (each reads
  # the checkpoint once more: ~1.8 GB/s from disk here, bench/RESULTS.md); False = neither.
  verify_checkpoints: bool = True
  # Resume from this checkpoint, moving newer ones aside; 0 = the latest.
  resume_step: int = non_negative(0)
  # Stop after this many skipped (non-finite) steps in a row; 0 = never. (float16's loss scale
  # halves at most 15 times from its start before it reaches 1.)
  max_nonfinite_steps: int = non_negative(20, zero='0 = never stop')
  # Persistent XLA cache: a directory, '' = off, or 'auto': ~/.cache/moetrain/jax on one
  # process, <workdir>/jax_cache on several (only process 0 writes it: it must be shared).
  compilation_cache: str = 'auto'
  # Weights & Biases: the project the run's records also go to ('' = none; needs the wandb
  # package, `pip install -e '.[wandb]'`; WANDB_MODE=offline keeps them on this machine), and
  # the entity (user or team) that owns it ('' = your default).
  wandb_project: str = ''
  wandb_entity: str = ''

  @property
  def last_step(self) -> int:
    """Where this invocation stops: stop_at_step (a time-boxed session) or steps."""
    return min(self.stop_at_step or self.steps, self.steps)

  def validate(self) -> None:
    if self.eval_batches <= 0:
      raise ValueError(
        f'train.eval_batches={self.eval_batches} must be positive; to train without evaluations '
        "set data.eval_split=''"
      )
    fields.check(self, 'train')
    if self.wandb_project and importlib.util.find_spec('wandb') is None:
      raise ValueError(
        f'train.wandb_project={self.wandb_project!r} needs the wandb package: '
        "pip install -e '.[wandb]' (or leave the project empty)"
      )


@dataclasses.dataclass(frozen=True)
class InitConfig:
  """The `config.init` section: the initial weights."""

  # A Hugging Face checkpoint directory of any supported family (config.json's model_type):
  # shapes, weights and tokenizer.
  hf_checkpoint: str = field('', role='path')
  # PEFT adapter directory (tools.export --adapter_only) to start from.
  peft_adapter: str = field('', role='path')
  # A directory (or gs:// URL), e.g. one beside the checkpoint, where the first start saves the
  # converted (for QLoRA quantised) base of hf_checkpoint as an Orbax checkpoint; later starts,
  # resumes and tools restore it onto any mesh instead of converting the safetensors again.
  # '' = convert on every start. (moetrain/run/base_cache.py)
  base_cache: str = field('', role='path')


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The `config.mesh` section: the device mesh, axes (stage, data, fsdp, expert, context,
  tensor); five entries (stage, data, fsdp, expert, tensor) mean context 1, four (data, fsdp,
  expert, tensor) stage 1 too. 'stage' > 1 splits the layers into a pipeline
  (engine.pipeline_microbatches, docs/pipeline.md); 'context' > 1 splits each row's tokens
  (docs/context.md)."""

  shape: tuple = (1, -1, 1, 1)  # one entry may be -1 (the remaining devices)
  # Multislice: how many slices each axis spans (over the data-center network), e.g. (2, 1, 1, 1)
  # puts data parallelism across 2 slices, (2, 1, 1, 1, 1) the pipeline's stages; () or all
  # ones = one slice. Divides `shape`.
  dcn_shape: tuple = ()
  rules: str = field('fsdp_ep_tp', choices=tuple(sharding.RULE_PRESETS))  # logical-axis rule preset


# The config's sections, each a dataclass whose fields are its keys; `seed` (model init and
# dropout; the data order has data.seed) is the one top-level key.
SECTIONS = {
  'model': ModelConfig,
  'engine': EngineConfig,
  'lora': LoraConfig,
  'data': loader.DataConfig,
  'init': InitConfig,
  'mesh': MeshConfig,
  'optim': optim.OptimConfig,
  'loss': LossConfig,
  'train': LoopConfig,
  'distill': DistillConfig,
  'preference': PreferenceConfig,
  'rl': RLConfig,
}
SEED = 0


def default_config() -> config_dict.ConfigDict:
  """Every key with its default (configs/base.py)."""
  c = config_dict.ConfigDict({'seed': SEED})
  for name, cls in SECTIONS.items():  # (a None default must take an int later: num_epochs)
    defaults = fields.defaults(cls).items()
    c[name] = {k: config_dict.placeholder(int) if v is None else v for k, v in defaults}
  return c


def with_defaults(saved: dict) -> dict:
  """A run's config.json (a dict) with the keys it lacks (an older run's) at their defaults, and
  the engine keys an older run kept in `model` read into `engine`."""
  model, moved = split_engine_keys(saved.get('model', {}))
  if moved:
    logging.info(
      'config.json: %d keys of its model section (model.%s, ...) are engine keys now, read as '
      'engine.<key>',
      len(moved),
      next(iter(moved)),
    )
    saved = saved | {'model': model, 'engine': moved | saved.get('engine', {})}
  out = {'seed': saved.get('seed', SEED)}
  for name, cls in SECTIONS.items():
    out[name] = {**fields.defaults(cls), **saved.get(name, {})}
  return out | {k: v for k, v in saved.items() if k not in out}


def path_fields() -> tuple[tuple[str, str], ...]:
  """(section, key) of every key that holds a local path."""
  return tuple(
    (name, key) for name, cls in SECTIONS.items() for key in fields.with_role(cls, 'path')
  )


def _comments(cls) -> dict[str, str]:
  """{key: the comment beside or above its declaration} from the section's source."""

  lines, _ = inspect.getsourcelines(cls)
  notes, above = {}, []
  for line in lines:
    if line.strip().startswith('#'):
      above.append(line.strip().lstrip('#').strip())
      continue
    code, _, trailing = line.partition('  # ')
    stripped = code.strip()
    key = stripped.split(':', 1)[0] if ':' in stripped and '=' in stripped else ''
    if key.isidentifier():
      notes[key] = ' '.join([*above, trailing.strip()]).strip()
    above = []
  return notes


def reference() -> str:
  """docs/config.md: every key with its default and what it does (python -m moetrain.run.sections)."""
  out = [
    '# Config keys',
    '',
    'Generated by `python -m moetrain.run.sections > docs/config.md` from the section dataclasses,',
    'where each key is declared once (a test checks this file is current).',
    '',
    '`seed` (default 0): model init and dropout; the data order has `data.seed`.',
  ]
  for name, cls in SECTIONS.items():
    doc = ' '.join((cls.__doc__ or '').split('\n\n')[0].split())
    out += ['', f'## {name}', '', doc, '', '| key | default | |', '|---|---|---|']
    notes = _comments(cls)
    choices = {f.name: f.metadata.get('choices') for f in dataclasses.fields(cls)}
    for key, default in fields.defaults(cls).items():
      if choices[key]:
        note = notes.get(key, '')
        notes[key] = f'{note}{"; " if note else ""}one of {", ".join(choices[key])}'
      note, shown = (t.replace('|', '\\|') for t in (notes.get(key, ''), repr(default)))
      out.append(f'| `{name}.{key}` | `{shown}` | {note} |')
  return '\n'.join(out) + '\n'


if __name__ == '__main__':
  print(reference(), end='')

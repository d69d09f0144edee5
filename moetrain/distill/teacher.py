"""The teacher: its model config (before anything compiles, with the vocabulary checks), and its
weights on the student's mesh."""

import dataclasses
import hashlib

from moetrain.convert import hf
from moetrain.core import storage
from moetrain.core.engine import LoraConfig
from moetrain.data import tokenizer as tokenizer_lib
from moetrain.model.config import ModelConfig
from moetrain.run import rundir, sections


def _check_exists(path: str) -> None:
  if not storage.isfile(storage.join(path, 'config.json')):
    raise FileNotFoundError(
      f'distill.teacher={path!r} holds no config.json: give a Hugging Face checkpoint directory '
      'or a moetrain run directory'
    )


def model_config(d, student: ModelConfig) -> ModelConfig:
  """The teacher's ModelConfig, computing as the student does (engine settings, sharding rules,
  platform and mesh) and stored as distill.teacher_quant asks; no LoRA but a run's own."""
  _check_exists(d.teacher)

  saved = rundir.run_config(d.teacher)
  if saved is None:
    cfg = hf.config_from_hf(hf.read_config(d.teacher), engine=student.engine, lora=LoraConfig())
  elif not rundir.saved_steps(d.teacher):  # (its weights are its latest checkpoint's)
    raise ValueError(
      f'distill.teacher={d.teacher!r} is a moetrain run directory with no checkpoint: train it '
      'to its first checkpoint, or name another teacher'
    )
  else:
    lora = LoraConfig(**saved.get('lora', {}))
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    own = {k: v for k, v in sections.with_defaults(saved)['model'].items() if k in known}
    own['mlp_only_layers'] = tuple(own.get('mlp_only_layers', ()))
    cfg = ModelConfig(**own, engine=student.engine, lora=lora)
  quant = d.teacher_quant if d.teacher_quant != 'none' else cfg.engine.quant
  # forward only: no recompute, and no gradients to stack
  return cfg.with_engine(quant=quant, remat='none', cast_weights_once=False)


def _digest(path: str) -> str:
  with storage.open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def check_vocabulary(d, teacher: ModelConfig, student: ModelConfig, data_tokenizer: str) -> None:
  """Teacher and student share one tokenizer: the same vocabulary size and the same tokenizer
  file content, or the divergence would compare other tokens. Refused naming both."""
  if teacher.vocab_size != student.vocab_size:
    raise ValueError(
      f'distill.teacher={d.teacher!r} has a vocabulary of {teacher.vocab_size} and the student '
      f'(model.vocab_size) {student.vocab_size}: teacher and student must share the tokenizer'
    )
  mine = str(tokenizer_lib.tokenizer_file(data_tokenizer) or data_tokenizer)
  theirs = rundir.checkpoint_tokenizer(d.teacher)
  missing = [p for p in (mine, theirs) if not storage.isfile(p)]
  if missing:
    raise FileNotFoundError(
      f'tokenizer {missing[0]} does not exist (distill.teacher={d.teacher!r})'
    )
  if mine != theirs and _digest(mine) != _digest(theirs):
    raise ValueError(
      f"the tokenizer of distill.teacher={d.teacher!r} ({theirs}) differs from the student's "
      f'(data.tokenizer={mine}): teacher and student must share the tokenizer'
    )

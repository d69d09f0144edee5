"""Exports a run to Hugging Face: the merged model (with the run's tokenizer), or the adapters
alone (PEFT layout).

  python -m moetrain.tools.export --workdir=runs/longcat_lora --out=exported/ \
      [--adapter_only] [--dtype=bfloat16] [--config=configs/longcat_lora.py]

The run's own config.json is used unless --config is given (it must then match the run). The
files are written next to --out and moved into it only once all are complete: a failed or killed
export leaves an earlier export in --out as it was.
"""

import json
import os
import shutil
import socket
import tempfile

import jax
from absl import app, flags
from ml_collections import config_flags

from moetrain import lease, rundir, runtime, storage
from moetrain import setup as setup_lib
from moetrain.convert import hf, peft_adapter
from moetrain.convert import safetensors_io as stio
from moetrain.data import chat
from moetrain.train_state import graphdef_of, merge_model

DTYPES = ('float32', 'bfloat16', 'float16')
# What a merged export takes along from the run's tokenizer (and the base checkpoint), so that it
# loads on its own (transformers, `generate --hf_checkpoint`).
TOKENIZER_FILES = (
  'tokenizer.json',
  'tokenizer_config.json',
  'special_tokens_map.json',
  chat.TEMPLATE_FILE,
)
SPM_FILE = 'tokenizer.model'


def define_flags():
  config_flags.DEFINE_config_file('config', None, "Experiment config (default: the run's own).")
  flags.DEFINE_string('workdir', None, 'Run directory (its latest checkpoint is exported).')
  flags.DEFINE_string('out', None, 'Output directory.')
  flags.DEFINE_bool('adapter_only', False, 'Write adapter_model.safetensors + adapter_config.json.')
  flags.DEFINE_string(
    'dtype', None, f'Weight dtype of the merged export {DTYPES}; default the model.param_dtype.'
  )
  runtime.define_process_flags()


def _inside(path: str, directory: str) -> bool:
  if storage.is_url(path) or storage.is_url(directory):
    return f'{path.rstrip("/")}/'.startswith(f'{directory.rstrip("/")}/')
  path, directory = os.path.realpath(path), os.path.realpath(directory)
  return os.path.commonpath([path, directory]) == directory


def check_out(out: str, workdir: str, setup: setup_lib.Setup) -> None:
  """--out (a directory, or a gs:// URL) must lie apart from what the export reads."""
  storage.check_url(out, f'--out={out}')
  for flag, source in (
    ('--workdir', workdir),
    ('init.hf_checkpoint', setup.hf_checkpoint),
    ('init.peft_adapter', setup.peft_adapter),
  ):
    if source and (_inside(out, source) or _inside(source, out)):
      raise ValueError(f'--out={out!r} overlaps {flag}={source!r}, which the export reads')


def companion_files(setup: setup_lib.Setup, workdir: str) -> dict[str, str]:
  """{name in the export: source} for the run's tokenizer (data.tokenizer: a .model or
  tokenizer.json file, or a checkpoint directory; else the one the run trained,
  <workdir>/tokenizer.model) and the base checkpoint's generation_config.json."""
  src, j = setup.data.tokenizer, storage.join
  files = {}
  if not src:
    files[SPM_FILE] = j(rundir.run_dir(workdir), SPM_FILE)
  elif storage.isdir(src):
    files = {n: j(src, n) for n in (*TOKENIZER_FILES, SPM_FILE)}
  elif src.endswith('.json'):
    files = {n: j(storage.dirname(src), n) for n in TOKENIZER_FILES[1:]}
    files['tokenizer.json'] = src
  else:
    files[SPM_FILE] = src
  if setup.hf_checkpoint:
    files['generation_config.json'] = j(setup.hf_checkpoint, 'generation_config.json')
    for name in remote_code_files(hf.read_config(setup.hf_checkpoint)):
      files[name] = j(setup.hf_checkpoint, name)
  return {n: p for n, p in files.items() if storage.isfile(p)}


def remote_code_files(config: dict) -> list[str]:
  """The Python files a config.json's auto_map names ('configuration_x.XConfig' -> 'configuration_x.py';
  'repo--module.Class' points at another repository: none)."""
  refs = [
    r for v in config.get('auto_map', {}).values() for r in (v if isinstance(v, list) else [v])
  ]
  return sorted({f'{r.rsplit(".", 1)[0]}.py' for r in refs if isinstance(r, str) and '--' not in r})


def base_config(hf_checkpoint: str) -> dict | None:
  """The base checkpoint's config.json for the merged export. Its auto_map (remote code for
  trust_remote_code=True, as the LongCat-Flash release has) is kept only when the files it names
  are there to copy: a config pointing at code the export lacks does not load."""
  if not hf_checkpoint:
    return None
  base = hf.read_config(hf_checkpoint)
  code = remote_code_files(base)
  if 'auto_map' in base and not all(storage.isfile(storage.join(hf_checkpoint, n)) for n in code):
    base = {k: v for k, v in base.items() if k != 'auto_map'}
  return base


def export(config, workdir: str, out: str, adapter_only: bool = False, dtype=None) -> str:
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f'--dtype={dtype!r}: use one of {DTYPES}')
  if dtype is not None and adapter_only:
    raise ValueError('--dtype applies to the merged export; adapters keep their training dtype')
  setup = setup_lib.tool_setup(config, workdir)
  check_out(out, workdir, setup)
  if adapter_only and not setup.model.lora.enabled:
    raise ValueError('--adapter_only needs a LoRA run (lora.rank > 0)')
  mesh = setup.make_mesh()
  primary = jax.process_index() == 0
  # Written beside --out (same filesystem, so the final moves are renames); for a gs:// --out
  # in a local temporary directory, then uploaded.
  staging = None
  if primary and storage.is_url(out):
    staging = tempfile.mkdtemp(prefix='moetrain-export.')
  elif primary:
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    remove_dead_staging(out)
    staging = tempfile.mkdtemp(prefix=f'{_staging_prefix(out)}{os.getpid()}.', dir=parent)
  try:
    with jax.set_mesh(mesh):
      state = setup_lib.load_latest(setup, workdir, mesh)
      model = merge_model(graphdef_of(setup.model), state.params, state.moe_bias, state.frozen)
      target = staging or out  # only process 0 writes; the others take part in the gathers
      if adapter_only:
        peft_adapter.save(model, setup.model, target, base_model=setup.hf_checkpoint)
      else:
        base = base_config(setup.hf_checkpoint)
        hf.save_hf(
          model, setup.model, target, dtype=dtype, base_config=base, base_dir=setup.hf_checkpoint
        )
        if primary:
          for name, source in companion_files(setup, workdir).items():
            storage.copy(source, os.path.join(staging, name))
    if primary:
      _replace_contents(staging, out)
  finally:
    if staging:
      shutil.rmtree(staging, ignore_errors=True)
  return out


def _staging_prefix(out: str) -> str:
  """Staging directories of exports to `out` from this host: '.<out>.<host>.<pid>.<random>'."""
  return f'.{os.path.basename(os.path.abspath(out))}.{socket.gethostname()}.'


def remove_dead_staging(out: str) -> None:
  """Removes the staging directories that killed exports to `out` from this host left behind
  (their process is gone); another host's, or a live export's, are left alone."""
  parent, mine = os.path.dirname(os.path.abspath(out)), _staging_prefix(out)
  for name in os.listdir(parent):
    pid = name.removeprefix(mine).split('.')[0]
    if name.startswith(mine) and pid.isdigit() and not lease.pid_alive(int(pid)):
      shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


# Files an export may write (with the model files, stio.is_model_file). An earlier export's that
# the new one does not write are removed: a stale model.safetensors shadows a new sharded index,
# a stale adapter_config.json makes transformers read a merged export as an adapter, a stale
# tokenizer.json wins over a new tokenizer.model.
EXPORT_FILES = (
  peft_adapter.ADAPTER_FILE,
  peft_adapter.ADAPTER_CONFIG,
  'config.json',
  'generation_config.json',
  SPM_FILE,
  *TOKENIZER_FILES,
)


def _replace_contents(staging: str, out: str) -> None:
  """Moves the finished files into `out`, first removing what an earlier export there wrote
  that this one did not (EXPORT_FILES, model files, remote code). Other files are left alone."""
  storage.makedirs(out)
  new = set(os.listdir(staging))
  old_config = storage.join(out, 'config.json')
  old_code = set()
  if storage.isfile(old_config):
    try:
      old_code = set(remote_code_files(json.loads(storage.read_text(old_config))))
    except ValueError:
      pass
  for name in storage.listdir(out):
    stale = stio.is_model_file(name) or name in EXPORT_FILES or name in old_code
    if stale and name not in new:
      storage.remove(storage.join(out, name))
  for name in sorted(new, key=lambda n: n == 'config.json' or n == 'adapter_config.json'):
    storage.move(os.path.join(staging, name), storage.join(out, name))


def main(argv):
  runtime.start_command(preemption=False)  # saves nothing: stay killable
  del argv
  f = flags.FLAGS
  out = export(f.config, f.workdir, f.out, f.adapter_only, f.dtype)
  if runtime.is_primary():
    print(f'wrote {out}')


if __name__ == '__main__':
  define_flags()
  flags.mark_flags_as_required(['workdir', 'out'])
  app.run(runtime.short_errors(main), flags_parser=runtime.parse_flags)

"""Exports a run to Hugging Face: the merged model (with the run's tokenizer), or the adapters
alone (PEFT layout).

  python -m moetrain.tools.export --workdir=runs/longcat_lora --out=exported/ \
      [--adapter_only] [--dtype=bfloat16] [--config=configs/longcat_lora.py] [--replace]
      [--quantize=compressed-int4]

The run's own config.json is used unless --config is given (it must then match the run). The
export is written into a directory beside --out, which then takes the place of --out in one
rename (`publish`): a failed or killed export leaves an earlier export in --out as it was.
--out must be new, empty, or an earlier export of the same kind (its MARKER file lists what it
wrote); anything else takes --replace.
"""

import ctypes
import dataclasses
import errno
import json
import os
import shutil
import socket
import stat
import tempfile

import jax
from absl import app, flags
from ml_collections import config_flags

from moetrain.convert import hf, peft_adapter
from moetrain.core import runtime, storage
from moetrain.data import chat
from moetrain.data import tokenizer as tokenizer_lib
from moetrain.run import lease, rundir, startup
from moetrain.training.train_state import graphdef_of, merge_model

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
    'dtype', None, f'Weight dtype of the merged export {DTYPES}; default the engine.param_dtype.'
  )
  flags.DEFINE_bool(
    'replace', False, 'Replace an --out that is not an earlier export of the same kind.'
  )
  flags.DEFINE_enum(
    'quantize',
    '',
    ['', 'compressed-int4'],
    'Merged export: routed experts written pack-quantized int4, groups of 32 (Kimi-K2 layout).',
  )
  runtime.define_process_flags()


def _inside(path: str, directory: str) -> bool:
  if storage.is_url(path) or storage.is_url(directory):
    return f'{path.rstrip("/")}/'.startswith(f'{directory.rstrip("/")}/')
  path, directory = os.path.realpath(path), os.path.realpath(directory)
  return os.path.commonpath([path, directory]) == directory


def check_out(out: str, workdir: str, setup: startup.Setup) -> None:
  """--out (a directory, or a gs:// URL) must lie apart from what the export reads."""
  storage.check_url(out, f'--out={out}')
  for flag, source in (
    ('--workdir', workdir),
    ('init.hf_checkpoint', setup.hf_checkpoint),
    ('init.peft_adapter', setup.peft_adapter),
  ):
    if source and (_inside(out, source) or _inside(source, out)):
      raise ValueError(f'--out={out!r} overlaps {flag}={source!r}, which the export reads')


def companion_files(setup: startup.Setup, workdir: str) -> dict[str, str]:
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
    for name in remote_code_files(text_model_config(setup.hf_checkpoint)):
      files[name] = j(setup.hf_checkpoint, name)
  return {n: p for n, p in files.items() if storage.isfile(p)}


def remote_code_files(config: dict) -> list[str]:
  """The Python files a config.json's auto_map names ('configuration_x.XConfig' -> 'configuration_x.py';
  'repo--module.Class' points at another repository: none)."""
  refs = [
    r for v in config.get('auto_map', {}).values() for r in (v if isinstance(v, list) else [v])
  ]
  return sorted({f'{r.rsplit(".", 1)[0]}.py' for r in refs if isinstance(r, str) and '--' not in r})


TOKEN_IDS = ('bos_token_id', 'eos_token_id', 'pad_token_id')


def text_model_config(hf_checkpoint: str) -> dict:
  """The base checkpoint's config.json, or a multimodal one's text_config (with the token ids it
  leaves to the outer config): the export is the language model alone (convert/multimodal.py)."""
  config = hf.read_config(hf_checkpoint)
  if not (text := config.get('text_config')):
    return config
  return {**{k: config[k] for k in TOKEN_IDS if k in config}, **text}


def base_config(hf_checkpoint: str) -> dict | None:
  """The base checkpoint's config.json for the merged export (text_model_config). Its auto_map
  (remote code for trust_remote_code=True, as the LongCat-Flash release has) is kept only when
  the files it names are there to copy: a config pointing at code the export lacks does not
  load."""
  if not hf_checkpoint:
    return None
  base = text_model_config(hf_checkpoint)
  code = remote_code_files(base)
  if 'auto_map' in base and not all(storage.isfile(storage.join(hf_checkpoint, n)) for n in code):
    base = {k: v for k, v in base.items() if k != 'auto_map'}
  return base


def export(
  config,
  workdir: str,
  out: str,
  adapter_only: bool = False,
  dtype=None,
  replace: bool = False,
  quantize: str = '',
) -> str:
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f'--dtype={dtype!r}: use one of {DTYPES}')
  if quantize and adapter_only:
    raise ValueError('--quantize applies to the merged export; adapters are not quantised')
  if dtype is not None and adapter_only:
    raise ValueError('--dtype applies to the merged export; adapters keep their training dtype')
  setup = startup.tool_setup(config, workdir)
  # Decoded or exported by layer index: read in layer order.
  setup = dataclasses.replace(setup, model=startup.without_repeats(setup.model))
  check_out(out, workdir, setup)
  if adapter_only and not setup.model.lora.enabled:
    raise ValueError('--adapter_only needs a LoRA run (lora.rank > 0)')
  kind = ADAPTER if adapter_only else MERGED
  check_target(out, kind, replace)
  companions = {} if adapter_only else companion_files(setup, workdir)
  check_tokenizer(companions)
  mesh = setup.make_mesh()
  primary = jax.process_index() == 0
  staging = _staging(out) if primary else None
  try:
    with jax.set_mesh(mesh):
      state = startup.load_latest(setup, workdir, mesh)
      model = merge_model(graphdef_of(setup.model), state.params, state.moe_bias, state.frozen)
      target = staging or out  # only process 0 writes; the others take part in the gathers
      if adapter_only:
        peft_adapter.save(model, setup.model, target, base_model=setup.hf_checkpoint)
      else:
        base = base_config(setup.hf_checkpoint)
        hf.save_hf(
          model,
          setup.model,
          target,
          dtype=dtype,
          base_config=base,
          base_dir=setup.hf_checkpoint,
          quantize=quantize,
        )
        if primary:
          for name, source in companions.items():
            storage.copy(source, os.path.join(staging, name))
    if primary:
      write_marker(staging, kind)
    if primary and storage.is_url(out):
      publish_url(staging, out)
    elif primary:
      staging = publish(staging, out)  # (what is left to remove: the earlier export)
  finally:
    if staging:
      shutil.rmtree(staging, ignore_errors=True)
  return out


def check_tokenizer(files: dict[str, str]) -> None:
  """The tokenizer an export takes along must load: an empty or corrupt one is refused, naming
  it, rather than copied into an export that then cannot be read."""
  for name in ('tokenizer.json', SPM_FILE):
    if name in files:
      tokenizer_lib.load_tokenizer(files[name])


def _staging(out: str) -> str:
  """A fresh directory for the export's files: for a local --out beside the directory it names
  (same filesystem: publishing it is a rename), for a gs:// one a local temporary directory."""
  if storage.is_url(out):
    return tempfile.mkdtemp(prefix='moetrain-export.')
  real = os.path.realpath(out)  # (--out may be a symbolic link: the directory it names)
  os.makedirs(os.path.dirname(real), exist_ok=True)
  remove_dead_staging(real)
  return tempfile.mkdtemp(
    prefix=f'{_staging_prefix(real)}{os.getpid()}.', dir=os.path.dirname(real)
  )


def _staging_prefix(out: str) -> str:
  """Staging directories of exports to `out` from this host: '.<out>.<host>.<pid>.<random>'."""
  return f'.{os.path.basename(os.path.abspath(out))}.{socket.gethostname()}.'


# The earlier export, moved aside where the directories cannot be exchanged in one step: if the
# export is killed before the new one takes its place, the next export puts it back.
PREVIOUS = '.previous'


def remove_dead_staging(out: str) -> None:
  """Removes the staging directories that killed exports to `out` from this host left behind
  (their process is gone); another host's, or a live export's, are left alone. An earlier export
  moved aside (PREVIOUS) goes back to `out` when nothing took its place."""
  parent, mine = os.path.dirname(os.path.abspath(out)), _staging_prefix(out)
  for name in os.listdir(parent):
    pid = name.removeprefix(mine).split('.')[0]
    if name.startswith(mine) and pid.isdigit() and not lease.pid_alive(int(pid)):
      path = os.path.join(parent, name)
      if name.endswith(PREVIOUS) and not os.path.lexists(out):
        os.rename(path, out)
      else:
        shutil.rmtree(path, ignore_errors=True)


CONFIGS = ('config.json', peft_adapter.ADAPTER_CONFIG)  # what makes a directory loadable
# Written last into every export: its kind and the names it wrote. Only those are replaced by the
# next export (files of the directory's owner stay), and only an export of the same kind may
# replace them without --replace: a model directory copied from the Hub, or an adapter export
# under a merged one, is never taken for something to overwrite.
MARKER = '.moetrain_export.json'
MERGED, ADAPTER = 'merged', 'adapter'


def write_marker(directory: str, kind: str, names=None) -> None:
  names = sorted(set(os.listdir(directory) if names is None else names) - {MARKER})
  text = json.dumps({'kind': kind, 'files': names}, indent=1)
  storage.write_atomic(storage.join(directory, MARKER), text + '\n')


def read_marker(directory: str) -> dict | None:
  """The marker of an earlier export in `directory` ({'kind', 'files'}), or None."""
  path = storage.join(directory, MARKER)
  if not storage.isfile(path):
    return None
  try:
    marker = json.loads(storage.read_text(path))
  except ValueError:
    return None
  if not isinstance(marker, dict) or marker.get('kind') not in (MERGED, ADAPTER):
    return None
  files = marker.get('files')
  if not isinstance(files, list) or not all(isinstance(n, str) for n in files):
    return None
  return marker


def _listed(names) -> str:
  names = sorted(names)
  more = f' and {len(names) - 8} more' if len(names) > 8 else ''
  return ', '.join(names[:8]) + more


def check_target(out: str, kind: str, replace: bool) -> None:
  """--out must be new, empty, or an earlier export of this kind; --replace allows the rest."""
  if not storage.exists(out):
    return
  if not storage.isdir(out):
    raise ValueError(f'--out={out} is a file, not a directory')
  names = storage.listdir(out)
  marker = read_marker(out)
  if not names or replace or (marker and marker['kind'] == kind):
    return
  if marker:
    ours = sorted(set(marker['files']) & set(names))
    raise ValueError(
      f'--out={out} holds a {marker["kind"]} export ({_listed(ours)}): choose another --out '
      f'for the {kind} export, or pass --replace to replace those files'
    )
  raise ValueError(
    f'--out={out} is not empty and no export wrote it; it holds {_listed(names)}: choose an '
    f'empty or new directory, or pass --replace to delete them'
  )


def _exported_by(out: str) -> set[str]:
  """The names in `out` that the next export replaces: those an earlier export wrote (its
  marker), or all of them where no export wrote it (check_target let it through: it was empty
  or --replace was given)."""
  names = set(storage.listdir(out))
  marker = read_marker(out)
  if marker is None:
    return names
  return (set(marker['files']) | {MARKER}) & names


def _exchange(a: str, b: str) -> None:
  """Swaps two paths in one step (Linux renameat2 RENAME_EXCHANGE: ext4, xfs, btrfs, tmpfs)."""
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE):
    e = ctypes.get_errno()
    raise OSError(e, os.strerror(e), b)


AT_FDCWD, RENAME_EXCHANGE = -100, 2


def publish(staging: str, out: str) -> str:
  """Makes the finished export in `staging` the directory `out` in one rename, so that a kill
  at any instant leaves `out` the earlier export or the new one. Files in `out` that no export
  wrote (notes, a README) are carried over (hard links). Returns the path now holding what
  `out` held, for the caller to remove."""
  out = os.path.realpath(out)
  if not os.path.lexists(out):
    os.chmod(staging, 0o777 & ~_umask())
    os.rename(staging, out)
    return ''
  if not os.path.isdir(out):
    raise NotADirectoryError(f'--out={out} is a file, not a directory')
  for name in sorted(set(os.listdir(out)) - _exported_by(out) - set(os.listdir(staging))):
    _link_tree(os.path.join(out, name), os.path.join(staging, name))
  os.chmod(staging, stat.S_IMODE(os.stat(out).st_mode))
  try:
    _exchange(staging, out)
    return staging
  except OSError as e:
    if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
      raise
  aside = staging + PREVIOUS  # (no exchange here, NFS say: two renames)
  os.rename(out, aside)
  try:
    os.rename(staging, out)
  except BaseException:
    os.rename(aside, out)
    raise
  return aside


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def _link_tree(src: str, dst: str) -> None:
  """A hard-linked copy of a file or directory (a copy where links are refused)."""
  if os.path.isdir(src) and not os.path.islink(src):
    shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
  else:
    _link_or_copy(src, dst)


def _link_or_copy(src: str, dst: str) -> None:
  try:
    os.link(src, dst, follow_symlinks=False)
  except OSError:
    shutil.copy2(src, dst, follow_symlinks=False)


def publish_url(staging: str, out: str) -> None:
  """Uploads the finished export in `staging` to a gs:// `out`. A bucket has no rename and no
  way to replace several objects at once; each object is replaced whole. So the earlier export's
  config.json (or adapter_config.json) goes first, then the new files come, the earlier export's
  leftovers go, and the new configs come last: a kill leaves the earlier export, a prefix that
  no loader takes for a model (no config), or the new export; never new weights read with an
  old config."""
  new = sorted(os.listdir(staging))
  earlier = _exported_by(out)
  stale = earlier - set(new) - set(CONFIGS) - {MARKER}
  # Until the end, the marker names the files of both exports: a rerun after a kill replaces them.
  write_marker(out, read_marker(staging)['kind'], earlier | set(new))
  first = [n for n in CONFIGS if storage.isfile(storage.join(out, n))]
  for name in first:
    storage.remove(storage.join(out, name))
  for name in (n for n in new if n not in CONFIGS and n != MARKER):
    storage.copy(os.path.join(staging, name), storage.join(out, name))
  for name in sorted(stale):
    storage.remove(storage.join(out, name))
  for name in (n for n in new if n in CONFIGS or n == MARKER):
    storage.copy(os.path.join(staging, name), storage.join(out, name))


def main(argv):
  runtime.start_command(preemption=False)  # saves nothing: stay killable
  del argv
  f = flags.FLAGS
  out = export(f.config, f.workdir, f.out, f.adapter_only, f.dtype, f.replace, f.quantize)
  if runtime.is_primary():
    print(f'wrote {out}')


if __name__ == '__main__':
  define_flags()
  flags.mark_flags_as_required(['workdir', 'out'])
  app.run(runtime.short_errors(main), flags_parser=runtime.parse_flags)

"""Exports replace --out in one step: a kill at any instant leaves the earlier export or the new
one (tools/export.py, `publish`; on gs://, `publish_url`, as far as a bucket allows)."""

import errno
import json
import os
import shutil

import pytest

from moetrain.core import storage
from moetrain.run import lease
from moetrain.tools import export

OLD = {'config.json': b'{"dtype": "float32"}', 'model.safetensors': b'old weights'}
NEW = {
  'config.json': b'{"dtype": "bfloat16"}',
  'model-00001-of-00002.safetensors': b'new 1',
  'model-00002-of-00002.safetensors': b'new 2',
  'model.safetensors.index.json': b'{}',
  'tokenizer.model': b'pieces',
}
MINE = {'notes.txt': b'not an export file'}  # left in --out by its owner: stays


def _marked(files: dict, kind: str = export.MERGED) -> dict:
  """`files` as an export writes them: with the marker naming them."""
  text = json.dumps({'kind': kind, 'files': sorted(files)}, indent=1) + '\n'
  return {**files, export.MARKER: text.encode()}


class Killed(BaseException):
  """A kill -9 at a step: nothing after it runs (no cleanup either)."""


def _files(path) -> dict:
  if not os.path.isdir(path):
    return {}
  return {n: open(os.path.join(path, n), 'rb').read() for n in sorted(os.listdir(path))}


def _write(path, files):
  os.makedirs(path, exist_ok=True)
  for name, data in files.items():
    with open(os.path.join(path, name), 'wb') as f:
      f.write(data)


STEPS = [(os, 'rename'), (os, 'replace'), (os, 'link'), (os, 'chmod'), (os, 'mkdir')]
STEPS += [(os, 'remove'), (os, 'unlink'), (shutil, 'rmtree'), (export, '_exchange')]


def _killing(real, name: str, n: int, calls: list):
  """`real`, which kills the export when it is the n-th filesystem change (0-based)."""

  def step(*args, **kw):
    if len(calls) == n:
      raise Killed(name)
    calls.append(name)
    return real(*args, **kw)

  return step


def _publish_killed_at(n: int, steps, publish, *args) -> tuple[object, list]:
  """(what publish(*args) returned, or Killed when its n-th step was killed; the steps it
  took)."""
  calls = []
  with pytest.MonkeyPatch.context() as m:
    for module, name in steps:
      m.setattr(module, name, _killing(getattr(module, name), name, n, calls))
    try:
      return publish(*args), calls
    except Killed:
      return Killed, calls


@pytest.mark.parametrize('exchange', [True, False], ids=['exchange', 'two_renames'])
def test_a_kill_at_any_step_leaves_the_old_export_or_the_new(tmp_path, monkeypatch, exchange):
  """Every step of publishing is killed in turn: --out then holds the earlier export or the new
  one (with its owner's files), and the next export's start leaves no debris. Where the
  directories cannot be exchanged (two renames), a kill between them leaves the earlier export
  aside, which the next export puts back."""
  if not exchange:

    def refused(a, b):
      raise OSError(errno.EINVAL, 'not supported')

    monkeypatch.setattr(export, '_exchange', refused)
  monkeypatch.setattr(lease, 'pid_alive', lambda pid: False)  # the killed export's process
  old, new = {**_marked(OLD), **MINE}, {**_marked(NEW), **MINE}
  for n in range(100):
    root = tmp_path / str(n)
    out = str(root / 'exported')
    _write(out, old)
    staging = export._staging(out)
    _write(staging, _marked(NEW))
    left, calls = _publish_killed_at(n, STEPS, export.publish, staging, out)
    assert _files(out) in (old, new) or (not exchange and _files(out) == {}), calls
    if left is not Killed:
      assert _files(out) == new and _files(left) == old
      break
    export.remove_dead_staging(out)  # the next export to --out starts with this
    assert _files(out) in (old, new) and os.listdir(root) == ['exported'], calls
  assert left is not Killed and n >= 3  # (links, the exchange or renames were each killed)


def test_an_export_to_a_new_directory_is_one_rename(tmp_path):
  out = str(tmp_path / 'sub' / 'exported')
  staging = export._staging(out)
  _write(staging, NEW)
  assert export.publish(staging, out) == ''
  assert _files(out) == NEW and os.listdir(tmp_path / 'sub') == ['exported']
  assert oct(os.stat(out).st_mode & 0o777) != oct(0o700)  # (not mkdtemp's private mode)


def test_a_bucket_never_shows_new_weights_with_the_old_config(tmp_path):
  """An object store has no rename: the earlier config goes first and the new one comes last, so
  a kill leaves the earlier export, no config (nothing loads it as a model), or the new one."""
  staging = str(tmp_path / 'staging')
  _write(staging, _marked(NEW))
  steps = [(storage, 'copy'), (storage, 'remove')]
  drop = lambda files: {k: v for k, v in files.items() if k != export.MARKER}
  for n in range(100):
    out = f'memory://bucket/run{n}'
    for name, data in {**_marked(OLD), **MINE}.items():
      storage.write_atomic(storage.join(out, name), data)
    done, calls = _publish_killed_at(n, steps, export.publish_url, staging, out)
    after = {f: storage.open(storage.join(out, f), 'rb').read() for f in storage.listdir(out)}
    if 'config.json' in after:
      assert drop(after) in ({**OLD, **MINE}, {**NEW, **MINE}), calls
    # A rerun after a kill replaces what either export wrote, and nothing of the owner's.
    assert set(after) - set(MINE) <= export._exported_by(out) | {export.MARKER}, calls
    if done is not Killed:
      assert after == {**_marked(NEW), **MINE}
      break
  # The old config, the new files, the stale weights, the new config and marker.
  assert done is not Killed and n == 1 + len(NEW) + 2


HUB_COPY = {
  'config.json': b'{"model_type": "qwen3_moe"}',
  'generation_config.json': b'{}',
  'model.safetensors': b'weights',
  'tokenizer.model': b'pieces',
  'notes.txt': b'mine',
}


def test_an_export_replaces_only_an_earlier_export_of_its_kind(tmp_path):
  """A directory that no export wrote (a model copied from the Hub, a user's files) is refused
  with its files named, as is an export of the other kind; --replace replaces them. Only the
  files an export wrote (its marker) are replaced: the owner's stay."""
  hub = str(tmp_path / 'hub')
  _write(hub, HUB_COPY)
  for kind in (export.ADAPTER, export.MERGED):
    with pytest.raises(ValueError, match=r'no export wrote it; it holds config\.json, generation'):
      export.check_target(hub, kind, replace=False)
  export.check_target(hub, export.ADAPTER, replace=True)
  assert _files(hub) == HUB_COPY
  export.check_target(str(tmp_path / 'new'), export.ADAPTER, replace=False)
  (tmp_path / 'empty').mkdir()
  export.check_target(str(tmp_path / 'empty'), export.ADAPTER, replace=False)
  with pytest.raises(ValueError, match='is a file, not a directory'):
    export.check_target(os.path.join(hub, 'notes.txt'), export.MERGED, replace=False)

  adapter = {'adapter_config.json': b'{}', 'adapter_model.safetensors': b'lora'}
  out = str(tmp_path / 'out')
  _write(out, {**_marked(adapter, export.ADAPTER), **MINE})
  export.check_target(out, export.ADAPTER, replace=False)
  message = r'holds a adapter export \(adapter_config\.json, adapter_model\.safetensors\): choose'
  with pytest.raises(ValueError, match=message.replace('a adapter', 'an? adapter')):
    export.check_target(out, export.MERGED, replace=False)
  staging = export._staging(out)
  _write(staging, _marked(NEW))
  shutil.rmtree(export.publish(staging, out))
  assert _files(out) == {**_marked(NEW), **MINE}

  staging = export._staging(hub)  # --replace over a directory no export wrote: all of it goes
  _write(staging, _marked(adapter, export.ADAPTER))
  shutil.rmtree(export.publish(staging, hub))
  assert _files(hub) == _marked(adapter, export.ADAPTER)

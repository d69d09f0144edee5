"""Files of a run wherever they are: local paths through `os`, object-store URLs (gs://...)
through fsspec (gcsfs, the `gcs` extra). Orbax reaches the same URLs itself (etils.epath for
files, TensorStore for arrays).

Object stores differ from a filesystem where the run directory relies on it, and the functions
here say how each is covered: an object is replaced whole when its upload completes (so a
`write_atomic` is one upload, no rename), nothing can be appended (`AppendLog` rewrites the
object), a directory is only a name prefix (`makedirs` has nothing to do) and a rename is a copy
then a delete (used only to set checkpoints aside, never to commit one).

A local emulator of Google Cloud Storage is used when STORAGE_EMULATOR_HOST names it (the
variable Google's clients read): `use_emulator` points TensorStore there too."""

import builtins
import contextlib
import glob as glob_lib
import hashlib
import json
import math
import os
import posixpath
import shutil
import tempfile
import time

from moetrain.core import runtime

EMULATOR = 'STORAGE_EMULATOR_HOST'


def is_url(path) -> bool:
  return isinstance(path, str) and '://' in path


def use_emulator(environ=os.environ) -> None:
  """With STORAGE_EMULATOR_HOST set: TensorStore (Orbax's arrays) talks to the same endpoint
  without credentials, and gcsfs skips its bucket-layout probe (an RPC the emulators lack, which
  it retries for a minute). Called on import; settings already made are kept."""
  host = environ.get(EMULATOR, '')
  if host in ('', 'default'):
    return
  if '://' not in host:
    host = f'http://{host}'
  environ.setdefault('TENSORSTORE_GCS_HTTP_URL', host)
  environ.setdefault('GOOGLE_AUTH_TOKEN_FOR_TESTING', 'emulator')
  environ.setdefault('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT', 'false')


use_emulator()


def _unreachable(url: str, e: Exception) -> str:
  """What to say of a URL whose scheme this installation has no filesystem for: fsspec's
  ImportError names the package ('Install s3fs to access S3'), its ValueError the scheme
  ('Protocol not known: x')."""
  if isinstance(e, ImportError):
    hint = "pip install -e '.[gcs]'" if url.startswith('gs://') else str(e)
    return f'{url}: this installation cannot reach it ({e}): {hint}'
  return f'{url}: {e}'


def _fs(url: str):
  """(fsspec filesystem, path inside it) of a URL; a clear error without the package."""
  import fsspec

  try:
    # No cached listings: other hosts and Orbax's writes land behind this process's back.
    return fsspec.core.url_to_fs(url, use_listings_cache=False)
  except (ImportError, ValueError) as e:
    raise runtime.UserError(_unreachable(url, e)) from e


def check_url(path: str, flag: str) -> None:
  """Fails early, naming `flag`, when `path` is a URL of a scheme this installation has no
  filesystem for (without connecting: credentials are looked for on first use)."""
  if not is_url(path):
    return
  import fsspec

  try:
    fsspec.get_filesystem_class(path.split('://')[0])
  except (ImportError, ValueError) as e:
    raise runtime.UserError(f'{flag}: {_unreachable(path, e)}') from None


def absolute(path: str) -> str:
  """A local path made absolute (~ expanded); '' and URLs unchanged."""
  if not path or is_url(path):
    return path
  return os.path.abspath(os.path.expanduser(path))


def join(path: str, *parts: str) -> str:
  return posixpath.join(path, *parts) if is_url(path) else os.path.join(path, *parts)


def dirname(path: str) -> str:
  return posixpath.dirname(path.rstrip('/')) if is_url(path) else os.path.dirname(path)


def exists(path: str) -> bool:
  if is_url(path):
    fs, p = _fs(path)
    return fs.exists(p)
  return os.path.exists(path)


def isfile(path: str) -> bool:
  if is_url(path):
    fs, p = _fs(path)
    return fs.isfile(p)
  return os.path.isfile(path)


def isdir(path: str) -> bool:
  if is_url(path):
    fs, p = _fs(path)
    return fs.isdir(p)
  return os.path.isdir(path)


def listdir(path: str) -> list[str]:
  """The names in a directory, sorted ([] when there is none)."""
  try:
    if is_url(path):
      fs, p = _fs(path)
      return sorted(posixpath.basename(q.rstrip('/')) for q in fs.ls(p, detail=False))
    return sorted(os.listdir(path))
  except FileNotFoundError:
    return []


def walk_files(path: str) -> list[str]:
  """Every file under a directory, relative to it, sorted."""
  if is_url(path):
    fs, p = _fs(path)
    return sorted(posixpath.relpath(q, p) for q in fs.find(p))
  out = []
  for root, _, files in os.walk(path):
    out += [os.path.relpath(os.path.join(root, f), path) for f in files]
  return sorted(out)


def getsize(path: str) -> int:
  if is_url(path):
    fs, p = _fs(path)
    return int(fs.size(p))
  return os.path.getsize(path)


def getmtime(path: str) -> float:
  if is_url(path):
    fs, p = _fs(path)
    return fs.modified(p).timestamp()
  return os.path.getmtime(path)


def stamp(path: str) -> list:
  """What changes whenever a file is written: a local file's size, mtime, ctime and inode (the
  kernel sets ctime on every write and no call sets it back, so a rewrite that restores the
  size and the mtime still changes it; a copy or rename of another file changes the inode); an
  object's size and generation (every upload makes a new one)."""
  if is_url(path):
    fs, p = _fs(path)
    info = fs.info(p)
    version = info.get('generation') or info.get('etag') or info.get('mtime') or ''
    return [int(info['size']), str(version)]
  st = os.stat(path)
  return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def makedirs(path: str) -> None:
  """A directory and its parents (nothing to do on an object store: names are prefixes)."""
  if not is_url(path):
    os.makedirs(path, exist_ok=True)


def open(path: str, mode: str = 'r'):  # noqa: A001 (the module's open, as os.path's functions)
  if is_url(path):
    fs, p = _fs(path)
    return fs.open(p, mode)
  return builtins.open(path, mode)


def read_text(path: str) -> str:
  with open(path) as f:
    return f.read()


def read_range(path: str, start: int, end: int) -> bytes:
  """Bytes [start, end) of a file: one ranged request for an object (an fsspec file would read
  ahead a whole block)."""
  if is_url(path):
    fs, p = _fs(path)
    return fs.cat_file(p, start, end)
  with builtins.open(path, 'rb') as f:
    f.seek(start)
    return f.read(end - start)


@contextlib.contextmanager
def naming(path: str):
  """An OSError inside (a full disk: "[Errno 28] No space left on device") names `path` when it
  names no file itself."""
  try:
    yield
  except OSError as e:
    if e.filename is not None or e.errno is None:
      raise
    raise type(e)(e.errno, e.strerror, path) from e


def write_atomic(path: str, data: str | bytes) -> None:
  """Replaces `path` by `data` so that a reader sees the old or the new, never a part: a
  temporary file beside it renamed over it, or one upload (an object appears whole)."""
  data = data.encode() if isinstance(data, str) else data
  if is_url(path):
    fs, p = _fs(path)
    fs.pipe_file(p, data)
    return
  makedirs(os.path.dirname(path) or '.')
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or '.', prefix=f'.{os.path.basename(path)}.')
  try:
    with naming(path), os.fdopen(fd, 'wb') as f:
      f.write(data)
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


def create_exclusive(path: str, text: str) -> bool:
  """Creates `path` holding `text` unless it exists (False then): O_EXCL, or an upload on the
  condition that no object has the name (ifGenerationMatch=0)."""
  if is_url(path):
    fs, p = _fs(path)
    if fs.exists(p):  # (emulators ignore the upload's condition: this covers them)
      return False
    try:
      with fs.open(p, 'xb') as f:
        f.write(text.encode())
    except FileExistsError:
      return False
    return True
  try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    return False
  with os.fdopen(fd, 'w') as f:
    f.write(text)
  return True


def remove(path: str) -> None:
  """Removes a file."""
  if is_url(path):
    fs, p = _fs(path)
    fs.rm(p)
  else:
    os.remove(path)


def copy(src: str, dst: str) -> None:
  """Copies a file; either may be a URL (an object appears whole when its upload ends)."""
  if not is_url(src) and not is_url(dst):
    shutil.copyfile(src, dst)
    return
  with open(src, 'rb') as f, open(dst, 'wb') as g:
    shutil.copyfileobj(f, g, 16 << 20)


def move(src: str, dst: str) -> None:
  """Moves a file or directory. On an object store a copy of every object, then the deletes:
  not atomic, so it is never how something is committed."""
  if is_url(src) and is_url(dst):
    fs, p = _fs(src)
    _, q = _fs(dst)
    fs.copy(p, q, recursive=True)
    fs.rm(p, recursive=True)
  elif is_url(src) or is_url(dst):  # a file between a machine and a bucket
    copy(src, dst)
    remove(src)
  else:
    os.rename(src, dst)


def glob(pattern: str) -> list[str]:
  """The files a pattern matches ('**' any number of directories), sorted; URLs keep their
  scheme."""
  if is_url(pattern):
    fs, p = _fs(pattern)
    scheme = pattern.split('://')[0]
    return sorted(f'{scheme}://{q}' for q in fs.glob(p) if fs.isfile(q))

  return sorted(p for p in glob_lib.glob(pattern, recursive=True) if os.path.isfile(p))


CACHE = '~/.cache/moetrain/objects'


def local_copy(url: str, cache: str = CACHE) -> str:
  """A local copy of the object at `url`, downloaded once into `cache` and again only when the
  object changes (its size or generation); a local path is returned as it is. For files read
  record by record (training data), which would otherwise cost a request per record."""
  if not is_url(url):
    return url

  fs, p = _fs(url)
  info = fs.info(p)
  stamp = {'url': url, 'size': int(info['size'])}
  stamp['version'] = str(info.get('generation') or info.get('mtime') or info.get('etag') or '')
  directory = os.path.join(os.path.expanduser(cache), hashlib.sha256(url.encode()).hexdigest()[:16])
  path, record = (os.path.join(directory, posixpath.basename(p)) + x for x in ('', '.source'))
  try:
    with builtins.open(record) as f:
      if json.load(f) == stamp and os.path.getsize(path) == stamp['size']:
        return path
  except (OSError, ValueError):
    pass
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory)
  with os.fdopen(fd, 'wb') as f, fs.open(p, 'rb') as g:
    shutil.copyfileobj(g, f, 16 << 20)
  os.replace(tmp, path)
  write_atomic(record, json.dumps(stamp))
  return path


class AppendLog:
  """A text file lines are appended to: a file opened for appending, or, on an object store
  (which cannot append), the object rewritten whole with what it held plus the new lines, at
  most every `every` seconds and on flush(force=True) and close()."""

  def __init__(self, path: str, every: float = 30.0):
    self.path, self.every = path, every
    if is_url(path):  # what the object holds, then the lines since (joined at each rewrite)
      self._parts = [read_text(path)] if exists(path) else []
      self._file, self._dirty, self._last = None, False, -math.inf
    else:
      self._file = open(path, 'a')

  def write(self, text: str) -> None:
    if self._file is not None:
      with naming(self.path):
        self._file.write(text)
    else:
      self._parts.append(text)
      self._dirty = True

  def flush(self, force: bool = False) -> None:
    if self._file is not None:
      with naming(self.path):
        self._file.flush()
      return
    now = time.monotonic()
    if self._dirty and (force or now - self._last >= self.every):
      self._parts = [''.join(self._parts)]
      write_atomic(self.path, self._parts[0])
      self._dirty, self._last = False, now

  def close(self) -> None:
    if self._file is not None:
      with naming(self.path):
        self._file.close()
    else:
      self.flush(force=True)

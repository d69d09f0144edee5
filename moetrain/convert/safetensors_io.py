"""Safetensors files read slice by slice and written tensor by tensor, with bounded host memory."""

import json
import math
import os
import re
import struct

import ml_dtypes
import numpy as np
from safetensors import safe_open

from moetrain.core import storage

SINGLE = 'model.safetensors'
INDEX = 'model.safetensors.index.json'
# Importing ml_dtypes registers bfloat16 with numpy, which lets safe_open(framework='numpy')
# return bf16 tensors and slices as ml_dtypes arrays instead of failing.
DTYPES = {'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'BF16': ml_dtypes.bfloat16}
# Integer tensors: read only by name (Reader.read_int: packed int4 codes, their shapes) and
# written by exports that pack them (compressed_int4.py).
INT_DTYPES = {'I32': np.int32, 'I64': np.int64}
# Every dtype a tensor is read in as stored (Reader.read_stored): float8_e4m3fn, which
# safe_open's numpy backend cannot build (block-scaled FP8 weights: block_fp8.py), and uint8.
STORED_DTYPES = {**DTYPES, **INT_DTYPES, 'F8_E4M3': ml_dtypes.float8_e4m3fn, 'U8': np.uint8}
DTYPE_NAMES = {np.dtype(v): k for k, v in STORED_DTYPES.items()}
_SHARD = re.compile(r'^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$')


class Reader:
  """The tensors of `single` or of the shards listed in `index`, in `directory`.

  Files are memory-mapped and `read(name, index)` copies only the requested slice, so host
  memory is the slice, not the file (a 5 GB shard costs nothing until read).
  """

  def __init__(self, directory: str, single: str = SINGLE, index: str | None = INDEX):
    self.directory, self.index = directory, index
    index_path = storage.join(directory, index) if index else None
    if storage.exists(storage.join(directory, single)):
      files = [single]
      self.files = None
    elif index_path and storage.exists(index_path):
      try:
        weight_map = json.loads(storage.read_text(index_path))['weight_map']
        self.files = dict(weight_map)
      except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(
          f'{index_path}: not a safetensors index (a JSON object with a "weight_map" of tensor '
          f'name -> file): {e!r}'
        ) from e
      files = sorted(set(weight_map.values()))
    else:
      raise FileNotFoundError(f'{directory} holds neither {single} nor {index}')
    self._handles = {name: _open(storage.join(directory, name)) for name in files}
    self._ranged = {}  # local files read by byte ranges (read_stored)
    if self.files is None:
      self.files = {k: single for k in self._handles[single].keys()}

  def keys(self) -> list[str]:
    return list(self.files)

  def __contains__(self, name: str) -> bool:
    return name in self.files

  def _slice(self, name: str):
    try:
      return self._handles[self.files[name]].get_slice(name)
    except Exception as e:  # safetensors raises its own SafetensorError
      if name in self._handles[self.files[name]].keys():
        raise
      raise ValueError(
        f'{name}: listed in {self.directory}/{self.index} under {self.files[name]}, which does '
        'not hold it (a stale or mismatched index?)'
      ) from e

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._slice(name).get_shape())

  def dtype(self, name: str) -> str:
    return self._slice(name).get_dtype()

  def read(self, name: str, index=None) -> np.ndarray:
    """The tensor, or the part selected by a tuple of slices (one per leading dimension)."""
    dt = self.dtype(name)
    if dt not in DTYPES:
      raise ValueError(
        f'{name} in {self.path(name)}: dtype {dt} is not supported (only {sorted(DTYPES)}; '
        'float8 weights are read with their weight_scale_inv)'
      )
    sl = self._slice(name)
    x = np.asarray(sl[tuple(index)] if index else sl[:])
    if not finite(x):
      raise ValueError(
        f'{name} in {storage.join(self.directory, self.files[name])} holds non-finite values '
        '(NaN or infinity): the checkpoint is damaged or was saved from a diverged run'
      )
    return x

  def read_int(self, name: str, index=None) -> np.ndarray:
    """An integer tensor (or the part `index` selects), which `read` refuses."""
    if (dt := self.dtype(name)) not in INT_DTYPES:
      raise ValueError(
        f'{name} in {self.path(name)}: dtype {dt}, expected one of {sorted(INT_DTYPES)}'
      )
    sl = self._slice(name)
    return np.asarray(sl[tuple(index)] if index else sl[:])

  def read_stored(self, name: str, index=None) -> np.ndarray:
    """The tensor (or the part `index` selects) in its stored dtype, whichever of
    STORED_DTYPES it is, read by byte ranges: only the rows of the first dimension asked for."""
    file = self.files[name]
    if not isinstance(handle := self._handles[file], RemoteFile):
      if file not in self._ranged:  # a local file: its header once, then ranged reads
        self._ranged[file] = RemoteFile(self.path(name))
      handle = self._ranged[file]
    sl = handle.get_slice(name)
    return np.asarray(sl[tuple(index)] if index else sl[:])

  def path(self, name: str) -> str:
    """The file that holds tensor `name`."""
    return storage.join(self.directory, self.files[name])


def finite(x: np.ndarray) -> bool:
  """Whether every number of a float array is finite (True for other arrays). bfloat16 is read
  as its bits (an exponent of all ones is NaN or infinity): numpy has no fast isfinite for it
  (about 2 GB/s this way, 3x ml_dtypes' ufunc); the others take numpy's own (about 8 GB/s)."""
  if x.dtype == ml_dtypes.bfloat16:
    return not np.any((x.view(np.uint16) & 0x7F80) == 0x7F80)
  return not np.issubdtype(x.dtype, np.floating) or bool(np.isfinite(x).all())


def is_model_file(name: str) -> bool:
  """model.safetensors, a model-0000k-of-0000n.safetensors shard, or their index."""
  return _SHARD.match(name) is not None


def _open(path: str):
  if not storage.isfile(path):
    raise FileNotFoundError(f'{path} does not exist (listed in the safetensors index)')
  try:
    return RemoteFile(path) if storage.is_url(path) else safe_open(path, framework='numpy')
  except Exception as e:  # SafetensorError: truncated, not safetensors, a Git LFS pointer
    raise ValueError(f'{path} is not a readable safetensors file: {e}') from e


class RemoteFile:
  """A safetensors file in a bucket, read as safe_open reads a local one (keys, get_slice) but
  by byte ranges: the header once, then for each read the rows of the first dimension it selects
  (the rest is selected on the host). A 5 GB shard is never downloaded whole. A local file is
  read this way too for the dtypes safe_open's numpy backend cannot build (read_stored)."""

  def __init__(self, path: str):
    self.path = path
    size = storage.getsize(path)
    (n,) = struct.unpack('<Q', storage.read_range(path, 0, 8))
    if n > min(100 << 20, size - 8):
      raise ValueError(f'header of {n} bytes in a file of {size} bytes')
    self._header = json.loads(storage.read_range(path, 8, 8 + n))
    self._header.pop('__metadata__', None)
    self._start = 8 + n
    for name, info in self._header.items():  # as safe_open checks a local file's
      start, end = info['data_offsets']
      if not 0 <= start <= end <= size - self._start:
        raise ValueError(
          f"{name}: data offsets {[start, end]} past the end of the file's "
          f'{size - self._start} data bytes'
        )

  def keys(self) -> list[str]:
    return sorted(self._header)  # (as safe_open lists them)

  def get_slice(self, name: str) -> '_RemoteSlice':
    if name not in self._header:
      raise KeyError(f'{self.path} holds no tensor {name!r}')
    return _RemoteSlice(self, self._header[name])

  def read_bytes(self, start: int, end: int) -> bytes:
    return storage.read_range(self.path, self._start + start, self._start + end)


class _RemoteSlice:
  def __init__(self, file: RemoteFile, info: dict):
    self.file, self.info = file, info

  def get_shape(self) -> list[int]:
    return list(self.info['shape'])

  def get_dtype(self) -> str:
    return self.info['dtype']

  def __getitem__(self, index) -> np.ndarray:
    shape, dtype = tuple(self.info['shape']), np.dtype(STORED_DTYPES[self.info['dtype']])
    index = index if isinstance(index, tuple) else (index,)
    start, end = self.info['data_offsets']
    first = index[0] if index else slice(None)
    rows = range(shape[0])[first] if shape and isinstance(first, slice) else None
    if rows is not None and rows.step == 1:  # only the rows asked for
      row = math.prod(shape[1:]) * dtype.itemsize
      lo, n = rows.start, len(rows)
      raw = self.file.read_bytes(start + lo * row, start + (lo + n) * row)
      arr = np.frombuffer(raw, dtype).reshape((n, *shape[1:]))
      return arr[(slice(None), *index[1:])]
    arr = np.frombuffer(self.file.read_bytes(start, end), dtype).reshape(shape)
    return arr[index]


def plan_shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
  """Consecutive groups of tensor indices, each at most max_bytes (a larger tensor goes alone)."""
  groups, cur, total = [], [], 0
  for i, n in enumerate(sizes):
    if cur and total + n > max_bytes:
      groups.append(cur)
      cur, total = [], 0
    cur.append(i)
    total += n
  return groups + ([cur] if cur else [])


def _header(specs) -> bytes:
  head, offset = {}, 0
  for name, shape, dtype in specs:
    n = math.prod(shape) * np.dtype(dtype).itemsize
    head[name] = {
      'dtype': DTYPE_NAMES[np.dtype(dtype)],
      'shape': list(shape),
      'data_offsets': [offset, offset + n],
    }
    offset += n
  head['__metadata__'] = {'format': 'pt'}  # transformers refuses files without it
  raw = json.dumps(head, separators=(',', ':')).encode()
  return raw + b' ' * (-len(raw) % 8)


def write_file(path: str, specs, produce, writable: bool = True) -> None:
  """One safetensors file of `specs` [(name, shape, dtype)]: the header is written first from the
  specs, then `produce(i)` is called for each tensor in order and its bytes appended, so only one
  tensor is on the host at a time. When not `writable` (processes other than 0) `produce` still
  runs, because it may be a collective, and nothing is written."""
  f = open(path, 'wb') if writable else None
  try:
    if f:
      head = _header(specs)
      f.write(struct.pack('<Q', len(head)) + head)
    for i, (name, shape, dtype) in enumerate(specs):
      arr = np.ascontiguousarray(produce(i), dtype=dtype)
      if arr.shape != tuple(shape):
        raise ValueError(f'{name}: produced shape {arr.shape}, planned {tuple(shape)}')
      if f:
        f.write(arr.reshape(-1).view(np.uint8).data)  # no copy of the tensor
  finally:
    if f:
      f.close()


def write_sharded(out_dir: str, specs, produce, max_shard_bytes: int, writable: bool = True):
  """Writes `specs` as model.safetensors, or as model-0000k-of-0000n.safetensors shards plus
  model.safetensors.index.json when they exceed max_shard_bytes, one tensor at a time.

  Old model*.safetensors files in out_dir are removed first: a stale single file would shadow a
  new index in transformers. Returns the weight map {name: file}.
  """
  sizes = [math.prod(s) * np.dtype(d).itemsize for _, s, d in specs]
  groups = plan_shards(sizes, max_shard_bytes)
  if writable:
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):
      if is_model_file(f):
        os.remove(os.path.join(out_dir, f))
  n, weight_map = len(groups), {}
  for k, group in enumerate(groups):
    fname = SINGLE if n == 1 else f'model-{k + 1:05d}-of-{n:05d}.safetensors'
    write_file(
      os.path.join(out_dir, fname),
      [specs[i] for i in group],
      lambda j, group=group: produce(group[j]),
      writable,
    )
    weight_map.update({specs[i][0]: fname for i in group})
  if writable and n > 1:
    with open(os.path.join(out_dir, INDEX), 'w') as f:
      json.dump({'metadata': {'total_size': sum(sizes)}, 'weight_map': weight_map}, f, indent=2)
  return weight_map

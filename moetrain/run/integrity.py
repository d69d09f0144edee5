"""Checksums of a checkpoint's files, written with it and verified before it is restored; content
fingerprints of a run's inputs."""

import concurrent.futures
import hashlib
import json
import zlib

from moetrain.core import storage

MANIFEST = 'moetrain_manifest.json'
CHUNK = 4 << 20
# Reads of several files overlap: zlib.crc32 releases the GIL on large buffers.
THREADS = 4


def checksum(path: str) -> tuple[int, str]:
  """(size, CRC-32 as 8 hex digits) of a file, read in chunks. CRC-32 finds the damage of copies
  and storage (zeroed, cut or flipped bytes); nobody forges a checkpoint."""
  crc, size = 0, 0
  with storage.open(path, 'rb') as f:
    while chunk := f.read(CHUNK):
      crc, size = zlib.crc32(chunk, crc), size + len(chunk)
  return size, f'{crc:08x}'


def item_files(step_dir: str) -> list[str]:
  """The files of a checkpoint's items (its subdirectories), relative to `step_dir`, sorted.
  Files at its top are left out: Orbax writes them (commit_success.txt) or rewrites them (the
  commit time in _CHECKPOINT_METADATA) after the manifest."""
  out = []
  for item in storage.listdir(step_dir):
    top = storage.join(step_dir, item)
    if storage.isdir(top):
      out += [f'{item}/{f}' for f in storage.walk_files(top)]
  return sorted(out)


def _checksums(step_dir: str, files: list[str]) -> list[tuple[int, str]]:
  with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
    return list(pool.map(lambda f: checksum(storage.join(step_dir, f)), files))


def write_manifest(step_dir: str) -> None:
  """Writes MANIFEST into `step_dir` once all its items are written (tmp + rename: a reader
  never sees half a manifest)."""
  files = item_files(step_dir)
  sums = _checksums(step_dir, files)
  manifest = {'files': {f: {'size': n, 'crc32': c} for f, (n, c) in zip(files, sums)}}
  storage.write_atomic(storage.join(step_dir, MANIFEST), json.dumps(manifest, indent=0))


def read_manifest(step_dir: str) -> dict | None:
  """{file: {'size', 'crc32'}} of a checkpoint, or None when it has none (written before moetrain
  wrote manifests, or with train.verify_checkpoints off). ValueError if it cannot be read."""
  path = storage.join(step_dir, MANIFEST)
  if not storage.exists(path):
    return None
  try:
    return dict(json.loads(storage.read_text(path))['files'])
  except (ValueError, KeyError, TypeError) as e:  # (JSONDecodeError is a ValueError)
    raise ValueError(f'{MANIFEST}: unreadable ({type(e).__name__})') from e


def problems(step_dir: str, manifest: dict, part: int = 0, parts: int = 1) -> list[str]:
  """What is wrong with the files of `manifest` in `step_dir` ([] when all match); checks every
  `parts`-th file from the `part`-th, so that several processes share the reading."""
  out, present = [], []
  for f in sorted(manifest)[part::parts]:
    path = storage.join(step_dir, f)
    if not storage.isfile(path):
      out.append(f'{f}: missing')
    elif (size := storage.getsize(path)) != manifest[f]['size']:
      out.append(f'{f}: {size} bytes, {manifest[f]["size"]} were written')
    else:
      present.append(f)
  for f, (_, crc) in zip(present, _checksums(step_dir, present)):
    if crc != manifest[f]['crc32']:
      out.append(f'{f}: checksum {crc}, {manifest[f]["crc32"]} was written')
  return out


# Content fingerprints of a run's inputs (its tokenizer and data files), recorded in the run
# directory and compared on a resume (rundir.check_inputs). SHA-256 in 8 MiB reads: about 1.9
# GB/s on one core here (hashlib releases the GIL, so files hash in parallel), faster than
# BLAKE2b (1.3 GB/s) where the CPU has SHA extensions.
HASH_CHUNK = 8 << 20


def content_hash(path: str) -> str:
  """SHA-256 of a file's bytes, as hex."""
  h = hashlib.sha256()
  with storage.open(path, 'rb') as f:
    while chunk := f.read(HASH_CHUNK):
      h.update(chunk)
  return h.hexdigest()


def fingerprints(paths: list[str], known: dict | None = None) -> dict:
  """{path: {'stamp': storage.stamp, 'sha256': content_hash}} of `paths`. A file whose stamp
  equals its entry in `known` keeps that entry (it is not read again): the stamp changes with
  every write (storage.stamp), so only files written since are hashed. The stamp is taken
  before the read: a file written during it is hashed again next time."""
  known = known or {}
  stamps = {p: storage.stamp(p) for p in paths}
  out = {p: known[p] for p in paths if known.get(p, {}).get('stamp') == stamps[p]}
  todo = [p for p in paths if p not in out]
  with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
    for p, digest in zip(todo, pool.map(content_hash, todo)):
      out[p] = {'stamp': stamps[p], 'sha256': digest}
  return {p: out[p] for p in paths}

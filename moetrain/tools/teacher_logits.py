"""Writes the teacher's top-k logits for every scored position of a run's training stream, in the
order its trainer reads them, for distillation without the teacher in the step.

  python -m moetrain.tools.teacher_logits --config=configs/distill.py --out=DIR [--top_k=32]
  python -m moetrain.main --config=configs/distill.py --config.distill.teacher_logits=DIR

--config is the run's config (its distill.teacher, data and train.steps); k is --top_k, else
distill.top_k. Each host writes its rows as ArrayRecord shards (moetrain/distill/logits.py); a
killed run continues after its last whole shard when rerun; the manifest is written last, and a
rerun with other settings replaces an unfinished write. Prints the bytes per scored position.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.experimental import multihost_utils
from ml_collections import config_flags

from moetrain.core import runtime, sharding, storage
from moetrain.data import loader
from moetrain.distill import logits as logits_lib
from moetrain.distill import teacher as teacher_lib
from moetrain.kernels import distill as kd
from moetrain.run import rundir, startup
from moetrain.run.evaluation import to_global
from moetrain.training.train_state import abstract_teacher, merge_teacher, state_shardings

STEPS_PER_SHARD = 50


def define_flags():
  config_flags.DEFINE_config_file('config', None, 'The distillation run to write logits for.')
  flags.DEFINE_string('out', None, 'Output directory.')
  flags.DEFINE_integer('top_k', 0, 'Tokens kept per position (default distill.top_k).')
  flags.DEFINE_integer('steps_per_shard', STEPS_PER_SHARD, 'Training steps per shard file.')
  runtime.define_process_flags()


def top_k_fn(cfg, k: int, chunk: int):
  """(teacher weights, batch) -> (ids, log-probabilities) [B, T, k], the head in blocks of
  `chunk` positions (the whole [B, T, V] logits never exist)."""

  @jax.jit
  def fn(weights, batch):
    model = merge_teacher(cfg, weights)
    h_BTD, _ = model.features(batch['inputs'], batch['positions'], batch['segment_ids'])
    t = h_BTD.shape[1]
    c = chunk if 0 < chunk < t else t
    blocks = kd._split(h_BTD, c)
    ids_U, logp_U = jax.lax.map(
      lambda h: kd.teacher_top(model.lm_head(h).astype(jnp.float32), k), blocks
    )
    whole = lambda x: x.swapaxes(0, 1).reshape(x.shape[1], -1, k)[:, :t]
    return whole(ids_U), whole(logp_U)

  return fn


def _setup(config, top_k: int):
  setup = startup.build(rundir.with_absolute_paths(config))
  d = setup.distill
  if not d.enabled:
    raise ValueError('distill.teacher is empty: name the teacher whose logits to write')
  k = top_k or d.top_k
  if k <= 0:
    raise ValueError('--top_k (or distill.top_k) must be positive: the tokens kept per position')
  d = dataclasses.replace(d, top_k=k, teacher_logits='')
  return dataclasses.replace(setup, distill=d), k


def _read(path: str) -> dict | None:
  return json.loads(storage.read_text(path)) if storage.isfile(path) else None


def _start(out: str, want: dict, process: int) -> None:
  """Readies --out for the logits `want` describes. A complete cache of them is kept, and an
  unfinished write of them (a killed run's) goes on. A complete cache of other settings is
  refused; one written from inputs that have since changed (stale), or an unfinished write of
  other settings (a failed run's), is replaced: no run can read either. The manifest is written
  when every shard is (_finish); until then PENDING holds it."""
  have = _read(storage.join(out, logits_lib.MANIFEST))
  pending = _read(storage.join(out, logits_lib.PENDING))
  problem = logits_lib.difference(have or pending or want, want)
  if have is not None and problem and not problem.startswith(logits_lib.STALE):
    raise ValueError(f'--out={out!r} holds logits {problem}; choose another --out')
  multihost_utils.sync_global_devices('teacher_logits_read')  # (before the primary writes)
  if (have is not None or pending is not None) and not problem:
    return
  _clear(out, process)
  if runtime.is_primary():
    if problem:
      what = 'logits' if have is not None else 'an unfinished write of logits'
      print(f'--out={out} holds {what} {problem}: writing them anew', flush=True)
    storage.makedirs(out)
    if have is not None:
      storage.remove(storage.join(out, logits_lib.MANIFEST))
    storage.write_atomic(storage.join(out, logits_lib.PENDING), json.dumps(want, indent=1))
  multihost_utils.sync_global_devices('teacher_logits_start')


def _finish(out: str, want: dict) -> None:
  """Every host's shards are whole: the manifest makes the logits readable."""
  multihost_utils.sync_global_devices('teacher_logits_done')
  if runtime.is_primary():
    storage.write_atomic(storage.join(out, logits_lib.MANIFEST), json.dumps(want, indent=1))
    if storage.isfile(pending := storage.join(out, logits_lib.PENDING)):
      storage.remove(pending)


def _clear(out: str, process: int) -> None:
  """Removes this host's shards and their done markers."""
  host = storage.dirname(logits_lib.shard_path(out, process, 0))
  if storage.isdir(host):
    for name in storage.listdir(host):
      if name.startswith('shard-'):
        storage.remove(storage.join(host, name))


def _done(out: str, process: int, shards: int) -> tuple[int, dict | None]:
  """(the whole shards this host has written, the data position after the last)."""
  n, position = 0, None
  while n < shards and storage.isfile(logits_lib.shard_path(out, process, n, done=True)):
    position = json.loads(storage.read_text(logits_lib.shard_path(out, process, n, done=True)))
    n += 1
  return n, position


def write(config, out: str, top_k: int = 0, steps_per_shard: int = STEPS_PER_SHARD) -> dict:
  """Writes (or finishes) the logits; returns {'positions', 'bytes', 'bytes_per_position'}."""
  from array_record.python.array_record_module import ArrayRecordWriter

  setup, k = _setup(config, top_k)
  process, count = jax.process_index(), jax.process_count()
  want = logits_lib.manifest(setup, k, steps_per_shard, count)
  _start(out, want, process)
  mesh = setup.make_mesh()
  # The teacher's weights as loaded, in layer order.
  cfg = startup.without_repeats(teacher_lib.model_config(setup.distill, setup.model))
  shards = -(-setup.train.steps // steps_per_shard)
  done, position = _done(out, process, shards)
  tokenizer = loader.make_tokenizer(setup.data, None)
  it = loader.make_train_iterator(setup.data, tokenizer, process_index=process, process_count=count)
  if position is not None:
    it.set_state(position)
  stats = {'positions': 0, 'bytes': 0}
  with jax.set_mesh(mesh):
    weights = startup.load_teacher(
      setup.distill, cfg, mesh, state_shardings(abstract_teacher(cfg), mesh, cfg.engine.rules)
    )
    fn, rows = top_k_fn(cfg, k, setup.model.engine.loss_chunk), sharding.batch_sharding(mesh)
    for shard in range(done, shards):
      path = logits_lib.shard_path(out, process, shard)
      storage.makedirs(storage.dirname(path))
      writer = ArrayRecordWriter(path, 'group_size:1')
      for _ in range(min(steps_per_shard, setup.train.steps - shard * steps_per_shard)):
        batch = next(it)
        ids, logp = fn(weights, to_global(batch, rows))
        local = multihost_utils.global_array_to_host_local_array
        ids, logp = (np.asarray(local(x, mesh, rows.spec)) for x in (ids, logp))
        record = logits_lib.encode(batch['loss_mask'], ids, logp)
        writer.write(record)
        stats['positions'] += int((batch['loss_mask'] > 0).sum())
        stats['bytes'] += len(record)
      writer.close()
      storage.write_atomic(
        logits_lib.shard_path(out, process, shard, done=True), json.dumps(it.get_state())
      )
      if runtime.is_primary():
        print(f'shard {shard + 1}/{shards} written', flush=True)
  it.close()
  _finish(out, want)
  stats['bytes_per_position'] = stats['bytes'] / max(stats['positions'], 1)
  return stats


def main(argv):
  del argv
  runtime.start_command(preemption=False)
  f = flags.FLAGS
  if not f.out:
    raise ValueError('--out is required: the directory to write the logits into')
  stats = write(f.config, f.out, f.top_k, f.steps_per_shard)
  if runtime.is_primary():
    print(
      f'{stats["positions"]} scored positions, {stats["bytes"]} bytes: '
      f'{stats["bytes_per_position"]:.1f} bytes per position (this host; top-k ids int32 and '
      'log-probabilities float32)'
    )


if __name__ == '__main__':
  define_flags()
  app.run(runtime.short_errors(main), flags_parser=runtime.parse_flags)

"""Orbax checkpoints of the train state (without the frozen base), data position and config.

Orbax writes each step into a temporary directory and renames it when complete, so a crash or
kill mid-save leaves the previous checkpoint as the latest valid one. Each carries the checksums
of its files (integrity.MANIFEST), checked before it is restored.
"""

import contextlib

import jax
import orbax.checkpoint as ocp
from absl import logging

from moetrain.core import multihost, runtime, storage
from moetrain.model import stages
from moetrain.run import integrity, rundir

# A checkpoint's meta entry: the (stages, repeats) order its stacked layers are stored in.
LAYERS = 'layer_order'


def _key(path) -> str:
  return '.'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


def flatten(tree) -> dict:
  """{'params.layers.attn_0.q_a.lora_a.value': array, ...}: a layout that does not depend on
  how nnx or optax classes flatten, so checkpoints restore into any equal-shaped state."""
  return {_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflatten_like(tree, flat: dict):
  paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  missing = [_key(p) for p, _ in paths if _key(p) not in flat]
  if missing:
    raise ValueError(
      f'checkpoint lacks {len(missing)} arrays the run needs, e.g. {missing[:3]}; '
      'was it written by a run with a different model or LoRA config?'
    )
  return jax.tree_util.tree_unflatten(treedef, [flat[_key(p)] for p, _ in paths])


def data_positions(saved: dict) -> list[dict]:
  """Every process's data position in a checkpoint's data item."""
  # Checkpoints written before per-process positions held the one process's state itself.
  return saved['processes'] if 'processes' in saved else [saved]


def process_data_state(saved: dict, reslice: bool = False) -> dict | None:
  """This process's entry of the per-process data positions a checkpoint holds. A checkpoint of
  another number of processes is refused, or with `reslice` (data.reslice_on_resume) gives None:
  the data then starts afresh in the new count's slices."""
  states = data_positions(saved)
  if len(states) == jax.process_count():
    return states[jax.process_index()]
  if reslice:
    return None
  raise ValueError(
    f'the checkpoint holds the data positions of {len(states)} processes, this run has '
    f'{jax.process_count()}: each host reads its own slice of the data, so resume with '
    f'{len(states)} processes, or start a new --workdir, or pass '
    f'--config.data.reslice_on_resume=True to go on with the data re-sliced for '
    f'{jax.process_count()}: it then restarts from its first example (data.num_epochs counts '
    'again)'
  )


SET_ASIDE = 'checkpoints_set_aside'  # in the run directory: train.resume_step moves newer ones


class DamagedCheckpoint(ValueError):
  """A checkpoint that cannot be restored; the message names it and the one to fall back to."""


def _innermost(e: BaseException) -> str:
  """The first line of the innermost exception in `e`'s chain: the one that says what failed
  (Orbax wraps it in one that prints the whole TensorStore spec)."""
  for _ in range(20):  # (a chain can loop)
    if (inner := e.__cause__ or e.__context__) is None:
      break
    e = inner
  line = (str(e).splitlines() or [''])[0]
  if len(line) > 300:  # (the cause is at the end: "... Failed to write: No space left on device")
    line = f'{line[:120]} ... {line[-180:]}'
  return f'{type(e).__name__}: {line}'


class SaveFailed(runtime.UserError):
  """A checkpoint save that failed (a full disk, say): the run stops at once, naming it."""


class Checkpointer:
  def __init__(
    self,
    workdir: str,
    *,
    every: int,
    keep: int,
    async_save: bool = True,
    verify: bool = True,
    layers: tuple[int, int] = (1, 1),
  ):
    """verify (train.verify_checkpoints): write each checkpoint's checksums and check them before
    a restore; without, neither (a checkpoint without checksums is restored unchecked).
    layers: the order the state's stacked layers are stored in (model.pipeline.layout), written
    into each checkpoint; a restore moves a checkpoint's layers from its order into this one."""
    self.layers = tuple(layers)
    self.directory = storage.join(rundir.run_dir(workdir), 'checkpoints')
    # Orbax's default policy also saves the first step a manager sees (InitialSavePolicy): for a
    # large model that is an unrequested full save at step 1 of every run and every resume.
    policy = ocp.checkpoint_managers.AnySavePolicy(
      [
        ocp.checkpoint_managers.FixedIntervalPolicy(max(every, 1)),
        ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
      ]
    )
    # Saves are always asynchronous (a synchronous one waits for it): Orbax runs the
    # post-finalization callback only there, on process 0 once every process has written its
    # files and before the temporary directory is renamed, so the checksums commit with them.
    options = ocp.CheckpointManagerOptions(
      save_decision_policy=policy,
      max_to_keep=keep,
      enable_async_checkpointing=True,
      async_options=ocp.AsyncOptions(
        post_finalization_callback=self._write_manifest if verify else None
      ),
      create=False,  # save() makes the directory: a run that fails before it writes nothing
    )
    self.manager = ocp.CheckpointManager(
      self.directory, options=options, item_names=('state', 'data', 'meta')
    )
    self.async_save, self.verify = async_save, verify
    self._saving, self._verified = None, set()
    self._pending = None  # the step whose save is in flight
    self._preempted = False
    self._positions = multihost.Exchange('data_positions')
    self._verdicts = multihost.Exchange('checkpoint_damage')
    self._saves_done = multihost.Exchange('saves_done')
    self._save_errors = multihost.Exchange('save_errors')

  def watch_preemption(self) -> None:
    """From here on a stop request makes the training loop save and stop (`preempted`). Only
    the loop calls this. One process: SIGTERM or Ctrl-C, through the handlers the command's
    entry point installed (runtime.handle_stop_signals). Several: JAX's preemption service
    (started by jax.distributed.initialize) catches SIGTERM on any host and all hosts agree on
    the step to stop at (`reached_preemption`). The service picks the step after the highest one
    any host has reported, so report the step a resumed run starts from now: a notice during its
    start-up then stops it at its first step instead of at a step number it has passed.
    (`python -m moetrain.main` reported it already on joining the job,
    runtime.initialize_distributed; this covers train.run called from Python.)"""
    if self.manager.reached_preemption(self.latest_step() or 0):
      self._preempted = True

  def preempted(self, step: int) -> bool:
    """True at the step every process stops at; call it at every step on every process."""
    return self._preempted or runtime.stop_requested() or self.manager.reached_preemption(step)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def due(self, step: int) -> bool:
    """Whether `step` is a save step (the interval, or a preemption); the same on every host."""
    return self.manager.should_save(step)

  def save(self, step: int, state, data_state: dict, meta: dict) -> bool:
    """Saves `step` (ask `due` first). Every process calls it at the same steps: the hosts' data
    positions (each reads its own slice) are gathered into the checkpoint then."""
    args = ocp.args.Composite(
      state=ocp.args.StandardSave(flatten(state.saved())),
      data=ocp.args.JsonSave({'processes': self._positions.json(data_state, step)}),
      meta=ocp.args.JsonSave({**meta, LAYERS: list(self.layers)}),
    )
    storage.makedirs(self.directory)
    self._finish()  # (the manager would): the callback of the previous save reads `_saving`
    self._saving = self._pending = step
    saved = self.manager.save(step, args=args, force=True)  # the loop asked `due`
    if not self.async_save:
      self._finish()
    return saved

  def _finish(self) -> None:
    """Waits for the save in flight; one that failed raises SaveFailed naming it and why."""
    step, self._pending = self._pending, None
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      if step is None:
        raise
      newest = rundir.saved_steps(storage.dirname(self.directory))
      newest = f'step {newest[-1]}' if newest else 'none (a rerun starts over)'
      raise SaveFailed(
        f'checkpoint {self.step_dir(step)} could not be saved ({_innermost(e)}). The newest '
        f'checkpoint is {newest}; fix the cause and rerun the same command to resume from it'
      ) from e

  def check_saves(self, step: int) -> None:
    """Call at every step on every process: a save that has failed in the background stops the
    run now, not at the next save. The processes agree on when a save has ended (each ends its
    own part) and on whether it failed anywhere."""
    if self._pending is None:
      return
    if not all(self._saves_done.json(not self.manager.is_saving_in_progress(), step)):
      return
    error = ''
    try:
      self._finish()
    except SaveFailed as e:
      error = str(e)
    if error := next((e for e in self._save_errors.json(error, step) if e), ''):
      raise SaveFailed(error)

  def settle(self) -> None:
    """When the run stops on an error elsewhere: the save in flight is finished first, so that
    a rerun resumes from it (one that fails leaves the previous checkpoint the newest, said in a
    warning: the run's own error is the one reported)."""
    if self._pending is None:
      return
    try:
      self._finish()
    except SaveFailed as e:
      logging.warning('%s', e)

  def _write_manifest(self) -> None:
    """Orbax's post-finalization callback: the step's files are complete, in the temporary
    directory (on filesystems where Orbax renames; else in place, committed by a file after)."""
    tmp = storage.join(self.directory, f'{self._saving}{ocp.path.atomicity_types.TMP_DIR_SUFFIX}')
    integrity.write_manifest(tmp if storage.isdir(tmp) else self.step_dir(self._saving))

  def step_dir(self, step: int) -> str:
    return storage.join(self.directory, str(step))

  def restore_data(self, step: int) -> dict:
    """The data item alone (cheap: no arrays are read), after the checksums are checked."""
    self.check(step)
    with self._naming_damage(step):
      return self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))[
        'data'
      ]

  def check(self, step: int) -> None:
    """Checks a checkpoint's files against its checksums (once per step), every process a share
    of them; all processes agree on the verdict. DamagedCheckpoint names what differs."""
    if not self.verify or step in self._verified:
      return
    path, manifest = self.step_dir(step), None
    try:
      manifest = integrity.read_manifest(path)
      parts = (jax.process_index(), jax.process_count())
      found = [] if manifest is None else integrity.problems(path, manifest, *parts)
    except (OSError, ValueError) as e:
      found = [str(e)]
    found = sum(self._verdicts.json(found, step), [])
    if found:
      more = f'; {len(found) - 1} more files differ' if len(found) > 1 else ''
      raise self._damaged(step, f'is damaged ({found[0]}{more})')
    if manifest is None:
      logging.warning(
        'Checkpoint %s has no checksums (saved before moetrain wrote them, or with '
        'train.verify_checkpoints=False): restored unchecked.',
        path,
      )
    self._verified.add(step)

  def _damaged(self, step: int, what: str) -> DamagedCheckpoint:
    """The error for checkpoint `step`, with the way to resume from the one before it."""
    earlier = [s for s in self.manager.all_steps() if s < step]
    if earlier:
      advice = (
        f'to resume from step {max(earlier)} (the one before it), rerun with '
        f'--config.train.resume_step={max(earlier)}: it moves step {step} (and any newer) into '
        f'{self.set_aside_dir}'
      )
    else:
      advice = f'to resume from the start, move it out of {self.directory}'
    return DamagedCheckpoint(
      f'checkpoint {self.step_dir(step)} {what}. Nothing was deleted; {advice}.'
    )

  @property
  def set_aside_dir(self) -> str:
    return storage.join(storage.dirname(self.directory), SET_ASIDE)

  def resume_from(self, step: int) -> None:
    """train.resume_step: the checkpoints after `step` are moved into set_aside_dir (nothing is
    deleted), so that the run goes on from `step` and saves its steps anew."""
    steps = sorted(self.manager.all_steps())
    if step not in steps:
      raise ValueError(
        f'train.resume_step={step}: {self.directory} holds no checkpoint of that step (it holds '
        f'steps {steps}); set one of them, or 0 for the latest'
      )
    newer = [s for s in steps if s > step]
    if newer and jax.process_index() == 0:
      storage.makedirs(self.set_aside_dir)
      for s in newer:
        to, n = storage.join(self.set_aside_dir, str(s)), 0
        while storage.exists(to + (f'.{n}' if n else '')):  # set aside before
          n += 1
        storage.move(self.step_dir(s), to + (f'.{n}' if n else ''))
    multihost.Exchange('resume_step')('', step)  # the others wait for process 0's moves
    self.manager.reload()
    if newer:
      logging.warning(
        'train.resume_step=%d: checkpoints %s moved into %s; the run goes on from step %d.',
        step,
        newer,
        self.set_aside_dir,
        step,
      )

  @contextlib.contextmanager
  def _naming_damage(self, step: int):
    """A checkpoint that cannot be read (a copy cut short, a filesystem whose renames are not
    atomic, or one saved without checksums) is named, with the way to resume from the one before
    it: nothing is deleted here. (The reads still in flight then call back into Orbax's closed
    event loop: runtime.start_command drops those 'Event loop is closed' tracebacks.)"""
    try:
      yield
    except Exception as e:  # (Orbax raises a bare Exception for an array it cannot decode)
      what = f'cannot be read ({_innermost(e)})'
      raise self._damaged(step, what) from e

  def restore(self, step: int, abstract_state):
    """Restores onto the shardings of `abstract_state` (any mesh), the stacked layers in this
    checkpointer's order (`layers`); returns (saved, data, meta), data holding every process's
    data position (see `process_data_state`)."""
    saved = abstract_state.saved()
    target = {
      k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      for k, x in flatten(saved).items()
    }
    self.check(step)
    with self._naming_damage(step):
      out = self.manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target),
          data=ocp.args.JsonRestore(),
          meta=ocp.args.JsonRestore(),
        ),
      )
    # Checkpoints without the key hold layer order.
    src = tuple(out['meta'].get(LAYERS, (1, 1)))
    state = stages.reorder(unflatten_like(saved, out['state']), src, self.layers)
    return state, out['data'], out['meta']

  def wait(self) -> None:
    self._finish()

  def close(self) -> None:
    self._finish()
    self.manager.close()

"""Orbax checkpoints of the train state (without the frozen base), data position and config.

Orbax writes each step into a temporary directory and renames it when complete, so a crash or
kill mid-save leaves the previous checkpoint as the latest valid one.
"""

import contextlib
import functools
import os
import signal
import sys

import jax
import orbax.checkpoint as ocp
from absl import logging

from moetrain import multihost, runtime


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


def _unless_loop_closed(hook, unraisable) -> None:
  """sys.unraisablehook that drops the RuntimeError('Event loop is closed') of a callback into a
  finished asyncio loop and passes anything else to `hook`."""
  e = unraisable.exc_value
  if not (isinstance(e, RuntimeError) and str(e) == 'Event loop is closed'):
    hook(unraisable)


class Checkpointer:
  def __init__(self, workdir: str, *, every: int, keep: int, async_save: bool = True):
    self.directory = os.path.join(runtime.run_dir(workdir), 'checkpoints')
    # Orbax's default policy also saves the first step a manager sees (InitialSavePolicy): for a
    # large model that is an unrequested full save at step 1 of every run and every resume.
    policy = ocp.checkpoint_managers.AnySavePolicy(
      [
        ocp.checkpoint_managers.FixedIntervalPolicy(max(every, 1)),
        ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
      ]
    )
    options = ocp.CheckpointManagerOptions(
      save_decision_policy=policy,
      max_to_keep=keep,
      enable_async_checkpointing=async_save,
      create=True,
    )
    self.manager = ocp.CheckpointManager(
      self.directory, options=options, item_names=('state', 'data', 'meta')
    )
    self._preempted = False
    self._previous_handler = None
    self._positions = multihost.Exchange('data_positions')

  def watch_preemption(self) -> None:
    """From here on a SIGTERM (TPU preemption) makes the training loop save and stop. Only the
    loop calls this: tools that merely restore must stay killable.

    One process: a Python handler sets a flag. Several: JAX's preemption service (started by
    jax.distributed.initialize) catches SIGTERM on any host and all hosts agree on the step to
    stop at (`reached_preemption`). A Python handler there would replace the service's own, and
    the host that caught the signal would stop alone while the others wait in its collectives.
    The service picks the step after the highest one any host has reported, so report the step
    a resumed run starts from now: a notice during its start-up then stops it at its first step
    instead of at a step number it has passed. (`python -m moetrain.main` reported it already on
    joining the job, runtime.initialize_distributed; this covers train.run called from Python.)
    """
    if jax.process_count() == 1:
      try:
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
      except ValueError:  # not on the main thread (e.g. under some notebook runners)
        pass
    if self.manager.reached_preemption(self.latest_step() or 0):
      self._preempted = True

  def _on_sigterm(self, signum, frame):
    del signum, frame
    logging.warning('SIGTERM received: saving a checkpoint at the next step, then exiting.')
    self._preempted = True

  def preempted(self, step: int) -> bool:
    """True at the step every process stops at; call it at every step on every process."""
    return self._preempted or self.manager.reached_preemption(step)

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
      meta=ocp.args.JsonSave(meta),
    )
    return self.manager.save(step, args=args, force=True)  # the loop asked `due`

  def restore_data(self, step: int) -> dict:
    """The data item alone (cheap: no arrays are read)."""
    with self._naming_damage(step):
      return self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))[
        'data'
      ]

  @contextlib.contextmanager
  def _naming_damage(self, step: int):
    """A checkpoint that cannot be read (a copy cut short, a filesystem whose renames are not
    atomic) is named, with the way to resume from the one before it: nothing is deleted here.
    A read that fails leaves Orbax's other reads in flight, whose completions call back into its
    closed event loop: each an unraisable 'Event loop is closed' traceback (hundreds when the
    array files are missing) that would bury the message. Those are dropped."""
    hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_unless_loop_closed, hook)
    try:
      yield
    except (KeyError, FileNotFoundError, ValueError, OSError, RuntimeError) as e:
      earlier = [s for s in self.manager.all_steps() if s < step]
      fallback = f'step {max(earlier)}' if earlier else 'the start'
      path = os.path.join(self.directory, str(step))
      raise ValueError(
        f'checkpoint {path} cannot be read ({type(e).__name__}: {str(e)[:300]}). If it is '
        f'incomplete or damaged (a copy cut short, a crash on a filesystem without atomic '
        f'renames), move it out of {self.directory} to resume from {fallback}.'
      ) from e  # (the filter stays: the reads in flight finish later)
    except BaseException:
      sys.unraisablehook = hook
      raise
    sys.unraisablehook = hook

  def restore(self, step: int, abstract_state):
    """Restores onto the shardings of `abstract_state` (any mesh); returns (saved, data, meta),
    data holding every process's data position (see `process_data_state`)."""
    saved = abstract_state.saved()
    target = {
      k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      for k, x in flatten(saved).items()
    }
    with self._naming_damage(step):
      out = self.manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target),
          data=ocp.args.JsonRestore(),
          meta=ocp.args.JsonRestore(),
        ),
      )
    return unflatten_like(saved, out['state']), out['data'], out['meta']

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
    self.release_signal()

  def release_signal(self) -> None:
    """Gives SIGTERM back to the handler before watch_preemption (train.run() has returned or
    failed: SIGTERM stops the caller again). Idempotent."""
    if self._previous_handler is not None:
      signal.signal(signal.SIGTERM, self._previous_handler)
      self._previous_handler = None

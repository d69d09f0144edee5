"""Orbax checkpoints of the train state (without the frozen base), data position and config.

Orbax writes each step into a temporary directory and renames it when complete, so a crash or
kill mid-save leaves the previous checkpoint as the latest valid one.
"""

import os
import signal

import jax
import orbax.checkpoint as ocp
from absl import logging


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


class Checkpointer:
  def __init__(self, workdir: str, *, every: int, keep: int, async_save: bool = True):
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    options = ocp.CheckpointManagerOptions(
      save_interval_steps=max(every, 1),
      max_to_keep=keep,
      enable_async_checkpointing=async_save,
      create=True,
    )
    self.manager = ocp.CheckpointManager(
      self.directory, options=options, item_names=('state', 'data', 'meta')
    )
    self._preempted = False

  def watch_preemption(self) -> None:
    """SIGTERM (TPU preemption) asks the training loop to save and stop. Only the loop calls
    this: tools that merely restore must stay killable."""
    if jax.process_index() == 0:
      try:
        signal.signal(signal.SIGTERM, self._on_sigterm)
      except ValueError:  # not on the main thread (e.g. under some notebook runners)
        pass

  def _on_sigterm(self, signum, frame):
    del signum, frame
    logging.warning('SIGTERM received: saving a checkpoint at the next step, then exiting.')
    self._preempted = True

  def preempted(self, step: int) -> bool:
    return self._preempted or self.manager.reached_preemption(step)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: dict, meta: dict, force: bool = False) -> bool:
    args = ocp.args.Composite(
      state=ocp.args.StandardSave(flatten(state.saved())),
      data=ocp.args.JsonSave(data_state),
      meta=ocp.args.JsonSave(meta),
    )
    return self.manager.save(step, args=args, force=force)

  def restore(self, step: int, abstract_state):
    """Restores onto the shardings of `abstract_state` (any mesh); returns (saved, data, meta)."""
    saved = abstract_state.saved()
    target = {
      k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      for k, x in flatten(saved).items()
    }
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

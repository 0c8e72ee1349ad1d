"""Orbax checkpoints of the train state, with the run's config beside it.

Each checkpoint step holds two items: 'state' (the TrainState pytree) and
'config' (the job's config as JSON), so that a resumed or downstream job can
check what it restores and rebuild the model that wrote it. Orbax writes each
step to a temporary directory and renames it when complete, so a run killed
while saving keeps its previous checkpoint. Every process calls save and
restore together (multi-host).
"""
import json
import signal
from typing import Optional

import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging

from contrastive_jax.core.errors import ConfigError


def _get(d: dict, dotted: str):
  for part in dotted.split("."):
    d = d.get(part) if isinstance(d, dict) else None
  return d


class Checkpointer:
  """Saves and restores one run's checkpoints in `directory`.

  Args:
    directory: absolute path (WORKDIR/checkpoints).
    keep: number of most recent checkpoints kept.
    read_only: for downstream jobs that only restore.

  The caller decides when to save (runner.py); every save call writes.
  """

  def __init__(self, directory: str, *, keep: int = 3, read_only: bool = False):
    self._manager = ocp.CheckpointManager(
        directory, item_names=("state", "config"),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                             read_only=read_only))

  @property
  def directory(self) -> str:
    return str(self._manager.directory)

  def all_steps(self):
    return list(self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def saved_config(self, step: Optional[int] = None) -> ml_collections.ConfigDict:
    """The config of the job that wrote checkpoint `step` (default: latest).

    Raises:
      ConfigError: no checkpoint, or no checkpoint at that step (lists those that exist).
    """
    step = self.resolve_step(step)
    saved = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return ml_collections.ConfigDict(saved.config)

  def check_compatible(self, config, fields, step: Optional[int] = None):
    """Raises ConfigError if a field of `fields` differs from checkpoint `step`'s.

    fields[0] must be a field that only this kind of job has (its absence
    means another kind of job wrote the checkpoint).
    """
    saved = self.saved_config(step).to_dict()
    current = json.loads(json.dumps(config.to_dict()))  # As saved: tuples become lists.
    if _get(saved, fields[0]) is None:
      raise ConfigError(fields[0], _get(current, fields[0]),
                        f"a field of the checkpoints in {self.directory}, which another kind "
                        "of job wrote (pretraining, linear probe, fine-tuning): use a new workdir")
    for field in fields:
      if _get(saved, field) != _get(current, field):
        raise ConfigError(field, _get(current, field),
                          f"{_get(saved, field)!r}, the value of the checkpoint in "
                          f"{self.directory} (use a new workdir for a different {field})")

  def restore(self, abstract_state, step: Optional[int] = None):
    """Restores checkpoint `step` (default: latest) onto abstract_state's shardings.

    abstract_state: pytree of jax.ShapeDtypeStruct with .sharding set, so a
    checkpoint written on another device count restores onto this mesh.
    """
    step = self.resolve_step(step)
    restored = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
    return restored.state

  def restore_partial(self, abstract_tree, step: Optional[int] = None):
    """Restores only the leaves of abstract_tree (a sub-tree of the saved state).

    abstract_tree: nested dicts of jax.ShapeDtypeStruct with .sharding, keyed
    like the saved TrainState's fields, e.g. {'params': {'encoder': ...}}.
    Nothing else of the checkpoint (optimizer state, MoCo's queue, ...) is read.

    Raises:
      ConfigError: no checkpoint, or none at `step`.
    """
    step = self.resolve_step(step)
    restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=abstract_tree, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_tree),
        partial_restore=True)))
    return restored.state

  def save(self, step: int, state, config):
    """Starts an asynchronous save of `state` and `config` at `step`."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(config.to_dict())),
        force=True)

  def wait(self):
    """Blocks until pending saves are complete on disk."""
    self._manager.wait_until_finished()

  def reached_preemption(self, step: int) -> bool:
    """True when the cluster announced preemption (multi-host runs only)."""
    return jax.process_count() > 1 and self._manager.reached_preemption(step)

  def close(self):
    """Waits for pending writes, then releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()

  def resolve_step(self, step: Optional[int], field: str = "step") -> int:
    """`step` if saved, the latest step if None.

    Raises:
      ConfigError: no checkpoint at all, or none at `step` (naming `field` and
        listing the saved steps).
    """
    steps = self.all_steps()
    if not steps:
      raise ConfigError(field, step, f"a saved step, but {self.directory} holds no checkpoint")
    if step is None:
      return max(steps)
    if step not in steps:
      raise ConfigError(field, step, f"one of the saved steps {sorted(steps)}")
    return step


def abstract_like(state, sharding):
  """ShapeDtypeStructs of `state` with every leaf placed on `sharding`."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)


class Preemption:
  """Remembers a SIGTERM so the loop can checkpoint and stop at a step boundary.

  A context manager: the previous SIGTERM handler is restored on exit. Only a
  single-process job installs it: on several hosts each one gets the signal
  at a different step, so they agree through Checkpointer.reached_preemption
  (JAX's distributed preemption sync) instead, and all stop at the same step.
  """

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    if jax.process_count() == 1:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)

  def _handle(self, signum, frame):
    logging.warning("SIGTERM: saving a checkpoint after this step, then stopping.")
    self.requested = True

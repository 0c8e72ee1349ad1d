"""Orbax checkpoints of the train state, with the run's config beside it.

Each checkpoint step holds two items: 'state' (the TrainState pytree) and
'config' (the job's config as JSON), so that a resumed or downstream job can
check what it restores and rebuild the model that wrote it. Orbax writes each
step to a temporary directory and renames it when complete, so a run killed
while saving keeps its previous checkpoint; a step that lost an item later
(partly deleted or corrupted) is skipped with a warning, and restoring falls
back to the newest complete one. Every process calls save and restore
together (multi-host).
"""

import json
import signal
from typing import Optional, Sequence

from absl import logging
import jax
import ml_collections
import orbax.checkpoint as ocp

from contrastive_jax.core import files
from contrastive_jax.core.errors import ABSENT
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import ForeignCheckpointError

# (item, the file of the item that Orbax writes last): a step holding both is complete.
_STEP_METADATA = "_CHECKPOINT_METADATA"  # Orbax's file naming a step's items.
_ITEM_MARKERS = (("state", "_METADATA"), ("config", "metadata"))
# A fine-tuning workdir read as a pretrained encoder (downstream jobs, a distillation
# teacher): its saved config's job name, and the (params, batch_stats) key paths of its
# fine-tuned encoder in the TrainState it saves (training/downstream.finetune_state: params
# {'encoder', 'head'}, batch_stats {'encoder'}).
FINETUNE_JOB = "finetune"
FINETUNED_ENCODER = (("params", "encoder"), ("batch_stats", "encoder"))


def _leaves(tree: dict, prefix: str = "") -> dict:
  """{dotted path: value} of a nested dict's leaves (an empty dict is a leaf)."""
  if not isinstance(tree, dict) or not tree:
    return {prefix: tree}
  out = {}
  for key, value in tree.items():
    out.update(_leaves(value, f"{prefix}.{key}" if prefix else key))
  return out


def config_differences(
  saved: dict, config: ml_collections.ConfigDict, may_change: Sequence[str]
) -> list:
  """[(dotted field, saved value, config's value)] of every leaf where they differ, sorted.

  saved: a config as a checkpoint holds it (JSON: tuples read back as lists);
  config is compared as it would be saved. A field under one of may_change
  (dotted prefixes, e.g. 'evaluators') is left out; a field only one side has
  differs, with errors.ABSENT as the other side's value, unless that side's value is
  None: an unset field computes what a config without the field does.
  """
  current = _leaves(json.loads(json.dumps(config.to_dict())))
  saved = _leaves(saved)
  # A field one side lacks and the other leaves unset (None) is no difference.
  current = {k: v for k, v in current.items() if v is not None or k in saved}
  saved = {k: v for k, v in saved.items() if v is not None or k in current}
  free = lambda field: any(field == p or field.startswith(p + ".") for p in may_change)
  return [
    (field, saved.get(field, ABSENT), current.get(field, ABSENT))
    for field in sorted(set(saved) | set(current))
    if not free(field) and saved.get(field, ABSENT) != current.get(field, ABSENT)
  ]


class Checkpointer:
  """Saves and restores one run's checkpoints in `directory`.

  Args:
    directory: absolute path (WORKDIR/checkpoints).
    keep: number of most recent checkpoints kept.
    read_only: for downstream jobs that only restore.

  The caller decides when to save (runner.py); every save call writes.
  """

  def __init__(self, directory: str, *, keep: int = 3, read_only: bool = False):
    # A writer also removes the temporary folders of saves that never completed (a
    # killed job, a full disk); the workdir lock (files.workdir_lock) keeps them
    # from being another running job's.
    # A reader's options are those Orbax would set for read_only itself (it warns otherwise).
    self._manager = ocp.CheckpointManager(
      directory,
      item_names=("state", "config"),
      options=ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep,
        save_interval_steps=0 if read_only else 1,
        create=not read_only,
        read_only=read_only,
        cleanup_tmp_directories=not read_only,
      ),
    )
    # Orbax starts that removal in a background thread and waits for it only at the first
    # save, never at close: a job that fails before it saves would leave the thread running
    # into the interpreter's shutdown, where it prints an error line of its own after the
    # job's ('cannot schedule new futures after interpreter shutdown'). Waited for here.
    self._manager._maybe_await_cleanup_tmp_directory()  # pylint: disable=protected-access
    self._warned = set()

  @property
  def directory(self) -> str:
    return str(self._manager.directory)

  def all_steps(self):
    """Every saved step, complete or not (see complete_steps), oldest first.

    Read from the directory (Orbax's own list also holds a step whose save
    failed), so call it when no save is pending: before the first, or after
    wait().
    """
    self._manager.reload()
    steps = sorted(self._manager.all_steps())
    for step in steps:
      self._check_ours(step)
    return steps

  def _check_ours(self, step: int):
    """Raises ForeignCheckpointError unless a Checkpointer wrote step's folder, whole or not:
    Orbax's metadata of the step names the items 'state' and 'config'."""
    try:
      with files.open_file(f"{self.directory}/{step}/{_STEP_METADATA}") as f:
        items = sorted(json.load(f).get("item_handlers") or ())
    except (FileNotFoundError, ValueError, AttributeError):
      items = None
    if items is None or not {"state", "config"} <= set(items):
      found = "no Orbax metadata" if items is None else f"the items {items}"
      raise ForeignCheckpointError(
        f"{self.directory}/{step} is not a checkpoint of contrastive_jax (it has {found}, "
        "not the items 'state' and 'config'); nothing in it was read or changed"
      )

  def _is_complete(self, step: int) -> bool:
    return all(
      files.exists(f"{self.directory}/{step}/{item}/{marker}") for item, marker in _ITEM_MARKERS
    )

  def complete_steps(self, steps: Optional[Sequence[int]] = None):
    """The saved steps (or those of `steps`) whose items are both whole, oldest first.

    Orbax renames a step's folder into place only once it is written, but a
    step can still lose an item afterwards (a partly deleted or corrupted
    folder); such a step is listed by all_steps and skipped here.
    """
    return [
      step for step in (self.all_steps() if steps is None else steps) if self._is_complete(step)
    ]

  def latest_step(self) -> Optional[int]:
    """The newest complete step (None if there is none).

    Logs a warning (once per step) naming each newer step that is incomplete
    and so skipped.
    """
    steps = self.all_steps()
    complete = self.complete_steps(steps)
    latest = max(complete) if complete else None
    for step in steps:
      if step not in complete and (latest is None or step > latest) and step not in self._warned:
        self._warned.add(step)
        logging.warning(
          "Checkpoint step %d in %s is incomplete (its 'state' or 'config' item "
          "is missing or unfinished): skipped; the newest complete one is %s.",
          step,
          self.directory,
          latest,
        )
    return latest

  def discard_incomplete(self):
    """Deletes the incomplete steps (a writer's, before it saves: it may save them again).

    Call on every process together. Logs a warning naming each.
    """
    steps = self.all_steps()
    complete = self.complete_steps(steps)
    for step in steps:
      if step not in complete:
        logging.warning(
          "Deleting checkpoint step %d in %s: it is incomplete (its 'state' or "
          "'config' item is missing or unfinished), so it cannot be restored.",
          step,
          self.directory,
        )
        self._warned.add(step)
        self._manager.delete(step)

  def saved_config(self, step: Optional[int] = None) -> ml_collections.ConfigDict:
    """The config of the job that wrote checkpoint `step` (default: latest).

    Raises:
      ConfigError: no checkpoint, or no checkpoint at that step (lists those that exist).
      ForeignCheckpointError: a step folder that no job of this project wrote
        (another tool's Orbax checkpoint, or any numbered folder).
    """
    step = self.resolve_step(step)
    saved = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return ml_collections.ConfigDict(saved.config)

  def restore(self, abstract_state, step: Optional[int] = None):
    """Restores checkpoint `step` (default: latest) onto abstract_state's shardings.

    abstract_state: pytree of jax.ShapeDtypeStruct with .sharding set, so a
    checkpoint written on another device count restores onto this mesh.
    """
    step = self.resolve_step(step)
    restored = self._manager.restore(
      step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
    )
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
    restored = self._manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
          item=abstract_tree,
          restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_tree),
          partial_restore=True,
        )
      ),
    )
    return restored.state

  def save(self, step: int, state, config):
    """Starts an asynchronous save of `state` and `config` at `step`."""
    self._manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(config.to_dict())
      ),
      force=True,
    )

  def wait(self):
    """Blocks until pending saves are complete on disk."""
    self._manager.wait_until_finished()

  def reached_preemption(self, step: int) -> bool:
    """True when the cluster announced preemption (multi-host runs only)."""
    return jax.process_count() > 1 and self._manager.reached_preemption(step)

  def close(self):
    """Waits for pending writes, then releases the manager (also when a write failed)."""
    try:
      if self._manager.is_saving_in_progress():  # A write that outlasted the job's last step.
        logging.info("Waiting for the checkpoint write in progress (%s) ...", self.directory)
      self._manager.wait_until_finished()
    finally:
      self._manager.close()

  def resolve_step(self, step: Optional[int], field: str = "step") -> int:
    """`step` if saved and complete; the newest complete step if None.

    Raises:
      ConfigError: no complete checkpoint at all, or none at `step` (naming
        `field` and listing the complete steps, and any incomplete ones).
    """
    latest, steps = self.latest_step(), self.all_steps()
    complete = self.complete_steps(steps)
    incomplete = [s for s in steps if s not in complete]
    skipped = f" (incomplete, so skipped: {incomplete})" if incomplete else ""
    if latest is None:
      raise ConfigError(
        field, step, f"a saved step, but {self.directory} holds no complete checkpoint{skipped}"
      )
    if step is None:
      return latest
    if step not in complete:
      raise ConfigError(field, step, f"one of the saved steps {complete}{skipped}")
    return step


def abstract_like(state, sharding):
  """ShapeDtypeStructs of `state` with every leaf placed on `sharding`."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)


class Preemption:
  """Remembers a SIGTERM or a first Ctrl-C so the loop can checkpoint and stop between steps.

  A context manager: the previous SIGTERM and SIGINT handlers are restored on
  exit. After the first Ctrl-C (SIGINT) a second one raises KeyboardInterrupt
  at once, as usual. Only a single-process job installs the handlers: on
  several hosts each one gets SIGTERM at a different step, so they agree
  through Checkpointer.reached_preemption (JAX's distributed preemption sync)
  instead, and all stop at the same step; Ctrl-C there raises
  KeyboardInterrupt in the process that gets it.

  Attributes:
    requested: a stop was asked for (either signal).
    interrupted: by Ctrl-C (the job then ends in errors.Interrupted, while
      a preempted job ends normally).
  """

  def __init__(self):
    self.requested = self.interrupted = False
    self._previous = {}

  def __enter__(self):
    if jax.process_count() == 1:
      self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
      # Not where SIGINT is ignored (a job started in the background by a script).
      if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle)
    return self

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      if handler is not None:  # None: a handler not set from Python, which cannot be restored.
        signal.signal(signum, handler)

  def _handle(self, signum, frame):
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.default_int_handler)
      logging.warning(
        "Ctrl-C: saving a checkpoint after this step, then stopping. Ctrl-C "
        "again stops at once, keeping the newest complete checkpoint."
      )
      self.interrupted = True
    else:
      logging.warning("SIGTERM: saving a checkpoint after this step, then stopping.")
    self.requested = True

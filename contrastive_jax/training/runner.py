"""The loop every job shares: pretraining, the linear probe, fine-tuning, and those to come.

A job module (pretrain.py, linear_probe.py, finetune.py) provides
check_config(config, num_devices) and build(config, mesh, saved_config,
workdir) -> Task (workdir for files of the job's own; saved_config is the
checkpoint's config when resuming, else None); run() does the rest, written
once: resume from the workdir's latest checkpoint (whose config must equal the
run's but for MAY_CHANGE_ON_RESUME), step, log, stop on a non-finite loss, run the
config's evaluators at their intervals and at the end, checkpoint, and stop
cleanly on preemption (one process: SIGTERM; several: JAX's distributed
preemption sync, so every host stops at the same step). Every exit path,
errors included, waits for pending checkpoint writes; nothing non-finite is
ever saved. It imports no TensorFlow (docs/design.md's TF-free modules), so a
job whose data needs none (benchmarks/device.py) runs it where JAX alone is.
"""

import contextlib
import time
from typing import Any, Callable, Iterator, NamedTuple, Optional

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from contrastive_jax import config_files
from contrastive_jax.core import checkpointing
from contrastive_jax.core import durations
from contrastive_jax.core import files
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import metrics as metrics_lib
from contrastive_jax.core import pictures
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import DataError
from contrastive_jax.core.errors import Interrupted
from contrastive_jax.core.errors import JobError
from contrastive_jax.core.errors import NonFiniteError
from contrastive_jax.core.errors import NoSpaceError
from contrastive_jax.core.errors import ResumeError
from contrastive_jax.data import unreadable as unreadable_lib
from contrastive_jax.training import evaluators

# Config fields (dotted prefixes) a resumed run may change: they decide when and
# how it logs, evaluates and checkpoints, and how fast it reads its data, never
# what it computes (init_from only decides step 0, which a resumed run restores).
# Every other field must equal the checkpoint's, so that the resumed run
# continues bit for bit.
MAY_CHANGE_ON_RESUME = (
  "log_every",
  "checkpoint_every",
  "keep_checkpoints",
  "evaluators",
  "data_threads",
  "data_dir",
  "cache",
  "init_from",
  "eval_batch_size",  # The label-efficiency job's evaluation batch.
)


class Task(NamedTuple):
  """What a job's build() gives the runner.

  config: the config saved with every checkpoint (the job's, with anything
    resolved at build time filled in).
  init: () -> state at step 0, replicated on the mesh (jitted).
  train_step: (state, batch) -> (state, metrics), jitted, state donated;
    metrics are float32 scalars with at least 'loss' and 'param_norm'.
  train_batches: start_step -> iterator of global batches from that step on.
  num_steps, steps_per_epoch, global_batch: the run's length and batch.
  schedule: step -> learning rate, for the logs.
  eval_model: what the evaluators call (evaluators.EvalModel).
  num_classes: of the dataset, or None (unlabeled).
  views_picture: None, or (state, batch) -> uint8 [H, W, 3], a picture of the
    augmented views the train step makes of the batch; a fresh run writes the
    first batch's to WORKDIR/augmented_views.png and TensorBoard.
  """

  config: ml_collections.ConfigDict
  init: Callable[[], Any]
  train_step: Callable
  train_batches: Callable[[int], Iterator]
  num_steps: int
  steps_per_epoch: int
  global_batch: int
  schedule: Callable
  eval_model: evaluators.EvalModel
  num_classes: Optional[int]
  views_picture: Optional[Callable] = None


def check_config(config: ml_collections.ConfigDict, num_devices: int):
  """Raises ConfigError for the fields every job has (call from a job's check_config).

  Checks the global batch, durations, checkpoint count, host pipeline sizes
  and each evaluator's interval form, before any compute.
  """
  if config.batch_size <= 0 or config.batch_size % num_devices:
    raise ConfigError(
      "batch_size",
      config.batch_size,
      f"a positive multiple of the number of devices ({num_devices})",
    )
  for field in ("keep_checkpoints", "data_threads", "shuffle_buffer"):
    if config[field] <= 0:
      raise ConfigError(field, config[field], "an integer > 0")
  for field in ("duration", "log_every", "checkpoint_every"):
    durations.check_duration(config[field], field)
  for name, evaluator in config.evaluators.items():
    durations.check_duration(evaluator.get("every"), f"evaluators.{name}.every")


def steps_per_epoch(source, config) -> int:
  """Optimizer steps in one pass over config.train_split at the global batch.

  Raises:
    ConfigError: a global batch larger than the split.
  """
  num_train = source.num_examples(config.train_split, "train_split")
  if num_train < config.batch_size:
    raise ConfigError(
      "batch_size",
      config.batch_size,
      f"at most the size of split {config.train_split!r} ({num_train})",
    )
  return num_train // config.batch_size


def run(job, config: ml_collections.ConfigDict, workdir: str):
  """Runs `job` with `config` in `workdir`; returns (final state, last evaluation results).

  Holds the workdir's lock (files.workdir_lock) from the config check to the
  end, and waits for pending checkpoint writes on every exit path. A job
  refused before its first step (build raises) removes the workdir it made.

  Raises:
    ConfigError: before any compute, for a config, dataset or checkpoint
      that cannot run.
    NonFiniteError: the loss or the state became NaN or infinite.
    Interrupted: Ctrl-C; the first one saves a checkpoint after the
      current step (as SIGTERM does), a second one stops at once.
    NoSpaceError: the disk filled up while writing to the workdir.
    DataError: a record of the dataset cannot be read (a damaged shard file).
    JobError: a workdir that is a file, or that another job is running in.
  """
  workdir = files.prepare_workdir(workdir)
  job.check_config(config, jax.device_count())
  fresh = not files.exists(workdir)
  with files.workdir_lock(workdir):
    ckpt = checkpointing.Checkpointer(f"{workdir}/checkpoints", keep=config.keep_checkpoints)
    with _closing(ckpt, workdir):
      ckpt.discard_incomplete()  # It could not resume them, and saves may need their steps.
      saved = None
      if ckpt.latest_step() is not None:
        saved = config_files.upgrade_config(ckpt.saved_config())
        if saved.get("job") != config.job:
          raise ConfigError(
            "job",
            config.job,
            f"{saved.get('job')!r}: another kind of job wrote the "
            f"checkpoints in {ckpt.directory}; use a new workdir",
          )
      mesh = mesh_lib.make_mesh()
      try:
        task = job.build(config, mesh, saved, workdir)
      except JobError:  # Refused before step 0: a workdir this run made is left as it was, absent.
        if fresh:
          files.remove_tree(workdir)
        raise
      if saved is not None:  # Compared with what build() resolved (e.g. the probe's preset).
        check_resume(saved.to_dict(), task.config, ckpt.directory)
      return _loop(task, workdir, ckpt, mesh)


def check_resume(saved: dict, config: ml_collections.ConfigDict, directory: str):
  """Raises ResumeError naming `directory` when config differs from the saved config (a dict,
  as read back from JSON) in a field outside MAY_CHANGE_ON_RESUME: the one resume rule."""
  differences = checkpointing.config_differences(saved, config, MAY_CHANGE_ON_RESUME)
  if differences:
    raise ResumeError(directory, differences, MAY_CHANGE_ON_RESUME)


@contextlib.contextmanager
def _closing(ckpt, workdir: str):
  """Closes ckpt on exit (waiting for pending writes); a full disk, Ctrl-C or a damaged
  dataset file becomes a JobError.

  A dataset record that cannot be read (unreadable.read_failure) ends the job in
  DataError naming the file and the newest checkpoint. A full disk can surface
  in the body or only when the pending writes are waited for; either way the
  job ends in NoSpaceError (unless it is already ending in another JobError),
  naming the newest complete checkpoint. A
  KeyboardInterrupt that _loop did not turn into Interrupted (one before the
  training loop, or while _loop waited for the writes) becomes Interrupted.
  """
  error = None
  try:
    yield
  except BaseException as e:  # pylint: disable=broad-except
    error = e
  try:
    ckpt.close()
  except Exception as e:  # pylint: disable=broad-except
    if error is None or (files.is_disk_full(e) and not isinstance(error, JobError)):
      error = e
    else:
      logging.error("Waiting for pending checkpoint writes also failed: %s", e)
  if error is None:
    return
  if isinstance(error, KeyboardInterrupt):
    raise Interrupted(f"interrupted: {_newest(ckpt)}") from None
  unreadable = unreadable_lib.read_failure(error)
  if unreadable is not None:
    raise DataError(
      unreadable.path,
      unreadable.record,
      f"{unreadable}; {_newest(ckpt, 'then start the same command again')}",
    ) from None
  if not isinstance(error, JobError) and files.is_disk_full(error):
    raise NoSpaceError(
      f"no space left on device while writing to {workdir}: "
      f"{_newest(ckpt, 'free space and start the same command again')}"
    ) from error
  raise error


def _interrupted(step: int, ckpt) -> Interrupted:
  """The error that ends a job interrupted at `step`, once pending checkpoint writes are done."""
  ckpt.wait()
  return Interrupted(f"interrupted at step {step}: {_newest(ckpt)}")


def _newest(ckpt, then: str = "start the same command again") -> str:
  """What a stopped job keeps and how to go on, in words (once pending writes are complete)."""
  latest = ckpt.latest_step()
  if latest is None:
    return f"no checkpoint was saved yet; {then} to start over"
  return f"the newest checkpoint is step {latest} (in {ckpt.directory}); {then} to resume"


def _loop(task: Task, workdir: str, ckpt, mesh):
  """Restores or initialises the state, then steps to task.num_steps (see run)."""
  config, spe = task.config, task.steps_per_epoch
  log_every = durations.to_steps(config.log_every, "log_every", spe)
  checkpoint_every = durations.to_steps(config.checkpoint_every, "checkpoint_every", spe)
  evals = evaluators.build(config.evaluators, task.eval_model, mesh, task.num_classes, spe)

  resumed_step = ckpt.latest_step()
  if resumed_step is None:
    state = task.init()
  else:
    state = ckpt.restore(
      checkpointing.abstract_like(jax.eval_shape(task.init), mesh_lib.replicated(mesh))
    )
    logging.info("Resumed from %s at step %d.", ckpt.directory, resumed_step)
  start_step = int(state.step)

  def evaluate(state, step, which):
    if which:  # Tens of seconds on a CPU (the kNN embeds its bank): say so first.
      logging.info("Step %d: evaluating %s ...", step, ", ".join(e.name for e in which))
    results = {}
    for evaluator in which:
      results.update(evaluator(state))
    if results:
      evaluators.log(step, results)
    return results

  if start_step >= task.num_steps:  # A finished run: report its final evaluation again.
    return state, evaluate(state, start_step, [e for _, e in evals])

  batches = task.train_batches(start_step)
  writer = metrics_lib.create_writer(workdir, resumed_step=resumed_step)
  results, step = {}, start_step
  try:
    with checkpointing.Preemption() as preemption:
      if start_step == 0:
        writer.write_hparams(config.to_dict())
        results = evaluate(state, 0, [e for _, e in evals if e.at_start])
        if results:
          writer.write_scalars(0, results)
      progress = _Progress(task.num_steps, every_secs=30.0)
      logging.info(
        "Training from step %d to %d (%d steps per epoch, global batch %d, %d devices).",
        start_step,
        task.num_steps,
        spe,
        task.global_batch,
        jax.device_count(),
      )
      window = _Window()
      for step in range(start_step + 1, task.num_steps + 1):
        batch = next(batches)
        if step == 1 and task.views_picture is not None:
          _write_views_picture(task.views_picture(state, batch), workdir, writer)
        state, step_metrics = task.train_step(state, batch)
        if step == start_step + 1:
          window.restart(step, step_metrics)  # The first step's time is compilation.
        progress(step)
        last = step == task.num_steps
        stop = preemption.requested or ckpt.reached_preemption(step)
        log = step % log_every == 0 or last
        save = step % checkpoint_every == 0 or last or stop
        # A preempted job saves and leaves at once: evaluation could outlast its grace.
        due = [] if stop else [e for every, e in evals if step % every == 0 or last]
        scalars = {}
        if log or save or due:
          host = jax.device_get(step_metrics)
          _check_finite(
            step, ckpt, loss=host["loss"], state_finite=not save or bool(_all_finite(state))
          )
          if log:
            scalars = dict(
              host, learning_rate=task.schedule(step - 1), **window.rates(step, task.global_batch)
            )
        if save:
          ckpt.save(step, state, config)  # Asynchronous: evaluation overlaps the write.
        if due:
          t0 = time.time()
          results = evaluate(state, step, due)
          scalars.update(results)
          window.exclude(time.time() - t0)
        if scalars:
          writer.write_scalars(step, scalars)
        if save:  # A resumed run keeps the records up to its checkpoint: store them now.
          writer.flush()
        if stop and preemption.interrupted:
          raise _interrupted(step, ckpt)
        if stop:
          logging.warning("Stopped at step %d after a preemption request.", step)
          break
  except KeyboardInterrupt:  # A second Ctrl-C, or one on a multi-host job.
    raise _interrupted(step, ckpt) from None
  finally:
    writer.close()
  return state, results


def _write_views_picture(picture, workdir: str, writer):
  """Writes the step-0 views picture as a PNG (process 0) and a TensorBoard image."""
  if jax.process_index() == 0:
    pictures.write_png(f"{workdir}/augmented_views.png", picture)
  writer.write_images(0, {"augmented_views": picture[None]})


class _Progress:
  """A console line on the run's progress every `every_secs` seconds and at the last step.

  The line: steps/s since the previous line, the share of the steps done and
  the time left at that rate, e.g. '2.5 steps/s, 40.0% (400/1000), ETA: 4m'.
  The first call (the step that compiles) starts the clock and writes nothing.
  """

  def __init__(self, num_steps: int, every_secs: float):
    self._num_steps, self._every_secs = num_steps, every_secs
    self._step = self._time = None

  def __call__(self, step: int):
    now = time.monotonic()
    if self._step is None:
      self._step, self._time = step, now
      return
    if step == self._step or (now - self._time <= self._every_secs and step != self._num_steps):
      return
    rate = (step - self._step) / (now - self._time)
    left = (self._num_steps - step) / rate
    logging.info(
      "%.1f steps/s, %.1f%% (%d/%d), ETA: %s",
      rate,
      100 * step / self._num_steps,
      step,
      self._num_steps,
      f"{left / 60:.0f}m" if left >= 60 else f"{left:.0f}s",
    )
    self._step, self._time = step, now


class _Window:
  """Steps/s and images/s since the last log, compilation and evaluation excluded."""

  def restart(self, step: int, step_metrics):
    """Starts timing once `step` (whose time is compilation) has finished."""
    jax.block_until_ready(step_metrics)
    self._time, self._step, self._excluded = time.time(), step, 0.0

  def exclude(self, seconds: float):
    self._excluded += seconds

  def rates(self, step: int, global_batch: int) -> dict:
    """Rates over the steps since the last call; {} when no step was timed."""
    now = time.time()
    steps, seconds = step - self._step, now - self._time - self._excluded
    self._time, self._step, self._excluded = now, step, 0.0
    if steps == 0:
      return {}
    return {"steps_per_sec": steps / seconds, "images_per_sec": steps * global_batch / seconds}


@jax.jit
def _all_finite(state):
  """Whether every float leaf of the state (params, statistics, optimizer, extra, probe) is
  finite."""
  return jnp.all(
    jnp.stack(
      [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(state)
        if jnp.issubdtype(x.dtype, jnp.inexact)
      ]
    )
  )


def _check_finite(step: int, ckpt, *, loss, state_finite: bool = True):
  """Raises NonFiniteError if the step's loss, or (when checked) its state, is NaN or infinite.

  Waits for pending checkpoint writes first, so that the checkpoint the
  message names is complete on disk.
  """
  if np.isfinite(loss) and state_finite:
    return
  ckpt.wait()
  latest = ckpt.latest_step()
  where = (
    "no checkpoint was saved before it"
    if latest is None
    else f"the newest checkpoint, step {latest} in {ckpt.directory}, is intact"
  )
  raise NonFiniteError(
    f"non-finite training at step {step} (loss {loss}"
    f"{'' if state_finite else ', and the state holds NaN or inf'}); nothing of that step "
    f"was saved and {where}. Rerunning the same config resumes from there and will diverge "
    "again; a changed recipe (e.g. a lower optimizer.base_lr) needs a new workdir"
  )

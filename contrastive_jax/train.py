"""The pretraining loop, shared by every method (SimCLR, MoCo, BYOL).

Reads top to bottom: check the config, build data, model, optimizer and state,
restore the latest checkpoint if the workdir has one, then step, log, evaluate
and checkpoint. Every random draw is a function of (seed, step), so a resumed
run continues bit for bit; SIGTERM saves a checkpoint and stops.
"""
import time
from typing import Any, Callable, NamedTuple

import jax
import ml_collections
import numpy as np
from absl import logging
from clu import periodic_actions

from contrastive_jax import augment
from contrastive_jax import checkpointing
from contrastive_jax import input_pipeline
from contrastive_jax import knn
from contrastive_jax import metrics as metrics_lib
from contrastive_jax import models
from contrastive_jax import optim
from contrastive_jax import train_state as ts
from contrastive_jax.errors import ConfigError
from contrastive_jax.methods import get_method


def check_config(config: ml_collections.ConfigDict, num_devices: int):
  """Raises ConfigError, naming the field, for a config that cannot run.

  Runs before any compute; dataset, method and checkpoint checks follow in
  train(), once the dataset's size is known.
  """
  get_method(config.method)
  if config.batch_size <= 0 or config.batch_size % num_devices:
    raise ConfigError("batch_size", config.batch_size,
                      f"a positive multiple of the number of devices ({num_devices})")
  if config.image_size <= 0:
    raise ConfigError("image_size", config.image_size, "> 0")
  if not 0 < config.crop_area_min <= 1:
    raise ConfigError("crop_area_min", config.crop_area_min, "in (0, 1]")
  if not 0 < config.eval_crop_fraction <= 1:
    raise ConfigError("eval_crop_fraction", config.eval_crop_fraction, "in (0, 1]")
  if config.num_epochs <= 0 and config.total_steps <= 0:
    raise ConfigError("total_steps", config.total_steps, "> 0 when num_epochs <= 0")
  positive = {"log_every_steps": config.log_every_steps,
              "checkpoint_every_steps": config.checkpoint_every_steps,
              "keep_checkpoints": config.keep_checkpoints, "data_threads": config.data_threads,
              "shuffle_buffer": config.shuffle_buffer,
              "knn.every_steps": config.knn.every_steps, "knn.k": config.knn.k,
              "knn.batch_size": config.knn.batch_size}
  for field, value in positive.items():
    if value <= 0:
      raise ConfigError(field, value, "an integer > 0")
  if not config.knn.temperature > 0:
    raise ConfigError("knn.temperature", config.knn.temperature, "> 0")
  if config.knn.batch_size % num_devices:
    raise ConfigError("knn.batch_size", config.knn.batch_size,
                      f"a multiple of the number of devices ({num_devices})")
  models.check_model_config(config.model)
  optim.check_optimizer_config(config.optimizer)
  views(config)


def views(config):
  """The (view 1, view 2) on-device augmentation settings of the config."""
  return (augment.ViewAugment.from_config(config.augment.view1, "augment.view1"),
          augment.ViewAugment.from_config(config.augment.view2, "augment.view2"))


def total_steps(config, steps_per_epoch: int) -> int:
  """config.total_steps if > 0, else num_epochs * steps_per_epoch."""
  return config.total_steps if config.total_steps > 0 else config.num_epochs * steps_per_epoch


class Run(NamedTuple):
  """What a config builds: the model, its lr schedule, init and train step."""
  model: Any
  schedule: Callable
  init: Callable          # () -> TrainState at step 0, replicated on the mesh.
  train_step: Callable    # (state, batch) -> (state, metrics), jitted, state donated.


def setup(config, mesh, steps_per_epoch: int, num_steps: int) -> Run:
  """Builds the method's model, optimizer, state initialiser and train step."""
  method = get_method(config.method)
  schedule = optim.learning_rate_schedule(config.optimizer, config.batch_size,
                                          steps_per_epoch, num_steps)
  tx = optim.build_optimizer(config.optimizer, schedule)
  model = method.build_model(config)
  init_rng, rng = jax.random.split(jax.random.PRNGKey(config.seed))
  init = jax.jit(lambda: method.init_state(config, model, tx, init_rng, rng),
                 out_shardings=ts.replicated(mesh))
  train_step = jax.jit(method.make_train_step(config, model, tx, views(config), mesh, num_steps),
                       donate_argnums=0)
  return Run(model, schedule, init, train_step)


def train(config: ml_collections.ConfigDict, workdir: str) -> ts.TrainState:
  """Pretrains with config.method; returns the final state.

  Writes WORKDIR/checkpoints (Orbax), TensorBoard events and metrics.jsonl.

  Raises:
    ConfigError: before any compute, for a config, dataset or workdir that
      cannot run.
  """
  workdir = checkpointing.resolve_dir(workdir)
  check_config(config, jax.device_count())
  method = get_method(config.method)
  builder = input_pipeline.get_builder(
      config.dataset, config.data_dir,
      {"train_split": config.train_split, "eval_split": config.eval_split,
       "knn.bank_split": config.knn.bank_split})
  num_train = builder.info.splits[config.train_split].num_examples
  steps_per_epoch = num_train // config.batch_size
  if steps_per_epoch == 0:
    raise ConfigError("batch_size", config.batch_size,
                      f"at most the size of split {config.train_split!r} ({num_train})")
  method.check_config(config, num_train)
  ckpt = checkpointing.Checkpointer(f"{workdir}/checkpoints",
                                    every_steps=config.checkpoint_every_steps,
                                    keep=config.keep_checkpoints)
  if ckpt.latest_step() is not None:
    ckpt.check_compatible(config)

  mesh = ts.make_mesh()
  num_steps = total_steps(config, steps_per_epoch)
  run = setup(config, mesh, steps_per_epoch, num_steps)
  if ckpt.latest_step() is None:
    state = run.init()
  else:
    state = ckpt.restore(checkpointing.abstract_like(jax.eval_shape(run.init),
                                                     ts.replicated(mesh)))
    logging.info("Resumed from %s at step %d.", ckpt.directory, ckpt.latest_step())
  start_step = int(state.step)

  local_batch = config.batch_size // jax.process_count()
  train_iter = input_pipeline.device_batches(
      input_pipeline.train_dataset(
          builder, config.train_split, local_batch=local_batch, image_size=config.image_size,
          crop_area_min=config.crop_area_min, seed=config.seed, start_step=start_step,
          cache=config.cache, shuffle_buffer=config.shuffle_buffer, threads=config.data_threads),
      ts.batch_sharded(mesh))

  embed_fn = knn.make_embed_fn(run.model.encoder, mesh)
  eval_kwargs = dict(local_batch=config.knn.batch_size // jax.process_count(),
                     image_size=config.image_size, crop_fraction=config.eval_crop_fraction,
                     threads=config.data_threads, cache=config.cache)
  knn_train_ds = input_pipeline.eval_dataset(builder, config.knn.bank_split, **eval_kwargs)
  knn_test_ds = input_pipeline.eval_dataset(builder, config.eval_split, **eval_kwargs)
  num_classes = builder.info.features["label"].num_classes

  def run_knn(state):
    result = knn.evaluate(embed_fn, method.encoder_variables(state), knn_train_ds, knn_test_ds,
                          mesh, num_classes=num_classes, k=config.knn.k,
                          temperature=config.knn.temperature)
    logging.info("Step %d: kNN top-1 %.4f.", int(state.step), result["knn_top1"])
    return result

  writer = metrics_lib.create_writer(workdir, resumed_step=ckpt.latest_step())
  with checkpointing.Preemption() as preemption:
    if start_step == 0:
      writer.write_hparams(config.to_dict())
      writer.write_scalars(0, run_knn(state))
    progress = periodic_actions.ReportProgress(num_train_steps=num_steps, every_secs=30)
    logging.info("Training %s from step %d to %d (%d steps per epoch, global batch %d, "
                 "%d devices).", config.method, start_step, num_steps, steps_per_epoch,
                 config.batch_size, jax.device_count())
    last_log_time, last_log_step, eval_seconds = time.time(), start_step, 0.0
    for step in range(start_step + 1, num_steps + 1):
      state, step_metrics = run.train_step(state, next(train_iter))
      progress(step)
      scalars = {}
      if step % config.log_every_steps == 0 or step == num_steps:
        scalars = jax.device_get(step_metrics)
        if not np.isfinite(scalars["loss"]):
          raise FloatingPointError(
              f"loss is {scalars['loss']} at step {step} (the newest checkpoint in "
              f"{ckpt.directory} is step {ckpt.latest_step()}); lower optimizer.base_lr "
              "or check the config")
        train_seconds = time.time() - last_log_time - eval_seconds
        scalars["learning_rate"] = run.schedule(step - 1)
        scalars["images_per_sec"] = (step - last_log_step) * config.batch_size / train_seconds
        last_log_time, last_log_step, eval_seconds = time.time(), step, 0.0
      if step % config.knn.every_steps == 0 or step == num_steps:
        t0 = time.time()
        scalars.update(run_knn(state))
        eval_seconds += time.time() - t0
      if scalars:
        writer.write_scalars(step, scalars)
      stop = preemption.requested or ckpt.reached_preemption(step)
      ckpt.save(step, state, config, force=stop or step == num_steps)
      if stop:
        logging.warning("Stopped at step %d after a preemption request.", step)
        break
  writer.flush()
  ckpt.close()
  return state

"""Linear probe job: a linear classifier on the frozen encoder's features h.

  python -m contrastive_jax.linear_probe --config=configs/linear_probe.py \
      --config.pretrain_workdir=PRETRAIN_DIR --workdir=PROBE_DIR

Restores the encoder (params and BN statistics; MoCo's query encoder, BYOL's
online encoder) from the pretraining workdir's Orbax checkpoint, onto however
many devices this job has, and rebuilds it from the config saved with the
checkpoint. The encoder stays frozen: eval-mode BN, no gradient, variables
never written. Protocol (SimCLR Sec. 4 / MoCo Sec. 4.1): features h before
the projection head, random crop-and-flip on train images, SGD with momentum
and cosine decay, no weight decay; top-1 and top-5 on every test image once.
A BN without affine parameters standardises h before the linear layer
(a fixed per-feature affine map, so the classifier stays linear) and makes one
learning rate fit every encoder, the random baseline included.
"""
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tensorflow as tf
from absl import app
from absl import flags
from absl import logging
from clu import periodic_actions
from ml_collections import config_flags

from contrastive_jax import checkpointing
from contrastive_jax import input_pipeline
from contrastive_jax import metrics as metrics_lib
from contrastive_jax import optim
from contrastive_jax import train
from contrastive_jax import train_state as ts
from contrastive_jax.errors import ConfigError
from contrastive_jax.methods import get_method

# Fields a resumed probe must share with its checkpoint (see checkpointing.IDENTITY_FIELDS).
PROBE_IDENTITY_FIELDS = ("pretrain_workdir", "pretrain_step", "random_init", "dataset",
                         "train_split", "crop_area_min", "batch_size", "seed", "num_epochs",
                         "total_steps", "optimizer", "shuffle_buffer")

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/linear_probe.py[:runlocal]",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for the probe's checkpoints and metrics.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() first (multi-host TPU pods).")


class LinearHead(nn.Module):
  """Affine-free BN then Dense: [N, D] float32 features -> [N, num_classes] logits."""
  num_classes: int

  @nn.compact
  def __call__(self, h, train: bool):
    h = nn.BatchNorm(use_running_average=not train, use_scale=False, use_bias=False,
                     momentum=0.9, epsilon=1e-6)(h)
    return nn.Dense(self.num_classes, kernel_init=nn.initializers.zeros)(h)


def restore_encoder(config, mesh):
  """The pretrained (or, with config.random_init, freshly initialised) encoder.

  Returns (encoder module, its {'params', 'batch_stats'} replicated on mesh,
  the pretraining config, the checkpoint step).

  Raises:
    ConfigError: pretrain_workdir with no checkpoint, a pretrain_step that was
      not saved (the saved ones are listed), or a model_name that differs from
      the checkpoint's model.
  """
  directory = f"{checkpointing.resolve_dir(config.pretrain_workdir or '')}/checkpoints"
  if not config.pretrain_workdir or not tf.io.gfile.isdir(directory):
    raise ConfigError("pretrain_workdir", config.pretrain_workdir,
                      f"a pretraining workdir with Orbax checkpoints in WORKDIR/checkpoints "
                      f"(looked in {directory})")
  ckpt = checkpointing.Checkpointer(directory, read_only=True)
  step = ckpt.resolve_step(None if config.pretrain_step < 0 else config.pretrain_step,
                           "pretrain_step")
  saved = ckpt.saved_config(step)
  if config.model_name and config.model_name != saved.model.name:
    raise ConfigError("model_name", config.model_name,
                      f"{saved.model.name!r}, the model of the checkpoint in {directory}")
  method = get_method(saved.method)
  run = train.setup(saved, mesh, steps_per_epoch=1, num_steps=1)  # Same state structure.
  if config.random_init:
    state = run.init()
  else:
    state = ckpt.restore(checkpointing.abstract_like(jax.eval_shape(run.init),
                                                     ts.replicated(mesh)), step)
  ckpt.close()
  return run.model.encoder, method.encoder_variables(state), saved, step


def check_config(config, num_devices: int):
  """Raises ConfigError for probe fields that cannot run (before any compute)."""
  for field in ("batch_size", "eval_batch_size"):
    if config[field] <= 0 or config[field] % num_devices:
      raise ConfigError(field, config[field],
                        f"a positive multiple of the number of devices ({num_devices})")
  if config.num_epochs <= 0 and config.total_steps <= 0:
    raise ConfigError("total_steps", config.total_steps, "> 0 when num_epochs <= 0")
  for field in ("log_every_steps", "checkpoint_every_steps", "shuffle_buffer", "data_threads"):
    if config[field] <= 0:
      raise ConfigError(field, config[field], "an integer > 0")
  if not 0 < config.crop_area_min <= 1:
    raise ConfigError("crop_area_min", config.crop_area_min, "in (0, 1]")
  optim.check_optimizer_config(config.optimizer)


def make_steps(encoder, head, tx):
  """Jitted train and eval steps; encoder variables are an argument, never updated."""

  def features(enc_vars, images):
    h = encoder.apply(enc_vars, images.astype(jnp.float32) / 255.0, train=False)
    return jax.lax.stop_gradient(h)

  def train_step(state, enc_vars, batch):
    h = features(enc_vars, batch["image"][:, 0])

    def loss_fn(params):
      logits, updates = head.apply({"params": params, "batch_stats": state.batch_stats}, h,
                                   train=True, mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
      return loss, (updates["batch_stats"], logits)

    (loss, (stats, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    top1 = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return ts.apply_gradients(state, grads, tx, batch_stats=stats), {"loss": loss,
                                                                     "train_top1": top1}

  def eval_step(state, enc_vars, batch):
    logits = head.apply({"params": state.params, "batch_stats": state.batch_stats},
                        features(enc_vars, batch["image"]), train=False)
    top5 = jax.lax.top_k(logits, 5)[1]
    hit1 = top5[:, 0] == batch["label"]
    hit5 = jnp.any(top5 == batch["label"][:, None], axis=1)
    return jnp.sum(hit1 & batch["mask"]), jnp.sum(hit5 & batch["mask"]), jnp.sum(batch["mask"])

  return jax.jit(train_step, donate_argnums=0), jax.jit(eval_step)


def evaluate(eval_step, state, enc_vars, ds, mesh) -> dict:
  """{'top1', 'top5'}: fractions of the split's images, each counted once."""
  totals = np.zeros(3, np.int64)
  for batch in input_pipeline.device_batches(ds, ts.batch_sharded(mesh)):
    # The counts are global sums, replicated: read this process's copy.
    totals += [int(c.addressable_data(0)) for c in eval_step(state, enc_vars, batch)]
  return {"top1": totals[0] / totals[2], "top5": totals[1] / totals[2]}


def probe(config: ml_collections.ConfigDict, workdir: str):
  """Trains and evaluates the linear probe; returns (final head state, encoder variables, metrics)."""
  workdir = checkpointing.resolve_dir(workdir)
  check_config(config, jax.device_count())
  mesh = ts.make_mesh()
  ckpt = checkpointing.Checkpointer(f"{workdir}/checkpoints",
                                    every_steps=config.checkpoint_every_steps, keep=2)
  config = config.copy_and_resolve_references()
  if ckpt.latest_step() is not None:
    ckpt.check_compatible(config, fields=("pretrain_workdir", "random_init"))
    if config.pretrain_step < 0:
      # Resuming "the latest": keep probing the encoder this probe started with.
      config.pretrain_step = ckpt.saved_config().pretrain_step
  encoder, enc_vars, saved, config.pretrain_step = restore_encoder(config, mesh)
  builder = input_pipeline.get_builder(config.dataset, config.data_dir,
                                       {"train_split": config.train_split,
                                        "eval_split": config.eval_split})
  num_classes = builder.info.features["label"].num_classes
  steps_per_epoch = builder.info.splits[config.train_split].num_examples // config.batch_size
  if steps_per_epoch == 0:
    raise ConfigError("batch_size", config.batch_size,
                      f"at most the size of split {config.train_split!r}")
  num_steps = train.total_steps(config, steps_per_epoch)
  schedule = optim.learning_rate_schedule(config.optimizer, config.batch_size, steps_per_epoch,
                                          num_steps)
  tx = optim.build_optimizer(config.optimizer, schedule)
  head = LinearHead(num_classes)
  feature_dim = jax.eval_shape(
      lambda v: encoder.apply(v, jnp.zeros((1, saved.image_size, saved.image_size, 3)),
                              train=False), enc_vars).shape[-1]

  def init():
    variables = head.init(jax.random.PRNGKey(config.seed), jnp.zeros((1, feature_dim)),
                          train=False)
    return ts.TrainState(step=jnp.zeros((), jnp.int32), params=variables["params"],
                         batch_stats=variables["batch_stats"],
                         opt_state=tx.init(variables["params"]),
                         rng=jax.random.PRNGKey(config.seed))

  init = jax.jit(init, out_shardings=ts.replicated(mesh))
  if ckpt.latest_step() is not None:
    ckpt.check_compatible(config, fields=PROBE_IDENTITY_FIELDS)
    state = ckpt.restore(checkpointing.abstract_like(jax.eval_shape(init), ts.replicated(mesh)))
  else:
    state = init()
  start_step = int(state.step)

  train_step, eval_step = make_steps(encoder, head, tx)
  train_iter = input_pipeline.device_batches(
      input_pipeline.train_dataset(
          builder, config.train_split, local_batch=config.batch_size // jax.process_count(),
          image_size=saved.image_size, crop_area_min=config.crop_area_min, seed=config.seed,
          start_step=start_step, cache=config.cache, shuffle_buffer=config.shuffle_buffer,
          threads=config.data_threads, num_views=1),
      ts.batch_sharded(mesh))
  test_ds = input_pipeline.eval_dataset(
      builder, config.eval_split, local_batch=config.eval_batch_size // jax.process_count(),
      image_size=saved.image_size, crop_fraction=saved.eval_crop_fraction,
      threads=config.data_threads)
  writer = metrics_lib.create_writer(workdir, resumed_step=ckpt.latest_step())
  logging.info("Probing %s encoder (%s, step %d of %s) for %d steps.",
               "a randomly initialised" if config.random_init else "the pretrained",
               saved.method, config.pretrain_step, config.pretrain_workdir, num_steps)
  result = {}
  t0 = time.time()
  progress = periodic_actions.ReportProgress(num_train_steps=num_steps, every_secs=30)
  with checkpointing.Preemption() as preemption:
    for step in range(start_step + 1, num_steps + 1):
      state, step_metrics = train_step(state, enc_vars, next(train_iter))
      progress(step)
      scalars = {}
      if step % config.log_every_steps == 0 or step == num_steps:
        scalars = dict(jax.device_get(step_metrics), learning_rate=schedule(step - 1),
                       steps_per_sec=(step - start_step) / (time.time() - t0))
      if step == num_steps:
        result = evaluate(eval_step, state, enc_vars, test_ds, mesh)
        scalars.update(result)
        logging.info("Linear probe: top-1 %.4f, top-5 %.4f.", result["top1"], result["top5"])
      if scalars:
        writer.write_scalars(step, scalars)
      ckpt.save(step, state, config, force=preemption.requested or step == num_steps)
      if preemption.requested:
        break
  if not result and int(state.step) == num_steps:  # Resumed a finished probe.
    result = evaluate(eval_step, state, enc_vars, test_ds, mesh)
  writer.flush()
  ckpt.close()
  return state, enc_vars, result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  metrics_lib.quiet_library_logs()
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  try:
    probe(_CONFIG.value, _WORKDIR.value)
  except ConfigError as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)

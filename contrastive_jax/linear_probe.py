"""The linear-probe job (config.job='linear_probe'): a linear classifier on frozen h.

  python -m contrastive_jax.main --config=configs/linear_probe.py \
      --config.pretrain_workdir=PRETRAIN_DIR --workdir=PROBE_DIR

Restores only the encoder (params and BN statistics; MoCo's query encoder,
BYOL's online encoder) from the pretraining workdir's Orbax checkpoint, with
a partial restore onto however many devices this job has, and rebuilds it
from the config saved with the checkpoint. The encoder stays frozen: eval-mode
BN, no gradient, variables never written. Protocol (SimCLR Sec. 4 / MoCo Sec.
4.1): features h before the projection head, random crop-and-flip on train
images, SGD with momentum and cosine decay, no weight decay; accuracy on
every test image once (the config's 'classifier' evaluator). A BN without
affine parameters standardises h before the linear layer (a fixed
per-feature affine map, so the classifier stays linear) and makes one
learning rate fit every encoder, the random baseline included.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import tensorflow as tf
from absl import logging

from contrastive_jax import checkpointing
from contrastive_jax import config_lib
from contrastive_jax import data
from contrastive_jax import evaluators
from contrastive_jax import gcs
from contrastive_jax import input_pipeline
from contrastive_jax import models
from contrastive_jax import optim
from contrastive_jax import pretrain
from contrastive_jax import runner
from contrastive_jax import train_state as ts
from contrastive_jax.errors import ConfigError
from contrastive_jax.methods import ENCODER
from contrastive_jax.methods import encoder_variables

# Fields a resumed probe must share with its checkpoint; the first exists only
# in probe configs.
IDENTITY_FIELDS = ("pretrain_workdir", "pretrain_step", "random_init", "data_source", "dataset",
                   "train_split", "crop_area_min", "batch_size", "seed", "duration",
                   "optimizer", "shuffle_buffer")


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
  the pretraining config, the checkpoint step). Only the encoder is read from
  the checkpoint (a partial restore).

  Raises:
    ConfigError: pretrain_workdir with no checkpoint, a pretrain_step that was
      not saved (the saved ones are listed), or a model_name that differs from
      the checkpoint's model.
    JobError: a gs:// pretrain_workdir without Google Cloud credentials.
  """
  gcs.check_credentials(config.pretrain_workdir or "", "config.pretrain_workdir")
  directory = f"{checkpointing.resolve_dir(config.pretrain_workdir or '')}/checkpoints"
  if not config.pretrain_workdir or not tf.io.gfile.isdir(directory):
    raise ConfigError("pretrain_workdir", config.pretrain_workdir,
                      f"a pretraining workdir with Orbax checkpoints in WORKDIR/checkpoints "
                      f"(looked in {directory})")
  ckpt = checkpointing.Checkpointer(directory, read_only=True)
  try:
    step = ckpt.resolve_step(None if config.pretrain_step < 0 else config.pretrain_step,
                             "pretrain_step")
    saved = ckpt.saved_config(step)
    if "method" not in saved:
      raise ConfigError("pretrain_workdir", config.pretrain_workdir,
                        "a pretraining workdir; its checkpoints were written by another kind "
                        "of job")
    if config.model_name and config.model_name != saved.model.name:
      raise ConfigError("model_name", config.model_name,
                        f"{saved.model.name!r}, the model of the checkpoint in {directory}")
    encoder = models.build_encoder(saved.model)
    replicated = ts.replicated(mesh)
    if config.random_init:  # The pretraining run's own initialisation, as it drew it.
      init = pretrain.setup(saved, mesh, steps_per_epoch=1, num_steps=1).init
      variables = jax.jit(lambda: encoder_variables(init()), out_shardings=replicated)()
    else:
      x = jnp.zeros((1, saved.image_size, saved.image_size, 3), jnp.float32)
      shapes = jax.eval_shape(lambda: encoder.init(jax.random.PRNGKey(0), x, train=False))
      abstract = checkpointing.abstract_like(
          {name: {ENCODER: shapes[name]} for name in ("params", "batch_stats")}, replicated)
      variables = encoder_variables(ckpt.restore_partial(abstract, step))
  finally:
    ckpt.close()
  return encoder, variables, saved, step


def check_config(config, num_devices: int):
  """Raises ConfigError for probe fields that cannot run (before any compute)."""
  runner.check_config(config, num_devices)
  if not 0 < config.crop_area_min <= 1:
    raise ConfigError("crop_area_min", config.crop_area_min, "in (0, 1]")
  optim.check_optimizer_config(config.optimizer)


def make_train_step(encoder, head, tx):
  """Jitted (state, encoder variables, batch) -> (state, metrics); the encoder is never updated.

  batch: {'image': uint8 [B, 1, S, S, 3] (one crop per image), 'label': int32 [B]}.
  metrics: float32 'loss' (cross-entropy), 'train_top1' and apply_gradients' norms.
  """

  def train_step(state, enc_vars, batch):
    h = jax.lax.stop_gradient(models.encode(encoder, enc_vars, batch["image"][:, 0]))

    def loss_fn(params):
      logits, updates = head.apply({"params": params, "batch_stats": state.batch_stats}, h,
                                   train=True, mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
      return loss, (updates["batch_stats"], logits)

    (loss, (stats, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    top1 = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    state, health = ts.apply_gradients(state, grads, tx, batch_stats=stats)
    return state, {"loss": loss, "train_top1": top1, **health}

  return jax.jit(train_step, donate_argnums=0)


def build(config, mesh, saved_config) -> runner.Task:
  """The probe Task for runner.run.

  Resuming a probe started on "the latest" checkpoint keeps probing the
  encoder it started with (saved_config.pretrain_step).

  Raises:
    ConfigError: see restore_encoder; an unlabeled dataset; a batch larger
      than the train split; an evaluator that cannot run.
  """
  config = config.copy_and_resolve_references()
  source = data.get_source(config, {"train_split": config.train_split})
  if source.num_classes is None:
    raise ConfigError("dataset", config.dataset,
                      "a labelled dataset: the linear probe trains on labels")
  evaluators.check_config(config.evaluators, source, jax.device_count())
  steps_per_epoch = runner.steps_per_epoch(source, config)
  num_steps = config_lib.to_steps(config.duration, "duration", steps_per_epoch)
  if saved_config is not None and config.pretrain_step < 0:
    config.pretrain_step = saved_config.pretrain_step
  encoder, enc_vars, pretrained, config.pretrain_step = restore_encoder(config, mesh)
  schedule = optim.learning_rate_schedule(config.optimizer, config.batch_size, steps_per_epoch,
                                          num_steps)
  tx = optim.build_optimizer(config.optimizer, schedule)
  head = LinearHead(source.num_classes)
  feature_dim = jax.eval_shape(functools.partial(models.encode, encoder, enc_vars),
                               jax.ShapeDtypeStruct((1, pretrained.image_size,
                                                     pretrained.image_size, 3),
                                                    jnp.uint8)).shape[-1]

  def init():
    variables = head.init(jax.random.PRNGKey(config.seed), jnp.zeros((1, feature_dim)),
                          train=False)
    return ts.TrainState(step=jnp.zeros((), jnp.int32), params=variables["params"],
                         batch_stats=variables["batch_stats"],
                         opt_state=tx.init(variables["params"]),
                         rng=jax.random.PRNGKey(config.seed))

  step_fn = make_train_step(encoder, head, tx)

  def logits(variables, images):
    enc, head_vars = variables
    return head.apply(head_vars, models.encode(encoder, enc, images), train=False)

  logging.info("Probing %s encoder (%s, step %d of %s).",
               "a randomly initialised" if config.random_init else "the pretrained",
               pretrained.method, config.pretrain_step, config.pretrain_workdir)
  eval_model = evaluators.EvalModel(
      variables=lambda state: (enc_vars, {"params": state.params,
                                          "batch_stats": state.batch_stats}),
      features=lambda variables, images: models.encode(encoder, variables[0], images),
      logits=logits,
      dataset=pretrain.eval_datasets(source, image_size=pretrained.image_size,
                                     crop_fraction=pretrained.eval_crop_fraction,
                                     threads=config.data_threads, cache=config.cache))
  return runner.Task(config=config, init=jax.jit(init, out_shardings=ts.replicated(mesh)),
                     train_step=lambda state, batch: step_fn(state, enc_vars, batch),
                     train_batches=input_pipeline.train_batches(
                         source, config, ts.batch_sharded(mesh),
                         image_size=pretrained.image_size, num_views=1),
                     num_steps=num_steps,
                     steps_per_epoch=steps_per_epoch, global_batch=config.batch_size,
                     schedule=schedule, eval_model=eval_model, num_classes=source.num_classes)

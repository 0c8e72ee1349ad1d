"""The pretraining job (config.job='pretrain'): SimCLR, MoCo v1/v2, MoCo v3, BYOL, DINO or
distillation from a frozen teacher.

Builds what runner.run() steps: the method's model, optimizer, state and
train step, the host input pipeline (or, with config.on_device_data, the
train split held and cropped on the device: data/device_data.py and
device_samplers.py) and the evaluators' view of the model (the kNN monitor on the h of
methods.evaluated_encoder, DINO's teacher; the online probe's classifier).
Every random draw is a function of (seed, step), so a resumed run continues
bit for bit. With config.init_from=FILE (a torchvision / timm / MoCo / DINO
weights file) every network starts from that file's encoder and the heads
from the method's initialisation; a DINO run from DINO's own training
checkpoint starts its student, teacher (encoders and heads) and centre from it.
With config.init_config too (the config of the file's model, as the downstream
jobs' pretrain_config: e.g. configs/dinov2.py:MODEL for a DINOv2 backbone) the
run's model is that config's (with_init_model), so that a DINO run continues a
foundation model: student and teacher from the file, the DINO heads new. A method
that reads something outside the workdir at every start (distillation's teacher) has it
recorded in the config first (methods.OptionalAttributes.recorded_config), so that the
resume check stops a run whose teacher changed.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from contrastive_jax import models
from contrastive_jax.core import durations
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import pictures
from contrastive_jax.core import tensor_files
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.data import crop_spec
from contrastive_jax.data import device_data
from contrastive_jax.data import device_samplers
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import sources
from contrastive_jax.methods import common
from contrastive_jax.methods import encoder_variables
from contrastive_jax.methods import evaluated_encoder
from contrastive_jax.methods import get_method
from contrastive_jax.methods import optim
from contrastive_jax.methods import optional_attributes
from contrastive_jax.methods import pretraining
from contrastive_jax.methods import with_encoder
from contrastive_jax.models import state_dicts
from contrastive_jax.training import evaluators
from contrastive_jax.training import restore
from contrastive_jax.training import runner


def check_config(config: ml_collections.ConfigDict, num_devices: int):
  """Raises ConfigError, naming the field, for a config that cannot run.

  Runs before any compute; dataset, evaluator and method checks follow in
  build(), once the dataset is known. Checks the config with_init_model gives.
  """
  config = with_init_model(config)
  runner.check_config(config, num_devices)
  get_method(config.method)
  if config.image_size <= 0:
    raise ConfigError("image_size", config.image_size, "> 0")
  crop_spec.check_config(config)
  crop_spec.check_local_crops(config)
  if config.get("local_crops") is not None and not optional_attributes(config.method).local_crops:
    raise ConfigError(
      "local_crops",
      config.local_crops.to_dict(),
      f"absent for method {config.method!r}, which trains on two views",
    )
  if not 0 < config.eval_crop_fraction <= 1:
    raise ConfigError("eval_crop_fraction", config.eval_crop_fraction, "in (0, 1]")
  if not config.online_probe.learning_rate > 0:
    raise ConfigError("online_probe.learning_rate", config.online_probe.learning_rate, "> 0")
  models.check_model_config(config.model, config.image_size)
  optim.check_optimizer_config(config.optimizer)
  pretraining.views(config)


def build(config, mesh, saved_config, workdir) -> runner.Task:
  """The pretraining Task for runner.run (see its docstring).

  Raises:
    ConfigError: unknown data source or dataset, missing data, empty split,
      a batch larger than the train split, an evaluator or method field that
      cannot run.
  """
  del workdir
  config = with_init_model(config)
  method = get_method(config.method)
  recorded = optional_attributes(config.method).recorded_config
  if recorded is not None:  # What the run reads from outside (a teacher), recorded.
    config = recorded(config, restore.checkpoint_encoder)
  # Read before any compute, and only when starting: a resumed run restores its state.
  start = imported_start(config) if config.get("init_from") and saved_config is None else None
  source = sources.get_source(config, {"train_split": config.train_split})
  evaluators.check_config(config.evaluators, source, jax.device_count())
  steps_per_epoch = runner.steps_per_epoch(source, config)
  method.check_config(config, source.num_examples(config.train_split, "train_split"))
  num_steps = durations.to_steps(config.duration, "duration", steps_per_epoch)
  train_batches = (
    on_device_batches(config, source, mesh, num_steps)
    if config.get("on_device_data", False)
    else input_pipeline.train_batches(
      source, config, mesh_lib.batch_sharded(mesh), image_size=config.image_size
    )
  )
  run = pretraining.setup(config, mesh, steps_per_epoch, num_steps, source.num_classes or 0, start)

  encoder = run.model.encoder
  monitored = evaluated_encoder(config.method)

  def logits(variables, images):
    h = models.encode(encoder, variables["encoder"], images)
    return run.probe.head.apply({"params": variables["probe"]}, h)

  # The kNN monitor's features are the method's monitored encoder's (DINO's teacher);
  # the online probe's logits, the encoder it was trained on.
  eval_model = evaluators.EvalModel(
    variables=lambda state: {
      "encoder": encoder_variables(state),
      "monitored": monitored(state),
      "probe": state.probe.get("params"),
    },
    features=lambda variables, images: models.encode(encoder, variables["monitored"], images),
    logits=logits if run.probe else None,
    dataset=input_pipeline.eval_datasets(
      source,
      eval_crop=input_pipeline.EvalCrop.of(config),
      threads=config.data_threads,
      cache=config.cache,
    ),
  )
  return runner.Task(
    config=config,
    init=run.init,
    train_step=run.train_step,
    train_batches=train_batches,
    num_steps=num_steps,
    steps_per_epoch=steps_per_epoch,
    global_batch=config.batch_size,
    schedule=run.schedule,
    eval_model=eval_model,
    num_classes=source.num_classes,
    views_picture=views_picture(pretraining.views(config), mesh),
  )


def on_device_batches(config, source, mesh, num_steps: int):
  """train_batches of config.on_device_data: the train split read once, replicated on the
  mesh, its batches cropped and flipped on the device (data/device_samplers.py).

  Raises:
    ConfigError: a split whose images differ in size or that does not fit the
      devices (device_data.check_config), checked before it is read.
  """
  device_data.check_config(config, source, num_steps)
  images, labels = device_data.read_split(source, config.train_split)
  return device_samplers.train_batches(
    device_data.to_mesh(images, labels, mesh), config, mesh, image_size=config.image_size
  )


def with_init_model(config) -> ml_collections.ConfigDict:
  """config, or with config.init_config set, a copy whose model is that config's: the model of
  the weights file config.init_from (restore.weights_config, the downstream jobs' reading of
  a file's model), with its architecture, compute dtype and input standardisation; the run's
  data, views, method and image size stay its own. The checkpoints save the copy, so that the
  downstream jobs read the run's model from them, and a resumed run (given the same fields)
  computes the same one.

  Raises:
    ConfigError: init_config without init_from.
    JobError: an init_config that cannot be loaded.
  """
  if not config.get("init_config"):
    return config
  if not config.get("init_from"):
    raise ConfigError(
      "init_config",
      config.init_config,
      "unset without init_from: it names the model of the weights file init_from",
    )
  model = restore.weights_config(config.init_from, config.init_config, "init_config").model
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.model = model
  return config


def imported_start(config):
  """(replace, variables) of config.init_from for pretraining.setup's start: a DINO run
  from DINO's own main_dino.py checkpoint continues its student, teacher and centre
  (the method's optional imported_state and with_imported: methods.OptionalAttributes);
  otherwise every network starts from the file's encoder (methods.with_encoder of
  state_dicts.from_state_dict: a torchvision / timm / MoCo / DINO weights file), for
  config.model at config.image_size.

  Raises:
    WeightsError: a file that cannot be read or does not fit config.model (one line).
  """
  path, own = config.init_from, optional_attributes(config.method)
  entries = tensor_files.read_entries(path)
  imported = own.imported_state(entries, path, config) if own.imported_state else None
  if imported is not None:
    return own.with_imported, imported
  tensors = tensor_files.state_dict(entries, path)
  return with_encoder, state_dicts.from_state_dict(tensors, path, config.model, config.image_size)


def views_picture(view_settings, mesh, count: int = 16):
  """(state, batch) -> uint8 picture of both augmented views of the batch's first images.

  The views are made by common.augmented_views in the train step's own shard_map
  layout, with the state's key and step, so they are exactly the pixels the
  train step sees (before the model's input normalisation). The picture shows
  the first n = min(count, batch) images in rows of ceil(n / 4), so at most 4
  rows (a batch of 8: 4 rows of 2), each image as its view 1 then view 2,
  captioned '<row in batch>: 1' and '<row in batch>: 2'; cells are at least 64 px.
  """

  def per_device(state, images):
    return jnp.stack(common.augmented_views(images, state.rng, state.step, view_settings), axis=1)

  sharded = jax.shard_map(
    per_device,
    mesh=mesh,
    in_specs=(jax.P(), jax.P(mesh_lib.DATA_AXIS)),
    out_specs=jax.P(mesh_lib.DATA_AXIS),
  )
  first = jax.jit(
    lambda state, images: sharded(state, images)[:count], out_shardings=mesh_lib.replicated(mesh)
  )

  def picture(state, batch):
    x = np.asarray(jax.device_get(first(state, batch["image"])))  # [n, 2, S, S, 3]
    x = np.round(np.clip(x, 0.0, 1.0) * 255).astype(np.uint8)
    n = len(x)
    per_row = -(-n // 4)
    rows = [range(start, min(start + per_row, n)) for start in range(0, n, per_row)]
    return pictures.grid(
      [[x[i, v] for i in row for v in range(2)] for row in rows],
      [[f"{i}: {v + 1}" for i in row for v in range(2)] for row in rows],
      cell=max(64, x.shape[2]),
    )

  return picture

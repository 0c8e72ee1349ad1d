"""What the jobs on a pretrained encoder share: the linear probe and fine-tuning.

Both restore only the encoder (params and BN statistics; MoCo's query
encoder, BYOL's online encoder) of a pretraining workdir's Orbax checkpoint,
with a partial restore onto however many devices the job has, and rebuild it
from the config saved with the checkpoint; or, with config.random_init, take
the pretraining run's own initialisation of it (the baseline); or read a
weights file (docs/weights.md) as the model of config.pretrain_config. Both train on
one random crop-and-flip per labelled image and are evaluated at the
pretraining run's image size and eval crop.
"""
import functools
import json
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import tensorflow as tf

from contrastive_jax.core import checkpointing
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import ForeignCheckpointError
from contrastive_jax.core import files
from contrastive_jax.core import gcs
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import tensor_files
from contrastive_jax.data import crops
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import sources
from contrastive_jax.jobs import evaluators
from contrastive_jax.jobs import runner
from contrastive_jax.methods import ENCODER
from contrastive_jax.methods import encoder_variables
from contrastive_jax.methods import initial_encoder_variables
from contrastive_jax.methods import optim
from contrastive_jax import models
from contrastive_jax.models import state_dicts
from contrastive_jax import recipes

# What the export job (export.py) writes beside an export, last: its run's config included.
EXPORT_META = "export.json"


class Encoder(NamedTuple):
  """A restored encoder.

  module: the ResNet or ViT (models.build_encoder of the pretraining config's model).
  variables: its {'params', 'batch_stats'} ({} for a ViT), replicated on the mesh.
  pretrained: the pretraining run's config (image_size, eval_crop_fraction, ...).
  step: the checkpoint step it comes from.
  dim: the size D of its representation h.
  """
  module: Any
  variables: Any
  pretrained: ml_collections.ConfigDict
  step: int
  dim: int


def check_config(config, num_devices: int):
  """Raises ConfigError for the shared fields that cannot run (before any compute)."""
  runner.check_config(config, num_devices)
  crops.check_config(config)
  optim.check_optimizer_config(config.optimizer)


def labelled_source(config, job: str):
  """The data source of config.train_split, checked with the config's evaluators.

  Raises:
    ConfigError: see sources.get_source and evaluators.check_config; an
      unlabeled dataset (`job`, e.g. 'the linear probe', trains on labels).
  """
  source = sources.get_source(config, {"train_split": config.train_split})
  if source.num_classes is None:
    raise ConfigError("dataset", config.dataset, f"a labelled dataset: {job} trains on labels")
  evaluators.check_config(config.evaluators, source, jax.device_count())
  return source


def restore_encoder(config, mesh, saved_config=None) -> Encoder:
  """The pretrained (or, with config.random_init, freshly initialised) encoder.

  Only the encoder is read from the checkpoint (a partial restore). A job
  resumed from saved_config (its own checkpoint's config) that was started on
  "the latest" pretraining checkpoint keeps the step it started with.

  Raises:
    ConfigError: pretrain_workdir with no checkpoint or with checkpoints of
      another tool, a pretrain_step that was not saved (the saved ones are
      listed), checkpoints of another kind of job, or a model_name that
      differs from the checkpoint's model.
    JobError: a gs:// pretrain_workdir without Google Cloud credentials.
  """
  gcs.check_credentials(config.pretrain_workdir or "", "config.pretrain_workdir")
  if tensor_files.is_weights_file(config.pretrain_workdir or ""):
    return _imported_encoder(config, mesh)
  directory = f"{files.resolve_dir(config.pretrain_workdir or '')}/checkpoints"
  if not config.pretrain_workdir or not tf.io.gfile.isdir(directory):
    raise ConfigError("pretrain_workdir", config.pretrain_workdir,
                      f"a pretraining workdir with Orbax checkpoints in WORKDIR/checkpoints "
                      f"(looked in {directory})")
  pretrain_step = config.pretrain_step
  if saved_config is not None and pretrain_step < 0:
    pretrain_step = saved_config.pretrain_step
  ckpt = checkpointing.Checkpointer(directory, read_only=True)
  try:
    try:
      step = ckpt.resolve_step(None if pretrain_step < 0 else pretrain_step, "pretrain_step")
      saved = ckpt.saved_config(step)
    except ForeignCheckpointError as e:
      raise ConfigError("pretrain_workdir", config.pretrain_workdir,
                        f"a pretraining workdir of contrastive_jax; {e}") from None
    if "method" not in saved:
      raise ConfigError("pretrain_workdir", config.pretrain_workdir,
                        "a pretraining workdir; its checkpoints were written by another kind "
                        "of job")
    if config.model_name and config.model_name != saved.model.name:
      raise ConfigError("model_name", config.model_name,
                        f"{saved.model.name!r}, the model of the checkpoint in {directory}")
    encoder = models.build_encoder(saved.model)
    replicated = mesh_lib.replicated(mesh)
    if config.random_init:  # The pretraining run's own initialisation, as it drew it.
      variables = jax.jit(lambda: initial_encoder_variables(saved), out_shardings=replicated)()
    else:
      x = jnp.zeros((1, saved.image_size, saved.image_size, 3), jnp.float32)
      shapes = jax.eval_shape(lambda: encoder.init(jax.random.PRNGKey(0), x, train=False))
      # A ViT has no 'batch_stats': nothing of it is saved, so nothing is asked for.
      abstract = checkpointing.abstract_like(
          {name: {ENCODER: shapes[name]} for name in ("params", "batch_stats")
           if name in shapes}, replicated)
      variables = encoder_variables(ckpt.restore_partial(abstract, step))
  finally:
    ckpt.close()
  dim = jax.eval_shape(functools.partial(models.encode, encoder, variables),
                       jax.ShapeDtypeStruct((1, saved.image_size, saved.image_size, 3),
                                            jnp.uint8)).shape[-1]
  return Encoder(encoder, variables, saved, step, dim)


def _imported_encoder(config, mesh) -> Encoder:
  """The encoder of the weights file config.pretrain_workdir, as config.pretrain_config's model
  (models/state_dicts.py), or, for a file the export job wrote, its run's config from
  EXPORT_META beside it; that config's image size and eval crop, step 0.

  Raises:
    ConfigError: no pretrain_config, random_init set, a model_name that differs.
    JobError: a config file that cannot be loaded; a weights file that does not fit.
  """
  path = config.pretrain_workdir
  if config.random_init:
    raise ConfigError("random_init", config.random_init,
                      "False with a weights file: its run's initialisation is not in it")
  if config.get("pretrain_config"):
    pretrained = recipes.load_config_file(config.pretrain_config, "config.pretrain_config")
  else:
    pretrained = _exported_config(path)
    if pretrained is None:
      raise ConfigError("pretrain_config", config.get("pretrain_config"),
                        "the pretraining config (configs/X.py[:VARIANT]) whose model the "
                        f"weights file {path} holds, e.g. configs/moco_v2_imagenet.py (a file "
                        f"the export job wrote has it in its {EXPORT_META})")
  if config.model_name and config.model_name != pretrained.model.name:
    raise ConfigError("model_name", config.model_name,
                      f"{pretrained.model.name!r}, the model of {config.pretrain_config}")
  variables = jax.device_put(state_dicts.from_state_dict(
      tensor_files.read(path), path, pretrained.model, pretrained.image_size),
      mesh_lib.replicated(mesh))
  encoder = models.build_encoder(pretrained.model)
  return Encoder(encoder, variables, pretrained, 0, models.encoder_width(pretrained.model))


def _exported_config(path: str):
  """The pretraining config the export job recorded for the weights file path, or None."""
  meta_path = f"{os.path.dirname(path)}/{EXPORT_META}"
  if not tf.io.gfile.exists(meta_path):
    return None
  with tf.io.gfile.GFile(meta_path) as f:
    meta = json.load(f)
  if os.path.basename(meta.get("path", "")) != os.path.basename(path):
    return None
  return ml_collections.ConfigDict(meta["pretrained_config"])


def eval_datasets(source, config, encoder: Encoder):
  """The evaluators' datasets (input_pipeline.eval_datasets) at the encoder's image size,
  centre crop and resize method."""
  return input_pipeline.eval_datasets(source, image_size=encoder.pretrained.image_size,
                                      crop_fraction=encoder.pretrained.eval_crop_fraction,
                                      crop_resize=encoder.pretrained.crop.resize,
                                      threads=config.data_threads, cache=config.cache)

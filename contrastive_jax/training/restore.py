"""Restoring a pretrained encoder: from a pretraining workdir's Orbax checkpoint or a weights file.

Only the encoder (params and BN statistics) that the method's paper evaluates
(methods.OptionalAttributes.evaluated_encoder: MoCo's query encoder, BYOL's online
encoder, DINO's teacher's encoder) is read from a checkpoint, with a partial restore onto
however many devices the job has, and rebuilt from the config saved with the checkpoint
(a fine-tuning workdir: its fine-tuned encoder, as the model it started from); or,
with config.random_init, the pretraining run's own initialisation of it (the
baseline); or a weights file (docs/weights.md) is read as the model of
config.pretrain_config. The export job also restores the projection head the
same way.
"""

import functools
import json
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import tensorflow as tf

from contrastive_jax import config_files
from contrastive_jax import models
from contrastive_jax.core import checkpointing
from contrastive_jax.core import files
from contrastive_jax.core import gcs
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import tensor_files
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import ForeignCheckpointError
from contrastive_jax.data import input_pipeline
from contrastive_jax.methods import common
from contrastive_jax.methods import get_method
from contrastive_jax.methods import initial_variables
from contrastive_jax.methods import optional_attributes
from contrastive_jax.models import heads
from contrastive_jax.models import state_dicts

PROJECTOR = "projector"  # The projection head's name in a method's model (heads.ContrastiveModel).

# What the export job writes beside an export, last: its run's config included.
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


def restore_encoder(config, mesh, saved_config=None) -> Encoder:
  """The pretrained (or, with config.random_init, freshly initialised) encoder.

  Only the encoder is read from the checkpoint (a partial restore). A job
  resumed from saved_config (its own checkpoint's config) that was started on
  "the latest" pretraining checkpoint keeps the step it started with.

  Raises:
    ConfigError: pretrain_workdir with no checkpoint or with checkpoints of
      another tool, a pretrain_step that was not saved (the saved ones are
      listed), checkpoints that checkpoint_encoder refuses, random_init with a
      fine-tuning workdir (its start is its own pretrain_workdir's), or a
      model_name that differs from the checkpoint's model.
    JobError: a gs:// pretrain_workdir without Google Cloud credentials.
  """
  gcs.check_credentials(config.pretrain_workdir or "", "config.pretrain_workdir")
  if tensor_files.is_weights_file(config.pretrain_workdir or ""):
    return _imported_encoder(config, mesh)
  path = config.pretrain_workdir
  directory = f"{files.resolve_dir(path or '')}/checkpoints"
  if not path or not tf.io.gfile.isdir(directory):
    raise ConfigError(
      "pretrain_workdir",
      path,
      f"a pretraining workdir with Orbax checkpoints in WORKDIR/checkpoints "
      f"(looked in {directory})",
    )
  pretrain_step = config.pretrain_step
  if saved_config is not None and pretrain_step < 0:
    pretrain_step = saved_config.pretrain_step
  ckpt = checkpointing.Checkpointer(directory, read_only=True)
  try:
    try:
      step = ckpt.resolve_step(None if pretrain_step < 0 else pretrain_step, "pretrain_step")
      saved = ckpt.saved_config(step)
    except ForeignCheckpointError as e:
      raise ConfigError(
        "pretrain_workdir", path, f"a pretraining workdir of contrastive_jax; {e}"
      ) from None
    pretrained, paths = checkpoint_encoder("pretrain_workdir", path, saved)
    if config.random_init and "method" not in saved:  # A fine-tuning workdir.
      raise ConfigError(
        "random_init",
        config.random_init,
        f"False with a fine-tuning workdir (its start: pretrain_workdir={saved.pretrain_workdir})",
      )
    if config.model_name and config.model_name != pretrained.model.name:
      raise ConfigError(
        "model_name", config.model_name, f"{pretrained.model.name!r}, the model of {path}"
      )
    encoder = models.build_encoder(pretrained.model)
    if config.random_init:  # The pretraining run's own initialisation, as it drew it.
      variables = jax.jit(
        lambda: initial_variables(pretrained), out_shardings=mesh_lib.replicated(mesh)
      )()
    else:
      x = jnp.zeros((1, pretrained.image_size, pretrained.image_size, 3), jnp.float32)
      variables = _restore_submodule(ckpt, step, encoder, x, paths, mesh)
  finally:
    ckpt.close()
  dim = jax.eval_shape(
    functools.partial(models.encode, encoder, variables),
    jax.ShapeDtypeStruct((1, pretrained.image_size, pretrained.image_size, 3), jnp.uint8),
  ).shape[-1]
  return Encoder(encoder, variables, pretrained, step, dim)


def checkpoint_encoder(field: str, path: str, saved) -> tuple[ml_collections.ConfigDict, tuple]:
  """Which encoder a checkpoint of the pretraining or fine-tuning workdir `path` holds, from
  that checkpoint's saved config `saved`: (the config of the pretraining run that describes
  it, upgraded to the current format (its model, image_size, eval_crop_fraction), the
  (params, batch_stats) key paths of the encoder in the checkpoint's state). A pretraining
  workdir: its own config and the encoder its method evaluates (MoCo's query encoder,
  DINO's teacher's, ...); a fine-tuning workdir: the config of the pretraining run or
  weights file it started from (at its recorded pretrain_step) and its fine-tuned encoder
  (checkpointing.FINETUNED_ENCODER). The one reading of a workdir's encoder, for the
  downstream jobs' restore and distillation's teacher.

  Raises:
    ConfigError (named `field`): checkpoints of another kind of job; a fine-tuning run of
      projection-head layers with its encoder (projector_layers > 0: the network is not the
      registry's encoder), or of a start another kind of job wrote.
    ConfigError (pretrain_config): a fine-tuning run of a weights file whose model
      weights_config cannot tell.
  """
  saved = config_files.upgrade_config(saved)
  if "method" in saved:
    return saved, optional_attributes(saved.method).evaluated_encoder
  if saved.get("job") != checkpointing.FINETUNE_JOB:
    raise ConfigError(
      field,
      path,
      "a pretraining or fine-tuning workdir; its checkpoints were written by another kind of job",
    )
  if saved.get("projector_layers", 0):
    raise ConfigError(
      field,
      path,
      "a fine-tuning workdir with projector_layers 0 (this one fine-tuned "
      f"{saved.projector_layers} projection-head layers with its encoder)",
    )
  source = saved.pretrain_workdir
  if tensor_files.is_weights_file(source):
    return (
      weights_config(source, saved.get("pretrain_config"), "pretrain_config"),
      checkpointing.FINETUNED_ENCODER,
    )
  start = checkpointing.Checkpointer(f"{files.resolve_dir(source)}/checkpoints", read_only=True)
  try:
    pretrained = config_files.upgrade_config(start.saved_config(saved.pretrain_step))
  finally:
    start.close()
  if "method" not in pretrained:
    raise ConfigError(
      field,
      path,
      "a fine-tuning workdir of a pretraining workdir or a weights file (this one "
      f"fine-tuned {source}, which another kind of job wrote)",
    )
  return pretrained, checkpointing.FINETUNED_ENCODER


def is_finetuning_workdir(path: str) -> bool:
  """Whether `path` is a workdir of the fine-tuning job (its latest checkpoint's config);
  False for anything else (a weights file, no checkpoints, another tool's checkpoints).

  Raises:
    ConfigError: checkpoints of which none is complete.
  """
  directory = f"{files.resolve_dir(path)}/checkpoints"
  if not path or tensor_files.is_weights_file(path) or not tf.io.gfile.isdir(directory):
    return False
  ckpt = checkpointing.Checkpointer(directory, read_only=True)
  try:
    return ckpt.saved_config().get("job") == checkpointing.FINETUNE_JOB
  except ForeignCheckpointError:
    return False
  finally:
    ckpt.close()


def _restore_submodule(ckpt, step: int, module, example, paths, mesh) -> dict:
  """{'params', 'batch_stats'} of a submodule of the method's state at checkpoint step `step`
  (its encoder, DINO's teacher's encoder, its projection head), replicated on the mesh: a
  partial restore that reads nothing else. 'batch_stats' is {} for a module without BN (a
  ViT: nothing of it is saved, so nothing is asked for).

  Args:
    ckpt: the pretraining run's checkpointing.Checkpointer.
    module: the submodule, built as the pretraining run built it.
    example: an input of the module's shape and dtype (batch 1), for its variables' shapes.
    paths: the (params, batch_stats) key paths of the submodule's variables in the saved
      TrainState, e.g. methods.optional_attributes(method).evaluated_encoder.
  """
  shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), example, train=False))
  wanted = {}
  for kind, path in zip(("params", "batch_stats"), paths):
    if kind in shapes:
      node = wanted
      for key in path[:-1]:
        node = node.setdefault(key, {})
      node[path[-1]] = shapes[kind]
  restored = ckpt.restore_partial(
    checkpointing.abstract_like(wanted, mesh_lib.replicated(mesh)), step
  )
  found = []
  for path in paths:
    node = restored
    for key in path:
      node = node.get(key, {})
    found.append(node)
  return {"params": found[0], "batch_stats": found[1]}


def restore_projector(config, encoder: Encoder, mesh):
  """(module, {'params', 'batch_stats'} on the host) of the projection head saved with the
  checkpoint of config.pretrain_workdir that `encoder` comes from: the head of the same
  network (DINO's teacher's head for its teacher's encoder)."""
  module = get_method(encoder.pretrained.method).build_model(encoder.pretrained).projector
  ckpt = checkpointing.Checkpointer(
    f"{files.resolve_dir(config.pretrain_workdir)}/checkpoints", read_only=True
  )
  try:
    variables = _restore_submodule(
      ckpt,
      encoder.step,
      module,
      jnp.zeros((1, encoder.dim), jnp.float32),
      # The head of the network the encoder comes from (DINO's teacher's).
      tuple(
        p[:-1] + (PROJECTOR,)
        for p in optional_attributes(encoder.pretrained.method).evaluated_encoder
      ),
      mesh,
    )
  finally:
    ckpt.close()
  return module, jax.device_get(variables)


def with_head_layers(config, encoder: Encoder, layers: int, field: str, mesh) -> Encoder:
  """`encoder` followed by the first `layers` hidden layers of its projection head, restored
  from the same checkpoint step (or, with config.random_init, at the run's initialisation):
  heads.EncoderWithHeadLayers, whose output is the new h (SimCLR v2's fine-tuning from the
  head's first layer: Chen et al. 2020b, Sec. 2). layers 0 returns `encoder` itself.

  Raises:
    ConfigError (named `field`): layers below 0, or more than the hidden layers of the
      method's projection head (none for a DINO head, a MoCo v1 linear head or a weights
      file, which holds no head).
  """
  if layers == 0:
    return encoder
  pretrained = encoder.pretrained
  projector = get_method(pretrained.method).build_model(pretrained).projector
  name = f"{pretrained.method}'s projection head ({type(projector).__name__})"
  if tensor_files.is_weights_file(config.pretrain_workdir or ""):
    hidden, allowed = 0, "0: a weights file holds no projection head"
  elif is_finetuning_workdir(config.pretrain_workdir or ""):
    hidden, allowed = 0, "0: a fine-tuning workdir holds its encoder, no projection head"
  elif not isinstance(projector, heads.MLP):
    hidden, allowed = 0, f"0: {name} has no Dense -> BN -> ReLU layers to fine-tune from"
  elif not projector.hidden_dims:
    hidden, allowed = 0, f"0: {name} is linear, with no hidden layers"
  else:
    hidden = len(projector.hidden_dims)
    plural = "s" if hidden != 1 else ""
    allowed = f"an integer in [0, {hidden}]: {name} has {hidden} hidden layer{plural}"
  if not 0 <= layers <= hidden:
    raise ConfigError(field, layers, allowed)
  # BN over the whole batch of the job's jitted step, as the restored encoder's (no named axis).
  trunk = projector.clone(
    hidden_dims=tuple(projector.hidden_dims[:layers]), out_dim=None, bn_axis_name=None
  )
  if config.random_init:
    variables = jax.device_get(jax.jit(lambda: initial_variables(pretrained, PROJECTOR))())
  else:
    _, variables = restore_projector(config, encoder, mesh)
  kept = {
    kind: {k: v for k, v in tree.items() if int(k.rsplit("_", 1)[1]) < layers}
    for kind, tree in variables.items()
  }
  module = heads.EncoderWithHeadLayers(encoder.module, trunk)
  combined = {
    kind: {
      k: v for k, v in (("encoder", encoder.variables.get(kind)), (PROJECTOR, kept.get(kind))) if v
    }
    for kind in ("params", "batch_stats")
  }
  combined = jax.device_put(combined, mesh_lib.replicated(mesh))
  return encoder._replace(module=module, variables=combined, dim=projector.hidden_dims[layers - 1])


def _imported_encoder(config, mesh) -> Encoder:
  """The encoder of the weights file config.pretrain_workdir, as config.pretrain_config's model
  (models/state_dicts.py), or, for a file the export job wrote, its run's config from
  EXPORT_META beside it; that config's image size and eval crop, step 0.

  Raises:
    ConfigError: no pretrain_config, random_init set, a model_name that differs, a model
      that cannot be built on the config's image size.
    JobError: a config file that cannot be loaded; a weights file that does not fit.
  """
  path = config.pretrain_workdir
  if config.random_init:
    raise ConfigError(
      "random_init",
      config.random_init,
      "False with a weights file: its run's initialisation is not in it",
    )
  pretrained = weights_config(path, config.get("pretrain_config"), "pretrain_config")
  if config.model_name and config.model_name != pretrained.model.name:
    raise ConfigError(
      "model_name",
      config.model_name,
      f"{pretrained.model.name!r}, the model of {config.pretrain_config}",
    )
  # Before the file is read: a patch size that does not divide the image size.
  models.check_model_config(pretrained.model, pretrained.image_size)
  variables = jax.device_put(
    state_dicts.from_state_dict(
      tensor_files.read(path), path, pretrained.model, pretrained.image_size
    ),
    mesh_lib.replicated(mesh),
  )
  encoder = models.build_encoder(pretrained.model)
  return Encoder(encoder, variables, pretrained, 0, models.encoder_width(pretrained.model))


def weights_config(path: str, config_file, field: str) -> ml_collections.ConfigDict:
  """The pretraining config that describes the model of the weights file `path`: config_file's
  (configs/X.py[:ARG], e.g. configs/dinov2.py:model=vit_base_patch14_dinov2), or, with
  config_file None, the one the export job recorded beside a file it wrote (EXPORT_META).
  The one reading of a weights file's model, for every job that takes a file (the downstream
  jobs' pretrain_config, the label-efficiency job's weights_config, pretraining's init_config).

  Raises:
    ConfigError (named `field`): config_file None for a file the export job did not write.
    JobError: a config file that cannot be loaded (config_files.load_config_file).
  """
  if config_file:
    return config_files.load_config_file(config_file, f"config.{field}")
  pretrained = _exported_config(path)
  if pretrained is None:
    raise ConfigError(
      field,
      config_file,
      "the pretraining config (configs/X.py[:VARIANT]) whose model the "
      f"weights file {path} holds, e.g. configs/moco_v2_imagenet.py (a file "
      f"the export job wrote has it in its {EXPORT_META})",
    )
  return pretrained


def _exported_config(path: str):
  """The pretraining config the export job recorded for the weights file path, or None."""
  meta_path = f"{os.path.dirname(path)}/{EXPORT_META}"
  if not tf.io.gfile.exists(meta_path):
    return None
  with tf.io.gfile.GFile(meta_path) as f:
    meta = json.load(f)
  if os.path.basename(meta.get("path", "")) != os.path.basename(path):
    return None
  return config_files.upgrade_config(ml_collections.ConfigDict(meta["pretrained_config"]))


class EmbedModel(NamedTuple):
  """A restored encoder as the embed and neighbours jobs use it.

  embed: uint8 images [B, S, S, 3] (a jax.Array on the mesh) -> float32
    [B, D] L2-normalised h, sharded like the images.
  eval_crop: the pretraining run's (input_pipeline.EvalCrop). step: the checkpoint's step.
  """

  embed: Callable
  eval_crop: input_pipeline.EvalCrop
  step: int


def embed_model(config, mesh) -> EmbedModel:
  """The encoder of config.pretrain_workdir (restore_encoder) as an EmbedModel.

  Raises:
    ConfigError, JobError: see restore_encoder.
  """
  encoder, variables, pretrained, step, _ = restore_encoder(config, mesh)
  features = jax.jit(lambda v, x: common.l2_normalize(models.encode(encoder, v, x)))
  return EmbedModel(
    lambda images: features(variables, images), input_pipeline.EvalCrop.of(pretrained), step
  )

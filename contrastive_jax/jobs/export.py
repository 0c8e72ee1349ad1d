"""The export job (config.job='export'): a pretraining checkpoint's encoder for other systems.

  python -m contrastive_jax.main --config=configs/export.py --workdir=OUT \
      --config.pretrain_workdir=PRETRAIN_DIR --config.format=saved_model

Formats (FORMATS; docs/weights.md says what reads each):
  'safetensors': OUT/encoder.safetensors, the encoder as a torchvision ResNet's or a
      timm ViT's state dict (models/state_dicts.py), numpy only; torchvision's network
      computes this package's h from it only for a ResNet padded as torchvision
      (model.padding 'torchvision'; a warning says so otherwise);
  'pth': OUT/encoder.pth, the same state dict through torch.save (needs torch);
  'saved_model': OUT/saved_model/, a TF SavedModel whose 'serving_default' signature
      takes uint8 images [N, H, W, 3] of any size, does the evaluation preprocessing
      (input_pipeline.center_crop at the checkpoint's image size, eval crop and resize, then the
      model's [0, 1] scaling and standardisation) and returns {'h': float32 [N, D]}
      (jax2tf, the batch size polymorphic), for TF Serving; with config.projection
      also 'z', the projection head's eval-mode output;
  'onnx': OUT/encoder.onnx (needs the onnx package), an ONNX model (models/onnx_graph.py)
      that takes uint8 images [N, S, S, 3] already centre-cropped to the checkpoint's image
      size S as the evaluation crops them (its metadata says how), scales and standardises
      them inside and returns 'h' (and 'z' with config.projection), for ONNX Runtime;
  'vertex': not the encoder but the rows of the embed job's index in
      config.index_workdir, as Vertex AI Vector Search's JSON input (search/vertex.py):
      OUT/vertex/vertex_{i:05d}.json, one file of JSON lines per shard, written shard
      by shard, the label as a restrict; no checkpoint is read.
Beside it OUT/export.json records what was exported from where; it is written last,
so a workdir holding it holds a complete export and is refused. Not a training loop,
so not run by runner.run.
"""

import importlib.util
import json

from absl import logging
import jax
from jax.experimental import jax2tf
import numpy as np
import tensorflow as tf

from contrastive_jax import models
from contrastive_jax.core import files
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import tensor_files
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.data import input_pipeline
from contrastive_jax.models import onnx_graph
from contrastive_jax.models import resnet
from contrastive_jax.models import state_dicts
from contrastive_jax.search import vertex
from contrastive_jax.training import restore

FORMATS = {
  "safetensors": "encoder.safetensors",
  "pth": "encoder.pth",
  "saved_model": "saved_model",
  "onnx": "encoder.onnx",
  "vertex": vertex.FOLDER,
}
SERVING = ("saved_model", "onnx")  # The formats that run the encoder, and can serve z too.
META = restore.EXPORT_META
SIGNATURE = "serving_default"


def check_config(config):
  """Raises ConfigError for a format that is unknown or whose writer is not installed, or a
  projection asked of a format or an encoder that has none."""
  if config.format not in FORMATS:
    raise ConfigError("format", config.format, f"one of {list(FORMATS)}")
  if (config.format == "vertex") != bool(config.index_workdir):
    raise ConfigError(
      "index_workdir",
      config.index_workdir,
      "an embed job's workdir when (and only when) config.format is 'vertex': the rows "
      f"it exports (format={config.format!r})",
    )
  if config.format == "vertex" and config.projection:
    raise ConfigError(
      "projection", config.projection, "False for 'vertex': it exports the index's h only"
    )
  if config.projection and config.format not in SERVING:
    raise ConfigError(
      "projection",
      config.projection,
      "False for a state dict: torchvision's and timm's models have no "
      f"projection head (the formats {list(SERVING)} serve z too)",
    )
  if config.projection and (
    config.random_init
    or tensor_files.is_weights_file(config.pretrain_workdir or "")
    or restore.is_finetuning_workdir(config.pretrain_workdir or "")
  ):
    raise ConfigError(
      "projection",
      config.projection,
      "False without a pretraining checkpoint (random_init, a weights file or a "
      "fine-tuning workdir): only a pretraining checkpoint holds a trained projection head",
    )
  if config.format == "pth" and importlib.util.find_spec("torch") is None:
    raise ConfigError(
      "format",
      config.format,
      "a format whose writer is installed: 'pth' "
      "needs torch (pip install 'contrastive_jax[torch]'); 'safetensors' holds "
      "the same state dict without it",
    )
  if config.format == "onnx" and importlib.util.find_spec("onnx") is None:
    raise ConfigError(
      "format",
      config.format,
      "a format whose writer is installed: 'onnx' "
      "needs the onnx package (pip install 'contrastive_jax[onnx]', which "
      "adds ONNX Runtime to read it)",
    )


def run(config, workdir: str) -> str:
  """Exports the encoder config names to workdir in config.format; returns the written path.

  Raises:
    ConfigError: see check_config and restore.restore_encoder.
    JobError: a workdir that is a file, already holds an export or that another job
      is running in.
  """
  workdir = files.prepare_workdir(workdir)
  check_config(config)
  _refuse_existing_export(workdir)
  if config.format == "vertex":
    return _export_index(config, workdir)
  mesh = mesh_lib.make_mesh()
  encoder = restore.restore_encoder(config, mesh)
  variables = jax.device_get(encoder.variables)
  projector = restore.restore_projector(config, encoder, mesh) if config.projection else None
  path = f"{workdir}/{FORMATS[config.format]}"
  with files.workdir_lock(workdir):
    _refuse_existing_export(workdir)
    if jax.process_index() == 0:
      if config.format == "saved_model":
        write_saved_model(path, encoder.module, variables, encoder.pretrained, projector)
      elif config.format == "onnx":
        write_onnx(
          path,
          variables,
          encoder.pretrained,
          projector,
          {"pretrain_workdir": str(config.pretrain_workdir), "pretrain_step": str(encoder.step)},
        )
      else:
        _warn_if_not_the_references_network(encoder.pretrained.model)
        size = encoder.pretrained.image_size
        tensor_files.write(
          path, state_dicts.to_state_dict(encoder.pretrained.model, variables, size)
        )
      meta = {
        "format": config.format,
        "path": path,
        "pretrain_workdir": config.pretrain_workdir,
        "pretrain_step": encoder.step,
        "random_init": config.random_init,
        "projection": config.projection,
        "eval_crop": input_pipeline.EvalCrop.of(encoder.pretrained)._asdict(),
        "model": encoder.pretrained.model.to_dict(),
        "dim": encoder.dim,
        # Read back when a downstream job takes the file (training/restore.py).
        "pretrained_config": encoder.pretrained.to_dict(),
      }
      files.write_atomic(f"{workdir}/{META}", json.dumps(meta, indent=1, default=str))
  return path


def _export_index(config, workdir: str) -> str:
  """Writes the rows of config.index_workdir's index as Vertex JSON files (process 0), then
  export.json; returns their folder.

  Raises:
    JobError: see vertex.write.
  """
  index_workdir = files.resolve_dir(config.index_workdir)
  path = f"{workdir}/{FORMATS['vertex']}"
  with files.workdir_lock(workdir):
    _refuse_existing_export(workdir)
    if jax.process_index() == 0:
      written = vertex.write(
        index_workdir, workdir, where=f"config.index_workdir={config.index_workdir!r}"
      )
      meta = {"format": config.format, "path": path, "index_workdir": index_workdir, **written}
      files.write_atomic(f"{workdir}/{META}", json.dumps(meta, indent=1))
  return path


def _warn_if_not_the_references_network(model_config):
  """Logs a warning when the state dict is not a torchvision network's: a ResNet padded
  otherwise than torchvision (models/resnet.py PADDINGS), whose dict loads into it but
  then computes another h, one with a projection shortcut in every stage's first block
  (SimCLR's, BYOL's), whose extra layer1.0.downsample tensors a strict load refuses, or a
  ResNet-10, which torchvision does not build."""
  padding = model_config.padding if models.family(model_config) == "resnet" else None
  # A bottleneck stage's first block widens anyway: only ResNet-10/18/34 gain tensors.
  extra = (
    padding is not None
    and model_config.stage_projection
    and resnet.SPECS[model_config.name][0] == "basic"
  )
  if padding not in (None, "torchvision") or extra or model_config.name == "resnet10":
    logging.warning(
      "The checkpoint's ResNet is not torchvision's (%s, padding %r, a projection shortcut "
      "in every stage's first block: %s): the state dict holds its tensors in torchvision's "
      "names, but torchvision's network computes another h from them or refuses them, and "
      "has no resnet10 (docs/weights.md). The SavedModel and ONNX exports compute this "
      "package's h.",
      model_config.name,
      padding,
      extra,
    )


def _refuse_existing_export(workdir: str):
  if tf.io.gfile.exists(f"{workdir}/{META}"):
    raise JobError(
      f"--workdir={workdir}: already holds an export ({META}); use a new workdir or delete it"
    )


def serving_function(module, variables, pretrained, projector=None):
  """The tf.function of the SavedModel: uint8 images [N, H, W, 3] -> {'h': float32 [N, D]}
  (and 'z': float32 [N, d], the projection head's eval-mode output, with a projector).

  Each image is centre-cropped and resized as the evaluation does (the pretraining
  run's input_pipeline.EvalCrop), then
  encoded (models.encode) by the jax2tf conversion, with the variables as TF
  variables of the returned function's `tf_variables` attribute. projector:
  None, or (module, variables) of restore.restore_projector.
  """
  eval_crop = input_pipeline.EvalCrop.of(pretrained)
  size = eval_crop.size

  def outputs(all_variables, images):
    h = models.encode(module, all_variables["encoder"], images)
    if projector is None:
      return {"h": h}
    return {"h": h, "z": projector[0].apply(all_variables["projector"], h, train=False)}

  converted = jax2tf.convert(outputs, polymorphic_shapes=[None, f"(b, {size}, {size}, 3)"])
  host = {"encoder": variables, **({} if projector is None else {"projector": projector[1]})}
  tf_variables = tf.nest.map_structure(lambda x: tf.Variable(np.asarray(x), trainable=False), host)

  @tf.function(
    input_signature=[tf.TensorSpec([None, None, None, 3], tf.uint8, name="images")], autograph=False
  )
  def serve(images):
    crops = tf.map_fn(
      eval_crop.apply, images, fn_output_signature=tf.TensorSpec([size, size, 3], tf.uint8)
    )
    return converted(tf_variables, crops)

  serve.tf_variables = tf_variables
  return serve


def write_saved_model(path: str, module, variables, pretrained, projector=None):
  """Writes the SavedModel (serving_function's) to path whole or not at all (written to
  path.tmp, then renamed)."""
  tmp = f"{path}.tmp"
  if tf.io.gfile.exists(tmp):  # Left by an export that was killed.
    tf.io.gfile.rmtree(tmp)
  serve = serving_function(module, variables, pretrained, projector)
  holder = tf.Module()
  holder.variables_ = serve.tf_variables
  holder.serve = serve
  tf.saved_model.save(holder, tmp, signatures={SIGNATURE: serve})
  tf.io.gfile.rename(tmp, path, overwrite=False)


def write_onnx(path: str, variables, pretrained, projector=None, source=None):
  """Writes the encoder (and projector: None, or restore.restore_projector's) as an ONNX model to
  path atomically (models/onnx_graph.py). Its metadata records the input it expects:
  "eval_crop", the checkpoint's input_pipeline.EvalCrop as JSON, and source (a dict of
  strings: where the weights come from)."""
  model_config, size = pretrained.model, pretrained.image_size
  tensors = state_dicts.to_state_dict(model_config, variables, size)
  metadata = {
    "input": f"uint8 [N, {size}, {size}, 3] RGB, centre-cropped as "
    "contrastive_jax.data.input_pipeline.center_crop does",
    "eval_crop": json.dumps(input_pipeline.EvalCrop.of(pretrained)._asdict()),
    # The checkpoint may compute in bfloat16 (model.dtype); the graph does not.
    "compute_dtype": "float32",
    **(source or {}),
  }
  model = onnx_graph.build(model_config, tensors, size, projector, metadata)
  files.write_atomic(path, model.SerializeToString())

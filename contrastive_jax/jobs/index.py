"""The embedding index an embed job writes and the neighbours job reads: one folder of files.

  embeddings.npy  float32 [N, D]: row i is image i's h (models.encode: the
                  eval-mode encoder on the centre crop the pretraining run
                  evaluated on), L2-normalised, so that a dot product of two
                  rows is their cosine similarity.
  index.jsonl     line i describes row i: {"name": ..., "label": ...}; the
                  name is the file's path (folders), the 'file_name' feature
                  (prepared image folders) or the TFDS id; "label" only for
                  labelled datasets.
  embed.json      what was embedded and how: the job's config (the
                  checkpoint step resolved), image size, crop fraction, N, D,
                  class names. Written last: its presence marks a complete
                  index, which the neighbours job reads.
  unreadable.txt  (folders) the files that could not be decoded, with why;
                  they have no row.

Every file is written atomically, embed.json last.
"""
import io
import json
import math
from typing import Callable, NamedTuple

import jax
import ml_collections
import numpy as np
import tensorflow as tf

from contrastive_jax.core import files
from contrastive_jax.jobs import downstream
from contrastive_jax.methods import common
from contrastive_jax import models

EMBEDDINGS, INDEX, META, UNREADABLE = "embeddings.npy", "index.jsonl", "embed.json", "unreadable.txt"


class EmbedModel(NamedTuple):
  """A restored encoder as the embed and neighbours jobs use it.

  embed: uint8 images [B, S, S, 3] (a jax.Array on the mesh) -> float32
    [B, D] L2-normalised h, sharded like the images.
  image_size: S, the pretraining run's; crop_fraction and crop_resize: its
  eval centre crop (input_pipeline.center_crop). step: the checkpoint's step.
  """
  embed: Callable
  image_size: int
  crop_fraction: float
  crop_resize: str
  step: int


def shorter_side(image_size: int, crop_fraction: float) -> int:
  """The shorter side image files are downscaled to (antialiased) before their centre crop.

  The crop's own scale, so that the crop's resize to image_size
  hardly resamples: a large photo is not aliased.
  """
  return math.ceil(image_size / crop_fraction)


def load_model(config, mesh) -> EmbedModel:
  """The encoder of config.pretrain_workdir's checkpoint (downstream.restore_encoder).

  Raises:
    ConfigError: no checkpoint there, or none at config.pretrain_step.
  """
  encoder, variables, pretrained, step, _ = downstream.restore_encoder(config, mesh)
  features = jax.jit(lambda v, x: common.l2_normalize(models.encode(encoder, v, x)))
  return EmbedModel(lambda images: features(variables, images), pretrained.image_size,
                    pretrained.eval_crop_fraction, pretrained.crop_resize, step)


def write(workdir, config, model, source, h, labels, names, num_unreadable: int):
  """Writes embeddings.npy, index.jsonl and, last, embed.json (see the module docstring).

  h: float32 [N, D] unit rows; labels: N ints (ignored for an unlabelled source);
  names: N strings; model: the EmbedModel that embedded them.
  """
  buffer = io.BytesIO()
  np.save(buffer, h.astype(np.float32))
  files.write_atomic(f"{workdir}/{EMBEDDINGS}", buffer.getvalue())
  labelled = source.num_classes is not None
  rows = [{"name": name, **({"label": int(label)} if labelled else {})}
          for name, label in zip(names, labels)]
  files.write_atomic(f"{workdir}/{INDEX}", "".join(json.dumps(r) + "\n" for r in rows).encode())
  meta = {"config": config.to_dict(), "image_size": model.image_size,
          "crop_fraction": model.crop_fraction, "crop_resize": model.crop_resize,
          "num_images": len(h), "dim": int(h.shape[1]),
          "class_names": source.class_names, "unreadable": num_unreadable}
  files.write_atomic(f"{workdir}/{META}", json.dumps(meta, indent=1).encode())


class Index(NamedTuple):
  """An embed job's output, as load_index reads it.

  embeddings: float32 [N, D] unit rows (memory-mapped for a local workdir).
  rows: N dicts {'name'[, 'label']}.
  config: the embed job's config; image_size, crop_fraction, crop_resize: how
  its images were cropped (input_pipeline.center_crop); class_names: list or None.
  """
  embeddings: np.ndarray
  rows: list
  config: ml_collections.ConfigDict
  image_size: int
  crop_fraction: float
  crop_resize: str
  class_names: list


def is_index(workdir: str) -> bool:
  """Whether workdir holds a complete embed job's output."""
  return tf.io.gfile.exists(f"{workdir}/{META}")


def load_index(workdir: str) -> Index:
  """Reads the index an embed job wrote to workdir (check is_index first)."""
  with tf.io.gfile.GFile(f"{workdir}/{META}") as f:
    meta = json.load(f)
  with tf.io.gfile.GFile(f"{workdir}/{INDEX}") as f:
    rows = [json.loads(line) for line in f]
  path = f"{workdir}/{EMBEDDINGS}"
  if "://" in path:
    with tf.io.gfile.GFile(path, "rb") as f:
      embeddings = np.load(io.BytesIO(f.read()))
  else:  # Memory-mapped: the neighbours job reads it chunk by chunk.
    embeddings = np.load(path, mmap_mode="r")
  # An index written before crop_resize was recorded was cropped bilinear.
  return Index(embeddings, rows, ml_collections.ConfigDict(meta["config"]), meta["image_size"],
               meta["crop_fraction"], meta.get("crop_resize", "pil_bilinear"),
               meta["class_names"])

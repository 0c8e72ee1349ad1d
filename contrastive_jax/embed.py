"""The embed job (config.job='embed'): the representation h of every image of a split or folder.

  python -m contrastive_jax.main --config=configs/embed.py --workdir=DIR \
      --config.pretrain_workdir=PRETRAIN_DIR --config.dataset=cifar10 --config.split=test
  python -m contrastive_jax.main --config=configs/embed.py --workdir=DIR \
      --config.pretrain_workdir=PRETRAIN_DIR --config.folder=/photos

Restores only the encoder of any method's pretraining checkpoint (as the
linear probe does) and writes to the workdir:

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

Not a training loop, so not run by runner.run. Each process embeds its own
part of the images; process 0 gathers the parts and writes the files, in the
order of the split or of the sorted file paths. A workdir that already holds
an index is refused (nothing already written is lost).
"""
import io
import json
import math
from typing import Callable, NamedTuple

import jax
import ml_collections
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from absl import logging
from clu import periodic_actions
from jax.experimental import multihost_utils

from contrastive_jax import checkpointing
from contrastive_jax import data
from contrastive_jax import downstream
from contrastive_jax import evaluators
from contrastive_jax import input_pipeline
from contrastive_jax import models
from contrastive_jax import train_state as ts
from contrastive_jax.errors import ConfigError
from contrastive_jax.errors import JobError

EMBEDDINGS, INDEX, META, UNREADABLE = "embeddings.npy", "index.jsonl", "embed.json", "unreadable.txt"


class EmbedModel(NamedTuple):
  """A restored encoder as the embed and neighbours jobs use it.

  embed: uint8 images [B, S, S, 3] (a jax.Array on the mesh) -> float32
    [B, D] L2-normalised h, sharded like the images.
  image_size: S, the pretraining run's; crop_fraction: its eval centre crop.
  step: the checkpoint's step.
  """
  embed: Callable
  image_size: int
  crop_fraction: float
  step: int


def shorter_side(image_size: int, crop_fraction: float) -> int:
  """The shorter side image files are downscaled to (antialiased) before their centre crop.

  The crop's own scale, so that the crop's bilinear resize to image_size
  hardly resamples: a large photo is not aliased.
  """
  return math.ceil(image_size / crop_fraction)


def check_config(config, num_devices: int):
  """Raises ConfigError for fields that cannot run (before anything is read).

  Exactly one of dataset and folder names the images.
  """
  if config.batch_size <= 0 or config.batch_size % num_devices:
    raise ConfigError("batch_size", config.batch_size,
                      f"a positive multiple of the number of devices ({num_devices})")
  if bool(config.dataset) == bool(config.folder):
    raise ConfigError("folder", config.folder,
                      "set when (and only when) config.dataset is not: the images are a "
                      f"dataset's split or a folder's files (dataset={config.dataset!r})")
  for field in ("max_pixels", "data_threads"):
    if config[field] <= 0:
      raise ConfigError(field, config[field], "an integer > 0")


def load_model(config, mesh) -> EmbedModel:
  """The encoder of config.pretrain_workdir's checkpoint (downstream.restore_encoder).

  Raises:
    ConfigError: no checkpoint there, or none at config.pretrain_step.
  """
  encoder, variables, pretrained, step, _ = downstream.restore_encoder(config, mesh)
  features = jax.jit(lambda v, x: evaluators.l2_normalize(models.encode(encoder, v, x)))
  return EmbedModel(lambda images: features(variables, images), pretrained.image_size,
                    pretrained.eval_crop_fraction, step)


def open_source(config, *, shorter_side: int):
  """(source, split) of the images config names: config.dataset's config.split or config.folder.

  A folder's files are downscaled to shorter_side when read.

  Raises:
    ConfigError: a missing dataset, split or folder, or an empty one.
  """
  if config.folder:
    source = data.FolderSource(config.folder, max_pixels=config.max_pixels,
                               shorter_side=shorter_side)
    return source, source.SPLIT
  return data.get_source(config, {"split": config.split}), config.split


def run(config, workdir: str):
  """Embeds the images config names with the checkpoint it names; writes the index to workdir.

  Returns the embeddings, float32 [N, D] (on every process).

  Raises:
    ConfigError: see check_config, load_model, open_source.
    JobError: a workdir that is a file or already holds an index; a folder
      none of whose files can be decoded.
  """
  workdir = checkpointing.prepare_workdir(workdir)
  if tf.io.gfile.exists(f"{workdir}/{META}") or tf.io.gfile.exists(f"{workdir}/{EMBEDDINGS}"):
    raise JobError(f"--workdir={workdir}: already holds embeddings ({EMBEDDINGS}); use a new "
                   "workdir or delete them")
  check_config(config, jax.device_count())
  mesh = ts.make_mesh()
  config = config.copy_and_resolve_references()
  for field in ("pretrain_workdir", "folder", "data_dir"):  # As the neighbours job will need them.
    if config[field]:
      config[field] = checkpointing.resolve_dir(config[field])
  model = load_model(config, mesh)
  config.pretrain_step = model.step
  source, split = open_source(
      config, shorter_side=shorter_side(model.image_size, model.crop_fraction))
  local_batch = config.batch_size // jax.process_count()
  ds = input_pipeline.eval_dataset(source, split, local_batch=local_batch,
                                   image_size=model.image_size, crop_fraction=model.crop_fraction,
                                   threads=config.data_threads, names=True)
  num_images = source.num_examples(split, "split")
  num_batches = -(-max(source.process_counts(split)) // local_batch)
  logging.info("Embedding %d images of %s (split %s) with the step-%d encoder of %s: %d "
               "batches of %d.", num_images, source.name, split, model.step,
               config.pretrain_workdir, num_batches, config.batch_size)
  h, labels, names = _embed(model, ds, mesh, num_batches)
  h, labels, names = _gather(h), _gather(labels), _gather_strings(names)
  unreadable = _gather_strings([f"{path}\t{reason}" for path, reason in
                                (source.unreadable if config.folder else [])])
  if jax.process_index() == 0:
    tf.io.gfile.makedirs(workdir)
    if unreadable:
      write_file(f"{workdir}/{UNREADABLE}", "".join(line + "\n" for line in unreadable).encode())
      logging.warning("%d files could not be decoded and have no row; they are listed with "
                      "why in %s/%s.", len(unreadable), workdir, UNREADABLE)
    if len(h):
      _write_index(workdir, config, model, source, h, labels, names, len(unreadable))
  if not len(h):
    raise JobError(f"config.folder={config.folder!r}: none of its {num_images} files could be "
                   f"decoded (listed with the reasons in {workdir}/{UNREADABLE})")
  logging.info("Wrote %d embeddings of dimension %d to %s.", len(h), h.shape[1], workdir)
  return h


def _embed(model: EmbedModel, ds: tf.data.Dataset, mesh, num_batches: int):
  """This process's (h float32 [n, D], labels int32 [n], names [n]) of ds, in order, padding dropped."""
  sharding = ts.batch_sharded(mesh)
  progress = periodic_actions.ReportProgress(num_train_steps=num_batches, every_secs=30)
  h, labels, names = [], [], []

  def collect(embedded, local):
    keep = local["mask"]
    rows = np.asarray(multihost_utils.global_array_to_host_local_array(
        embedded, mesh, jax.P(ts.DATA_AXIS)))
    h.append(rows[keep])
    labels.append(local["label"][keep])
    names.extend(name.decode() for name in local["name"][keep])

  pending = None
  for i, local in enumerate(tfds.as_numpy(ds)):
    embedded = model.embed(jax.make_array_from_process_local_data(sharding, local["image"]))
    if pending is not None:  # Copied to the host while the device embeds the next batch.
      collect(*pending)
    pending = (embedded, local)
    progress(i + 1)
  collect(*pending)
  return np.concatenate(h), np.concatenate(labels), names


def _gather(x: np.ndarray) -> np.ndarray:
  """The processes' arrays x [n_p, ...] concatenated in process order, on every process."""
  if jax.process_count() == 1:
    return x
  counts = multihost_utils.process_allgather(np.int64(len(x)))
  padded = np.zeros((int(counts.max()),) + x.shape[1:], x.dtype)
  padded[:len(x)] = x
  gathered = multihost_utils.process_allgather(padded)
  return np.concatenate([part[:count] for part, count in zip(gathered, counts)])


def _gather_strings(strings) -> list:
  """The processes' lists of strings concatenated in process order, on every process."""
  if jax.process_count() == 1:
    return list(strings)
  encoded = np.frombuffer("".join(s + "\0" for s in strings).encode(), np.uint8)
  return _gather(encoded).tobytes().decode().split("\0")[:-1]


def write_file(path: str, content: bytes):
  """Writes content to path (local or gs://) atomically: a reader sees all of it or nothing."""
  tmp = path + ".tmp"
  with tf.io.gfile.GFile(tmp, "wb") as f:
    f.write(content)
  tf.io.gfile.rename(tmp, path, overwrite=True)


def _write_index(workdir, config, model, source, h, labels, names, num_unreadable: int):
  """Writes embeddings.npy, index.jsonl and, last, embed.json (see the module docstring)."""
  buffer = io.BytesIO()
  np.save(buffer, h.astype(np.float32))
  write_file(f"{workdir}/{EMBEDDINGS}", buffer.getvalue())
  labelled = source.num_classes is not None
  rows = [{"name": name, **({"label": int(label)} if labelled else {})}
          for name, label in zip(names, labels)]
  write_file(f"{workdir}/{INDEX}", "".join(json.dumps(r) + "\n" for r in rows).encode())
  meta = {"config": config.to_dict(), "image_size": model.image_size,
          "crop_fraction": model.crop_fraction, "num_images": len(h), "dim": int(h.shape[1]),
          "class_names": source.class_names, "unreadable": num_unreadable}
  write_file(f"{workdir}/{META}", json.dumps(meta, indent=1).encode())


class Index(NamedTuple):
  """An embed job's output, as load_index reads it.

  embeddings: float32 [N, D] unit rows (memory-mapped for a local workdir).
  rows: N dicts {'name'[, 'label']}.
  config: the embed job's config; image_size, crop_fraction: how its images
  were cropped; class_names: list or None.
  """
  embeddings: np.ndarray
  rows: list
  config: ml_collections.ConfigDict
  image_size: int
  crop_fraction: float
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
  return Index(embeddings, rows, ml_collections.ConfigDict(meta["config"]), meta["image_size"],
               meta["crop_fraction"], meta["class_names"])

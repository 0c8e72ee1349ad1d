"""The embed job (config.job='embed'): the representation h of every image of a split or folder.

  python -m contrastive_jax.main --config=configs/embed.py --workdir=DIR \
      --config.pretrain_workdir=PRETRAIN_DIR --config.dataset=cifar10 --config.split=test
  python -m contrastive_jax.main --config=configs/embed.py --workdir=DIR \
      --config.pretrain_workdir=PRETRAIN_DIR --config.folder=/photos

Restores only the encoder of any method's pretraining checkpoint (as the
linear probe does) and writes the index (index.py) to the workdir.

Not a training loop, so not run by runner.run. Each process embeds its own
part of the images; process 0 gathers the parts and writes the files, in the
order of the split or of the sorted file paths. A workdir that already holds
an index is refused (nothing already written is lost); files an interrupted
embed left without its embed.json, which marks an index complete, are
written anew.
"""

import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from absl import logging
from clu import periodic_actions
from jax.experimental import multihost_utils

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.core import files
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import sources
from contrastive_jax.jobs import index

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


def open_source(config, *, shorter_side: int):
  """(source, split) of the images config names: config.dataset's config.split or config.folder.

  A folder's files are downscaled to shorter_side when read.

  Raises:
    ConfigError: a missing dataset, split or folder, or an empty one.
  """
  if config.folder:
    source = sources.FolderSource(config.folder, max_pixels=config.max_pixels,
                                  shorter_side=shorter_side)
    return source, source.SPLIT
  return sources.get_source(config, {"split": config.split}), config.split


def run(config, workdir: str):
  """Embeds the images config names with the checkpoint it names; writes the index to workdir.

  Returns the embeddings, float32 [N, D] (on every process).

  Holds the workdir's lock (files.workdir_lock) once the inputs are checked.

  Raises:
    ConfigError: see check_config, load_model, open_source.
    JobError: a workdir that is a file, already holds an index or that
      another job is running in; a folder none of whose files can be decoded.
  """
  workdir = files.prepare_workdir(workdir)
  _refuse_existing_index(workdir)
  check_config(config, jax.device_count())
  mesh = mesh_lib.make_mesh()
  config = config.copy_and_resolve_references()
  for field in ("pretrain_workdir", "folder", "data_dir"):  # As the neighbours job will need them.
    if config[field]:
      config[field] = files.resolve_dir(config[field])
  model = index.load_model(config, mesh)
  config.pretrain_step = model.step
  source, split = open_source(
      config, shorter_side=index.shorter_side(model.image_size, model.crop_fraction))
  with files.workdir_lock(workdir):
    _refuse_existing_index(workdir)  # Again: a job that held the lock may have written one.
    return _embed_and_write(config, workdir, mesh, model, source, split)


def _refuse_existing_index(workdir: str):
  """Raises JobError if workdir holds a complete index (one is never overwritten)."""
  if index.is_index(workdir):
    raise JobError(f"--workdir={workdir}: already holds embeddings ({index.META}, "
                   f"{index.EMBEDDINGS}); use a new workdir or delete them")
  if tf.io.gfile.exists(f"{workdir}/{index.EMBEDDINGS}"):
    logging.warning("%s/%s is left from an embed job that did not finish (no %s): embedding "
                    "again.", workdir, index.EMBEDDINGS, index.META)


def _embed_and_write(config, workdir: str, mesh, model: index.EmbedModel, source, split: str):
  """run's work once the inputs are checked and the workdir locked; returns the embeddings."""
  local_batch = config.batch_size // jax.process_count()
  ds = input_pipeline.eval_dataset(source, split, local_batch=local_batch,
                                   image_size=model.image_size, crop_fraction=model.crop_fraction,
                                   crop_resize=model.crop_resize,
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
      files.write_atomic(f"{workdir}/{index.UNREADABLE}", "".join(line + "\n" for line in unreadable).encode())
      logging.warning("%d files could not be decoded and have no row; they are listed with "
                      "why in %s/%s.", len(unreadable), workdir, index.UNREADABLE)
    if len(h):
      index.write(workdir, config, model, source, h, labels, names, len(unreadable))
  if not len(h):
    raise JobError(f"config.folder={config.folder!r}: none of its {num_images} files could be "
                   f"decoded (listed with the reasons in {workdir}/{index.UNREADABLE})")
  logging.info("Wrote %d embeddings of dimension %d to %s.", len(h), h.shape[1], workdir)
  return h


def _embed(model: index.EmbedModel, ds: tf.data.Dataset, mesh, num_batches: int):
  """This process's (h float32 [n, D], labels int32 [n], names [n]) of ds, in order, padding dropped."""
  sharding = mesh_lib.batch_sharded(mesh)
  progress = periodic_actions.ReportProgress(num_train_steps=num_batches, every_secs=30)
  h, labels, names = [], [], []

  def collect(embedded, local):
    keep = local["mask"]
    rows = np.asarray(multihost_utils.global_array_to_host_local_array(
        embedded, mesh, jax.P(mesh_lib.DATA_AXIS)))
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



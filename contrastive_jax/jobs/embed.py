"""The embed job (config.job='embed'): the representation h of every image of a split or folder.

  python -m contrastive_jax.main --config=configs/embed.py --workdir=DIR \
      --config.pretrain_workdir=PRETRAIN_DIR --config.dataset=cifar10 --config.split=test
  python -m contrastive_jax.main --config=configs/embed.py --workdir=DIR \
      --config.pretrain_workdir=PRETRAIN_DIR --config.folder=/photos
  python -m contrastive_jax.main --config=configs/embed.py --workdir=DIR \
      --config.add=True --config.folder=/photos_new

Restores only the encoder of any method's pretraining checkpoint (as the
linear probe does) and writes the index (index.py) to the workdir, with its
ANN index (ann.py; config.ann).

With config.add, the files of config.folder that the index in the workdir
does not hold yet (by path) are embedded with the index's own checkpoint and
added to it as a new part, their rows numbered on from its last; the ANN
index grows with them. A checkpoint other than the index's is refused.

Not a training loop, so not run by runner.run. Each process embeds its own
part of the images; process 0 gathers the parts and writes the files, in the
order of the split or of the sorted file paths. A workdir that already holds
an index is refused (nothing already written is lost); files an interrupted
embed left without its embed.json, which marks an index complete, are
written anew.
"""

from absl import logging
from clu import periodic_actions
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from contrastive_jax.core import files
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import sources
from contrastive_jax.search import ann as ann_lib
from contrastive_jax.search import index as index_lib
from contrastive_jax.training import restore


def check_config(config, num_devices: int):
  """Raises ConfigError for fields that cannot run (before anything is read).

  Exactly one of dataset and folder names the images.
  """
  if config.batch_size <= 0 or config.batch_size % num_devices:
    raise ConfigError(
      "batch_size",
      config.batch_size,
      f"a positive multiple of the number of devices ({num_devices})",
    )
  if bool(config.dataset) == bool(config.folder):
    raise ConfigError(
      "folder",
      config.folder,
      "set when (and only when) config.dataset is not: the images are a "
      f"dataset's split or a folder's files (dataset={config.dataset!r})",
    )
  for field in ("max_pixels", "data_threads"):
    if config[field] <= 0:
      raise ConfigError(field, config[field], "an integer > 0")
  if config.add and not config.folder:
    raise ConfigError(
      "folder",
      config.folder,
      "a folder of image files when config.add is True: the images added to an index are files",
    )
  ann_lib.check_config(config.ann, adding=config.add)


def _adding_config(config, existing: index_lib.Index):
  """The config that embeds config.folder for the index `existing`: its own checkpoint's.

  Its ANN fields are the index's, but for config.ann.threads.

  Raises:
    ConfigError: config names a checkpoint (pretrain_workdir, pretrain_step
      other than -1, random_init) other than the index's; growing the index's
      ANN index needs FAISS, which does not import (ann.check_add).
  """
  saved = existing.config
  checkpoint = f"the index's checkpoint ({saved.pretrain_workdir}, step {saved.pretrain_step})"
  given = config.pretrain_workdir
  if given and files.resolve_dir(given) != saved.pretrain_workdir:
    raise ConfigError(
      "pretrain_workdir",
      config.pretrain_workdir,
      f"unset or {checkpoint} when config.add is True: new rows must come from "
      "the encoder of the old ones",
    )
  if config.pretrain_step not in (-1, saved.pretrain_step):
    raise ConfigError(
      "pretrain_step",
      config.pretrain_step,
      f"-1 or {saved.pretrain_step}, {checkpoint}, when config.add is True",
    )
  if config.random_init != saved.random_init:
    raise ConfigError(
      "random_init",
      config.random_init,
      f"{saved.random_init}, as the index's embed, when config.add is True",
    )
  adding = ml_collections.ConfigDict(saved.to_dict())
  # The index keeps the ANN fields it was embedded with ('auto' follows its rows);
  # an index from before ANN indexes (or a field) gets config.ann's.
  ann = {
    **config.ann.to_dict(),
    **(saved.ann.to_dict() if "ann" in saved else {}),
    "threads": config.ann.threads,
  }
  ann_lib.check_add(ml_collections.ConfigDict(ann), existing.ann)
  adding.update(
    dataset=None,
    folder=files.resolve_dir(config.folder),
    max_pixels=config.max_pixels,
    batch_size=config.batch_size,
    data_threads=config.data_threads,
    ann=ann,
    add=True,
  )
  return adding


def open_source(config, *, shorter_side: int, skip=frozenset()):
  """(source, split) of the images config names: config.dataset's config.split or config.folder.

  A folder's files are downscaled to shorter_side when read; those whose path
  is in skip are left out.

  Raises:
    ConfigError: a missing dataset, split or folder, or an empty one.
  """
  if config.folder:
    source = sources.FolderSource(
      config.folder, max_pixels=config.max_pixels, shorter_side=shorter_side, skip=skip
    )
    return source, source.SPLIT
  return sources.get_source(config, {"split": config.split}), config.split


def run(config, workdir: str):
  """Embeds the images config names with the checkpoint it names; writes the index to workdir.

  Returns the embeddings written, float32 [N, D] (on every process); with
  config.add, those of the files added (none: [0, D]).

  Holds the workdir's lock (files.workdir_lock) once the inputs are checked.

  Raises:
    ConfigError: see check_config, _adding_config, restore.embed_model, open_source.
    JobError: a workdir that is a file, already holds an index (without
      config.add) or holds none (with it), or that another job is running
      in; an index to add to whose files do not fit (index_lib.load_index); a
      folder none of whose files can be decoded.
  """
  workdir = files.prepare_workdir(workdir)
  check_config(config, jax.device_count())
  existing = _index_to_add_to(workdir) if config.add else _refuse_existing_index(workdir)
  mesh = mesh_lib.make_mesh()
  config = config.copy_and_resolve_references()
  if existing:
    config = _adding_config(config, existing)
  if config.folder:  # A folder has no split: embed.json says so rather than the default's.
    config.split = None
  for field in ("pretrain_workdir", "folder", "data_dir"):  # As the neighbours job will need them.
    if config[field]:
      config[field] = files.resolve_dir(config[field])
  model = restore.embed_model(config, mesh)
  config.pretrain_step = model.step
  shorter = model.eval_crop.shorter_side()
  if not existing:
    source, split = open_source(config, shorter_side=shorter)
    with files.workdir_lock(workdir):
      _refuse_existing_index(workdir)  # Again: a job that held the lock may have written one.
      return _embed_and_write(config, workdir, mesh, model, source, split, None)
  with files.workdir_lock(workdir):
    existing = _index_to_add_to(workdir)  # Again: another add may have grown it meanwhile.
    source, split = open_source(
      config, shorter_side=shorter, skip=frozenset(row["name"] for row in existing.rows)
    )
    if not source.files:
      logging.info("Every file of %s is in the index already: nothing to add.", config.folder)
      return np.zeros((0, existing.embeddings.shape[1]), np.float32)
    return _embed_and_write(config, workdir, mesh, model, source, split, existing)


def _index_to_add_to(workdir: str) -> index_lib.Index:
  """The index in workdir (config.add), its ANN file checked before anything is embedded.

  Raises:
    JobError: there is none, or its files do not fit (index_lib.load_index,
      ann.verify).
  """
  if not index_lib.is_index(workdir):
    raise JobError(
      f"--workdir={workdir}: must hold a finished embed job's index when "
      f"config.add is True (no {index_lib.META} there)"
    )
  where = f"--workdir={workdir}"
  existing = index_lib.load_index(workdir, where=where)
  if existing.ann:
    ann_lib.verify(workdir, existing.ann, where=where)
  return existing


def _refuse_existing_index(workdir: str):
  """Raises JobError if workdir holds a complete index (one is never overwritten)."""
  if index_lib.is_index(workdir):
    raise JobError(
      f"--workdir={workdir}: already holds embeddings ({index_lib.META}, "
      f"{index_lib.EMBEDDINGS}); use a new workdir or delete them, or add "
      "config.folder's new files to them with --config.add=True"
    )
  if tf.io.gfile.exists(f"{workdir}/{index_lib.EMBEDDINGS}"):
    logging.warning(
      "%s/%s is left from an embed job that did not finish (no %s): embedding again.",
      workdir,
      index_lib.EMBEDDINGS,
      index_lib.META,
    )


def _embed_and_write(
  config, workdir: str, mesh, model: restore.EmbedModel, source, split: str, existing
):
  """run's work once the inputs are checked and the workdir locked; returns the embeddings.

  existing: the index to add the embeddings to (index_lib.append), or None for a new one.
  """
  local_batch = config.batch_size // jax.process_count()
  ds = input_pipeline.eval_dataset(
    source,
    split,
    local_batch=local_batch,
    eval_crop=model.eval_crop,
    threads=config.data_threads,
    names=True,
  )
  num_images = source.num_examples(split, "split")
  num_batches = -(-max(source.process_counts(split)) // local_batch)
  logging.info(
    "Embedding %d images of %s (split %s) with the step-%d encoder of %s: %d batches of %d.",
    num_images,
    source.name,
    split,
    model.step,
    config.pretrain_workdir,
    num_batches,
    config.batch_size,
  )
  h, labels, names = _embed(model, ds, mesh, num_batches)
  h, labels, names = _gather(h), _gather(labels), _gather_strings(names)
  unreadable = _gather_strings(
    [f"{path}\t{reason}" for path, reason in (source.unreadable if config.folder else [])]
  )
  listed = index_lib.part_names(len(existing.meta["parts"]) if existing else 0)["unreadable"]
  if jax.process_index() == 0:
    tf.io.gfile.makedirs(workdir)
    if unreadable:
      files.write_atomic(
        f"{workdir}/{listed}", "".join(line + "\n" for line in unreadable).encode()
      )
      logging.warning(
        "%d files could not be decoded and have no row; they are listed with why in %s/%s.",
        len(unreadable),
        workdir,
        listed,
      )
    if len(h) and existing:
      index_lib.append(workdir, existing, config.ann, h, labels, names, source, len(unreadable))
    elif len(h):
      index_lib.write(workdir, config, model, source, h, labels, names, len(unreadable))
  if not len(h):
    raise JobError(
      f"config.folder={config.folder!r}: none of its {num_images} files could be "
      f"decoded (listed with the reasons in {workdir}/{listed})"
    )
  logging.info(
    "%s %d embeddings of dimension %d to %s.",
    "Added" if existing else "Wrote",
    len(h),
    h.shape[1],
    workdir,
  )
  return h


def _embed(model: restore.EmbedModel, ds: tf.data.Dataset, mesh, num_batches: int):
  """This process's (h float32 [n, D], labels int32 [n], names [n]) of ds, in order, padding
  dropped."""
  sharding = mesh_lib.batch_sharded(mesh)
  progress = periodic_actions.ReportProgress(num_train_steps=num_batches, every_secs=30)
  h, labels, names = [], [], []

  def collect(embedded, local):
    keep = local["mask"]
    rows = np.asarray(
      multihost_utils.global_array_to_host_local_array(embedded, mesh, jax.P(mesh_lib.DATA_AXIS))
    )
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
  padded[: len(x)] = x
  gathered = multihost_utils.process_allgather(padded)
  return np.concatenate([part[:count] for part, count in zip(gathered, counts)])


def _gather_strings(strings) -> list:
  """The processes' lists of strings concatenated in process order, on every process."""
  if jax.process_count() == 1:
    return list(strings)
  encoded = np.frombuffer("".join(s + "\0" for s in strings).encode(), np.uint8)
  return _gather(encoded).tobytes().decode().split("\0")[:-1]

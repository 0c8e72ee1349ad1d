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

Not a training loop, so not run by runner.run. The images (the split in
order, or the sorted file paths) are cut into shards of config.shard_rows
(search/shards.py); each process embeds and writes its own shards while it
embeds, holding one shard's rows at a time, so that no process gathers
every row and the files do not depend on the number of processes. Process 0
then builds the ANN index from the shards, memory-mapped, and writes
embed.json last. A workdir that already holds an index is refused (nothing
already written is lost). An embed that was interrupted resumes at the
shards it had not written, when run again with the same images, checkpoint
and shard_rows (PLAN, written before the first shard, says which); a
workdir whose shards are another run's is refused, never overwritten.

With config.engine='beam' the same shards are embedded and written by the workers
of an Apache Beam runner (search/beam_embed.py: config.runner, num_workers,
beam_options), one process running the job; the rest is the same.
"""

import functools
import hashlib
import importlib.util
import json

from absl import logging
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np
import tensorflow as tf

from contrastive_jax.core import files
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.data import sources
from contrastive_jax.search import ann as ann_lib
from contrastive_jax.search import index as index_lib
from contrastive_jax.search import shard_embed
from contrastive_jax.search import shards as shards_lib
from contrastive_jax.training import restore

# What an unfinished embed's shards hold (_plan): a run that finds it resumes them.
PLAN = "embed_plan.json"
# config.engine: who embeds the shards (docs/search.md).
ENGINES = ("jax", "beam")


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
  for field in ("max_pixels", "data_threads", "shard_rows"):
    if config[field] <= 0:
      raise ConfigError(field, config[field], "an integer > 0")
  if config.add and not config.folder:
    raise ConfigError(
      "folder",
      config.folder,
      "a folder of image files when config.add is True: the images added to an index are files",
    )
  ann_lib.check_config(config.ann, adding=config.add)
  if config.engine not in ENGINES:
    raise ConfigError("engine", config.engine, f"one of {list(ENGINES)}")
  if config.num_workers < 0:
    raise ConfigError("num_workers", config.num_workers, "an integer >= 0 (0: one per core)")
  if config.engine == "beam" and jax.process_count() > 1:
    raise ConfigError(
      "engine",
      config.engine,
      f"'jax' on {jax.process_count()} processes: the Beam embed is run by one driver "
      "process, its runner's workers embed",
    )


def _beam_runner(config, workdir: str):
  """The Beam runner config names (config.engine 'beam'), checked; None for 'jax'.

  Raises:
    JobError: Apache Beam is not installed; the runner is unknown or not installed
      (naming its package); a runner other than DirectRunner (remote workers) with a
      workdir, pretrain_workdir, folder or data_dir that is not a gs:// path its workers can reach.
  """
  if config.engine != "beam":
    return None
  if importlib.util.find_spec("apache_beam") is None:
    raise JobError(
      "config.engine='beam': Apache Beam is not installed: pip install -e '.[beam]' "
      "(or pip install apache-beam==2.77.0); config.engine='jax' needs none"
    )
  from contrastive_jax.search import beam_embed  # pylint: disable=g-import-not-at-top

  runner = beam_embed.choose_runner(config.runner, config.num_workers, config.beam_options)
  if runner.name != "FnApiRunner":
    for flag, value in (
      ("--workdir", workdir),
      ("config.pretrain_workdir", config.pretrain_workdir),
      ("config.folder" if config.folder else "config.data_dir", config.folder or config.data_dir),
    ):
      if not (value or "").startswith("gs://"):
        raise JobError(
          f"{flag}={value!r}: must be a gs:// path with config.runner={config.runner!r}, "
          "whose workers run on other machines (or use config.runner='DirectRunner')"
        )
  return runner


def worker_model(config_json: str, workdir: str) -> tuple:
  """(model, mesh, source, split): a Beam worker's encoder and images, of the config's JSON.

  What load_model of beam_embed.EncoderHandler calls, once per worker process: the
  checkpoint is read there, the source opened (a folder listed) as the driver did; with
  config.add, the files the index in workdir holds left out, as the driver left them out.
  """
  config = ml_collections.ConfigDict(json.loads(config_json))
  mesh = mesh_lib.make_mesh()
  model = restore.embed_model(config, mesh)
  skip = frozenset(index_lib.load_index(workdir).rows.names()) if config.add else frozenset()
  source, split = open_source(config, shorter_side=model.eval_crop.shorter_side(), skip=skip)
  return model, mesh, source, split


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
    # Who embeds this run's shards: this run's choice, whichever engine embedded the index.
    engine=config.engine,
    runner=config.runner,
    num_workers=config.num_workers,
    beam_options=config.beam_options,
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

  Returns the embeddings written, float32 [N, D] (on every process: an
  index.Parts of the shards, memory-mapped); with config.add, those of the
  files added (none: [0, D]).

  Holds the workdir's lock (files.workdir_lock) once the inputs are checked.

  Raises:
    ConfigError: see check_config, _adding_config, restore.embed_model, open_source.
    JobError: a workdir that is a file, already holds an index (without
      config.add) or holds none (with it), or that another job is running
      in; shards of another run (_shards_to_write); an index to add to
      whose files do not fit (index_lib.load_index); a
      folder none of whose files can be decoded.
  """
  workdir = files.prepare_workdir(workdir)
  check_config(config, jax.device_count())
  runner = _beam_runner(config, workdir)
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
      return _embed_and_write(config, workdir, mesh, model, source, split, None, runner)
  with files.workdir_lock(workdir):
    existing = _index_to_add_to(workdir)  # Again: another add may have grown it meanwhile.
    source, split = open_source(config, shorter_side=shorter, skip=frozenset(existing.rows.names()))
    if not source.files:
      logging.info("Every file of %s is in the index already: nothing to add.", config.folder)
      return np.zeros((0, existing.embeddings.shape[1]), np.float32)
    return _embed_and_write(config, workdir, mesh, model, source, split, existing, runner)


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
      f"{shards_lib.EMBEDDINGS_DIR}/); use a new workdir or delete them, or add "
      "config.folder's new files to them with --config.add=True"
    )


def _embed_and_write(
  config, workdir: str, mesh, model: restore.EmbedModel, source, split: str, existing, runner
):
  """run's work once the inputs are checked and the workdir locked; returns the part's rows.

  existing: the index to add the part to (index_lib.append), or None for a new one.
  runner: the Beam runner (config.engine 'beam': beam_embed.embed_shards embeds and
  writes the shards on its workers) or None (config.engine 'jax': each process
  embeds and writes its shards of the shards not yet complete (_shards_to_write),
  in rounds of one shard per process). Process 0 writes the unreadable list, the
  ANN index and embed.json once every shard is.
  """
  meta = existing.meta if existing else {"parts": []}
  part = len(meta["parts"])
  class_names, relabel = index_lib.classes_with(existing, source)
  plan = _plan(config, model, source, split, meta, class_names)
  shards = shards_lib.plan(plan["num_images"], config.shard_rows, plan["first_shard"])
  missing = _shards_to_write(workdir, plan, shards)
  count, index = jax.process_count(), jax.process_index()
  local_batch = config.batch_size // count
  logging.info(
    "Embedding %d images of %s (split %s) with the step-%d encoder of %s: %d shards of "
    "%d, %d of them written already.",
    plan["num_images"],
    source.name,
    split,
    model.step,
    config.pretrain_workdir,
    len(shards),
    config.shard_rows,
    len(shards) - len(missing),
  )
  rows = {"split": split, "relabel": relabel, "labelled": bool(class_names)}
  if config.engine == "beam":
    from contrastive_jax.search import beam_embed  # pylint: disable=g-import-not-at-top

    beam_embed.embed_shards(
      missing,
      beam_embed.Embedding(
        functools.partial(worker_model, config.to_json(), workdir),
        workdir,
        config.batch_size,
        config.data_threads,
        plan["first_id"],
        rows,
      ),
      runner,
    )
  else:
    for first in range(0, len(missing), count):
      group = missing[first : first + count]
      batches = shard_embed.num_batches(group, local_batch)
      mine = group[index] if index < len(group) else None
      ds = shard_embed.shard_dataset(
        source, split, mine, model.eval_crop, local_batch, batches, config.data_threads
      )
      embedded = shard_embed.embed_batches(model, ds, mesh, batches)
      if mine:
        content = shard_embed.shard_content(mine, embedded, source, plan["first_id"], rows)
        shard_embed.write_shard(workdir, mine, content)
  multihost_utils.sync_global_devices("embed: every shard written")
  written = [shards_lib.entry(s.number, shards_lib.count_rows(workdir, s.number)) for s in shards]
  entry = {  # The part's entry of embed.json's parts.
    "shards": written,
    "num_images": sum(shard["num_images"] for shard in written),
    "ids": [plan["first_id"], plan["first_id"] + plan["num_images"]],
    "folder": source.name if config.folder else None,
  }
  listed = index_lib.unreadable_name(part)
  unreadable = [f"{path}\t{why}" for path, why in (source.skipped if config.folder else [])]
  unreadable += [line for s in shards for line in shards_lib.read_unreadable(workdir, s.number)]
  if index == 0:
    if unreadable:
      files.write_atomic(f"{workdir}/{listed}", "".join(line + "\n" for line in unreadable))
      logging.warning(
        "%d files could not be decoded and have no row; they are listed with why in %s/%s.",
        len(unreadable),
        workdir,
        listed,
      )
    if entry["num_images"] and existing:
      index_lib.append(workdir, existing, config.ann, entry, class_names, len(unreadable))
    elif entry["num_images"]:
      index_lib.write(workdir, config, model, source, entry, len(unreadable))
    if entry["num_images"]:  # The part is in embed.json: nothing left to resume.
      tf.io.gfile.remove(f"{workdir}/{PLAN}")
  if not entry["num_images"]:
    raise JobError(
      f"config.folder={config.folder!r}: none of its {plan['num_images']} files could be "
      f"decoded (listed with the reasons in {workdir}/{listed})"
    )
  multihost_utils.sync_global_devices("embed: embed.json written")
  h = index_lib.Parts(index_lib.part_arrays(workdir, entry, workdir))
  logging.info(
    "%s %d embeddings of dimension %d to %s.",
    "Added" if existing else "Wrote",
    len(h),
    h.shape[1],
    workdir,
  )
  return h


def _plan(config, model, source, split, meta: dict, class_names) -> dict:
  """What the part's shards hold: PLAN's content, the same for a run and its resumption.

  The batch size, threads and ANN fields are not in it: they change no row.
  """
  names = "\n".join(source.files) if config.folder else ""
  return {
    "part": len(meta["parts"]),
    "first_shard": index_lib.next_shard(meta),
    "first_id": index_lib.next_id(meta),
    "shard_rows": config.shard_rows,
    "num_images": source.num_examples(split, "split"),
    "source": source.name,
    "split": split,
    "data_dir": config.data_dir,
    "files_sha256": hashlib.sha256(names.encode()).hexdigest(),
    "class_names": class_names,
    "max_pixels": config.max_pixels,
    "pretrain_workdir": config.pretrain_workdir,
    "pretrain_step": model.step,
    "random_init": config.random_init,
    "eval_crop": model.eval_crop._asdict(),
  }


def _shards_to_write(workdir: str, plan: dict, shards: list) -> list:
  """The shards not yet complete, by process 0's view; writes PLAN the first time.

  Shards left by an interrupted run of the same plan are kept; PLAN of an
  earlier, finished part (left by a run stopped between embed.json and its
  removal) is replaced.

  Raises:
    JobError: PLAN is another run's (other images, checkpoint, crop or
      shard_rows), or a shard of this part exists without PLAN: nothing is
      overwritten.
  """
  path = f"{workdir}/{PLAN}"
  saved = None
  if tf.io.gfile.exists(path):
    with tf.io.gfile.GFile(path) as f:
      saved = json.load(f)
    if saved.get("part", -1) < plan["part"]:  # A finished part's.
      saved = None
  if saved is not None and saved != plan:
    differ = sorted(key for key in plan if saved.get(key) != plan[key])
    raise JobError(
      f"--workdir={workdir}: holds the shards of an unfinished embed of other images or "
      f"another encoder ({PLAN} differs in {', '.join(differ)}); use a new workdir, or "
      f"delete {PLAN}, {shards_lib.EMBEDDINGS_DIR}/ and {shards_lib.METADATA_DIR}/ to embed "
      "these images anew"
    )
  if saved is None:
    for shard in shards:
      for name in shards_lib.names(shard.number).values():
        if tf.io.gfile.exists(f"{workdir}/{name}"):
          raise JobError(
            f"--workdir={workdir}: holds {name} but no {PLAN} saying what it holds; use a "
            f"new workdir, or delete {shards_lib.EMBEDDINGS_DIR}/ and "
            f"{shards_lib.METADATA_DIR}/ to embed these images anew"
          )
  multihost_utils.sync_global_devices("embed: plan checked")
  if jax.process_index() == 0 and saved is None:
    files.write_atomic(path, json.dumps(plan, indent=1))
  done = np.array([shards_lib.is_complete(workdir, s.number) for s in shards], bool)
  done = np.asarray(multihost_utils.broadcast_one_to_all(done)) if len(shards) else done
  if done.any():
    logging.info("Resuming: %d of %d shards are written already.", done.sum(), len(shards))
  return [shard for shard, complete in zip(shards, done) if not complete]

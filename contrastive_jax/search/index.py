"""The embedding index an embed job writes and the neighbours job reads: one folder of files.

  img_emb/, metadata/  the rows in shards (shards.py: the clip-retrieval / autofaiss layout):
                  img_emb_{i:05d}.npy float32 [n, D], row r is image r's h
                  (models.encode: the eval-mode encoder on the centre crop the
                  pretraining run evaluated on), L2-normalised, so that a dot
                  product of two rows is their cosine similarity; beside it
                  metadata_{i:05d}.parquet, row r's id, name, label and split;
                  the name is the file's path (folders), the 'file_name'
                  feature (prepared image folders) or the TFDS id; the label
                  only for labelled images.
  embed.json      what was embedded and how: the job's config (the
                  checkpoint step resolved), eval_crop (size, fraction, resize), N, D,
                  class names, format_version, run_id (this embed run's id),
                  parts (below) and ann (what ann.json holds, or null).
                  Written last: its presence marks a complete index, which
                  the neighbours job reads.
  unreadable.txt  (folders) the files that could not be decoded, with why;
                  they have no row.
  ann.G.faiss, ann.json  the ANN index of the rows and its description
                  (ann.py), unless config.ann.type is 'none'.

Images added later (the embed job with config.add) are a new part: new
shards numbered on from the index's last (and unreadable.P.txt for part P =
1, 2, ...), their ids numbered on from the previous parts'; embed.json's
"parts" lists every part ({"shards": [{"embeddings", "metadata",
"num_images"}], "num_images", "ids": [first, stop), "folder"}) and
load_index reads them all, in order. Nothing already written is rewritten
but the ANN index (a new generation, with the new rows added) and embed.json.

An index of format_version 1 to 3 (one embeddings.npy and index.jsonl per
part: embeddings.P.npy, index.P.jsonl for added ones) is read as one shard
per part; images added to it go to shards.

Every file is written atomically, embed.json after the files it lists, so an
interrupted embed or add leaves the previous embed.json, whose files are
untouched. ann.json follows embed.json; the ANN file it replaces is deleted
after it.
"""

import io
import json
from typing import NamedTuple, Optional
import uuid

from absl import logging
import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import tensorflow as tf

from contrastive_jax.core import files
from contrastive_jax.core.errors import JobError
from contrastive_jax.data import images
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import sources
from contrastive_jax.search import ann as ann_lib
from contrastive_jax.search import shards as shards_lib

# The files of an index of format_version 1 to 3 (its first part's).
EMBEDDINGS, INDEX = "embeddings.npy", "index.jsonl"
META, UNREADABLE = "embed.json", "unreadable.txt"
# embed.json's format: 1 (no format_version field: one part, no ANN index), 2 (parts, run_id,
# ann; the eval crop in image_size, crop_fraction and, where present, crop_resize), 3 (the
# eval crop as "eval_crop"), 4 (each part's rows in shards). load_index reads each through
# _upgrade_meta.
FORMAT_VERSION = 4


def unreadable_name(part: int) -> str:
  """The file listing the files of part `part` (0: the first embed) that have no row."""
  return f"unreadable.{part}.txt" if part else UNREADABLE


def next_shard(meta: dict) -> int:
  """The number of the next shard an add writes: one past the index's last (0 for none)."""
  return sum(
    shard["embeddings"].startswith(shards_lib.EMBEDDINGS_DIR + "/")
    for part in meta["parts"]
    for shard in part["shards"]
  )


def next_id(meta: dict) -> int:
  """The id of the first image an add embeds: one past the index's last part's."""
  return meta["parts"][-1]["ids"][1] if meta["parts"] else 0


def classes_with(index: Optional["Index"], source) -> tuple:
  """(class_names or None, relabel): the index's classes and then source's new ones.

  relabel[l] is the label, in class_names, of source's label l, so that old
  labels keep their meaning; a new index (index None) has source's classes.
  """
  class_names = list((index.class_names if index else None) or [])
  if source.class_names:
    class_names += [name for name in source.class_names if name not in class_names]
  return class_names or None, [class_names.index(name) for name in source.class_names or []]


def part_arrays(workdir: str, part: dict, where: str) -> list:
  """The embeddings of each of part's shards (float32 [n, D], memory-mapped where local).

  Raises:
    JobError: a shard's embeddings missing, damaged or of another row count than part says.
  """
  arrays = []
  for shard in part["shards"]:
    try:
      array = _read_embeddings(f"{workdir}/{shard['embeddings']}")
    except (ValueError, OSError, tf.errors.OpError) as e:
      raise _shard_error(where, shard, e) from None
    if len(array) != shard["num_images"]:
      raise JobError(
        f"{where}: {shard['embeddings']} holds {len(array)} rows: must be "
        f"{shard['num_images']} ({META})"
      )
    arrays.append(array)
  return arrays


def _write_ann(workdir: str, config, h, *, generation: int, run_id: str):
  """Builds the ANN index config.ann asks for of h and writes its file; its description or None."""
  spec = ann_lib.choose(len(h), h.shape[1], config.ann)
  if spec is None:
    return None
  if config.ann.type == "auto" and not ann_lib.has_faiss():
    # The base install: the index is searched exactly (as a 'flat' index would be below
    # EXACT_BELOW rows), and said so, rather than refused.
    logging.warning(
      "FAISS is not installed: no ANN index for these %d rows; neighbours "
      "searches them exactly (pip install 'contrastive_jax[search]' for one, "
      "or --config.ann.type=none to say so).",
      len(h),
    )
    return None
  memory = spec.get("memory")
  logging.info(
    "Building a FAISS %s index (%s) of %d rows%s.",
    spec["type"],
    spec["params"],
    len(h),
    f", about {ann_lib.human_bytes(memory['estimate'])} within ann.max_memory="
    f"{ann_lib.human_bytes(memory['budget'])}"
    if memory
    else "",
  )
  built, spec = ann_lib.build(h, spec, threads=config.ann.threads)
  return ann_lib.write(workdir, built, spec, generation=generation, embed_run=run_id)


def _commit(workdir: str, meta: dict, old_ann: Optional[dict]):
  """Writes embed.json (the marker), then ann.json, then deletes the ANN file old_ann names."""
  files.write_atomic(f"{workdir}/{META}", json.dumps(meta, indent=1).encode())
  if meta["ann"]:
    ann_lib.write_meta(workdir, meta["ann"])
  elif tf.io.gfile.exists(f"{workdir}/{ann_lib.META}"):
    tf.io.gfile.remove(f"{workdir}/{ann_lib.META}")
  if old_ann and (not meta["ann"] or old_ann["file"] != meta["ann"]["file"]):
    tf.io.gfile.remove(f"{workdir}/{old_ann['file']}")


def write(workdir, config, model, source, part: dict, num_unreadable: int):
  """Writes a new index of one part whose shards are written: the ANN index, then embed.json.

  part: its entry of embed.json's parts (the embed job's); model: the
  restore.EmbedModel that embedded its rows; source: what they were read from
  (its class names); config.ann: which ANN index (ann.choose), built from the
  shards' rows memory-mapped.
  """
  h = Parts(part_arrays(workdir, part, workdir))
  run_id = uuid.uuid4().hex
  meta = {
    "format_version": FORMAT_VERSION,
    "run_id": run_id,
    "config": config.to_dict(),
    "eval_crop": model.eval_crop._asdict(),
    "num_images": len(h),
    "dim": int(h.shape[1]),
    "class_names": source.class_names,
    "unreadable": num_unreadable,
    "parts": [part],
    "ann": _write_ann(workdir, config, h, generation=0, run_id=run_id),
  }
  _commit(workdir, meta, None)


def append(workdir, index: "Index", ann, part: dict, class_names, num_unreadable: int):
  """Adds a part whose shards are written to the index in workdir: the ANN index grown, then
  embed.json.

  The ANN index is loaded, the part's rows added, its search parameter
  calibrated again if it was calibrated (ann.calibrate), and written as its
  next generation; when ann.type is 'auto' and the new row count calls for
  another type (ann.choose), or the index has none yet (one from before ANN
  indexes), it is built from every part instead. Nothing else already written
  is changed.

  Args:
    workdir: the index's folder.
    index: load_index(workdir).
    ann: config.ann (its type 'auto' follows the rows; another is kept).
    part: the new part's entry of embed.json's parts (its shards numbered on
      from index's, their labels those of class_names).
    class_names: classes_with(index, source)'s.
    num_unreadable: files of the folder that could not be decoded.
  Raises:
    JobError: the new rows' dimension is not the index's.
  """
  new = part_arrays(workdir, part, f"--workdir={workdir}")
  if new[0].shape[1] != index.embeddings.shape[1]:
    raise JobError(
      f"--workdir={workdir}: holds embeddings of dimension "
      f"{index.embeddings.shape[1]}; the new images' are {new[0].shape[1]}: it must be "
      "the same encoder's"
    )
  meta = dict(index.meta)
  old = index.embeddings.parts if isinstance(index.embeddings, Parts) else [index.embeddings]
  parts = Parts([*old, *new])
  old_ann = meta.get("ann")
  follow = ann.type == "auto" or not old_ann
  wanted = ann_lib.choose(len(parts), parts.shape[1], ann) if follow else old_ann
  number = len(meta["parts"])
  generation = int(old_ann["file"].split(".")[1]) + 1 if old_ann else number
  # Within a memory budget the grown index is rebuilt when another one fits it (fewer bytes
  # of code a row, or more lists).
  budgeted = bool(wanted and wanted.get("memory"))
  if (
    wanted
    and old_ann
    and wanted["type"] == old_ann["type"]
    and (not budgeted or wanted["factory"] == old_ann["factory"])
  ):
    faiss_index = ann_lib.load(workdir, old_ann, where=f"--workdir={workdir}")
    ann_lib.add(faiss_index, parts, len(index.rows))
    spec = {key: old_ann.get(key) for key in ("type", "factory", "params", "calibration")}
    if wanted.get("memory"):
      spec["memory"] = wanted["memory"]
    if spec["calibration"]:  # The grown index may need another nprobe for its target.
      spec = ann_lib.calibrate(faiss_index, parts, spec)
    if spec["type"] != "flat":
      spec = ann_lib.score(faiss_index, parts, spec)
    new_ann = ann_lib.write(
      workdir, faiss_index, spec, generation=generation, embed_run=meta["run_id"]
    )
  elif wanted:  # 'auto' chose another type (grown past EXACT_BELOW, or an old 'ivfpq').
    config = ml_collections.ConfigDict({"ann": ann.to_dict()})
    new_ann = _write_ann(workdir, config, parts, generation=generation, run_id=meta["run_id"])
  else:
    new_ann = None
  meta.update(
    num_images=len(parts),
    parts=[*meta["parts"], part],
    ann=new_ann,
    unreadable=meta["unreadable"] + num_unreadable,
    class_names=class_names,
  )
  _commit(workdir, meta, old_ann)


class Parts:
  """The rows of several float32 [n_p, D] arrays as one [sum n_p, D] array, none copied.

  What load_index returns for an index of several parts: len, shape, dtype,
  an int row, a slice (step 1) or an int array of rows, and np.asarray (a copy).
  """

  def __init__(self, parts: list):
    self.parts = parts
    self.starts = np.cumsum([0] + [len(p) for p in parts])
    self.shape = (int(self.starts[-1]), parts[0].shape[1])
    self.dtype = np.dtype(np.float32)

  def __len__(self):
    return self.shape[0]

  def __getitem__(self, key):
    if isinstance(key, slice):
      begin, stop, step = key.indices(len(self))
      if step != 1:
        raise ValueError("Parts: slices of step 1 only")
      pieces = [p[max(begin - s, 0) : max(stop - s, 0)] for p, s in zip(self.parts, self.starts)]
      return np.concatenate(
        [np.asarray(x) for x in pieces if len(x)] or [np.zeros((0, self.shape[1]), np.float32)]
      )
    rows = np.asarray(key)
    if rows.ndim == 0:
      row = int(rows) + len(self) if rows < 0 else int(rows)
      if not 0 <= row < len(self):
        raise IndexError(f"row {int(rows)} outside [0, {len(self)})")
      part = int(np.searchsorted(self.starts, row, side="right")) - 1
      return np.asarray(self.parts[part][row - self.starts[part]])
    flat = rows.ravel().astype(np.int64)
    flat = np.where(flat < 0, flat + len(self), flat)
    outside = (flat < 0) | (flat >= len(self))
    if outside.any():
      raise IndexError(f"row {int(rows.ravel()[np.argmax(outside)])} outside [0, {len(self)})")
    part = np.searchsorted(self.starts, flat, side="right") - 1
    out = np.empty((len(flat), self.shape[1]), self.dtype)
    for p in np.unique(part):  # Each part's rows in one fancy index (memory-mapped: read once).
      chosen = part == p
      out[chosen] = self.parts[p][flat[chosen] - self.starts[p]]
    return out.reshape(rows.shape + self.shape[1:])

  def __array__(self, dtype=None, copy=None):
    del copy  # Always a new array.
    return np.concatenate([np.asarray(p) for p in self.parts]).astype(dtype or self.dtype)


class Rows:
  """The row descriptions {'name'[, 'label']} of an index's shards, read from their files when
  asked: no Python object is made for a row not asked for, and at most CACHED shards' columns
  are held (read_table: parquet memory-mapped where local).

  len; rows[i] (an int: one dict); rows[a:b] and take(rows) (lists, read a shard at a time);
  iteration (in row order, one shard at a time); find(names) (the rows of given names).
  """

  CACHED = 2

  def __init__(self, paths: list, counts: list):
    self.paths = paths
    self.starts = np.cumsum([0] + list(counts))
    self._cache = {}  # shard -> pyarrow.Table, at most CACHED of them, the oldest dropped.

  def __len__(self):
    return int(self.starts[-1])

  @property
  def held(self) -> list:
    """The shards whose columns are held now (at most CACHED), oldest first."""
    return list(self._cache)

  def _table(self, shard: int) -> pa.Table:
    if shard not in self._cache:
      if len(self._cache) >= self.CACHED:
        del self._cache[next(iter(self._cache))]
      self._cache[shard] = _read_table(self.paths[shard])
    return self._cache[shard]

  def __getitem__(self, key):
    if isinstance(key, slice):
      return self.take(range(*key.indices(len(self))))
    row = int(key) + len(self) if key < 0 else int(key)
    if not 0 <= row < len(self):
      raise IndexError(f"row {int(key)} outside [0, {len(self)})")
    shard = int(np.searchsorted(self.starts, row, side="right")) - 1
    return shards_lib.row_dicts(self._table(shard).slice(row - int(self.starts[shard]), 1))[0]

  def take(self, rows) -> list:
    """[{'name'[, 'label']}] of the given rows (ints in [0, len)), in their order."""
    rows = np.asarray(rows, np.int64).ravel()
    if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
      raise IndexError(f"rows outside [0, {len(self)})")
    shard = np.searchsorted(self.starts, rows, side="right") - 1
    out = [None] * len(rows)
    for s in np.unique(shard):
      chosen = np.flatnonzero(shard == s)
      picked = self._table(int(s)).take(pa.array(rows[chosen] - self.starts[s]))
      for i, row in zip(chosen, shards_lib.row_dicts(picked)):
        out[i] = row
    return out

  def __iter__(self):
    for shard in range(len(self.paths)):
      yield from shards_lib.row_dicts(_read_table(self.paths[shard]))

  def names(self):
    """Every row's name, in row order, a shard's at a time (an iterator of str)."""
    for shard in range(len(self.paths)):
      yield from _read_table(self.paths[shard])["name"].to_pylist()

  def find(self, wanted) -> dict:
    """{name: row} of the names in `wanted` that rows have (the first row of each)."""
    wanted, found = set(wanted), {}
    if not wanted:
      return found
    for shard in range(len(self.paths)):
      column = _read_table(self.paths[shard])["name"]
      hits = np.flatnonzero(pc.is_in(column, value_set=pa.array(sorted(wanted))).to_numpy(False))
      for i in hits:
        found.setdefault(column[int(i)].as_py(), int(self.starts[shard] + i))
    return found


class Index(NamedTuple):
  """An embed job's output, as load_index reads it.

  embeddings: float32 [N, D] unit rows of every shard, in order (a
  memory-mapped array for one local shard, a Parts of them for several).
  rows: the N rows' {'name'[, 'label']}, read from the shards' metadata when asked (Rows).
  config: the embed job's config; eval_crop: how its images were cropped
  (input_pipeline.EvalCrop); class_names: list or None.
  meta: embed.json as read (its "ann": the ANN index's description, or None).
  """

  embeddings: np.ndarray
  rows: Rows
  config: ml_collections.ConfigDict
  eval_crop: input_pipeline.EvalCrop
  class_names: list
  meta: dict

  @property
  def ann(self) -> Optional[dict]:
    """The ANN index's description (ann.json's content), or None: search it exactly."""
    return self.meta.get("ann")

  @property
  def dataset_rows(self) -> int:
    """How many rows, from the first, were read from config.dataset (0 for a folder's index)."""
    return 0 if self.config.folder else self.meta["parts"][0]["num_images"]


def center_crop(index: Index, image: np.ndarray, size: int) -> np.ndarray:
  """The centre crop the index's images had (its eval_crop) at size px, uint8 [size, size, 3]."""
  return index.eval_crop.apply(tf.constant(image), size).numpy()


def read_images(index: Index, rows, shorter_side: int) -> dict:
  """{row: uint8 [H, W, 3]} for rows of the index, read again from its folder or dataset split.

  Files are downscaled to shorter_side; a dataset's images are as stored.
  Rows from index.dataset_rows on came from folders.

  Raises:
    ConfigError: the index's dataset is gone.
    ImageError: a file of the index's folders cannot be decoded any more.
  """
  # A folder's row names its file (files that could not be read have no row).
  read = {
    r: images.load_image(
      index.rows[r]["name"], max_pixels=index.config.max_pixels, shorter_side=shorter_side
    )
    for r in rows
    if r >= index.dataset_rows
  }
  from_dataset = [r for r in rows if r < index.dataset_rows]
  if from_dataset:
    source = sources.get_source(index.config, {"split": index.config.split})
    read.update(zip(from_dataset, source.images(index.config.split, from_dataset)))
  return read


def is_index(workdir: str) -> bool:
  """Whether workdir holds a complete embed job's output."""
  return tf.io.gfile.exists(f"{workdir}/{META}")


def _read_embeddings(path: str):
  """A shard's float32 [n, D] rows: memory-mapped where local, read whole from a bucket."""
  if "://" in path:
    with tf.io.gfile.GFile(path, "rb") as f:
      return np.load(io.BytesIO(f.read()))
  return np.load(path, mmap_mode="r")  # The neighbours job reads it chunk by chunk.


def _read_table(path: str) -> pa.Table:
  """A shard's "name" and "label" columns: its parquet (format 4) or JSON lines (1 to 3).

  Raises:
    OSError, ValueError (pyarrow.ArrowInvalid, json.JSONDecodeError): a missing or damaged file.
  """
  if path.endswith(".jsonl"):
    with tf.io.gfile.GFile(path) as f:
      rows = [json.loads(line) for line in f]
    return pa.table(
      {
        "name": pa.array([row["name"] for row in rows], pa.string()),
        "label": pa.array([row.get("label") for row in rows], pa.int64()),
      }
    )
  return shards_lib.read_table(path)


def _count_rows(path: str) -> int:
  """A shard's row count: its parquet's footer (format 4), or its JSON lines' (1 to 3).

  Raises:
    OSError, ValueError (pyarrow.ArrowInvalid): a missing or damaged file.
  """
  if path.endswith(".jsonl"):
    with tf.io.gfile.GFile(path) as f:
      return sum(1 for _ in f)
  return shards_lib.num_rows(path)


def _shard_error(where: str, shard: dict, error: Exception) -> JobError:
  """The error line of a shard whose files cannot be read."""
  return JobError(
    f"{where}: {shard['embeddings']} and {shard['metadata']} must be the files of "
    f"{shard['num_images']} rows {META} lists; they are missing, truncated or "
    f"damaged ({str(error).splitlines()[0]})"
  )


def load_index(workdir: str, *, where: Optional[str] = None) -> Index:
  """Reads the index an embed job wrote to workdir, every part (check is_index first).

  Args:
    workdir: the embed job's workdir.
    where: how the user named it, e.g. "config.index_workdir='/x'", to start
      each error's line (default: workdir).
  Raises:
    JobError: embed.json of an unknown format_version or not JSON; a shard's
      embeddings or metadata missing, truncated or of another row count or
      dimension than embed.json says (naming the file); ann.json missing,
      of an unknown format_version or
      other than embed.json's copy (ann.check_meta_file); an ANN description
      that does not fit (ann.check).
  """
  where = where or workdir
  try:
    with tf.io.gfile.GFile(f"{workdir}/{META}") as f:
      meta = json.load(f)
  except ValueError as e:
    raise JobError(f"{where}: {META} must be the JSON an embed job writes ({e})") from None
  meta = _upgrade_meta(meta, where)
  paths, counts, arrays = [], [], []
  for part in meta["parts"]:
    for shard in part["shards"]:
      path = f"{workdir}/{shard['metadata']}"
      try:
        count = _count_rows(path)
        array = _read_embeddings(f"{workdir}/{shard['embeddings']}")
      except (ValueError, OSError, tf.errors.OpError, pa.ArrowException) as e:
        raise _shard_error(where, shard, e) from None
      if not count == len(array) == shard["num_images"] or array.shape[1:] != (meta["dim"],):
        raise JobError(
          f"{where}: {shard['embeddings']} holds {array.shape} and {shard['metadata']} "
          f"{count} rows: must be {shard['num_images']} rows of dimension "
          f"{meta['dim']} ({META})"
        )
      paths.append(path)
      counts.append(count)
      arrays.append(array)
  rows = Rows(paths, counts)
  if meta.get("ann"):
    ann_lib.check_meta_file(workdir, meta["ann"], where=where)
    ann_lib.check(
      meta["ann"], rows=len(rows), dim=meta["dim"], embed_run=meta["run_id"], where=where
    )
  return Index(
    arrays[0] if len(arrays) == 1 else Parts(arrays),
    rows,
    ml_collections.ConfigDict(meta["config"]),
    input_pipeline.EvalCrop(**meta["eval_crop"]),
    meta["class_names"],
    meta,
  )


def _upgrade_meta(meta: dict, where: str) -> dict:
  """embed.json of any format_version as this code writes it (FORMAT_VERSION), one step each.

  Raises:
    JobError: a format_version this code does not know.
  """
  version = meta.get("format_version", 1)
  if version not in range(1, FORMAT_VERSION + 1):
    raise JobError(
      f"{where}: {META} has format_version={version!r}: must be 1 to "
      f"{FORMAT_VERSION} (written by a newer contrastive_jax?)"
    )
  if version == 1:  # One part, no ANN index, no run id: given one if an add rewrites it.
    part = {
      "embeddings": EMBEDDINGS,
      "rows": INDEX,
      "num_images": meta["num_images"],
      "folder": meta["config"].get("folder"),
    }
    meta = dict(meta, run_id=uuid.uuid4().hex, parts=[part], ann=None)
  if version <= 2:  # An index without crop_resize was cropped bilinear.
    meta = dict(meta)
    meta["eval_crop"] = {
      "size": meta.pop("image_size"),
      "fraction": meta.pop("crop_fraction"),
      "resize": meta.pop("crop_resize", "pil_bilinear"),
    }
  if version <= 3:  # A part's one embeddings file and JSON lines are its one shard.
    parts, first = [], 0
    for part in meta["parts"]:
      shard = {
        "embeddings": part["embeddings"],
        "metadata": part["rows"],
        "num_images": part["num_images"],
      }
      parts.append(
        {
          "shards": [shard],
          "num_images": part["num_images"],
          "ids": [first, first + part["num_images"]],
          "folder": part["folder"],
        }
      )
      first += part["num_images"]
    meta = dict(meta, parts=parts)
  return dict(meta, format_version=FORMAT_VERSION)

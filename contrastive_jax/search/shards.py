"""Embedding shards: an index's rows in files of a fixed number of images, as clip-retrieval writes.

  img_emb/img_emb_{i:05d}.npy          float32 [n, D]: the shard's rows, L2-normalised h.
  metadata/metadata_{i:05d}.parquet    n rows: id (int64: the image's position in the split
                                       or sorted file list, numbered on across added parts),
                                       name (string: file path or dataset id), label (int64,
                                       null where unlabelled), split (string).
  unreadable/unreadable_{i:05d}.txt    (folders, where any) the shard's files that could not be
                                       decoded, one 'path<TAB>reason' a line; they have no row.

Shard i holds the images at positions [first + (i - first_shard) * S, ... + S) of its part's
source (S: config.shard_rows), whatever the number of processes that wrote it, so the names
sort in row order (zero-padded: autofaiss and clip-retrieval read them in file-name order).
Each file is written atomically, the parquet last: a shard whose two files exist is complete.
"""

import io
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tensorflow as tf

from contrastive_jax.core import files

EMBEDDINGS_DIR, METADATA_DIR, UNREADABLE_DIR = "img_emb", "metadata", "unreadable"
SCHEMA = pa.schema(
  [("id", pa.int64()), ("name", pa.string()), ("label", pa.int64()), ("split", pa.string())]
)


class Shard(NamedTuple):
  """Shard `number`: the source positions [start, stop) of its part's split or file list."""

  number: int
  start: int
  stop: int


def names(number: int) -> dict:
  """{"embeddings", "metadata", "unreadable"}: shard `number`'s files, relative to the index."""
  return {
    "embeddings": f"{EMBEDDINGS_DIR}/img_emb_{number:05d}.npy",
    "metadata": f"{METADATA_DIR}/metadata_{number:05d}.parquet",
    "unreadable": f"{UNREADABLE_DIR}/unreadable_{number:05d}.txt",
  }


def plan(num_images: int, shard_rows: int, first_shard: int) -> list:
  """The Shards of a part of num_images source positions, shard_rows each (the last fewer)."""
  return [
    Shard(first_shard + i, start, min(start + shard_rows, num_images))
    for i, start in enumerate(range(0, num_images, shard_rows))
  ]


def is_complete(workdir: str, number: int) -> bool:
  """Whether shard `number` in workdir was written whole (both files exist)."""
  return all(
    tf.io.gfile.exists(f"{workdir}/{names(number)[key]}") for key in ("embeddings", "metadata")
  )


def write(workdir: str, number: int, h: np.ndarray, rows: dict, unreadable: list):
  """Writes shard `number`: its unreadable list (if any), its embeddings, then its metadata.

  Args:
    workdir: the index's folder.
    h: float32 [n, D] unit rows.
    rows: {"id": int [n], "name": n strings, "label": n ints or None, "split": str}.
    unreadable: 'path<TAB>reason' lines of the shard's files without a row.
  """
  paths = {key: f"{workdir}/{name}" for key, name in names(number).items()}
  for key in ("embeddings", "metadata", "unreadable")[: 3 if unreadable else 2]:
    tf.io.gfile.makedirs(paths[key].rsplit("/", 1)[0])
  if unreadable:
    files.write_atomic(paths["unreadable"], "".join(line + "\n" for line in unreadable))
  buffer = io.BytesIO()
  np.save(buffer, np.asarray(h, np.float32))
  files.write_atomic(paths["embeddings"], buffer.getvalue())
  table = pa.table(
    {
      "id": pa.array(np.asarray(rows["id"], np.int64)),
      "name": pa.array(list(rows["name"]), pa.string()),
      "label": pa.array(list(rows["label"]), pa.int64()),
      "split": pa.array([rows["split"]] * len(h), pa.string()),
    },
    schema=SCHEMA,
  )
  buffer = pa.BufferOutputStream()
  pq.write_table(table, buffer)
  files.write_atomic(paths["metadata"], buffer.getvalue().to_pybytes())


def read_unreadable(workdir: str, number: int) -> list:
  """The 'path<TAB>reason' lines of shard `number`'s files without a row ([] if none)."""
  path = f"{workdir}/{names(number)['unreadable']}"
  if not tf.io.gfile.exists(path):
    return []
  with tf.io.gfile.GFile(path) as f:
    return f.read().splitlines()


def read_table(path: str) -> pa.Table:
  """A metadata parquet file's "name" and "label" columns, memory-mapped where local.

  Only the columns are decoded: no Python object per row is made (row_dicts makes them).

  Raises:
    OSError, ValueError (pyarrow.ArrowInvalid): a missing or damaged file.
  """
  if "://" in path:
    with tf.io.gfile.GFile(path, "rb") as f:
      return pq.read_table(io.BytesIO(f.read()), columns=["name", "label"])
  return pq.read_table(path, columns=["name", "label"], memory_map=True)


def row_dicts(table: pa.Table) -> list:
  """[{"name"[, "label"]}] of a table of "name" and "label" columns (read_table's), in order."""
  return [
    {"name": name, **({} if label is None else {"label": label})}
    for name, label in zip(table["name"].to_pylist(), table["label"].to_pylist())
  ]


def num_rows(path: str) -> int:
  """The row count of a metadata parquet file, from its footer (no row is read).

  Raises:
    OSError, ValueError (pyarrow.ArrowInvalid): a missing or damaged file.
  """
  if "://" in path:
    with tf.io.gfile.GFile(path, "rb") as f:
      return pq.ParquetFile(io.BytesIO(f.read())).metadata.num_rows
  return pq.ParquetFile(path, memory_map=True).metadata.num_rows


def entry(number: int, num_images: int) -> dict:
  """Shard `number`'s entry of embed.json's part "shards": its two files and row count."""
  shard = names(number)
  return {
    "embeddings": shard["embeddings"],
    "metadata": shard["metadata"],
    "num_images": num_images,
  }


def count_rows(workdir: str, number: int) -> int:
  """The row count of complete shard `number`, from its parquet footer (no row is read)."""
  return num_rows(f"{workdir}/{names(number)['metadata']}")

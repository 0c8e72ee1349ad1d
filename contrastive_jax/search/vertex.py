"""An index's rows as Vertex AI Vector Search's JSON input: one file of JSON lines per shard.

  vertex/vertex_{i:05d}.json   shard i's rows, one JSON object a line:
      {"id": "<the row's id, a string>", "embedding": [D floats],
       "restricts": [{"namespace": "label", "allow": ["<class name>"]}]}
      (restricts only for a labelled row). The folder is the batch root a Vector Search
      index is built or updated from (docs/search.md): data files directly in it, named
      *.json, at most 5,000 of them.

The rows are read from the shards (shards.py) one at a time, embeddings memory-mapped,
and each file is written to a temporary name and renamed, so no more than a shard is held
and a file is whole or absent. The id is the metadata's id (shards.SCHEMA): unique
across the index's parts, so that an added part's files update an index built from the
earlier ones. The float32 values are written as the shortest decimal that reads back as
the same float64 (the float32 value exactly).
"""

import io
import json
import posixpath

from etils import epath
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tensorflow as tf

from contrastive_jax.core import files
from contrastive_jax.core.errors import JobError
from contrastive_jax.search import index as index_lib

FOLDER = "vertex"
NAMESPACE = "label"  # The restrict's namespace of a row's class name.


def file_name(number: int) -> str:
  """Shard `number`'s file, relative to the export's folder."""
  return f"{FOLDER}/vertex_{number:05d}.json"


def records(h: np.ndarray, ids, labels, class_names):
  """The JSON lines (str, newline-ended) of rows h float32 [n, D] with their int ids and labels.

  labels: int or None each (an index into class_names); None: no restrict.
  """
  for row, row_id, label in zip(h, ids, labels):
    record = {"id": str(row_id), "embedding": np.asarray(row, np.float32).tolist()}
    if label is not None:
      record["restricts"] = [{"namespace": NAMESPACE, "allow": [class_names[label]]}]
    yield json.dumps(record) + "\n"


def _write_lines(path: str, lines):
  """Writes the lines to path atomically (path.tmp, then renamed), streamed."""
  tmp = path + ".tmp"
  try:
    with files.open_file(tmp, "w") as f:
      for line in lines:
        f.write(line)
    epath.Path(tmp).replace(path)
  except BaseException:
    if tf.io.gfile.exists(tmp):
      tf.io.gfile.remove(tmp)
    raise


def write(index_workdir: str, out: str, *, where: str) -> dict:
  """Writes the rows of the index in index_workdir as out/vertex/*.json, shard by shard.

  Returns {"files": [paths relative to out], "num_records", "dim"}.

  Raises:
    JobError: no index there, one without shards (format_version 1 to 3: embed it
      again), or a shard missing, damaged or of another row count than embed.json says
      (naming the file; where starts the line).
  """
  if not index_lib.is_index(index_workdir):
    raise JobError(f"{where}: holds no embed job's index (no {index_lib.META} there)")
  with tf.io.gfile.GFile(f"{index_workdir}/{index_lib.META}") as f:
    meta = json.load(f)
  if meta.get("format_version", 1) < 4:
    raise JobError(
      f"{where}: its index has format_version {meta.get('format_version', 1)}, without "
      "shards (img_emb/, metadata/): embed the images again to export them"
    )
  tf.io.gfile.makedirs(f"{out}/{FOLDER}")
  written, count = [], 0
  for part in meta["parts"]:
    arrays = index_lib.part_arrays(index_workdir, part, where)
    for shard, h in zip(part["shards"], arrays):
      path = f"{index_workdir}/{shard['metadata']}"
      try:
        with tf.io.gfile.GFile(path, "rb") as f:
          table = pq.read_table(io.BytesIO(f.read()), columns=["id", "label"])
      except (OSError, tf.errors.OpError, pa.ArrowException) as e:
        raise JobError(
          f"{where}: {shard['metadata']} must be the parquet file of {shard['num_images']} "
          f"rows {index_lib.META} lists ({str(e).splitlines()[0]})"
        ) from None
      if table.num_rows != len(h):
        raise JobError(
          f"{where}: {shard['metadata']} holds {table.num_rows} rows: must be {len(h)}, "
          f"as {shard['embeddings']}"
        )
      # The shard's number, from its file's name (metadata_{i:05d}.parquet).
      number = int(posixpath.splitext(shard["metadata"])[0].rsplit("_", 1)[1])
      lines = records(h, table["id"].to_pylist(), table["label"].to_pylist(), meta["class_names"])
      _write_lines(f"{out}/{file_name(number)}", lines)
      written.append(file_name(number))
      count += len(h)
  return {"files": written, "num_records": count, "dim": meta["dim"]}

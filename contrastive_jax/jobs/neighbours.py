"""The neighbours job (config.job='neighbours'): search an embed job's index by image.

  python -m contrastive_jax.main --config=configs/neighbours.py --workdir=DIR \
      --config.index_workdir=EMBED_DIR --config.queries=/photos/new/a.jpg,/photos/new/b.jpg
  python -m contrastive_jax.main --config=configs/neighbours.py --workdir=DIR \
      --config.index_workdir=EMBED_DIR --config.query_rows=0,50,100

A query is a row number of the index (config.query_rows), the name of a
row or an image file (decoded, cropped and embedded with the index's encoder
as the embed job does a folder's files). config.queries holds names and files
separated by commas; a name that has a comma goes in config.queries_file, a
text file (UTF-8) of queries, one per line, each line taken as it is (spaces
included; blank lines skipped), as tar -T and rsync --files-from read theirs.
Relative paths are relative to the working directory, as in config.queries.
Rows come first, then config.queries, then config.queries_file, in their order.
For each, the k rows of the index with the
largest cosine similarity, best first; a query that is in the index finds
itself first, with score 1. Writes to the workdir (process 0):

  neighbours.json  {"index_workdir", "k", "search", "queries": [{"query",
                   "row" (its row, or null for a file), "neighbours":
                   [{"row", "name", "score"[, "label"]}, ...]}, ...]};
                   "search" says how: {"method": "ann", "type", "params",
                   "file"} or {"method": "exact"}.
  neighbours.png   one line per query: the query, then its k neighbours, each
                   with its score (and class) under it; every image
                   centre-cropped as the encoder saw it.
  TensorBoard      the same picture, image 'neighbours' at step 0.

With config.search 'auto' (the default) and an ANN index beside the
embeddings (ann.py: HNSW or IVF), FAISS searches it: approximate, fast at
millions of rows. Otherwise (no ANN index, an exact 'flat' one, or
config.search 'exact') the search is exact: it streams the index through the
device in chunks (search/exact.py), so an index of millions of rows never needs
more than a chunk of scores per query batch. Not a training loop, so not run
by runner.run.
"""

import json
import os

from absl import logging
from clu import metric_writers
import jax
import numpy as np
import tensorflow as tf

from contrastive_jax.core import files
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import pictures
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import ImageError
from contrastive_jax.data import images
from contrastive_jax.search import index as index_lib
from contrastive_jax.search import searcher as searcher_lib
from contrastive_jax.search import shards as shards_lib
from contrastive_jax.training import restore

RESULTS, PICTURE = "neighbours.json", "neighbours.png"


def _split(value: str) -> list:
  return [item.strip() for item in value.split(",") if item.strip()]


def _named_queries(config) -> list:
  """[(query, line)]: config.queries' comma-separated items (line None), then the lines of
  config.queries_file (line: its number, from 1), blank lines left out.

  Raises:
    ConfigError: a queries_file that does not exist or is not UTF-8 text.
  """
  found = [(item, None) for item in _split(config.queries)]
  if config.queries_file:
    try:
      with open(config.queries_file, encoding="utf-8", newline="") as f:
        text = f.read()
    except (OSError, UnicodeDecodeError) as e:
      raise ConfigError(
        "queries_file", config.queries_file, f"a UTF-8 text file of queries, one per line ({e})"
      ) from None
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    found += [(line, number) for number, line in enumerate(lines, 1) if line]
  return found


def _query_error(config, query: str, line, allowed: str) -> ConfigError:
  """The ConfigError for one query: naming config.queries and it, or config.queries_file
  and its line."""
  if line is not None:
    return ConfigError(
      "queries_file",
      config.queries_file,
      f"a file of queries, one per line; line {line} ({query!r}) must be {allowed}",
    )
  return ConfigError("queries", query, allowed)


def check_config(config):
  """Raises ConfigError for fields that cannot run, before any image is read."""
  for field in ("k", "chunk_size", "cell", "max_pixels"):
    if config[field] <= 0:
      raise ConfigError(field, config[field], "an integer > 0")
  if config.search not in searcher_lib.MODES:
    raise ConfigError("search", config.search, f"one of {searcher_lib.MODES}")
  if not _named_queries(config) and not _split(config.query_rows):
    raise ConfigError(
      "queries",
      config.queries,
      "at least one query: image files or names of index rows, "
      "comma-separated (or config.queries_file: one per line; "
      "config.query_rows: row numbers)",
    )
  if not config.index_workdir or not index_lib.is_index(files.resolve_dir(config.index_workdir)):
    raise ConfigError(
      "index_workdir",
      config.index_workdir,
      f"the workdir of a finished embed job (holding {index_lib.META} and the shards it lists)",
    )


def _queries(config, index: index_lib.Index):
  """[(query as given, its row or None, the encoder's input or None)], every file read.

  A file's input is uint8 [S, S, 3], decoded, downscaled and centre-cropped
  as the embed job reads a folder's files.

  Raises:
    ConfigError: a row outside the index; a query that is neither a name in
      the index nor a file; a file that cannot be decoded (naming it, and its
      line of queries_file, and why).
  """
  num_rows = len(index.rows)
  found = []
  for item in _split(config.query_rows):
    if not item.isdigit() or int(item) >= num_rows:
      raise ConfigError(
        "query_rows",
        config.query_rows,
        f"comma-separated rows of the index, each in [0, {num_rows}) ({item!r} is not)",
      )
    found.append((item, int(item), None))
  named = list(_named_queries(config))
  by_name = index.rows.find(item for item, _ in named)  # Only the rows of these names.
  for item, line in named:
    if item in by_name:
      found.append((item, by_name[item], None))
    elif not os.path.isfile(item):
      hint = (
        " (a query whose name has a comma goes in config.queries_file, one per line)"
        if line is None and "," in config.queries
        else ""
      )
      raise _query_error(
        config,
        item,
        line,
        "an image file or the name of a row of the index "
        f"(see its {shards_lib.METADATA_DIR}/); there is no such file or name{hint}",
      )
    else:
      try:
        image = images.load_image(
          item, max_pixels=config.max_pixels, shorter_side=index.eval_crop.shorter_side()
        )
      except ImageError as e:
        raise _query_error(
          config, item, line, f"an image file that can be read: {e.reason}"
        ) from None
      found.append((item, None, index_lib.center_crop(index, image, index.eval_crop.size)))
  return found


def run(config, workdir: str) -> dict:
  """Finds the neighbours of config's queries in config.index_workdir; writes them to workdir.

  Returns what neighbours.json holds. Holds the workdir's lock
  (files.workdir_lock) once the queries are read.

  Raises:
    ConfigError: before any compute: see check_config and _queries; k larger
      than the index; an ANN index to search without FAISS installed.
    JobError: a workdir that is a file, or that another job is running in;
      an index whose files do not fit its embed.json (index.load_index,
      ann.load).
  """
  workdir = files.prepare_workdir(workdir)
  check_config(config)
  index_workdir = files.resolve_dir(config.index_workdir)
  where = f"config.index_workdir={config.index_workdir!r}"
  index = index_lib.load_index(index_workdir, where=where)
  if config.k > len(index.rows):
    raise ConfigError("k", config.k, f"at most the size of the index ({len(index.rows)})")
  searcher = searcher_lib.Searcher(
    index, index_workdir, mode=config.search, chunk_size=config.chunk_size, where=where
  )
  queries = _queries(config, index)
  with files.workdir_lock(workdir):
    return _search_and_write(config, workdir, index_workdir, index, queries, searcher)


def _search_and_write(
  config,
  workdir: str,
  index_workdir: str,
  index: index_lib.Index,
  queries,
  searcher: searcher_lib.Searcher,
) -> dict:
  """run's work once the queries are read and the workdir locked; returns the results."""
  new_images = [image for _, row, image in queries if row is None]
  embedded = iter([])
  if new_images:  # Embedded whole on every device: a few images.
    mesh = mesh_lib.make_mesh()
    model = restore.embed_model(index.config, mesh)
    embedded = iter(
      np.asarray(model.embed(jax.device_put(np.stack(new_images), mesh_lib.replicated(mesh))))
    )
  vectors = np.stack(
    [index.embeddings[row] if row is not None else next(embedded) for _, row, _ in queries]
  )
  search = searcher.description
  scores, rows = searcher.search(vectors, config.k)
  logging.info(
    "Searched %d rows (%s) for the %d nearest of %d queries.",
    len(index.rows),
    search,
    config.k,
    len(queries),
  )

  results = {
    "index_workdir": index_workdir,
    "k": config.k,
    "search": search,
    "queries": [
      {
        "query": item,
        "row": row,
        "neighbours": _described(index, rows[i], scores[i]),
      }
      for i, (item, row, _) in enumerate(queries)
    ],
  }
  if jax.process_index() == 0:
    tf.io.gfile.makedirs(workdir)
    files.write_atomic(f"{workdir}/{RESULTS}", json.dumps(results, indent=1).encode())
    picture = _picture(config, index, queries, scores, rows)
    pictures.write_png(f"{workdir}/{PICTURE}", picture)
    writer = metric_writers.create_default_writer(workdir, asynchronous=False)
    writer.write_images(0, {"neighbours": picture[None]})
    writer.close()
    logging.info("Wrote %s and %s to %s.", RESULTS, PICTURE, workdir)
  return results


def _described(index: index_lib.Index, rows, scores) -> list:
  """[{'name'[, 'label'], 'row', 'score'}] of one query's neighbours (rows int [k], -1 for none;
  scores float [k]), only their rows read from the index's shards."""
  found = np.flatnonzero(np.asarray(rows) >= 0)
  described = index.rows.take(np.asarray(rows)[found])
  return [dict(d, row=int(rows[j]), score=float(scores[j])) for j, d in zip(found, described)]


def _picture(config, index: index_lib.Index, queries, scores, rows) -> np.ndarray:
  """The grid: per query, the query then its neighbours, centre-cropped as the encoder saw them.

  Images are read again: from the index's dataset split or folder, and the
  query files, at the cell's scale where the files allow (the encoder may
  have seen them smaller).
  """
  side = index.eval_crop.shorter_side(max(config.cell, index.eval_crop.size))
  wanted = sorted(
    {int(r) for r in rows.ravel() if r >= 0} | {r for _, r, _ in queries if r is not None}
  )
  read = index_lib.read_images(index, wanted, side)

  def caption(score, row):
    label = index.rows[row].get("label")
    named = f" {index.class_names[label]}" if label is not None and index.class_names else ""
    return f"{score:.3f}{named}"

  lines, captions = [], []
  for (item, row, _), line_scores, line_rows in zip(queries, scores, rows):
    query = (
      read[row]
      if row is not None
      else images.load_image(item, max_pixels=config.max_pixels, shorter_side=side)
    )
    found = [(s, int(r)) for s, r in zip(line_scores, line_rows) if r >= 0]
    shown = [query] + [read[r] for _, r in found]
    lines.append([index_lib.center_crop(index, x, config.cell) for x in shown])
    captions.append(["query"] + [caption(s, r) for s, r in found])
  return pictures.grid(lines, captions, cell=config.cell)

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
device in chunks (top_k_cosine), so an index of millions of rows never needs
more than a chunk of scores per query batch. Not a training loop, so not run
by runner.run.
"""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import tensorflow as tf
from absl import logging
from clu import metric_writers

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import ImageError
from contrastive_jax.core import files
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import pictures
from contrastive_jax.data import images
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import sources
from contrastive_jax.jobs import ann as ann_lib
from contrastive_jax.jobs import index as index_lib

RESULTS, PICTURE = "neighbours.json", "neighbours.png"
SEARCHES = ("auto", "exact")
_CHARS_PER_PIXEL = 1 / 6  # PIL's default font is about 6 pixels per character.


@functools.partial(jax.jit, static_argnames="k")
def _merge_chunk(best_scores, best_rows, queries, chunk, start, valid, *, k: int):
  """Merges the top-k of queries . chunk^T (its first `valid` rows, bank rows start...) into the best."""
  sims = jnp.matmul(queries, chunk.T, precision=jax.lax.Precision.HIGHEST)
  sims = jnp.where(jnp.arange(chunk.shape[0]) < valid, sims, -jnp.inf)
  scores, cols = jax.lax.top_k(sims, min(k, chunk.shape[0]))
  # The best so far come first and hold only lower rows, so among equal scores
  # the lower row stays first (lax.top_k keeps the lower index of a tie first).
  scores = jnp.concatenate([best_scores, scores], axis=1)
  rows = jnp.concatenate([best_rows, cols.astype(jnp.int32) + start], axis=1)
  top, pos = jax.lax.top_k(scores, k)
  return top, jnp.take_along_axis(rows, pos, axis=1)


def top_k_cosine(queries, bank, k: int, *, chunk_size: int, query_batch: int = 256):
  """The k rows of bank with the largest dot product with each query, best first.

  With L2-normalised rows the dot product is the cosine similarity. The bank
  goes to the device chunk_size rows at a time and each chunk's top-k is
  merged into the running top-k (jax.lax.top_k), so the device holds at most
  query_batch x (chunk_size + 2k) scores whatever the bank's size.

  Args:
    queries: float32 [Q, D].
    bank: float32 [N, D], N >= k; any array-like (a memory-mapped .npy is
      read chunk by chunk).
    k: neighbours per query.
    chunk_size: bank rows per device step.
    query_batch: queries per device step.
  Returns:
    (scores float32 [Q, k], rows int32 [Q, k]) as numpy, each line sorted by
    score, largest first; equal scores in row order.
  """
  num_rows = len(bank)
  chunk = min(chunk_size, num_rows)
  block = min(query_batch, len(queries))
  scores, rows = [], []
  for q0 in range(0, len(queries), block):
    q = np.zeros((block, queries.shape[1]), np.float32)
    q[:len(queries[q0:q0 + block])] = queries[q0:q0 + block]
    best = (jnp.full((block, k), -jnp.inf), jnp.full((block, k), -1, jnp.int32))
    for start in range(0, num_rows, chunk):
      part = np.zeros((chunk, bank.shape[1]), np.float32)
      valid = len(bank[start:start + chunk])
      part[:valid] = bank[start:start + chunk]
      best = _merge_chunk(*best, q, part, np.int32(start), np.int32(valid), k=k)
    scores.append(np.asarray(best[0]))
    rows.append(np.asarray(best[1]))
  count = len(queries)
  return np.concatenate(scores)[:count], np.concatenate(rows)[:count]


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
      raise ConfigError("queries_file", config.queries_file,
                        f"a UTF-8 text file of queries, one per line ({e})") from None
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    found += [(line, number) for number, line in enumerate(lines, 1) if line]
  return found


def _query_error(config, query: str, line, allowed: str) -> ConfigError:
  """The ConfigError for one query: naming config.queries and it, or config.queries_file
  and its line."""
  if line is not None:
    return ConfigError("queries_file", config.queries_file,
                       f"a file of queries, one per line; line {line} ({query!r}) must be "
                       f"{allowed}")
  return ConfigError("queries", query, allowed)


def check_config(config):
  """Raises ConfigError for fields that cannot run, before any image is read."""
  for field in ("k", "chunk_size", "cell", "max_pixels"):
    if config[field] <= 0:
      raise ConfigError(field, config[field], "an integer > 0")
  if config.search not in SEARCHES:
    raise ConfigError("search", config.search, f"one of {SEARCHES}")
  if not _named_queries(config) and not _split(config.query_rows):
    raise ConfigError("queries", config.queries,
                      "at least one query: image files or names of index rows, "
                      "comma-separated (or config.queries_file: one per line; "
                      "config.query_rows: row numbers)")
  if not config.index_workdir or not index_lib.is_index(
      files.resolve_dir(config.index_workdir)):
    raise ConfigError("index_workdir", config.index_workdir,
                      f"the workdir of a finished embed job (holding {index_lib.META}, "
                      f"{index_lib.INDEX} and {index_lib.EMBEDDINGS})")


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
      raise ConfigError("query_rows", config.query_rows,
                        f"comma-separated rows of the index, each in [0, {num_rows}) ({item!r} "
                        "is not)")
    found.append((item, int(item), None))
  by_name = {row["name"]: i for i, row in enumerate(index.rows)}
  for item, line in _named_queries(config):
    if item in by_name:
      found.append((item, by_name[item], None))
    elif not os.path.isfile(item):
      hint = (" (a query whose name has a comma goes in config.queries_file, one per line)"
              if line is None and "," in config.queries else "")
      raise _query_error(config, item, line, "an image file or the name of a row of the index "
                         f"(see {index_lib.INDEX}); there is no such file or name{hint}")
    else:
      try:
        image = images.load_image(item, max_pixels=config.max_pixels,
                                  shorter_side=index_lib.shorter_side(index.image_size,
                                                                      index.crop_fraction))
      except ImageError as e:
        raise _query_error(config, item, line,
                           f"an image file that can be read: {e.reason}") from None
      found.append((item, None, _crop(image, index.image_size, index)))
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
  approximate = config.search == "auto" and index.ann and index.ann["type"] != "flat"
  ann_index = ann_lib.load(index_workdir, index.ann, where=where) if approximate else None
  queries = _queries(config, index)
  with files.workdir_lock(workdir):
    return _search_and_write(config, workdir, index_workdir, index, queries, ann_index)


def _search_and_write(config, workdir: str, index_workdir: str, index: index_lib.Index,
                      queries, ann_index) -> dict:
  """run's work once the queries are read and the workdir locked; returns the results.

  ann_index: the FAISS index to search, or None to search exactly.
  """
  new_images = [image for _, row, image in queries if row is None]
  embedded = iter([])
  if new_images:  # Embedded whole on every device: a few images.
    mesh = mesh_lib.make_mesh()
    model = index_lib.load_model(index.config, mesh)
    embedded = iter(np.asarray(model.embed(jax.device_put(np.stack(new_images),
                                                          mesh_lib.replicated(mesh)))))
  vectors = np.stack([index.embeddings[row] if row is not None else next(embedded)
                      for _, row, _ in queries])
  if ann_index is not None:
    search = {"method": "ann", **{key: index.ann[key] for key in ("type", "params", "file")}}
    scores, rows = ann_lib.search(ann_index, vectors, config.k)
  else:
    search = {"method": "exact"}
    scores, rows = top_k_cosine(vectors, index.embeddings, config.k, chunk_size=config.chunk_size)
  logging.info("Searched %d rows (%s) for the %d nearest of %d queries.", len(index.rows),
               search, config.k, len(queries))

  results = {"index_workdir": index_workdir, "k": config.k, "search": search, "queries": [
      {"query": item, "row": row,
       "neighbours": [dict(index.rows[r], row=int(r), score=float(s))
                      for r, s in zip(rows[i], scores[i]) if r >= 0]}
      for i, (item, row, _) in enumerate(queries)]}
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


def _crop(image: np.ndarray, size: int, index: index_lib.Index) -> np.ndarray:
  """The centre crop the index's images had (input_pipeline.center_crop), uint8 [size, size, 3]."""
  return input_pipeline.center_crop(tf.constant(image), size, index.crop_fraction,
                                    index.crop_resize).numpy()


def _images(index: index_lib.Index, rows, shorter_side: int) -> dict:
  """{row: uint8 [H, W, 3]} for rows of the index, read again from its folder or dataset split.

  Files are downscaled to shorter_side; a dataset's images are as stored.
  Rows from index.dataset_rows on came from folders.

  Raises:
    ConfigError: the index's dataset is gone.
    ImageError: a file of the index's folders cannot be decoded any more.
  """
  # A folder's row names its file (files that could not be read have no row).
  read = {r: images.load_image(index.rows[r]["name"], max_pixels=index.config.max_pixels,
                               shorter_side=shorter_side)
          for r in rows if r >= index.dataset_rows}
  from_dataset = [r for r in rows if r < index.dataset_rows]
  if from_dataset:
    source = sources.get_source(index.config, {"split": index.config.split})
    read.update(zip(from_dataset, source.images(index.config.split, from_dataset)))
  return read


def _picture(config, index: index_lib.Index, queries, scores, rows) -> np.ndarray:
  """The grid: per query, the query then its neighbours, centre-cropped as the encoder saw them.

  Images are read again: from the index's dataset split or folder, and the
  query files, at the cell's scale where the files allow (the encoder may
  have seen them smaller).
  """
  side = index_lib.shorter_side(max(config.cell, index.image_size), index.crop_fraction)
  wanted = sorted({int(r) for r in rows.ravel() if r >= 0} |
                  {r for _, r, _ in queries if r is not None})
  read = _images(index, wanted, side)
  chars = int(config.cell * _CHARS_PER_PIXEL)

  def caption(score, row):
    label = index.rows[row].get("label")
    named = f" {index.class_names[label]}" if label is not None and index.class_names else ""
    return f"{score:.3f}{named}"[:chars]

  lines, captions = [], []
  for (item, row, _), line_scores, line_rows in zip(queries, scores, rows):
    query = read[row] if row is not None else images.load_image(
        item, max_pixels=config.max_pixels, shorter_side=side)
    found = [(s, int(r)) for s, r in zip(line_scores, line_rows) if r >= 0]
    shown = [query] + [read[r] for _, r in found]
    lines.append([_crop(x, config.cell, index) for x in shown])
    captions.append(["query"] + [caption(s, r) for s, r in found])
  return pictures.grid(lines, captions, cell=config.cell)

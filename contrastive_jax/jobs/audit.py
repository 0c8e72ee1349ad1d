"""The audit job (config.job='audit'): near-duplicate images in a split, and leaks between splits.

  python -m contrastive_jax.main --config=configs/audit.py --workdir=DIR \
      --config.index_workdir=TRAIN_EMBED_DIR --config.against=TEST_EMBED_DIR,VAL_EMBED_DIR

Reads embed job outputs (index.py), one per split or folder, all embedded with
one checkpoint. A pair of images is reported when the cosine similarity of
their embeddings is at least config.threshold:

  duplicate  two rows of the reference (config.index_workdir), each row
             searched for its config.k nearest other rows in the reference;
  leak       a row of an `against` index (a test or validation split) and a
             reference row, each against row searched for its k nearest
             reference rows.

Each row costs one search of the reference index: its ANN index when it has
one other than 'flat' (config.search 'auto'), else the exact chunked search of
the neighbours job. So the audit's time is the row count times one search;
a row with more than k pairs shows only k (summary.json counts the rows whose
k-th neighbour is still above the threshold). Writes to the workdir (process 0):

  pairs.csv     kind, score, then split, row, name and class (a folder's
                file: its folder below the index's) of each image
                (a: the lower reference row, or the against row; b: the
                reference row), best score first.
  summary.json  threshold, k, how the reference was searched, the indexes,
                pair counts per kind, per split (pairs, images in a pair) and
                per class, pairs whose two images have different classes,
                rows that may have more pairs than k, the search's seconds.
  pairs.png     config.picture_pairs pairs, the best of each kind (half each
                when both kinds have enough), side by side: under a its
                score and kind, under b the class (a's|b's when they
                differ), every image centre-cropped as the encoder saw it
                (also to TensorBoard, image 'pairs' at step 0); none when no
                pair is found.

Not a training loop, so not run by runner.run.
"""

import collections
import csv
import io
import json
import os
import time

from absl import logging
from clu import metric_writers
import jax
import numpy as np
import tensorflow as tf

from contrastive_jax.core import files
from contrastive_jax.core import pictures
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.search import index as index_lib
from contrastive_jax.search import searcher as searcher_lib

PAIRS, SUMMARY, PICTURE = "pairs.csv", "summary.json", "pairs.png"
SEARCHES = ("auto", "exact")
COLUMNS = (
  "kind",
  "score",
  "split_a",
  "row_a",
  "name_a",
  "class_a",
  "split_b",
  "row_b",
  "name_b",
  "class_b",
)
# The embed config's fields that name the encoder: two indexes agree on all of them
# (and on the dimension) or their scores are not comparable.
CHECKPOINT_FIELDS = ("pretrain_workdir", "pretrain_config", "pretrain_step", "random_init")
_PAIRS_PER_LINE = 4  # pairs.png: 8 cells a line.


def _split(value: str) -> list:
  return [item.strip() for item in value.split(",") if item.strip()]


def check_config(config):
  """Raises ConfigError for fields that cannot run, before any index is read."""
  threshold = config.threshold
  if (
    isinstance(threshold, bool)
    or not isinstance(threshold, (int, float))
    or not (-1.0 <= threshold <= 1.0)
  ):
    raise ConfigError("threshold", threshold, "a cosine similarity in [-1, 1]")
  for field in ("k", "chunk_size", "cell"):
    if config[field] <= 0:
      raise ConfigError(field, config[field], "an integer > 0")
  if config.picture_pairs < 0:
    raise ConfigError("picture_pairs", config.picture_pairs, "an integer >= 0 (0: no picture)")
  if config.search not in SEARCHES:
    raise ConfigError("search", config.search, f"one of {SEARCHES}")
  finished = f"the workdir of a finished embed job (holding {index_lib.META})"
  if not config.index_workdir or not index_lib.is_index(files.resolve_dir(config.index_workdir)):
    raise ConfigError("index_workdir", config.index_workdir, finished)
  seen = {files.resolve_dir(config.index_workdir)}
  for item in _split(config.against):
    if not index_lib.is_index(files.resolve_dir(item)):
      raise ConfigError(
        "against",
        config.against,
        f"comma-separated workdirs of finished embed jobs ({item!r} holds no {index_lib.META})",
      )
    if files.resolve_dir(item) in seen:
      raise ConfigError(
        "against",
        config.against,
        f"workdirs other than config.index_workdir's and each other's ({item!r} is named twice)",
      )
    seen.add(files.resolve_dir(item))


def checkpoint_of(index: index_lib.Index) -> dict:
  """The encoder an index was embedded with: its embed config's CHECKPOINT_FIELDS and "dim"."""
  return {
    **{field: index.config.get(field) for field in CHECKPOINT_FIELDS},
    "dim": int(index.embeddings.shape[1]),
  }


def split_name(index: index_lib.Index) -> str:
  """How pairs.csv names an index's images: its dataset split (e.g. 'test'), or its folders
  in the order they were embedded, comma-separated (one, unless files of other folders were
  added to it)."""
  if not index.config.folder:
    return index.config.split
  folders = [part.get("folder") or index.config.folder for part in index.meta["parts"]]
  return ", ".join(dict.fromkeys(folders))


def _check_comparable(config, reference: index_lib.Index, others: list):
  """Raises ConfigError unless every index of `against` has the reference's checkpoint.

  Also refuses k larger than the reference's rows less one (a row is not its
  own neighbour) and two indexes of one split.
  """
  if config.k > len(reference.rows) - 1:
    raise ConfigError(
      "k", config.k, f"at most the reference's rows less one ({len(reference.rows) - 1})"
    )
  want = checkpoint_of(reference)
  names = {split_name(reference)}
  for item, other in others:
    got = checkpoint_of(other)
    differ = {field: (want[field], got[field]) for field in want if want[field] != got[field]}
    if differ:
      listed = ", ".join(
        f"{field} {theirs!r} (the reference's: {ours!r})"
        for field, (ours, theirs) in differ.items()
      )
      raise ConfigError(
        "against",
        config.against,
        f"embed outputs of config.index_workdir's encoder: {item!r} was "
        f"embedded with {listed}; embed it again with the reference's "
        "checkpoint, or the scores are not comparable",
      )
    if split_name(other) in names:
      raise ConfigError(
        "against",
        config.against,
        f"indexes of other splits or folders than the reference's and each "
        f"other's ({item!r} holds {split_name(other)!r} again)",
      )
    names.add(split_name(other))


def run(config, workdir: str) -> dict:
  """Finds the duplicate and leaked pairs of config's indexes; writes them to workdir.

  Returns what summary.json holds. Holds the workdir's lock
  (files.workdir_lock) while writing.

  Raises:
    ConfigError: before any compute: see check_config and _check_comparable;
      an ANN index to search without FAISS installed.
    JobError: a workdir that is a file, or that another job is running in;
      an index whose files do not fit its embed.json (index.load_index,
      ann.load).
  """
  workdir = files.prepare_workdir(workdir)
  check_config(config)
  reference_dir = files.resolve_dir(config.index_workdir)
  where = f"config.index_workdir={config.index_workdir!r}"
  reference = index_lib.load_index(reference_dir, where=where)
  others = [
    (
      item,
      index_lib.load_index(
        files.resolve_dir(item), where=f"config.against={config.against!r}: {item!r}"
      ),
    )
    for item in _split(config.against)
  ]
  _check_comparable(config, reference, others)
  searcher = searcher_lib.Searcher(
    reference, reference_dir, mode=config.search, chunk_size=config.chunk_size, where=where
  )
  search, nearest = searcher.description, searcher.search

  start = time.perf_counter()
  # k + 1: a row finds itself too (first, unless rows of score 1 tie with it).
  duplicates, dup_saturated = duplicate_pairs(
    *nearest(reference.embeddings, config.k + 1), config.threshold, config.k
  )
  leaks = []
  for number, (_, other) in enumerate(others):
    pairs, saturated = leak_pairs(*nearest(other.embeddings, config.k), config.threshold)
    leaks.append((number, pairs, saturated))
  seconds = time.perf_counter() - start
  logging.info(
    "Searched %d reference rows (%s) with %d + %d queries in %.1f s.",
    len(reference.rows),
    search,
    len(reference.rows),
    sum(len(o.rows) for _, o in others),
    seconds,
  )

  indexes = [reference] + [other for _, other in others]
  table = [("duplicate", score, 0, a, 0, b) for a, b, score in duplicates]
  table += [
    ("leak", score, number + 1, a, 0, b) for number, pairs, _ in leaks for a, b, score in pairs
  ]
  table.sort(key=lambda p: (-p[1], p[0], p[2], p[3], p[5]))
  described = _described(indexes, table)
  summary = _summary(
    config,
    reference_dir,
    others,
    indexes,
    table,
    described,
    search,
    seconds,
    {"duplicate": int(dup_saturated.sum()), "leak": int(sum(s.sum() for _, _, s in leaks))},
  )
  with files.workdir_lock(workdir):
    if jax.process_index() == 0:
      tf.io.gfile.makedirs(workdir)
      files.write_atomic(f"{workdir}/{PAIRS}", _csv(indexes, table, described).encode())
      if table and config.picture_pairs:
        picture = _picture(config, indexes, _shown(table, config.picture_pairs), described)
        pictures.write_png(f"{workdir}/{PICTURE}", picture)
        writer = metric_writers.create_default_writer(workdir, asynchronous=False)
        writer.write_images(0, {"pairs": picture[None]})
        writer.close()
      elif tf.io.gfile.exists(f"{workdir}/{PICTURE}"):  # An earlier audit's, of other pairs.
        tf.io.gfile.remove(f"{workdir}/{PICTURE}")
      files.write_atomic(f"{workdir}/{SUMMARY}", json.dumps(summary, indent=1).encode())
  logging.info(
    "%d duplicate and %d leaked pairs at threshold %g: wrote %s, %s%s to %s.",
    summary["pairs"]["duplicate"],
    summary["pairs"]["leak"],
    config.threshold,
    PAIRS,
    SUMMARY,
    f" and {PICTURE}" if summary["picture"] else "",
    workdir,
  )
  return summary


def duplicate_pairs(scores: np.ndarray, rows: np.ndarray, threshold: float, k: int):
  """The pairs of rows of one index scoring at least threshold, from each row's nearest.

  Args:
    scores: float32 [N, k + 1], rows: int [N, k + 1]: row i's nearest rows of
      the same index, best first (row -1: none found); row i itself among them
      is left out, and then all but the first k others.
    threshold: the smallest score of a pair.
    k: other rows kept per row.
  Returns:
    ([(a, b, score)] with a < b, each pair once with its best score;
    bool [N]: rows whose k others all score at least threshold).
  """
  own = np.arange(len(rows))[:, None]
  other = (rows != own) & (rows >= 0)
  other &= np.cumsum(other, axis=1) <= k
  hit = other & (scores >= threshold)
  saturated = hit.sum(axis=1) >= k
  i, col = np.nonzero(hit)
  j = rows[i, col]
  best = {}
  for a, b, score in zip(np.minimum(i, j), np.maximum(i, j), scores[i, col]):
    key = (int(a), int(b))
    best[key] = max(best.get(key, -np.inf), float(score))
  return [(a, b, score) for (a, b), score in best.items()], saturated


def leak_pairs(scores: np.ndarray, rows: np.ndarray, threshold: float):
  """The pairs (query row, reference row) scoring at least threshold.

  Args:
    scores: float32 [M, k], rows: int [M, k]: each query row's k nearest
      reference rows, best first (row -1: none found).
    threshold: the smallest score of a pair.
  Returns:
    ([(query row, reference row, score)]; bool [M]: rows whose k nearest all
    score at least threshold).
  """
  hit = (rows >= 0) & (scores >= threshold)
  i, col = np.nonzero(hit)
  return (
    [(int(a), int(rows[a, c]), float(scores[a, c])) for a, c in zip(i, col)],
    hit.sum(axis=1) >= rows.shape[1],
  )


def _class(index: index_lib.Index, row: dict) -> str:
  """The class of an index's row (its {'name'[, 'label']}): its label's name, or for a folder's
  file its folder below the index's folder, as the prepare job names classes ('' for a file at
  the top)."""
  label = row.get("label")
  if label is not None:
    return index.class_names[label] if index.class_names else str(label)
  if index.config.folder:
    folder = os.path.relpath(os.path.dirname(row["name"]), index.config.folder)
    return "" if folder == "." else folder
  return ""


def _described(indexes: list, table: list) -> dict:
  """{(which, row): {'name'[, 'label']}} of the rows of the pairs in table, each index's read
  from its shards in one pass (index.Rows.take), no other row's."""
  wanted = collections.defaultdict(set)
  for _, _, which, a, reference, b in table:
    wanted[which].add(a)
    wanted[reference].add(b)
  described = {}
  for which, rows in wanted.items():
    rows = sorted(rows)
    described.update(((which, r), d) for r, d in zip(rows, indexes[which].rows.take(rows)))
  return described


def _csv(indexes: list, table: list, described: dict) -> str:
  out = io.StringIO()
  writer = csv.writer(out, lineterminator="\n")
  writer.writerow(COLUMNS)
  for kind, score, which, a, reference, b in table:
    ia, ib = indexes[which], indexes[reference]
    writer.writerow(
      [
        kind,
        f"{score:.6f}",
        split_name(ia),
        a,
        described[which, a]["name"],
        _class(ia, described[which, a]),
        split_name(ib),
        b,
        described[reference, b]["name"],
        _class(ib, described[reference, b]),
      ]
    )
  return out.getvalue()


def _summary(
  config, reference_dir, others, indexes, table, described, search, seconds, saturated
) -> dict:
  """summary.json's content (the module docstring); described: _described(indexes, table)."""
  splits = {
    split_name(index): {"rows": len(index.rows), "pairs": 0, "images_in_pairs": 0}
    for index in indexes
  }
  in_pairs = collections.defaultdict(set)
  classes = collections.defaultdict(lambda: {"duplicate": 0, "leak": 0})
  different = {"duplicate": 0, "leak": 0}
  for kind, _, which, a, reference, b in table:
    name = split_name(indexes[which])
    splits[name]["pairs"] += 1
    in_pairs[name].add(a)
    if kind == "duplicate":
      in_pairs[name].add(b)
    names = {
      _class(indexes[which], described[which, a]),
      _class(indexes[reference], described[reference, b]),
    }
    for cls in names:  # A pair of two classes counts for each.
      classes[cls][kind] += 1
    different[kind] += len(names) > 1
  for name, rows in in_pairs.items():
    splits[name]["images_in_pairs"] = len(rows)
  return {
    "threshold": config.threshold,
    "k": config.k,
    "search": search,
    "index_workdir": reference_dir,
    "against": [files.resolve_dir(item) for item, _ in others],
    "checkpoint": checkpoint_of(indexes[0]),
    "pairs": {
      "duplicate": sum(p[0] == "duplicate" for p in table),
      "leak": sum(p[0] == "leak" for p in table),
    },
    "splits": splits,
    "classes": dict(sorted(classes.items())),
    "different_classes": different,
    "rows_with_k_pairs": saturated,
    "picture": PICTURE if table and config.picture_pairs else None,
    "search_seconds": round(seconds, 3),
  }


def _shown(table: list, count: int) -> list:
  """The pairs pairs.png draws: the best of each kind, half of count each where both kinds
  have that many (a split's few leaks are not hidden by many duplicates), by score."""
  kinds = {kind: [i for i, p in enumerate(table) if p[0] == kind] for kind in ("leak", "duplicate")}
  leaks = min(len(kinds["leak"]), max(count // 2, count - len(kinds["duplicate"])))
  return [table[i] for i in sorted(kinds["leak"][:leaks] + kinds["duplicate"][: count - leaks])]


def _picture(config, indexes: list, table: list, described: dict) -> np.ndarray:
  """pairs.png: _PAIRS_PER_LINE pairs a line, each image then its pair, with captions.

  Images are read again from each index's dataset split or folder
  (index.read_images), centre-cropped as the encoder saw them.
  """
  wanted = collections.defaultdict(set)
  for _, _, which, a, reference, b in table:
    wanted[which].add(a)
    wanted[reference].add(b)
  # pylint: disable=protected-access
  read = {}
  for which, rows in wanted.items():
    index = indexes[which]
    side = index.eval_crop.shorter_side(max(config.cell, index.eval_crop.size))
    for row, image in index_lib.read_images(index, sorted(rows), side).items():
      read[which, row] = index_lib.center_crop(index, image, config.cell)
  # pylint: enable=protected-access
  lines, captions = [], []
  for start in range(0, len(table), _PAIRS_PER_LINE):
    line, caption = [], []
    for kind, score, which, a, reference, b in table[start : start + _PAIRS_PER_LINE]:
      line += [read[which, a], read[reference, b]]
      classes = [
        _class(indexes[which], described[which, a]),
        _class(indexes[reference], described[reference, b]),
      ]
      caption += [
        f"{score:.4f} {kind}",
        classes[0] if classes[0] == classes[1] else "|".join(classes),
      ]
    lines.append(line)
    captions.append(caption)
  return pictures.grid(lines, captions, cell=config.cell)

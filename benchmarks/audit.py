"""Recall and precision of the audit job against a photo corpus's manifest, and the score
distributions its threshold is calibrated on; prints tables.

  python benchmarks/audit.py --manifest=CORPUS/manifest.csv --train_index=TRAIN_EMBED_DIR \
      --test_index=TEST_EMBED_DIR --audit=AUDIT_DIR --thresholds=0.9,0.95

CORPUS is made by ../shared/tools/make_photo_corpus.py, prepared with
the prepare job; TRAIN_EMBED_DIR and TEST_EMBED_DIR are embed job outputs of its
train and test splits, and AUDIT_DIR the audit job's output for them at a
threshold no higher than the lowest of --thresholds. The pairs at a higher
threshold t are those of pairs.csv scoring at least t: each row's k nearest
are the same lists, so these are the pairs an audit at t finds.

Ground truth, from manifest.csv: an image's original is its duplicate_of, or
itself when that is empty. Two images with one original are re-uploads of each
other: the pairs to find (the same photo, crop, mirror and colours at another
size and JPEG quality). duplicate_of is followed one step only: the tool draws
a re-upload of image j from j's own random draw, so a re-upload of a re-upload
shows j's draw, not what j shows (their crop boxes differ in the manifest; the
script checks that the pairs it counts have one source photo and crop box).
Two images of one source photo with different originals are other views of
one photo (other crops and colours): counted apart, neither hits nor false
positives. Any other pair is a false positive.

  recall (duplicates)  of the train pairs of re-uploads, the share in pairs.csv;
  recall (leaks)       of the test images with a re-upload in train (leaked),
                       the share with a leak pair to one of them;
  precision            re-upload pairs / (re-upload pairs + false positives),
                       over both kinds.

The distributions are computed from the embeddings (numpy, every pair of the
train and test rows, exact): re-upload pairs, other views of one photo, two
different source photos of one class (all pairs, and each image's best such
pair: the hardest), and of two classes.
"""

import collections
import csv
import json
import os
import sys

# Measure the package this script sits in, not another installed copy of it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from contrastive_jax.core import runtime

if __name__ == "__main__":
  runtime.setup()  # Every process setting first, before the imports below (core/runtime.py).

from absl import app
from absl import flags
import numpy as np  # pylint: disable=g-import-not-at-top

from contrastive_jax.jobs import audit
from contrastive_jax.search import index as index_lib


def define_flags():
  """Registers the command-line flags (not at import, so that tests can import this file)."""
  flags.DEFINE_string("manifest", None, "The corpus's manifest.csv.", required=True)
  flags.DEFINE_string("train_index", None, "The embed output of the train split.", required=True)
  flags.DEFINE_string("test_index", None, "The embed output of the test split.", required=True)
  flags.DEFINE_string("audit", None, "The audit job's workdir for the two.", required=True)
  flags.DEFINE_string(
    "thresholds",
    "0.85,0.9,0.92,0.94,0.95,0.96,0.97,0.98",
    "Thresholds to measure recall and precision at.",
  )


_BLOCK = 2048  # Rows scored against all rows at a time (the distributions).
_BINS = np.linspace(-1.0, 1.0, 20_001)  # Histogram of the many negative pairs' scores.


def _image_id(name: str) -> str:
  """The manifest id of an index row's name ('train/dress/00000012.jpg' -> '00000012')."""
  return os.path.splitext(os.path.basename(name))[0]


def ground_truth(manifest: str):
  """{id: (split, class, source photo, original id)} from manifest.csv.

  Raises:
    ValueError: two images of one original with other source photos or crop boxes.
  An original named by a re-upload of a re-upload may be shown by no image
  but its re-uploads (it is j's draw, not what j shows).
  """
  with open(manifest) as f:
    rows = {r["id"]: r for r in csv.DictReader(f)}
  truth = {
    i: (r["split"], r["class"], r["source"], r["duplicate_of"] or i) for i, r in rows.items()
  }
  shown = {}
  for i, (_, _, _, original) in truth.items():
    content = shown.setdefault(original, (rows[i]["source"], rows[i]["crop_xywh"]))
    if content != (rows[i]["source"], rows[i]["crop_xywh"]):
      raise ValueError(f"{i}, a re-upload of {original}'s draw, shows another photo or crop")
  chains = sum(
    bool(r["duplicate_of"] and rows[r["duplicate_of"]]["duplicate_of"]) for r in rows.values()
  )
  print(
    f"manifest: {len(rows)} images, {sum(bool(r['duplicate_of']) for r in rows.values())} "
    f"re-uploads, {chains} of them of a re-upload (paired with what they show: its draw)"
  )
  return truth


def relation(truth, a: str, b: str) -> str:
  """'reupload', 'view' (one source photo), 'class' (one class) or 'other' for two ids."""
  if truth[a][3] == truth[b][3]:
    return "reupload"
  if truth[a][2] == truth[b][2]:
    return "view"
  return "class" if truth[a][1] == truth[b][1] else "other"


def _quantiles(histogram: np.ndarray, qs) -> list:
  cumulative = np.cumsum(histogram) / histogram.sum()
  return [float(_BINS[1:][np.searchsorted(cumulative, q)]) for q in qs]


def distributions(truth, ids: list, embeddings: np.ndarray) -> dict:
  """Scores of every pair of rows by relation: arrays for re-uploads and views, histograms
  (and each row's best) for one class and two classes."""
  codes = {
    kind: np.unique([truth[i][n] for i in ids], return_inverse=True)[1]
    for kind, n in (("class", 1), ("source", 2), ("original", 3))
  }
  kept = {"reupload": [], "view": []}
  hist = {"class": np.zeros(len(_BINS) - 1), "other": np.zeros(len(_BINS) - 1)}
  best_class = np.full(len(ids), -np.inf)
  for start in range(0, len(ids), _BLOCK):
    rows = np.arange(start, min(start + _BLOCK, len(ids)))
    scores = embeddings[rows] @ embeddings.T
    upper = np.arange(len(ids))[None, :] > rows[:, None]  # Each pair once.
    same = {kind: code[rows][:, None] == code[None, :] for kind, code in codes.items()}
    kept["reupload"].append(scores[upper & same["original"]])
    kept["view"].append(scores[upper & same["source"] & ~same["original"]])
    one_class = same["class"] & ~same["source"]
    hist["class"] += np.histogram(scores[upper & one_class], _BINS)[0]
    hist["other"] += np.histogram(scores[upper & ~same["class"]], _BINS)[0]
    best_class[rows] = np.where(one_class, scores, -np.inf).max(axis=1)
  return {**{k: np.concatenate(v) for k, v in kept.items()}, **hist, "best_class": best_class}


def main(argv):
  del argv
  truth = ground_truth(flags.FLAGS.manifest)
  train, test = (index_lib.load_index(d) for d in (flags.FLAGS.train_index, flags.FLAGS.test_index))
  ids = [_image_id(r["name"]) for r in [*train.rows, *test.rows]]
  embeddings = np.concatenate([np.asarray(train.embeddings), np.asarray(test.embeddings)])
  with open(os.path.join(flags.FLAGS.audit, audit.SUMMARY)) as f:
    summary = json.load(f)
  with open(os.path.join(flags.FLAGS.audit, audit.PAIRS)) as f:
    pairs = [
      (r["kind"], float(r["score"]), _image_id(r["name_a"]), _image_id(r["name_b"]))
      for r in csv.DictReader(f)
    ]
  print(
    f"audit: threshold {summary['threshold']}, k {summary['k']}, search "
    f"{summary['search']}, {summary['search_seconds']} s; rows with k pairs "
    f"{summary['rows_with_k_pairs']}"
  )

  found = distributions(truth, ids, embeddings)
  qs = (0.001, 0.01, 0.05, 0.5, 0.95, 0.99, 0.999)
  print(
    "\nscores of pairs          pairs       min  " + "  ".join(f"q{q:<5g}" for q in qs) + "   max"
  )
  for kind, title in (
    ("reupload", "re-uploads"),
    ("view", "other views, one photo"),
    ("best_class", "best of one class/image"),
  ):
    x = found[kind]
    print(
      f"{title:24s} {len(x):9d}  {x.min():7.4f}  "
      + "  ".join(f"{v:6.4f}" for v in np.quantile(x, qs))
      + f"  {x.max():7.4f}"
    )
  for kind, title in (("class", "one class, 2 photos"), ("other", "two classes")):
    h = found[kind]
    top = _BINS[1:][np.nonzero(h)[0][-1]]
    print(
      f"{title:24s} {int(h.sum()):9d}  {'':7s}  "
      + "  ".join(f"{v:6.4f}" for v in _quantiles(h, qs))
      + f"  {top:7.4f}"
    )

  train_ids = [_image_id(r["name"]) for r in train.rows]
  test_ids = [_image_id(r["name"]) for r in test.rows]
  groups = collections.Counter(truth[i][3] for i in train_ids)
  wanted_pairs = sum(n * (n - 1) // 2 for n in groups.values())
  leaked = {i for i in test_ids if groups[truth[i][3]]}
  print(
    f"\ntruth: {wanted_pairs} train pairs of re-uploads, {len(leaked)} of {len(test_ids)} "
    "test images leaked (a re-upload in train)"
  )
  print(
    "threshold  dup pairs  recall   leak pairs  leaked found  recall   views  false pos  precision"
  )
  for threshold in sorted(float(t) for t in flags.FLAGS.thresholds.split(",")):
    if threshold < summary["threshold"]:
      raise app.UsageError(
        f"--thresholds: {threshold} is below the audit's "
        f"({summary['threshold']}), whose pairs.csv has no pair under it"
      )
    kept = [p for p in pairs if p[1] >= threshold]
    relations = collections.Counter((kind, relation(truth, a, b)) for kind, _, a, b in kept)
    dup_hits = relations["duplicate", "reupload"]
    leak_found = {
      a for kind, _, a, b in kept if kind == "leak" and relation(truth, a, b) == "reupload"
    }
    hits = dup_hits + relations["leak", "reupload"]
    views = relations["duplicate", "view"] + relations["leak", "view"]
    false = len(kept) - hits - views
    print(
      f"{threshold:9.4f}  {sum(k == 'duplicate' for k, *_ in kept):9d}  "
      f"{dup_hits / max(wanted_pairs, 1):6.3f}  {sum(k == 'leak' for k, *_ in kept):10d}  "
      f"{len(leak_found):12d}  {len(leak_found) / max(len(leaked), 1):6.3f}  {views:6d}  "
      f"{false:9d}  {hits / max(hits + false, 1):9.3f}"
    )


if __name__ == "__main__":
  define_flags()
  app.run(main)

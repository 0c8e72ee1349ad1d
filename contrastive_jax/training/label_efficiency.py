"""The label-efficiency job's pure parts: labelled subsets, their scores and the gain's interval.

A label count is drawn from a labelled train split as a class-balanced subset
per (count, seed), with a validation part held out of it for every choice a
protocol makes (kNN's k, the probe's and fine-tune's epoch); the test split
scores only the model so chosen. A cell's scores (top-1, balanced accuracy,
AUROC) are computed here from its class scores; summarise turns the cells into
each init's best protocol per label count and the gain of the first init over
the others with a 95% t-interval paired by seed. Nothing here touches a device.
"""

import math
from typing import NamedTuple, Sequence

import numpy as np
import scipy.stats

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.data import labelled


class Subset(NamedTuple):
  """A labelled subset of a split: sorted int64 indices into it, its two disjoint parts.

  train: what the protocol fits on. validation: what its choices are made on.
  """

  train: np.ndarray
  validation: np.ndarray


def parse_counts(counts: str, split_size: int) -> tuple:
  """Label counts from 'A,B,...': integers as given, fractions (0 < f < 1) of split_size.

  A fraction f becomes round(f x split_size) (halves up); the result is sorted
  and without repeats, e.g. '0.01,5000' of 50,000 images -> (500, 5000).

  Raises:
    ConfigError: an entry that is neither an integer >= 1 nor a fraction in
      (0, 1), or a count larger than the split (naming its size).
  """
  resolved = []
  for entry in str(counts).split(","):
    try:
      value = float(entry)
    except ValueError:
      value = math.nan
    if 0 < value < 1:
      resolved.append(int(math.floor(value * split_size + 0.5)))
    elif value >= 1 and value == int(value):
      resolved.append(int(value))
    else:
      raise ConfigError(
        "labels",
        counts,
        f"comma-separated label counts, each an integer >= 1 or a fraction in (0, 1) of the "
        f"train split's {split_size} images (e.g. '100,400,1000' or '0.01,0.1'); "
        f"{entry!r} is neither",
      )
  for count in resolved:
    if count > split_size:
      raise ConfigError(
        "labels", counts, f"at most the train split's size ({split_size} images); {count} is more"
      )
  return tuple(sorted(set(resolved)))


def class_shares(count: int, num_classes: int, seed: int) -> np.ndarray:
  """int64 [num_classes]: the examples of each class in a class-balanced draw of `count`.

  count // num_classes each; the count % num_classes left over go one each to
  classes chosen by the seed (the smallest labelled.hash_ranks of their indices).
  """
  shares = np.full(num_classes, count // num_classes, np.int64)
  ranks = labelled.hash_ranks(np.array([str(c) for c in range(num_classes)], object), seed)
  shares[np.argsort(ranks, kind="stable")[: count % num_classes]] += 1
  return shares


def validation_sizes(shares: np.ndarray, fraction: float) -> np.ndarray:
  """int64 [C]: of each class's share, round(fraction x share), kept in [1, share - 1]."""
  return np.clip(np.floor(fraction * shares + 0.5).astype(np.int64), 1, shares - 1)


def check_counts(counts: Sequence[int], labels: np.ndarray, num_classes: int, class_names=None):
  """Raises ConfigError for a label count that no class-balanced draw of `labels` can give.

  Each class needs at least 2 examples of a count's subset (one to train on,
  one to validate on) and at most as many as it holds; the first class that
  falls short is named, with its count.

  Args:
    counts: label counts (parse_counts). labels: int [N] of the train split.
    class_names: optional names of the classes, in label order, for the message.
  """
  held = np.bincount(labels, minlength=num_classes)
  name = lambda c: f"class {c}" + (f" ({class_names[c]!r})" if class_names is not None else "")
  for count in counts:
    if count < 2 * num_classes:
      raise ConfigError(
        "labels",
        count,
        f"at least 2 per class ({2 * num_classes} for {num_classes} classes): every class "
        "needs one labelled example to train on and one to validate on",
      )
    most = -(-count // num_classes)  # A class's share, whichever the seed gives the remainder.
    short = np.flatnonzero(held < most)
    if short.size:
      raise ConfigError(
        "labels",
        count,
        f"at most {num_classes} x the smallest class's size: a class-balanced draw of "
        f"{count} takes up to {most} of each class and {name(short[0])} has "
        f"{held[short[0]]} in the train split",
      )


def draw_subset(ids, labels, count: int, seed: int, num_classes: int, validation_fraction: float):
  """The class-balanced labelled subset of `count` examples for `seed`, with its validation part.

  Each class c gives class_shares(count)[c] examples: those of smallest
  labelled.hash_ranks(ids, seed) (ties by id), a function of the (id, label)
  pairs and the seed only, never of their order. Of each class's share, the
  validation_sizes(...) of largest rank form the validation part.

  Args:
    ids: object [N] str, unique; labels: int [N] in [0, num_classes).
    validation_fraction: in (0, 1).
  Returns:
    Subset of sorted int64 indices into ids.
  Raises:
    ConfigError: see check_counts.
  """
  check_counts([count], labels, num_classes)
  shares = class_shares(count, num_classes, seed)
  held_out = validation_sizes(shares, validation_fraction)
  ranks = labelled.hash_ranks(ids, seed)
  train, validation = [], []
  for c in range(num_classes):
    members = np.flatnonzero(labels == c)
    chosen = members[np.lexsort((ids[members].astype(str), ranks[members]))[: shares[c]]]
    train.append(chosen[: shares[c] - held_out[c]])
    validation.append(chosen[shares[c] - held_out[c] :])
  return Subset(np.sort(np.concatenate(train)), np.sort(np.concatenate(validation)))


def top1(scores: np.ndarray, labels: np.ndarray) -> float:
  """Fraction of rows whose highest score is the label. scores [N, C], labels int [N]."""
  return float(np.mean(np.argmax(scores, axis=1) == labels))


def balanced_accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
  """Mean over the classes present in `labels` of their recall (top-1 within the class)."""
  hits = np.argmax(scores, axis=1) == labels
  return float(np.mean([np.mean(hits[labels == c]) for c in np.unique(labels)]))


def binary_auroc(scores: np.ndarray, positive: np.ndarray) -> float:
  """Area under the ROC curve of float [N] scores for bool [N] positives.

  The Mann-Whitney U statistic over (positives x negatives), ties counted
  half: (sum of the positives' average ranks - n1 (n1 + 1) / 2) / (n1 n0)
  (Hanley and McNeil 1982, Eq. 2).

  Raises:
    ValueError: no positive or no negative.
  """
  n1, n0 = int(np.sum(positive)), int(np.sum(~positive))
  if not n1 or not n0:
    raise ValueError(f"AUROC needs positives and negatives, got {n1} and {n0}")
  ordered = np.sort(scores)
  ranks = np.searchsorted(ordered, scores, "left") + np.searchsorted(ordered, scores, "right")
  ranks = (ranks + 1) / 2  # 1-based average rank of each score among its ties.
  return float((np.sum(ranks[positive]) - n1 * (n1 + 1) / 2) / (n1 * n0))


def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
  """AUROC of class scores [N, C]: binary_auroc of class 1 for C = 2, else the one-vs-rest
  macro mean over the C classes (each class's scores against its label's presence).

  Raises:
    ValueError: a class (or, for C = 2, either class) absent from `labels`, or every
      label one class.
  """
  if scores.shape[1] == 2:
    return binary_auroc(scores[:, 1], labels == 1)
  return float(np.mean([binary_auroc(scores[:, c], labels == c) for c in range(scores.shape[1])]))


def scores_of(scores: np.ndarray, labels: np.ndarray, with_auroc: bool) -> dict:
  """{'top1', 'balanced_accuracy'[, 'auroc']} of class scores [N, C] and int labels [N]."""
  result = {"top1": top1(scores, labels), "balanced_accuracy": balanced_accuracy(scores, labels)}
  if with_auroc:
    result["auroc"] = auroc(scores, labels)
  return result


def paired_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> dict:
  """The mean gain of a over b, paired by position (seed), with its t confidence interval.

  d_i = a_i - b_i; mean +- t_{(1 + confidence) / 2, n - 1} x sd(d, ddof=1) / sqrt(n)
  (Student's paired t-interval). With one pair the interval is unknown (NaN).

  Returns:
    {'mean', 'low', 'high', 'pairs'}: floats, and the number of pairs n.
  """
  d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  n = len(d)
  if n < 2:
    return {"mean": float(np.mean(d)), "low": math.nan, "high": math.nan, "pairs": n}
  half = scipy.stats.t.ppf((1 + confidence) / 2, n - 1) * np.std(d, ddof=1) / math.sqrt(n)
  return {
    "mean": float(np.mean(d)),
    "low": float(d.mean() - half),
    "high": float(d.mean() + half),
    "pairs": n,
  }


def summarise(rows: Sequence[dict], inits: Sequence[str], metrics: Sequence[str]) -> dict:
  """summary.json's content from the curve's rows.

  For each label count: each init's best protocol, the one of highest mean
  validation top-1 over its seeds ('val_top1'; ties: the first in row order),
  with its mean test scores; and, for each metric, the gain of inits[0]'s best
  protocol over each other init's best, paired_interval over the seeds both ran.

  Args:
    rows: {'init', 'protocol', 'labels', 'seed', 'val_top1', and each metric}.
    inits: the inits in config order; the first is the one whose gain is reported.
  Returns:
    {'labels': {str(count): {'best': {init: {'protocol', 'val_top1', metric: mean}},
      'gain': {baseline: {metric: paired_interval}}}}}.
  """
  summary = {}
  for count in sorted({r["labels"] for r in rows}):
    at = [r for r in rows if r["labels"] == count]
    best, by_seed = {}, {}
    for init in inits:
      protocols = {}
      for r in at:
        if r["init"] == init:
          protocols.setdefault(r["protocol"], []).append(r)
      if not protocols:
        continue
      name = max(protocols, key=lambda p: np.mean([r["val_top1"] for r in protocols[p]]))
      chosen = protocols[name]
      best[init] = {"protocol": name, "val_top1": float(np.mean([r["val_top1"] for r in chosen]))}
      best[init].update({m: float(np.mean([r[m] for r in chosen])) for m in metrics})
      by_seed[init] = {r["seed"]: r for r in chosen}
    gain = {}
    if inits[0] in by_seed:
      for baseline in inits[1:]:
        if baseline in by_seed:
          seeds = sorted(set(by_seed[inits[0]]) & set(by_seed[baseline]))
          gain[baseline] = {
            m: paired_interval(
              [by_seed[inits[0]][s][m] for s in seeds], [by_seed[baseline][s][m] for s in seeds]
            )
            for m in metrics
          }
    summary[str(count)] = {"best": best, "gain": gain}
  return {"labels": summary}

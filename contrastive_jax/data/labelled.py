"""Labelled subsets: the class-balanced part of a split whose labels a run keeps.

select_labelled draws the subset (SimCLR's semi-supervised 1% and 10% of
ImageNet), from hash_ranks, an order of the examples' ids keyed by a seed;
LabelledSubset is a source (sources.Source) over another source's split,
restricted to such a subset (fine-tuning, label efficiency).
"""

import hashlib

import jax
import numpy as np
import tensorflow as tf

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.data import records as records_lib


def hash_ranks(ids, seed: int) -> np.ndarray:
  """uint64 [N]: the 64-bit BLAKE2b hash of each id (str [N]), keyed by seed (int >= 0).

  A random order of the ids that depends on the ids and the seed only, never
  on their order or storage: how labelled subsets are drawn.
  """
  key = seed.to_bytes(8, "little")
  return np.array(
    [
      int.from_bytes(hashlib.blake2b(i.encode("utf-8"), digest_size=8, key=key).digest(), "little")
      for i in ids
    ],
    dtype=np.uint64,
  )


def select_labelled(ids, labels, fraction: float, seed: int):
  """The class-balanced labelled subset of a split: sorted indices into ids.

  Each class keeps round(fraction x its count) of its examples (halves round
  up), those whose 64-bit BLAKE2b hash of the id, keyed by the seed, is
  smallest (ties by id): the semi-supervised subsets of SimCLR (Chen et al.
  2020, Sec. 6: 1% and 10% of ImageNet, sampled class-balanced). The choice is
  a function of the (id, label) pairs and the seed only, never of their order,
  of how the data is stored or of the process count (for a dataset without an
  id feature the ids are TFDS's record positions, which name the file in
  TFRecord and not in ArrayRecord); images added to a class change its subset
  only where they outrank kept ones or change its count.

  Args:
    ids: [N] str, unique per example; labels: int [N], >= 0.
    fraction: in (0, 1].
    seed: int >= 0.
  Raises:
    ConfigError: a fraction that gives some class of the split no example
      (naming the smallest class and the fraction it needs).
  """
  ranks = hash_ranks(ids, seed)
  chosen = []
  for label in np.unique(labels):
    members = np.flatnonzero(labels == label)
    keep = int(np.floor(fraction * len(members) + 0.5))
    if keep == 0:
      smallest = np.bincount(labels).astype(float)
      smallest[smallest == 0] = np.inf
      least = int(np.argmin(smallest))
      raise ConfigError(
        "label_fraction",
        fraction,
        f"in [{0.5 / smallest[least]:.3g}, 1], so that every class keeps an "
        f"image (class {least} has {int(smallest[least])} images in the split)",
      )
    order = np.lexsort((ids[members].astype(str), ranks[members]))
    chosen.append(members[order[:keep]])
  return np.sort(np.concatenate(chosen))


class LabelledSubset:
  """A source's split restricted to its labelled subset (select_labelled): a source itself.

  It stands for that one split (its methods take the split only to match
  the source interface). Every process selects the same subset from the
  whole split's ids and labels, then reads its own part: the subset's
  examples in read order, split into process_count() parts of equal size
  (within one; none is dropped, so every process count trains on the same
  images). Each process reads only the stretch of the split its part spans.

  Attributes:
    ids: object [n] str and labels: int32 [n], the subset in read order.
  Raises:
    ConfigError: see select_labelled.
  """

  def __init__(self, source, split: str, fraction: float, seed: int):
    ids, labels = source.ids_and_labels(split)
    self._set(source, split, select_labelled(ids, labels, fraction, seed), ids, labels)

  @classmethod
  def of_indices(cls, source, split: str, indices, ids, labels) -> "LabelledSubset":
    """The subset of `split` at sorted int indices [n] (n >= 1) into its ids and labels
    (source.ids_and_labels(split), read once by the caller)."""
    subset = cls.__new__(cls)
    subset._set(source, split, np.asarray(indices), ids, labels)
    return subset

  def _set(self, source, split, indices, ids, labels):
    self._indices = indices
    self.ids, self.labels = ids[self._indices], labels[self._indices]
    self.name, self.num_classes = source.name, source.num_classes
    self.class_names = source.class_names
    self.random_access = source.random_access
    self._source, self._split = source, split

  def num_examples(self, split: str, field: str) -> int:
    """Source.num_examples: the subset's size (never empty: select_labelled)."""
    del field
    self._check(split)
    return len(self._indices)

  def process_counts(self, split: str, drop_remainder: bool = False) -> list:
    """Source.process_counts (drop_remainder is ignored: nothing is dropped)."""
    del drop_remainder
    self._check(split)
    return [len(part) for part in np.array_split(self._indices, jax.process_count())]

  def _part(self):
    """Positions in the subset and indices in the split of this process's part of it."""
    positions = np.array_split(np.arange(len(self._indices)), jax.process_count())[
      jax.process_index()
    ]
    return positions, self._indices[positions]

  def records(self, split: str) -> records_lib.Records:
    """TfdsSource.records of this process's part of the subset (the source's records by index).

    Raises:
      ValueError: the source is not stored in a random-access format.
    """
    self._check(split)
    self._source.check_random_access()
    return records_lib.Records(self._source, split, indices=self._part()[1])

  def read(
    self, split: str, *, drop_remainder: bool, decode: bool = True, names: bool = False
  ) -> tf.data.Dataset:
    """Source.read of this process's part of the subset, in read order; names are its ids."""
    del drop_remainder
    self._check(split)
    positions, part = self._part()
    start, stop = int(part[0]), int(part[-1]) + 1
    keep = np.zeros(stop - start, bool)
    keep[part - start] = True
    ds = tf.data.Dataset.zip(
      self._source.read_range(split, start, stop, decode=decode),
      tf.data.Dataset.from_tensor_slices(keep),
    )
    ds = ds.filter(lambda _, kept: kept).map(lambda example, unused_kept: example)
    if names:
      ds = tf.data.Dataset.zip(
        ds, tf.data.Dataset.from_tensor_slices(self.ids[positions].astype(str))
      ).map(lambda example, name: (*example, name))
    return ds

  def _check(self, split):
    if split != self._split:
      raise ValueError(f"LabelledSubset of {self._split!r} asked for split {split!r}")

"""Decoded images held in host memory as a data source: a labelled subset read once, served often.

The label-efficiency protocols read each part of a subset many times (every
validation, every fine-tuning epoch); read_parts decodes the parts' images once
in one pass over the split, and each part is then an InMemory source.
"""

from typing import Sequence

import numpy as np
import tensorflow as tf

from contrastive_jax.data import labelled


class InMemory:
  """Decoded images and their labels held in host memory: a source (sources.Source) whose
  every split is them, read by one process.

  Args:
    source: the source they were read from (its name and classes are this one's).
    images: uint8 [H, W, 3] arrays, in order.
    labels: int [n], theirs.
  """

  random_access = False

  def __init__(self, source, images: list, labels: np.ndarray):
    self.name, self.num_classes = source.name, source.num_classes
    self.class_names = source.class_names
    self._images, self._labels = images, labels

  def num_examples(self, split: str, field: str) -> int:
    """Source.num_examples: how many images it holds."""
    del split, field
    return len(self._labels)

  def process_counts(self, split: str, drop_remainder: bool = False) -> list:
    """Source.process_counts: one process reads them all."""
    del split, drop_remainder
    return [len(self._labels)]

  def read(
    self, split: str, *, drop_remainder: bool, decode: bool = True, names: bool = False
  ) -> tf.data.Dataset:
    """Source.read: (image, label) in order; decoded only (ValueError otherwise), no names."""
    del split, drop_remainder
    if not decode or names:
      raise ValueError("an in-memory part serves decoded images without names only")
    return tf.data.Dataset.from_generator(
      lambda: zip(self._images, self._labels),
      output_signature=(
        tf.TensorSpec([None, None, 3], tf.uint8),
        tf.TensorSpec([], tf.int32),
      ),
    )


def read_parts(source, split: str, parts: Sequence[np.ndarray], ids, labels) -> list:
  """The images of disjoint parts of `split`, read in one pass, as an InMemory source each.

  Args:
    source: a labelled source (sources.Source with ids_and_labels and read_range).
    parts: int [n_i] indices into the split, each part in the order it is served.
    ids, labels: source.ids_and_labels(split), read once by the caller.
  Returns:
    [InMemory of part i's images and labels[part i]], in the order of parts.
  """
  both = np.concatenate(parts)
  order = np.argsort(both)
  reader = labelled.LabelledSubset.of_indices(source, split, both[order], ids, labels)
  images = [None] * len(both)
  for position, (image, _) in zip(
    order, reader.read(split, drop_remainder=False).as_numpy_iterator()
  ):
    images[position] = image
  ends = np.cumsum([len(part) for part in parts])
  return [
    InMemory(source, images[end - len(part) : end], labels[part]) for part, end in zip(parts, ends)
  ]

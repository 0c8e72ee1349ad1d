"""Data sources: a dataset name resolves to its splits, sizes, classes and images.

A source is what every job and evaluator reads through; none of them sees the
storage format. TFDS is the first source (config.data_source='tfds'): a
prepared dataset in data_dir, read with tf.data, one part per JAX process.
Nothing is ever downloaded.
"""
import os
from typing import Optional

import jax
import tensorflow as tf
import tensorflow_datasets as tfds

from contrastive_jax.errors import ConfigError


class TfdsSource:
  """A prepared TFDS dataset.

  Args:
    name: TFDS name, e.g. 'cifar10' or 'imagenet2012', or the name of an image
      folder prepared by prepare_images.
    data_dir: where it is prepared; None means TFDS's default (TFDS_DATA_DIR
      or ~/tensorflow_datasets).

  Raises:
    ConfigError: unknown name, or a data_dir that does not hold the prepared
      dataset (the message says where it looked).
  """

  def __init__(self, name: str, data_dir: Optional[str]):
    self.name = name
    looked = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
    try:
      # A name TFDS has no code for is read from its files in data_dir
      # (read_only_builder): how folders prepared by prepare_images are found.
      self._builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
      raise ConfigError("dataset", name,
                        "a TFDS dataset name such as 'cifar10' or 'imagenet2012', or a dataset "
                        "prepared in data_dir by `python -m contrastive_jax.prepare_images` "
                        f"(none named {name!r} in data_dir={looked})") from None
    if not self._builder.is_prepared():
      raise ConfigError(
          "data_dir", data_dir,
          f"a directory holding the prepared dataset '{name}'; looked in "
          f"{self._builder.data_dir} (data_dir={looked}). Prepare it with "
          f"tfds.builder('{name}').download_and_prepare() on a machine with internet, or "
          "point data_dir / TFDS_DATA_DIR at a copy")
    features = self._builder.info.features
    self._num_classes = features["label"].num_classes if "label" in features else None

  @property
  def num_classes(self) -> Optional[int]:
    """Number of classes, or None for an unlabeled dataset."""
    return self._num_classes

  def num_examples(self, split: str, field: str) -> int:
    """Examples in `split` (a split name or a TFDS slice such as 'train[:10%]').

    Raises:
      ConfigError: an unknown or empty split, naming `field`.
    """
    try:
      count = self._builder.info.splits[split].num_examples
    except (KeyError, ValueError, AssertionError):
      count = 0
    if count == 0:
      raise ConfigError(field, split, f"a non-empty split of {self.name} (one of "
                        f"{sorted(self._builder.info.splits)}, or a TFDS slice of one such as "
                        "'train[:1000]')")
    return count

  def process_counts(self, split: str):
    """Examples each process reads of `split` with read(drop_remainder=False), by process."""
    return [self._builder.info.splits[s].num_examples
            for s in tfds.even_splits(split, n=jax.process_count(), drop_remainder=False)]

  def read(self, split: str, *, drop_remainder: bool, decode: bool = True) -> tf.data.Dataset:
    """This process's part of `split` as (image, label) pairs, in a fixed order.

    image: uint8 [H, W, 3] (or the encoded bytes when decode=False, for
    tf.io.decode_image later); label: int32 scalar (-1 if unlabeled).
    drop_remainder=True gives every process the same count (training);
    False keeps every example (evaluation).
    """
    process_split = tfds.split_for_jax_process(split, drop_remainder=drop_remainder)
    ds = self._builder.as_dataset(
        split=process_split, shuffle_files=False,
        decoders=None if decode else {"image": tfds.decode.SkipDecoding()})
    has_label = self._num_classes is not None
    return ds.map(lambda ex: (ex["image"],
                              tf.cast(ex["label"], tf.int32) if has_label else tf.constant(-1)))


SOURCES = {"tfds": TfdsSource}


def get_source(config, splits: dict):
  """The data source a job's config names, with each of `splits` checked.

  Args:
    config: fields data_source, dataset, data_dir.
    splits: {config field: split} to check now, before any compute.
  Raises:
    ConfigError: unknown data_source or dataset, missing data, empty split.
  """
  if config.data_source not in SOURCES:
    raise ConfigError("data_source", config.data_source, f"one of {sorted(SOURCES)}")
  source = SOURCES[config.data_source](config.dataset, config.data_dir)
  for field, split in splits.items():
    source.num_examples(split, field)
  return source

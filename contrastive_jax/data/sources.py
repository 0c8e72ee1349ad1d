"""Data sources: a dataset name resolves to its splits, sizes, classes and images.

A source is what every job and evaluator reads through; none of them sees the
storage format. TFDS is the first source (config.data_source='tfds'): a
prepared dataset in data_dir, read with tf.data, one part per JAX process.
Nothing is ever downloaded. A source has `name`, `num_classes`,
`num_examples`, `process_counts` and `read`; fine-tuning's LabelledSubset
(labelled.py), a source over another one, also needs its `ids_and_labels` and
`read_range`. FolderSource reads a folder of image files as they are, for the
embed job.

A TFDS dataset stored in a random-access format (ArrayRecord) also serves any
record by its index (`random_access`, `records`: records.Records): training
reads it in a fresh order every epoch and resumes anywhere at no cost
(input_pipeline.py).
"""

import functools
import operator
import os
import threading
from typing import Optional, Protocol, runtime_checkable

from absl import logging
import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from contrastive_jax.core import gcs
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import ImageError
from contrastive_jax.data import images as images_lib
from contrastive_jax.data import layout
from contrastive_jax.data import records as records_lib

# Features that name an example, first found first: the source file of a prepared
# image folder, TFDS's own per-example id (e.g. cifar10's 'train_16399').
ID_FEATURES = ("file_name", "id")


@runtime_checkable
class Source(Protocol):
  """What every data source provides (TfdsSource, FolderSource, LabelledSubset).

  A new kind of source implements this (and is registered in SOURCES when a
  config's data_source names it); tests/test_input_pipeline.py checks that
  each source's methods have exactly these signatures.

  Attributes:
    name: what the source reads (a TFDS name, a folder), for messages.
    num_classes: the number of classes, or None for unlabeled images.
    class_names: the classes' names in label order, or None.
    random_access: whether `records(split)` serves this process's training
      part by index (then the input pipeline reads it through that).
  """

  name: str
  num_classes: Optional[int]
  class_names: Optional[list]
  random_access: bool

  def num_examples(self, split: str, field: str) -> int:
    """Examples in `split`. Raises ConfigError naming `field` for an unknown or empty split."""

  def process_counts(self, split: str, drop_remainder: bool = False) -> list:
    """Examples each process reads of `split` with read(drop_remainder=...), by process index."""

  def read(
    self, split: str, *, drop_remainder: bool, decode: bool = True, names: bool = False
  ) -> tf.data.Dataset:
    """This process's part of `split` as (image, label[, name]), in a fixed order.

    image: uint8 [H, W, 3], or its encoded bytes with decode=False; label:
    int32 scalar, -1 if unlabeled; name (names=True): string scalar naming
    the example. drop_remainder=True gives every process the same count
    (training); False keeps every example (evaluation). The processes' parts
    are contiguous and in process order: together they are the split in order.
    Raises ValueError for an option the source cannot serve (named in the message).
    """


class TfdsSource:
  """A prepared TFDS dataset.

  Args:
    name: TFDS name, e.g. 'cifar10' or 'imagenet2012', or the name of an image
      folder prepared by the prepare job.
    data_dir: where it is prepared; None means TFDS's default (TFDS_DATA_DIR
      or ~/tensorflow_datasets).

  Raises:
    ConfigError: unknown name, or a data_dir that does not hold the prepared
      dataset (the message says where it looked).
    JobError: a gs:// data_dir (or TFDS_DATA_DIR) without Google Cloud credentials.
  """

  def __init__(self, name: str, data_dir: Optional[str]):
    self.name = name
    if data_dir:
      gcs.check_credentials(data_dir, "config.data_dir")
    else:
      gcs.check_credentials(os.environ.get("TFDS_DATA_DIR", ""), "TFDS_DATA_DIR")
    looked = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
    try:
      # A name TFDS has no code for is read from its files in data_dir
      # (read_only_builder): how folders prepared by the prepare job are found.
      self._builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
      raise ConfigError(
        "dataset",
        name,
        "a TFDS dataset name such as 'cifar10' or 'imagenet2012', or a dataset "
        "prepared in data_dir by the prepare job (configs/prepare.py) "
        f"(none named {name!r} in data_dir={looked})",
      ) from None
    if not self._builder.is_prepared():
      raise ConfigError(
        "data_dir",
        data_dir,
        f"a directory holding the prepared dataset '{name}'; looked in "
        f"{self._builder.data_dir} (data_dir={looked}). Prepare it with "
        f"tfds.builder('{name}').download_and_prepare() on a machine with internet, or "
        "point data_dir / TFDS_DATA_DIR at a copy",
      )
    self.features = features = self._builder.info.features
    self._num_classes = features["label"].num_classes if "label" in features else None
    self.class_names = features["label"].names if "label" in features else None
    self._id_feature = next((name for name in ID_FEATURES if name in features), None)
    # ArrayRecord only: TFDS's other random-access format, Parquet, hands its records
    # over as memoryviews, and its datasets are read as a stream (as_dataset), as TFRecord.
    self.random_access = (
      self._builder.info.file_format == tfds.core.file_adapters.FileFormat.ARRAY_RECORD
    )
    # Records fetched by index (Records.read), counted for tests and benchmarks.
    self.records_read = 0
    self._lock = threading.Lock()

  @property
  def num_classes(self) -> Optional[int]:
    """Number of classes, or None for an unlabeled dataset."""
    return self._num_classes

  def num_examples(self, split: str, field: str) -> int:
    """Source.num_examples of a split name or a TFDS slice such as 'train[:10%]'.

    Raises:
      ConfigError: an unknown or empty split, naming `field`.
    """
    try:
      count = self._builder.info.splits[split].num_examples
    except (KeyError, ValueError, AssertionError):
      count = 0
    if count == 0:
      raise ConfigError(
        field,
        split,
        f"a non-empty split of {self.name} (one of "
        f"{sorted(self._builder.info.splits)}, or a TFDS slice of one such as "
        "'train[:1000]')",
      )
    return count

  def process_counts(self, split: str, drop_remainder: bool = False) -> list:
    """Source.process_counts."""
    return [
      self._builder.info.splits[s].num_examples
      for s in tfds.even_splits(split, n=jax.process_count(), drop_remainder=drop_remainder)
    ]

  def records(self, split: str) -> records_lib.Records:
    """This process's part of `split` by index: the records read(drop_remainder=True) reads.

    Raises:
      ValueError: the dataset is not stored in a random-access format.
    """
    self.check_random_access()
    counts = self.process_counts(split, drop_remainder=True)
    return records_lib.Records(
      self,
      tfds.split_for_jax_process(split, drop_remainder=True),
      names=(split, sum(counts[: jax.process_index()])),
    )

  def count_read(self, count: int):
    """Adds `count` records to records_read (Records' fetches; thread-safe)."""
    with self._lock:
      self.records_read += count

  def parse(self, serialized, indices, spec: str):
    """Records.read's (image, label, name) of serialized tf.Examples string [k]."""
    wanted = ["image"] + (["label"] if self._num_classes is not None else [])
    wanted += [self._id_feature] if self._id_feature else []
    example_spec = self.features.tf_example_spec
    parsed = tf.io.parse_example(serialized, {k: example_spec[k] for k in wanted})
    label = (
      tf.cast(parsed["label"], tf.int32)
      if self._num_classes is not None
      else -tf.ones_like(indices, tf.int32)
    )
    name = (
      parsed[self._id_feature]
      if self._id_feature
      else tf.strings.join([spec, tf.strings.as_string(indices)], separator="__")
    )
    return parsed["image"], label, name

  def data_source(self, spec):
    """TFDS's random-access data source of a split spec: serialized tf.Examples by index."""
    return self._builder.as_data_source(
      spec, deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES
    )

  def file_instructions(self, spec) -> list:
    """The shard files of a split spec in read order, each with the records it gives (its
    filename, skip and take)."""
    return self._builder.info.splits[spec].file_instructions

  def check_random_access(self):
    """Raises ValueError, naming the format, unless the dataset is stored as ArrayRecord."""
    if not self.random_access:
      raise ValueError(
        f"{self.name} is stored as {self._builder.info.file_format.value}, "
        "not in a random-access format (ArrayRecord)"
      )

  def read(
    self, split: str, *, drop_remainder: bool, decode: bool = True, names: bool = False
  ) -> tf.data.Dataset:
    """Source.read; encoded images (decode=False) are for tf.io.decode_image later.

    A name is the first of ID_FEATURES the dataset has ('file_name' for
    prepared image folders), else its TFDS record id.
    """
    counts = self.process_counts(split, drop_remainder=drop_remainder)
    return self._read(
      tfds.split_for_jax_process(split, drop_remainder=drop_remainder),
      decode,
      names,
      (split, sum(counts[: jax.process_index()])),
    )

  def read_range(
    self, split: str, start: int, stop: int, *, decode: bool = True, names: bool = False
  ):
    """Examples start to stop - 1 of `split` in read order (that of ids_and_labels), as read().

    Every process that calls it reads the same examples; TFDS reads only the
    files (and records) that hold them.
    """
    parts, offset = [], 0
    for part in tfds.core.ReadInstruction.from_spec(split).to_absolute(self._builder.info.splits):
      first = part.from_ or 0
      last = self._builder.info.splits[part.splitname].num_examples if part.to is None else part.to
      lo, hi = max(start - offset, 0), min(stop - offset, last - first)
      if lo < hi:
        parts.append(
          tfds.core.ReadInstruction(part.splitname, from_=first + lo, to=first + hi, unit="abs")
        )
      offset += last - first
    return self._read(
      functools.reduce(operator.add, parts), decode, names=names, record_names=(split, start)
    )

  def ids_and_labels(self, split: str):
    """(ids, labels) of every example of `split` in read order; images are not decoded.

    ids: object [N] of str, the first of ID_FEATURES the dataset has, else
    TFDS's record id (file and position; '<split>__<position>' for ArrayRecord);
    labels: int32 [N] (-1 if unlabeled).
    Every process reads the whole split.
    """
    if self.random_access:
      ids, labels = [], []
      for _, label, name in tfds.as_numpy(self._read(split, False, names=True).batch(10_000)):
        ids.extend(n.decode("utf-8") for n in name)
        labels.append(label)
      return np.array(ids, dtype=object), np.concatenate(labels).astype(np.int32)
    wanted = {"label": True} if self._num_classes is not None else {}
    if self._id_feature:
      wanted[self._id_feature] = True
    ds = self._builder.as_dataset(
      split=split,
      shuffle_files=False,
      decoders=tfds.decode.PartialDecoding(wanted),
      read_config=tfds.ReadConfig(add_tfds_id=not self._id_feature),
    )
    ids, labels = [], []
    for batch in tfds.as_numpy(ds.batch(10_000)):
      names = batch[self._id_feature or "tfds_id"]
      ids.extend(name.decode("utf-8") for name in names)
      labels.append(batch.get("label", np.full(len(names), -1)))
    return np.array(ids, dtype=object), np.concatenate(labels).astype(np.int32)

  def _read(
    self, split, decode: bool, names: bool = False, record_names: Optional[tuple] = None
  ) -> tf.data.Dataset:
    """(image, label[, name]) of a split spec or tfds.core.ReadInstruction, in read order.

    record_names: Records' names of id-less ArrayRecord records, (split, first position).
    """
    if self.random_access:
      return records_lib.Records(self, split, names=record_names).in_order(
        decode=decode, names=names
      )
    ds = self._builder.as_dataset(
      split=split,
      shuffle_files=False,
      decoders=None if decode else {"image": tfds.decode.SkipDecoding()},
      read_config=tfds.ReadConfig(add_tfds_id=names and not self._id_feature),
    )
    has_label = self._num_classes is not None

    def example(ex):
      label = tf.cast(ex["label"], tf.int32) if has_label else tf.constant(-1)
      if not names:
        return ex["image"], label
      return ex["image"], label, ex[self._id_feature or "tfds_id"]

    return ds.map(example)

  def images(self, split: str, rows) -> list:
    """The images at positions `rows` of `split` (uint8 [H, W, 3] each), read by this process.

    Reads the split in order up to the last row wanted, decoding only the
    rows wanted.
    """
    wanted, found = set(rows), {}
    ds = self._read(split, decode=False).take(max(wanted) + 1)
    for row, (encoded, _) in enumerate(ds.as_numpy_iterator()):
      if row in wanted:
        found[row] = tf.io.decode_image(encoded, channels=3, expand_animations=False).numpy()
    return [found[r] for r in rows]


class FolderSource:
  """A folder of image files read as they are, without preparation (the embed job's input).

  Every file below `folder` is one example, in the order of its path, named
  by its path. Class folders label their files as the prepare job does
  (layout.class_folders: two or more classes, named by their folders below
  the ones every file shares); a file beside the class folders, such as a
  LICENSE, then joins `unreadable`, and without class folders the files are
  unlabeled (label -1, num_classes and class_names None). The listing is
  images.list_files' (links followed, a link loop refused; hidden entries,
  names starting with '.', left out); other entries it skips (broken links,
  special files) join `unreadable` (and are kept in `skipped`). Its one split
  is SPLIT, the whole folder. Files are
  decoded when read (images.load_image: RGB, EXIF orientation applied, at
  most max_pixels pixels) and downscaled with antialiasing to a shorter side
  of at most shorter_side; a file that cannot be decoded is skipped, logged
  and kept in `unreadable` as (path, reason), never dropped silently. Files
  whose path is in `skip` (those an index holds already) are left out; when
  that leaves none, `files` is empty.

  Raises:
    ConfigError (field 'folder'): not an existing folder, or no file in it.
    JobError: a symbolic link loop in the folder.
  """

  SPLIT = "all"
  random_access = False

  def __init__(self, folder: str, *, max_pixels: int, shorter_side: int, skip=frozenset()):
    if not os.path.isdir(folder):
      raise ConfigError("folder", folder, "an existing folder of image files")
    self.name = folder
    files, skipped = images_lib.list_files(folder, flag="config.folder")
    if not files:
      raise ConfigError("folder", folder, "a folder holding image files; it holds no file")
    classes, names = layout.class_folders([f.split("/")[:-1] for f in files])
    self.class_names = classes or None
    self.num_classes = len(classes) or None
    self.skipped = [(os.path.join(folder, f), why) for f, why in skipped if why != "hidden"]
    label_of = {name: i for i, name in enumerate(classes)}
    self.files, self._labels = [], []
    for f, name in zip(files, names):
      path = os.path.join(folder, f)
      if classes and not name:
        self.skipped.append((path, "not in a class folder (the folder has class folders)"))
      elif path not in skip:
        self.files.append(path)
        self._labels.append(label_of[name] if name else -1)
    self._max_pixels, self._shorter_side = max_pixels, shorter_side
    self.unreadable = []

  def num_examples(self, split: str, field: str) -> int:
    """Source.num_examples: the number of files (a folder has one split, never empty)."""
    del split, field
    return len(self.files)

  def process_counts(self, split: str, drop_remainder: bool = False) -> list:
    """Source.process_counts: the files in process_count() contiguous parts (none dropped)."""
    del split, drop_remainder
    return [len(part) for part in np.array_split(np.arange(len(self.files)), jax.process_count())]

  def _load(self, path: str) -> np.ndarray:
    return images_lib.load_image(path, max_pixels=self._max_pixels, shorter_side=self._shorter_side)

  def read(
    self, split: str, *, drop_remainder: bool, decode: bool = True, names: bool = False
  ) -> tf.data.Dataset:
    """Source.read: this process's contiguous part of the files (image, label[, path]), in order.

    For evaluation only: decoded images, drop_remainder False (ValueError
    otherwise). Files that cannot be decoded are skipped and listed in
    `unreadable`, which each pass over the dataset rebuilds.
    """
    if drop_remainder or not decode:
      raise ValueError(
        "a FolderSource is read for evaluation only: decode=True, drop_remainder=False"
      )
    counts = self.process_counts(split)
    start = sum(counts[: jax.process_index()])
    # The listing's skips are the whole folder's: process 0 reports them.
    return self._files(start, start + counts[jax.process_index()], names, jax.process_index() == 0)

  def read_range(
    self, split: str, start: int, stop: int, *, decode: bool = True, names: bool = False
  ) -> tf.data.Dataset:
    """Files start to stop - 1 in path order, as read(); `unreadable` then lists theirs only."""
    del split
    if not decode:
      raise ValueError("a FolderSource is read decoded: decode=True")
    return self._files(start, stop, names, listing=False)

  def _files(self, start: int, stop: int, names: bool, listing: bool) -> tf.data.Dataset:
    """(image, label[, path]) of files start to stop - 1, those that cannot be decoded skipped.

    Each pass rebuilds `unreadable`: the skipped files (and, with listing, `skipped`).
    """
    files, labels = self.files[start:stop], self._labels[start:stop]

    def examples():
      self.unreadable = list(self.skipped) if listing else []
      for path, label in zip(files, labels):
        try:
          image = self._load(path)
        except ImageError as e:
          logging.warning("Skipped %s", e)
          self.unreadable.append((path, e.reason))
          continue
        yield (image, label, path) if names else (image, label)

    signature = (tf.TensorSpec([None, None, 3], tf.uint8), tf.TensorSpec([], tf.int32))
    if names:
      signature += (tf.TensorSpec([], tf.string),)
    return tf.data.Dataset.from_generator(examples, output_signature=signature)


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

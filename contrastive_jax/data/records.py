"""Records of a TFDS dataset in a random-access format (ArrayRecord), read by index.

TFDS reads such a dataset only through its data source (as_dataset refuses it),
so every read of it goes through Records: by index for training (a fresh order
every epoch, a resume anywhere at no cost: input_pipeline.py), in order for
evaluation (Records.in_order). A record that cannot be read fails its pipeline
with a TF error that unreadable.read_failure turns into a DataError.
"""

import atexit
import threading
import time
from typing import Optional

import numpy as np
import tensorflow as tf

from contrastive_jax.core.errors import DataError
from contrastive_jax.data import unreadable

# Records fetched per call into Python when a dataset is read in order.
READ_BATCH = 256


class _Fetches:
  """The Records fetches (tf.py_function calls into Python) in flight, process-wide.

  A tf.py_function call still running when Python finalizes never gets the
  GIL back, and destroying a tf.data iterator waits for its calls: a job that
  exits while its pipeline is still filling its buffers would hang at exit
  (seen about one exit in three). wait_until_idle, run at exit before
  finalization, lets the pipelines fill their buffers and stop fetching.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._running = 0
    self._last = 0.0
    self._registered = False

  def start(self):
    with self._lock:
      self._running += 1
      if not self._registered:
        atexit.register(self.wait_until_idle)
        self._registered = True

  def end(self):
    with self._lock:
      self._running -= 1
      self._last = time.monotonic()

  def wait_until_idle(self, quiet: float = 0.5, timeout: float = 60.0):
    """Returns once no fetch has run for `quiet` seconds (or after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      with self._lock:
        if self._running == 0 and time.monotonic() - self._last >= quiet:
          return
      time.sleep(0.05)


_FETCHES = _Fetches()


class Records:
  """Records of a TFDS dataset in a random-access format, by index: a tf.data bridge.

  Reads the serialized tf.Example records of one split spec through TFDS's
  data source (source.data_source: as_data_source with RAW_BYTES,
  batches of indices at once), and parses them in the tf.data graph with the
  builder's own feature spec. Record i is the split spec's i-th in TFDS's
  order (that of as_dataset for other formats); with `indices`, record i is
  the spec's indices[i]-th (a LabelledSubset's part).

  Use len(records) and read(): indices int64 [k] -> (image, label int32 [k],
  name string [k]), image the encoded bytes string [k]; decode each later with
  decode(image) (TFDS's decoding: uint8 [H, W, 3]) or crops.decode_random_resized_crops.
  Every record fetched adds one to the source's records_read. A record that
  cannot be read (a damaged shard file) fails the fetch, and the pipeline's
  iterator raises a TF error that unreadable.read_failure turns into a
  DataError naming the file and the record.

  source: the TfdsSource whose records these are (its data_source,
  file_instructions, parse, features and count_read are used).
  """

  def __init__(
    self, source, spec, indices: Optional[np.ndarray] = None, *, names: Optional[tuple] = None
  ):
    # Names of id-less records: (split, position of record 0 in it), so that a
    # process's part names its records as the whole split does (ids_and_labels).
    self._source, self._spec = source, spec
    self._names = names or (str(spec), 0)
    self._data = source.data_source(spec)
    self._indices = indices

  def __len__(self) -> int:
    return len(self._data) if self._indices is None else len(self._indices)

  def _fetch(self, indices):
    """(serialized records string [k], ''), or (k empty strings, unreadable.register's line) when a
    record cannot be read."""
    _FETCHES.start()
    try:
      # One record at a time: __getitems__ reads through a thread pool, which
      # refuses work once the interpreter shuts down (a traceback at every exit).
      fetched = []
      for index in indices.numpy().tolist():
        try:
          fetched.append(self._data[index])
        except RuntimeError as e:  # What ArrayRecord raises for a damaged file.
          return (
            tf.constant("", shape=indices.shape),
            tf.constant(unreadable.register(self._unreadable(index, e))),
          )
    finally:
      _FETCHES.end()
    self._source.count_read(len(fetched))
    return tf.constant(fetched, tf.string, shape=[len(fetched)]), tf.constant("")

  def _unreadable(self, index: int, error: RuntimeError) -> DataError:
    """The DataError of record `index` of the spec: its shard file and its place in it."""
    shards = self._source.file_instructions(self._spec)
    ends = np.cumsum([shard.take for shard in shards])
    shard = int(np.searchsorted(ends, index, side="right"))
    path = shards[shard].filename
    record = shards[shard].skip + index - (int(ends[shard - 1]) if shard else 0)
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return DataError(
      path,
      record,
      (
        f"{path}: record {record} of this file cannot be read ({reason}). Prepare the dataset "
        f"{self._source.name!r} again (an image folder: the prepare job with "
        "--config.overwrite=True) or "
        "restore the file from a copy"
      ),
    )

  def read(self, indices):
    """(image string [k], label int32 [k], name string [k]) of the records at int64 indices [k].

    name: the example's first of sources.ID_FEATURES, else '<split>__<position in the
    split>' (the names given, else the spec and the index in it), as TFDS's
    record ids name a position.
    """
    at = indices if self._indices is None else tf.gather(self._indices, indices)
    serialized, failed = tf.py_function(self._fetch, [at], [tf.string, tf.string])
    # A record that cannot be read fails the pipeline here: an exception raised in the
    # py_function would be logged twice with its traceback, and its TF error name no file.
    with tf.control_dependencies([tf.debugging.Assert(tf.equal(failed, ""), [failed])]):
      serialized = tf.identity(serialized)
    serialized.set_shape(indices.shape)
    prefix, offset = self._names
    return self._source.parse(serialized, at + offset, prefix)

  def decode(self, image):
    """uint8 [H, W, 3] of one encoded image, decoded as TFDS's as_dataset decodes it."""
    return self._source.features["image"].decode_example(image)

  def in_order(self, *, decode: bool, names: bool) -> tf.data.Dataset:
    """Every record once, in index order, as Source.read's (image, label[, name])."""
    ds = tf.data.Dataset.range(len(self)).batch(READ_BATCH).map(self.read).unbatch()

    def example(image, label, name):
      image = self.decode(image) if decode else image
      return (image, label, name) if names else (image, label)

    return ds.map(example)

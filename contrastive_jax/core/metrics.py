"""Metric writers: TensorBoard + console (clu) and WORKDIR/metrics.jsonl.

Only process 0 writes files; other processes log to the console only.
"""

import json
import logging as std_logging
import sys
import time
from typing import Optional
import warnings

from absl import logging
from clu import metric_writers
from clu.metric_writers import interface
import jax
import numpy as np
import tensorflow as tf

from contrastive_jax.core import files

# How often metrics.jsonl on gs:// is uploaded, besides at every checkpoint and at the end.
GCS_FLUSH_SECS = 60.0


class JsonlWriter(interface.MetricWriter):
  """Appends one JSON object per write_scalars call: {"step": s, name: value, ...}.

  The JSONL file holds scalars only; hyperparameters, images, videos, audio,
  texts and histograms go to TensorBoard and are skipped here (the config is
  also saved with every checkpoint).

  Args:
    path: a local path or a gs:// URL.
    flush_every_secs: the records reach storage at the first write this many
      seconds after the previous flush (0: at every write), and at flush()
      and close(). GCS objects cannot be appended to: on gs://, tf.io.gfile's
      append mode keeps a local copy of the file and uploads all of it at
      each flush, so flushing every record would upload O(records^2) bytes.
  """

  def __init__(self, path: str, flush_every_secs: float = 0.0):
    self._file = tf.io.gfile.GFile(path, "a")
    self._flush_every_secs = flush_every_secs
    self._flushed = time.monotonic()

  def _write(self, record: dict):
    self._file.write(json.dumps(record) + "\n")
    if time.monotonic() - self._flushed >= self._flush_every_secs:
      self.flush()

  def write_scalars(self, step, scalars):
    self._write({"step": int(step), **{k: float(np.asarray(v)) for k, v in scalars.items()}})

  def write_hparams(self, hparams):
    pass

  def write_summaries(self, step, values, metadata=None):
    pass

  def write_images(self, step, images):
    pass

  def write_videos(self, step, videos):
    pass

  def write_audios(self, step, audios, *, sample_rate):
    pass

  def write_texts(self, step, texts):
    pass

  def write_histograms(self, step, arrays, num_buckets=None):
    pass

  def flush(self):
    self._file.flush()
    self._flushed = time.monotonic()

  def close(self):
    self._file.close()


def create_writer(workdir: str, resumed_step: Optional[int]) -> interface.MetricWriter:
  """TensorBoard events in WORKDIR, WORKDIR/metrics.jsonl and the console log.

  WORKDIR may be a local path or gs://. metrics.jsonl keeps only the records
  up to resumed_step, the step of the checkpoint the job resumed from (None
  for a fresh start: none are kept); a job killed between two checkpoints wrote
  the later ones and will write them again. A record cut short (the last
  line, when a kill or a full disk stopped its write) is dropped with a
  warning; the file is rewritten atomically. Locally each record is flushed at
  once; on gs:// every GCS_FLUSH_SECS (see JsonlWriter), and the runner
  flushes the writer at every checkpoint.
  """
  if jax.process_index() > 0:
    return metric_writers.create_default_writer(just_logging=True)
  tf.io.gfile.makedirs(workdir)
  path = f"{workdir}/metrics.jsonl"
  if tf.io.gfile.exists(path):
    kept = []
    if resumed_step is not None:
      with tf.io.gfile.GFile(path) as f:
        kept = [
          line
          for line in _whole_records(path, f.read())
          if json.loads(line)["step"] <= resumed_step
        ]
    files.write_atomic(path, "".join(kept))
  return metric_writers.MultiWriter(
    [
      metric_writers.create_default_writer(workdir, asynchronous=False),
      JsonlWriter(path, flush_every_secs=GCS_FLUSH_SECS if workdir.startswith("gs://") else 0.0),
    ]
  )


def _whole_records(path: str, text: str) -> list:
  """The lines of text that are whole JSON records; logs a warning for each other one."""
  whole = []
  for number, line in enumerate(text.splitlines(keepends=True), 1):
    try:
      json.loads(line)
    except ValueError:
      pass
    else:
      if line.endswith("\n"):
        whole.append(line)
        continue
    logging.warning(
      "%s: dropped line %d, %r: not a whole record (a write cut short when the job stopped).",
      path,
      number,
      line[:80],
    )
  return whole


# Records that only restate a setting of this project's own, (library, message start):
# JAX found no TPU library on a machine without TPUs (other backends' failures are kept);
# Orbax warns that a checkpoint directory a downstream job only reads is opened read-only.
_SETTINGS_RESTATED = (
  ("jax", "Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so"),
  ("orbax", "Given directory is read only"),
)

# Records about a library's own internals that a user cannot act on, (library path, message
# part): TFDS's decoding reads its own deprecated FeatureConnector.dtype; TensorFlow renames
# the internal resource inputs of the SavedModel that jax2tf writes.
_LIBRARY_INTERNALS = (
  ("tensorflow_datasets", ".dtype` is deprecated. Please change your code"),
  ("tensorflow/python/saved_model", "contains input name(s) resource with unsupported"),
)


class _QuietLibraries(std_logging.Filter):
  """Drops INFO records of Orbax, TFDS and TensorFlow, restated settings, notices of
  library internals (_LIBRARY_INTERNALS) and a failed save's duplicates.

  Orbax and TFDS log every checkpoint file they touch, TensorFlow each step of
  writing a SavedModel; _SETTINGS_RESTATED lists the records that restate what
  this project chose. When a save fails
  (a full disk, say), each of Orbax's background threads logs the error with
  a traceback, and asyncio logs its tasks' again, some at exit; the main
  thread raises the same error and reports it once (main.py: one line for an
  expected failure, a traceback otherwise). Of Orbax's records only the
  message is kept; asyncio's about Orbax's tasks are dropped.
  """

  def filter(self, record):
    message = record.getMessage()
    if record.name == "asyncio" and "orbax" in message:
      return False
    if record.levelno < std_logging.ERROR and (
      any(
        f"/{lib}/" in record.pathname and message.startswith(start)
        for lib, start in _SETTINGS_RESTATED
      )
      or any(f"/{lib}/" in record.pathname and part in message for lib, part in _LIBRARY_INTERNALS)
    ):
      return False
    if record.exc_info and "orbax" in record.pathname:
      record.exc_info = record.exc_text = None
    return record.levelno >= std_logging.WARNING or not any(
      lib in record.pathname for lib in ("orbax", "tensorflow_datasets", "/tensorflow/python/")
    )


def _drop_closed_loop_callbacks(unraisable, previous=sys.unraisablehook):
  """sys.unraisablehook without the 'Event loop is closed' errors of abandoned writes.

  After a failed save, TensorStore still completes the writes Orbax stopped
  waiting for, and their callbacks find Orbax's event loop closed: one
  traceback each, printed from TensorStore's threads (the save's error itself
  is reported by the main thread). Everything else goes to `previous`.
  """
  if not (
    isinstance(unraisable.exc_value, RuntimeError)
    and str(unraisable.exc_value) == "Event loop is closed"
  ):
    previous(unraisable)


def quiet_library_logs():
  """Keeps the console to this project's progress lines and the libraries' warnings.

  See _QuietLibraries and _drop_closed_loop_callbacks for what is left out, and
  TensorFlow's INFO records. Also dropped: Python's 'coroutine ... was never
  awaited' warning, printed at exit (after the job's last line) for each of
  Orbax's writes a failed save abandoned; this project runs no coroutines of
  its own.
  """
  logging.get_absl_handler().addFilter(_QuietLibraries())
  # TensorFlow's INFO lines (a SavedModel's saver and builder steps) come twice, through its
  # own handler and absl's; its warnings and errors are kept.
  std_logging.getLogger("tensorflow").setLevel(std_logging.WARNING)
  sys.unraisablehook = _drop_closed_loop_callbacks
  warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)

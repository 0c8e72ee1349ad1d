"""Metric writers: the console, WORKDIR/metrics.jsonl and TensorBoard events.

Only process 0 writes files; other processes log to the console only.

TensorBoard's events (events.out.tfevents.*) are written with TensorFlow's
summary writer (through clu), imported only when a writer is created: the train
step, checkpoints and metrics.jsonl need no TensorFlow. Where TensorFlow is not
installed (an accelerator image with JAX alone, say), the job writes
metrics.jsonl and the console lines as usual and logs one warning that no
events are written; nothing else changes (tensorboard can plot metrics.jsonl
only through a conversion, so install tensorflow-cpu to get events).
"""

import json
import logging as std_logging
import sys
import time
from typing import Any, Mapping, Optional, Sequence
import warnings

from absl import logging
import jax
import numpy as np

from contrastive_jax.core import files

# How often metrics.jsonl on gs:// is uploaded, besides at every checkpoint and at the end.
GCS_FLUSH_SECS = 60.0


class ConsoleWriter:
  """Logs each write at INFO: '[STEP] name=value, ...' for scalars (sorted by name,
  floats with 6 significant digits), the shapes of images, the hyperparameters.

  The methods are those of clu's MetricWriter, which every writer here has.
  """

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    values = [
      f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(scalars.items())
    ]
    logging.info("[%d] %s", step, ", ".join(values))

  def write_hparams(self, hparams: Mapping[str, Any]):
    logging.info("[Hyperparameters] %s", hparams)

  def write_summaries(self, step, values, metadata=None):
    logging.info("[%d] Got raw tensors: %s.", step, {k: np.shape(v) for k, v in values.items()})

  def write_images(self, step, images):
    logging.info("[%d] Got images: %s.", step, {k: np.shape(v) for k, v in images.items()})

  def write_videos(self, step, videos):
    logging.info("[%d] Got videos: %s.", step, {k: np.shape(v) for k, v in videos.items()})

  def write_audios(self, step, audios, *, sample_rate):
    logging.info("[%d] Got audios: %s.", step, {k: np.shape(v) for k, v in audios.items()})

  def write_texts(self, step, texts):
    logging.info("[%d] Got texts: %s.", step, texts)

  def write_histograms(self, step, arrays, num_buckets=None):
    logging.info("[%d] Got histograms: %s.", step, {k: np.shape(v) for k, v in arrays.items()})

  def flush(self):
    logging.flush()

  def close(self):
    self.flush()


class MultiWriter:
  """Passes every write, flush and close on to each of `writers`, in order."""

  def __init__(self, writers: Sequence[Any]):
    self._writers = tuple(writers)

  def _each(self, method: str, *args, **kwargs):
    for writer in self._writers:
      getattr(writer, method)(*args, **kwargs)

  def write_scalars(self, step, scalars):
    self._each("write_scalars", step, scalars)

  def write_hparams(self, hparams):
    self._each("write_hparams", hparams)

  def write_summaries(self, step, values, metadata=None):
    self._each("write_summaries", step, values, metadata)

  def write_images(self, step, images):
    self._each("write_images", step, images)

  def write_videos(self, step, videos):
    self._each("write_videos", step, videos)

  def write_audios(self, step, audios, *, sample_rate):
    self._each("write_audios", step, audios, sample_rate=sample_rate)

  def write_texts(self, step, texts):
    self._each("write_texts", step, texts)

  def write_histograms(self, step, arrays, num_buckets=None):
    self._each("write_histograms", step, arrays, num_buckets)

  def flush(self):
    self._each("flush")

  def close(self):
    self._each("close")


class JsonlWriter:
  """Appends one JSON object per write_scalars call: {"step": s, name: value, ...}.

  The JSONL file holds scalars only; hyperparameters, images, videos, audio,
  texts and histograms go to TensorBoard and are skipped here (the config is
  also saved with every checkpoint).

  Args:
    path: a local path or a gs:// URL.
    flush_every_secs: the records reach storage at the first write this many
      seconds after the previous flush (0: at every write), and at flush()
      and close(). GCS objects cannot be appended to: on gs://, the append
      mode (files.open_file) keeps a local copy of the file and uploads all of it at
      each flush, so flushing every record would upload O(records^2) bytes.
  """

  def __init__(self, path: str, flush_every_secs: float = 0.0):
    self._file = files.open_file(path, "a")
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


_warned_no_events = False


def _tensorboard_writer(workdir: str):
  """clu's TensorBoard SummaryWriter on workdir, or None where TensorFlow is not installed
  (logged once per process, as a warning)."""
  global _warned_no_events
  try:
    import tensorflow  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    if not _warned_no_events:
      _warned_no_events = True
      logging.warning(
        "TensorBoard events are not written: they need TensorFlow, which is not installed "
        "(pip install tensorflow-cpu). Every scalar is still in %s/metrics.jsonl.",
        workdir,
      )
    return None
  from clu.metric_writers import summary_writer  # pylint: disable=import-outside-toplevel

  return summary_writer.SummaryWriter(workdir)


def create_writer(workdir: str, resumed_step: Optional[int]) -> MultiWriter:
  """The console log, WORKDIR/metrics.jsonl and TensorBoard events in WORKDIR.

  WORKDIR may be a local path or gs://. metrics.jsonl keeps only the records
  up to resumed_step, the step of the checkpoint the job resumed from (None
  for a fresh start: none are kept); a job killed between two checkpoints wrote
  the later ones and will write them again. A record cut short (the last
  line, when a kill or a full disk stopped its write) is dropped with a
  warning; the file is rewritten atomically. Locally each record is flushed at
  once; on gs:// every GCS_FLUSH_SECS (see JsonlWriter), and the runner
  flushes the writer at every checkpoint. The events need TensorFlow; without
  it they are left out, with one warning (the module's docstring). A process
  other than 0 gets the console alone.

  Returns:
    A MultiWriter (the methods of clu's MetricWriter: write_scalars(step,
    {name: scalar}), write_images(step, {name: uint8 [N, H, W, C]}),
    write_hparams, flush, close, ...).
  """
  if jax.process_index() > 0:
    return MultiWriter([ConsoleWriter()])
  files.makedirs(workdir)
  path = f"{workdir}/metrics.jsonl"
  if files.exists(path):
    kept = []
    if resumed_step is not None:
      with files.open_file(path) as f:
        kept = [
          line
          for line in _whole_records(path, f.read())
          if json.loads(line)["step"] <= resumed_step
        ]
    files.write_atomic(path, "".join(kept))
  events = _tensorboard_writer(workdir)
  return MultiWriter(
    [ConsoleWriter()]
    + ([] if events is None else [events])
    + [JsonlWriter(path, flush_every_secs=GCS_FLUSH_SECS if workdir.startswith("gs://") else 0.0)]
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

"""Records that cannot be read, carried through the TF error that fails their pipeline.

A record of a dataset read by index (records.Records) that cannot be read (a
damaged ArrayRecord shard) cannot raise its DataError itself: its fetch runs in
a tf.py_function, and the pipeline's iterator raises a TF error instead. The
fetch keeps the DataError here (register) and puts the line register returns
into the TF error's message; read_failure turns that TF error back into the
DataError. This module imports no TensorFlow, so that the training loop
(training/runner.py), which asks read_failure of every error, runs without it.
"""

import re
import sys
import threading
from typing import Optional

from contrastive_jax.core.errors import DataError

_LOCK = threading.Lock()
# Every DataError registered by this process, numbered by its place here.
_ERRORS = []


def register(error: DataError) -> str:
  """Keeps `error`; returns its line: 'unreadable record N: ' and its message."""
  with _LOCK:
    _ERRORS.append(error)
    return f"unreadable record {len(_ERRORS) - 1}: {error}"


def read_failure(error: BaseException) -> Optional[DataError]:
  """The DataError behind `error`, a TF error from iterating a pipeline that read Records, or None.

  The DataError names the shard file and the record. Jobs turn the TF error
  back into the DataError with this (runner.run, main.py). Without TensorFlow
  imported no TF error exists, and the answer is None.
  """
  tf = sys.modules.get("tensorflow")
  if tf is None or not isinstance(error, tf.errors.OpError):
    return None
  found = re.search(r"unreadable record (\d+): ", str(error))
  with _LOCK:
    return _ERRORS[int(found[1])] if found else None

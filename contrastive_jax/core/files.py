"""Files and workdirs: local paths or gs:// URLs, atomic writes.

Every path goes through tf.io.gfile, so a workdir may be a local directory or
a gs:// URL alike.
"""
import os
from typing import Optional, Union

import tensorflow as tf

from contrastive_jax.core.errors import JobError
from contrastive_jax.core import gcs


def resolve_dir(path: str) -> str:
  """An absolute local path, or a URL (gs://...) unchanged."""
  return path if "://" in path else os.path.abspath(path)


def prepare_workdir(path: Optional[str]) -> str:
  """resolve_dir(path) for a job's --workdir, checked before anything is written.

  Raises:
    JobError: no path, a path that exists and is not a directory, or a gs://
      path without Google Cloud credentials.
  """
  if not path:
    raise JobError("--workdir is empty: give the directory for checkpoints and metrics")
  path = resolve_dir(path)
  gcs.check_credentials(path, "--workdir")
  if tf.io.gfile.exists(path) and not tf.io.gfile.isdir(path):
    raise JobError(f"--workdir={path}: must be a directory (or not exist yet); it is a file")
  return path


def write_atomic(path: str, content: Union[bytes, str]):
  """Writes content to path (local or gs://) atomically: a reader sees all of it or nothing.

  The content goes to path + '.tmp' first, which is then renamed over path, so
  a job killed while writing leaves the previous file (or none) in place.
  """
  tmp = path + ".tmp"
  with tf.io.gfile.GFile(tmp, "wb") as f:
    f.write(content.encode() if isinstance(content, str) else content)
  tf.io.gfile.rename(tmp, path, overwrite=True)

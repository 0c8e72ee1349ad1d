"""Files and workdirs: local paths or gs:// URLs, atomic writes.

Every path goes through etils.epath, so a workdir may be a local directory or
a gs:// URL alike, and no TensorFlow is imported. A gs:// path is read and
written through TensorFlow's tf.io.gfile when TensorFlow is installed (as
etils.epath chooses), else through fsspec's gcsfs, which must then be installed
(check_remote_support says so before a job starts).
"""

import contextlib
import errno
import fcntl
import os
import socket
from typing import Optional, Union

from etils import epath
import jax
from jax.experimental import multihost_utils
import numpy as np

from contrastive_jax.core import gcs
from contrastive_jax.core.errors import JobError

LOCK = ".lock"  # The file in a workdir that the job working in it holds locked.


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
  check_remote_support(path, "--workdir")
  if exists(path) and not isdir(path):
    raise JobError(f"--workdir={path}: must be a directory (or not exist yet); it is a file")
  return path


def check_remote_support(path: str, field: str):
  """Raises JobError when `path` is a gs:// URL that nothing installed can read.

  etils.epath reads gs:// through TensorFlow when it is installed, else through
  fsspec's gcsfs; a local path always passes.

  Raises:
    JobError: a gs:// path, and neither tensorflow nor gcsfs can be imported.
  """
  if not str(path).startswith("gs://"):
    return
  for module in ("tensorflow", "gcsfs"):
    try:
      __import__(module)
    except ImportError:
      continue
    return
  raise JobError(
    f"{field}={path}: gs:// paths need TensorFlow (pip install tensorflow-cpu) or gcsfs "
    "(pip install gcsfs), and neither is installed"
  )


def exists(path: str) -> bool:
  """Whether path (local or gs://) exists."""
  return epath.Path(path).exists()


def isdir(path: str) -> bool:
  """Whether path (local or gs://) is a folder (on gs://: a prefix holding objects)."""
  return epath.Path(path).is_dir()


def makedirs(path: str):
  """Creates the folder path and its parents (local or gs://); an existing one is kept."""
  epath.Path(path).mkdir(parents=True, exist_ok=True)


def listdir(path: str) -> list:
  """The names directly in the folder path (local or gs://), sorted, without a trailing '/'.

  Raises:
    FileNotFoundError: no folder at path.
  """
  return sorted(child.name for child in epath.Path(path).iterdir())


def open_file(path: str, mode: str = "r"):
  """The file path (local or gs://) opened in mode 'r', 'rb', 'w', 'wb', 'a' or 'ab'.

  A context manager, like open(). On gs://, an append mode keeps a local copy
  and uploads all of it at each flush (GCS objects cannot be appended to).

  Raises:
    FileNotFoundError: reading a file that does not exist.
  """
  if path.startswith("gs://") and mode in ("a", "ab"):
    return _GcsAppender(path, binary=mode == "ab")
  return epath.Path(path).open(mode)


class _GcsAppender:
  """An append-mode file on gs://: the object's bytes so far plus what was written, all
  uploaded at each flush and at close (a GCS object is replaced whole, never appended to)."""

  def __init__(self, path: str, *, binary: bool):
    self._path = epath.Path(path)
    self._binary = binary
    self._data = self._path.read_bytes() if self._path.exists() else b""

  def write(self, data) -> int:
    self._data += data if self._binary else data.encode("utf-8")
    return len(data)

  def flush(self):
    self._path.write_bytes(self._data)

  def close(self):
    self.flush()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def remove_tree(path: str):
  """Removes the folder path and everything in it (process 0; local or gs://)."""
  if jax.process_index() == 0 and exists(path):
    epath.Path(path).rmtree()


def write_atomic(path: str, content: Union[bytes, str]):
  """Writes content to path (local or gs://) atomically: a reader sees all of it or nothing.

  The content goes to path + '.tmp' first, which is then renamed over path, so
  a job killed while writing leaves the previous file (or none) in place.
  """
  tmp = path + ".tmp"
  try:
    with open_file(tmp, "wb") as f:
      f.write(content.encode() if isinstance(content, str) else content)
    epath.Path(tmp).replace(path)
  except BaseException:  # A full disk, say: leave no partial .tmp behind.
    try:
      epath.Path(tmp).unlink()
    except Exception:  # pylint: disable=broad-except  # Never written, or unreachable: the
      pass  # first error tells.
    raise


@contextlib.contextmanager
def workdir_lock(workdir: str):
  """Holds WORKDIR/.lock for the block, so a second job on the same workdir is refused.

  A local workdir (created if missing) is locked with an OS advisory lock
  (fcntl.flock) on WORKDIR/.lock, which names the holder (pid and host). The
  kernel releases it when the holder's process ends in any way, kill -9
  included, so a lock is never left stuck; the file stays and is reused.
  Locks of a network file system are only as reliable as its flock.

  A gs:// workdir is not locked: GCS has no lock, and a lease file would
  need a heartbeat and a timeout to recover from a killed holder. Starting
  two jobs on one gs:// workdir remains the user's mistake to avoid (both
  would write the same checkpoints and metrics).

  Multi-host: every process calls this together. Only process 0 takes the
  lock (the processes of one job share the workdir, and each host may have
  its own local disk); the others learn from it whether it was refused, so
  all of them stop together.

  Raises:
    JobError: another job holds the lock; nothing was written.
  """
  handle, refusal = None, None
  if jax.process_index() == 0 and "://" not in workdir:
    os.makedirs(workdir, exist_ok=True)
    handle = open(os.path.join(workdir, LOCK), "a+")  # pylint: disable=consider-using-with
    try:
      fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      handle.seek(0)
      holder = handle.read().strip() or "a process"
      handle.close()
      handle = None
      refusal = (
        f"--workdir={workdir}: another job is running in it ({holder} holds "
        f"{workdir}/{LOCK}); nothing was changed. Wait for it to end, or use "
        "another workdir"
      )
    else:
      handle.seek(0)
      handle.truncate()
      handle.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
      handle.flush()
  if jax.process_count() > 1:
    refused = bool(multihost_utils.broadcast_one_to_all(np.int32(refusal is not None)))
    if refused and refusal is None:
      refusal = (
        f"--workdir={workdir}: process 0 found another job running in it (see its "
        "log); nothing was changed"
      )
  if refusal:
    raise JobError(refusal)
  try:
    yield
  finally:
    if handle is not None:
      handle.close()  # Releases the lock.


def _mtime(path: str) -> float:
  """path's modification time in seconds since the epoch (local or gs://).

  Local times keep their fraction; etils.epath gives a gs:// object's in whole
  seconds (truncated), which callers allow for (main.py asks a second early).
  """
  if "://" not in path:
    return os.stat(path).st_mtime
  return float(epath.Path(path).stat().mtime)


def written_since(workdir: str, start: float) -> list:
  """The entries directly in workdir written at or after `start`, sorted; folders end in '/'.

  Args:
    workdir: a local or gs:// folder (none yet: []).
    start: seconds since the epoch (time.time()).
  Returns:
    Names: a file counts by its modification time, a folder by the newest of its
    files at any depth (and, locally, of itself: a removal inside it counts).
    The lock file (LOCK) is left out.
  """
  if not isdir(workdir):
    return []
  found = []
  for name in listdir(workdir):
    path = f"{workdir}/{name}"
    if name == LOCK:
      continue
    if isdir(path):
      times = [_mtime(f"{root}/{f}") for root, _, names in _walk(path) for f in names]
      if "://" not in path:  # A GCS folder is a name prefix, with no time of its own.
        times.append(os.stat(path).st_mtime)
      if max(times, default=0.0) >= start:
        found.append(name + "/")
    elif _mtime(path) >= start:
      found.append(name)
  return found


def _walk(path: str):
  """(folder, subfolder names, file names) of path and every folder below it, as os.walk."""
  for root, folders, names in epath.Path(path).walk():
    yield str(root).rstrip("/"), folders, names


def is_disk_full(error: BaseException) -> bool:
  """Whether error, or an exception it was raised from or while handling, is a full disk.

  Recognises OSError ENOSPC and the messages of TensorFlow's gfile on gs://
  (ResourceExhaustedError '...; No space left on device') and of Orbax's
  TensorStore writes ('RESOURCE_EXHAUSTED: ... No space left on device').
  """
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or (
      "No space left on device" in str(error)
    ):
      return True
    error = error.__cause__ or error.__context__
  return False

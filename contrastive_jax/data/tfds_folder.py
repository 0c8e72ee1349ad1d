"""A TFDS dataset folder, written beside the one of its name and renamed into place.

DATA_DIR/NAME/VERSION/ holds TFDS's on-disk format: ArrayRecord shard files
named as TFDS names them, features.json and dataset_info.json written by
tfds.folder_dataset.write_metadata, and the preparation's report. It is built
in a temporary folder in DATA_DIR (Staging) and renamed into place (replace),
so a failed or interrupted preparation leaves the previous dataset intact.

A staging folder is DATA_DIR/.NAME.preparing.<12 hex digits> and holds an
OWNER file first ('pid P on host H'), which every process writing into the
folder holds locked (hold); a staging folder left by a killed preparation is
removed by the next one of that name (remove_stale).
"""

import contextlib
import fcntl
import json
import os
import signal
import socket
import threading
import uuid

from absl import logging
import tensorflow as tf
import tensorflow_datasets as tfds

VERSION = "1.0.0"
REPORT = "prepare_report.json"
OWNER = "owner"  # In a staging folder: the process that made it.
_STAGING = ".{name}.preparing."


def features(encoding: str, classes) -> tfds.features.FeaturesDict:
  """The dataset's features: 'image' (uint8 [H, W, 3], stored as encoding, 'jpeg' or 'png'),
  'file_name' (Text) and, only when classes is not empty, 'label' (ClassLabel of classes)."""
  found = {
    "image": tfds.features.Image(shape=(None, None, 3), encoding_format=encoding),
    "file_name": tfds.features.Text(),
  }
  if classes:
    found["label"] = tfds.features.ClassLabel(names=classes)
  return tfds.features.FeaturesDict(found)


def records_name(name: str, split: str, index: int, num_shards: int) -> str:
  """The file name TFDS reads shard `index` of `num_shards` of a split from."""
  return f"{name}-{split}.array_record-{index:05d}-of-{num_shards:05d}"


def write_metadata(
  folder: str, feature_dict, shard_lengths: dict, num_bytes: dict, description: str
) -> None:
  """TFDS's metadata (dataset_info.json, features.json, ...) of the shards in folder.

  With TFDS's tfds.folder_dataset.write_metadata (for datasets written
  outside TFDS), given each split's shard lengths (in shard order) and bytes.
  Its check of the data reads with as_dataset, which TFDS 4.9.10 cannot for
  ArrayRecord; tests read the result with as_data_source instead.
  """
  tfds.folder_dataset.write_metadata(
    data_dir=folder,
    features=feature_dict,
    version=VERSION,
    check_data=False,
    split_infos=[
      tfds.core.SplitInfo(name=split, shard_lengths=lengths, num_bytes=num_bytes[split])
      for split, lengths in sorted(shard_lengths.items())
    ],
    description=description,
  )


def previous_report(final: str):
  """The report in the dataset folder `final` (DATA_DIR/NAME), or None (absent or unreadable)."""
  try:
    with tf.io.gfile.GFile(os.path.join(final, VERSION, REPORT)) as f:
      return json.load(f)
  except (tf.errors.OpError, ValueError):
    return None


def _owner() -> str:
  return f"pid {os.getpid()} on host {socket.gethostname()}"


def hold(path: str):
  """Opens the local file path and takes a shared lock (flock) on it; returns the open file.

  Every process that writes into a staging folder holds its OWNER file so
  (the job, and the Beam driver it starts), until it closes the file or ends
  in any way (the kernel releases the lock, kill -9 included).
  """
  handle = open(path, "a+")  # pylint: disable=consider-using-with
  fcntl.flock(handle, fcntl.LOCK_SH)
  return handle


def _is_stale(folder: str) -> bool:
  """Whether no live preparation can be writing the staging folder `folder`.

  Only a folder holding an OWNER file is one of this module's (a folder from
  before OWNER files is kept). Locally, it is stale when no process holds its
  OWNER file (hold): the lock cannot be taken exclusively while one does. On
  gs:// (no lock), when its owner ran on this host and has ended.
  """
  owner = os.path.join(folder, OWNER)
  if not folder.startswith("gs://"):
    try:
      with open(owner) as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      return False
    except OSError:  # No OWNER file.
      return False
    return True
  try:
    with tf.io.gfile.GFile(owner) as f:
      words = f.read().split()
  except tf.errors.OpError:
    return False
  if len(words) != 5 or words[3] != socket.gethostname() or not words[1].isdigit():
    return False
  try:
    os.kill(int(words[1]), 0)
  except ProcessLookupError:
    return True
  except PermissionError:  # Another user's live process.
    return False
  return False


def remove_stale(data_dir: str, name: str) -> list:
  """Removes the staging folders of `name` in data_dir that no live preparation uses.

  Called under the data dir's lock (files.workdir_lock), so that no other
  preparation creates one meanwhile. Returns the folders removed; one that
  cannot be proven stale (_is_stale) is kept, with a warning naming it.
  """
  prefix = _STAGING.format(name=name)
  removed = []
  for entry in sorted(tf.io.gfile.listdir(data_dir) if tf.io.gfile.isdir(data_dir) else []):
    entry = entry.rstrip("/")
    if not entry.startswith(prefix):
      continue
    folder = os.path.join(data_dir, entry)
    if _is_stale(folder):
      tf.io.gfile.rmtree(folder)
      removed.append(folder)
    else:
      logging.warning(
        "%s is the temporary folder of another preparation of %r (or of an "
        "earlier version): kept; remove it if no preparation is running.",
        folder,
        name,
      )
  return removed


class Staging:
  """A new staging folder DATA_DIR/.NAME.preparing.<hex> (module docstring); removed by remove().

  Attributes:
    path: the staging folder.
    dataset: path/NAME, where the new dataset is built (its VERSION folder inside).
    owner: path/OWNER, held (hold) by this process until remove() when local.
  """

  def __init__(self, data_dir: str, name: str):
    self.name, self.final = name, os.path.join(data_dir, name)
    self.path = os.path.join(data_dir, _STAGING.format(name=name) + uuid.uuid4().hex[:12])
    self.dataset = os.path.join(self.path, name)
    self.owner = os.path.join(self.path, OWNER)
    self._held = None
    tf.io.gfile.makedirs(self.path)
    try:
      if self.path.startswith("gs://"):
        with tf.io.gfile.GFile(self.owner, "w") as f:
          f.write(_owner() + "\n")
      else:
        self._held = hold(self.owner)
        self._held.write(_owner() + "\n")
        self._held.flush()
    except BaseException:
      self.remove()
      raise

  def replace(self) -> None:
    """Moves the dataset built in self.dataset to DATA_DIR/NAME, the previous one aside first.

    The previous dataset (if any) is renamed into the staging folder, then the
    new one into place; if that fails the previous one is renamed back. Ctrl-C
    meanwhile waits for the renames (ctrl_c_deferred).
    """
    aside = os.path.join(self.path, "previous")
    with ctrl_c_deferred("moving the dataset into place"):
      if tf.io.gfile.exists(self.final):
        _rename(self.final, aside)
      try:
        _rename(self.dataset, self.final)
      except (OSError, tf.errors.OpError):
        if tf.io.gfile.exists(aside):
          _rename(aside, self.final)
        raise

  def remove(self) -> None:
    """Removes the staging folder and all in it (a previous dataset moved aside included)."""
    with ctrl_c_deferred("removing the temporary folder"):
      if tf.io.gfile.exists(self.path):
        tf.io.gfile.rmtree(self.path)
      if self._held is not None:
        self._held.close()
        self._held = None


def _rename(src: str, dst: str) -> None:
  """Renames the folder src to dst: locally at once; on gs://, file by file (not atomic).

  On gs:// each object is renamed by itself: TensorFlow's rename of a gs://
  folder failed (HTTP 404) on the GCS emulator of the tests.
  """
  if not src.startswith("gs://"):
    tf.io.gfile.rename(src, dst)
    return
  for folder, _, names in tf.io.gfile.walk(src):
    rel = folder[len(src) :].strip("/")
    for name in names:
      tf.io.gfile.rename(
        f"{folder.rstrip('/')}/{name}", "/".join(part for part in (dst, rel, name) if part)
      )


@contextlib.contextmanager
def ctrl_c_deferred(doing: str):
  """Runs the block to its end even on Ctrl-C (SIGINT), which is then only logged.

  For the last steps of a preparation: the renames (interrupted between them,
  the previous dataset would be left aside in the staging folder, which is
  then removed) and the removal of the staging folder. Outside the main thread
  (where signal handlers cannot be set) the block just runs.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  received = []
  previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
  try:
    yield
  finally:
    if previous is not None:  # None: a handler set outside Python, which cannot be restored.
      signal.signal(signal.SIGINT, previous)
    if received:
      logging.warning("Ctrl-C while %s: finished that first.", doing)

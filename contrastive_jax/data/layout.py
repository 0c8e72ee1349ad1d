"""A folder's file list, and its layout into splits and classes (the prepare job's first step).

Computed from the list of files alone, before any file is opened: opening 10^7
files first would be one process's work. A file that turns out not to be an
image still counts for the layout (it can be held out, or make its folder a
class); the Beam stage skips it where it decodes it.
"""

import collections
import hashlib
import json
import os
import zlib

import numpy as np

from contrastive_jax.core.errors import JobError
from contrastive_jax.data import images

SPLIT_FOLDERS = ("train", "validation", "test")


def _list_gcs(src: str, field: str):
  """(files, skipped, stamps) of a gs:// folder: one listing, no object read.

  stamps {file: 'size crc32c'}. Hidden entries: the first hidden part of the
  path, once. Raises JobError when nothing is under src.
  """
  from google.cloud import storage  # pylint: disable=g-import-not-at-top  (only for gs://)

  bucket, _, prefix = src[len("gs://") :].partition("/")
  prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
  files, hidden, stamps = [], set(), {}
  for blob in storage.Client().list_blobs(bucket, prefix=prefix):
    rel = blob.name[len(prefix) :]
    if not rel or rel.endswith("/"):  # A folder marker.
      continue
    parts = rel.split("/")
    first_hidden = next((i for i, part in enumerate(parts) if part.startswith(".")), None)
    if first_hidden is not None:
      hidden.add("/".join(parts[: first_hidden + 1]))
      continue
    files.append(rel)
    stamps[rel] = f"{blob.size} {blob.crc32c}"
  if not files and not hidden:
    raise JobError(f"{field}={src!r}: does not exist or holds no file")
  return sorted(files), [(f, "hidden") for f in sorted(hidden)], stamps


def list_source(src: str, field: str):
  """Every file below src (local or gs://) and what identifies its content, cheaply.

  Args:
    src: the folder, local or gs://.
    field: how the user gave src, for messages (e.g. 'config.src').
  Returns:
    (files, skipped, stamps): files relative, '/'-separated and sorted;
    skipped [(file, reason)] (images.list_files' reasons, or hidden on gs://);
    stamps {file: str}, 'size mtime_ns' locally, 'size crc32c' on gs://.
  Raises:
    JobError: src missing, not a folder or a symbolic link loop of folders
      (images.list_files).
  """
  if src.startswith("gs://"):
    return _list_gcs(src, field)
  files, skipped = images.list_files(src, flag=field)
  stamps = {}
  for rel in files:
    try:
      stat = os.stat(os.path.join(src, rel))
      stamps[rel] = f"{stat.st_size} {stat.st_mtime_ns}"
    except OSError as e:
      stamps[rel] = f"error {e.errno}"  # Reported as skipped where it is decoded.
  return files, skipped, stamps


def fingerprint(files, stamps: dict, options: dict) -> str:
  """sha256 of the options and of every file's relative path and stamp (list_source)."""
  digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
  for rel in files:
    digest.update(rel.encode() + b"\0" + stamps[rel].encode() + b"\0")
  return digest.hexdigest()


def class_folders(folders):
  """The classes that folders give their files: (classes, names).

  Args:
    folders: per file, the list of its folder names from the top (a split
      folder or the source) down; [] for a file at the top.
  Returns:
    classes: the sorted distinct class names, [] when fewer than two (unlabeled).
    names: per file, its class name ('/'-joined folders less the leading ones
      that every file in a folder shares), '' for a file in no class folder
      and for every file when unlabeled.
  """
  in_folders = [f for f in folders if f]
  shared = len(os.path.commonprefix(in_folders)) if in_folders else 0
  names = ["/".join(f[shared:]) for f in folders]
  classes = sorted(set(names) - {""})
  if len(classes) < 2:
    return [], [""] * len(names)
  return classes, names


def layout(files, *, holdout_fraction: float, seed: int):
  """Assigns files to splits and classes.

  Args:
    files: relative, '/'-separated paths of the files listed (images or not).
    holdout_fraction: the fraction of each class held out as test, in (0, 1).
    seed: the seed of the held-out choice.
  Returns:
    (examples, classes, skipped, warnings): examples {split: [(file, class)]}
    with class '' when unlabeled; classes the sorted class names ([] when
    unlabeled); skipped [(file, reason)]; warnings [str].

  Splits: with a top-level train/ folder, files under train/, validation/ and
  test/ go to those splits and any other file is skipped; without one every
  file is in train. When there is no validation or test split, test is held
  out from train: in each class (sorted files, permuted with a generator
  seeded by (seed, crc32 of the class name)) round(holdout_fraction x n)
  files, at least 1 and at most n - 1; a class of one image stays in train.

  Classes: a file's folders below its split folder (or below src), less the
  leading folders that every file in a folder shares. Files directly in the
  split folder (or in src), such as a LICENSE or a classes.csv, take no part
  in that: they sit beside the class folders, not in one. With fewer than two
  distinct classes the dataset is unlabeled and every file is kept;
  otherwise a file in no class folder is skipped.
  """
  skipped, warnings = [], []
  split_layout = any(f.startswith("train/") for f in files)
  placed = []  # (file, split or None, folder parts below the split folder)
  for f in files:
    parts = f.split("/")
    if split_layout:
      if parts[0] not in SPLIT_FOLDERS or len(parts) == 1:
        skipped.append((f, "outside the train/, validation/ and test/ folders"))
        continue
      placed.append((f, parts[0], parts[1:-1]))
    else:
      placed.append((f, None, parts[:-1]))
  classes, names = class_folders([folders for _, _, folders in placed])
  examples = collections.defaultdict(list)
  for (f, split, _), name in zip(placed, names):
    if classes and not name:
      skipped.append((f, "not in a class folder (the dataset has class folders beside it)"))
      continue
    examples[split or "train"].append((f, name))

  if not {"validation", "test"} & set(examples) and examples["train"]:
    _hold_out(examples, holdout_fraction, seed)
  splits_of = collections.defaultdict(list)
  for split, split_examples in sorted(examples.items()):
    for f, name in split_examples:
      splits_of[name].append((f, split))
  for name in classes:
    if len(splits_of[name]) == 1:
      warnings.append(
        f"class {name!r} has 1 image ({splits_of[name][0][0]}), in {splits_of[name][0][1]} only"
      )
    if "train" not in {split for _, split in splits_of[name]}:
      warnings.append(
        f"class {name!r} has no image in train: a kNN or classifier fitted on "
        "train never predicts it"
      )
  return dict(examples), classes, skipped, warnings


def _hold_out(examples: dict, holdout_fraction: float, seed: int) -> None:
  """Moves each class's held-out files from examples['train'] to examples['test'] (layout)."""
  by_class = collections.defaultdict(list)
  for f, name in examples["train"]:
    by_class[name].append(f)
  examples["train"], examples["test"] = [], []
  for name, group in sorted(by_class.items()):
    n = len(group)
    n_test = min(max(round(holdout_fraction * n), 1), n - 1)
    order = np.random.default_rng([seed, zlib.crc32(name.encode())]).permutation(n)
    test = set(order[:n_test].tolist())
    for i, f in enumerate(group):
      examples["test" if i in test else "train"].append((f, name))
  if not examples["test"]:
    del examples["test"]

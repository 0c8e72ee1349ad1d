"""Prepares a folder of image files as a TFDS dataset, usable by name like cifar10.

  python -m contrastive_jax.data.prepare_images --src=DIR --name=NAME --data_dir=DIR2

writes DIR2/NAME/1.0.0/ (TFDS's on-disk format, written by TFDS's own
store_as_tfds_dataset) and its report, DIR2/NAME/1.0.0/prepare_report.json.
Jobs then read it with --config.dataset=NAME --config.data_dir=DIR2.

Features: 'image' (tfds.features.Image, uint8 [H, W, 3], stored JPEG or PNG),
'file_name' (Text: the path relative to --src, '/'-separated) and, when the
folder has classes, 'label' (ClassLabel, names sorted).

The layout (see `layout` for the exact rules):
- Splits: the top-level folders train/, validation/ and test/ when src has a
  train/ folder; otherwise (and when train/ has neither validation/ nor test/
  beside it) a test split is held out: --holdout_fraction of each class,
  chosen with --seed.
- Classes: an image's class is its folder below the split folder (or below
  src), parts joined by '/', less the leading folders that all images share.
  grocery/val/Fruit/Apple/x.jpg -> 'Fruit/Apple'; clothing/train/hat/x.jpg ->
  'hat'. With fewer than two classes the dataset is unlabeled
  (chest_xray/images/x.png).

Every file is tried; a file Pillow cannot read or decode, one claiming more
than --max_pixels pixels, one outside the split folders or outside any class
folder, and hidden files and folders (names starting with '.') are skipped,
counted and listed in the report with the reason. Images are stored with
their shorter side at most --image_size (never upscaled); smaller ones are
listed in the report too: the input pipeline's crops upscale them (bilinear).

Preparing the same files with the same options again changes nothing; other
files or options under an existing name are refused unless --overwrite. The
dataset is written to a temporary folder in data_dir and renamed into place,
so a failed or interrupted preparation leaves the previous one intact; Ctrl-C
ends it with one line saying so (the temporary folder is removed), and one
during the final renames waits for them.
"""
import collections
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import zlib

from absl import app
from absl import flags
from absl import logging
import numpy as np
from PIL import Image
import tensorflow_datasets as tfds

from contrastive_jax.core.errors import ImageError
from contrastive_jax.core.errors import JobError
from contrastive_jax.core import metrics
from contrastive_jax.data import images

VERSION = "1.0.0"
REPORT = "prepare_report.json"
SPLIT_FOLDERS = ("train", "validation", "test")

_SRC = flags.DEFINE_string("src", None, "Folder of image files (any depth).")
_NAME = flags.DEFINE_string("name", None, "Dataset name: lowercase letters, digits and '_'.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "TFDS data directory to write the dataset to.")
_IMAGE_SIZE = flags.DEFINE_integer(
    "image_size", 256, "Stored shorter side in pixels (larger images are downscaled, keeping "
    "the aspect ratio; smaller ones are kept); 0 stores every image at its own size.",
    lower_bound=0)
_FORMAT = flags.DEFINE_enum("format", "jpeg", ["jpeg", "png"],
                            "Storage encoding: jpeg (quality 95, small) or png (lossless).")
_MAX_PIXELS = flags.DEFINE_integer(
    "max_pixels", 100_000_000, "Files whose header claims more pixels (width x height) are "
    "skipped before decoding (decompression bombs).", lower_bound=1)
_HOLDOUT_FRACTION = flags.DEFINE_float(
    "holdout_fraction", 0.1, "Fraction of each class held out as the test split when src has "
    "no validation/ or test/ folder.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the held-out choice.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False,
                               "Replace a dataset of this name prepared from other files or "
                               "with other options.")


def fingerprint(src: str, files, options: dict) -> str:
  """sha256 of the options and of every file's relative path and content."""
  digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
  for rel in files:
    digest.update(rel.encode() + b"\0")
    try:
      with open(os.path.join(src, rel), "rb") as f:
        content = hashlib.sha256()
        for block in iter(lambda: f.read(1 << 20), b""):
          content.update(block)
      digest.update(content.digest())
    except OSError as e:
      digest.update(str(e.errno).encode())  # Reported as skipped later.
  return digest.hexdigest()


def layout(files, *, holdout_fraction: float, seed: int):
  """Assigns image files to splits and classes.

  Args:
    files: relative paths of the files whose header Pillow read.
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

  Classes: the folder of the file below its split folder (or below src),
  less the leading folders every image shares. Fewer than two distinct
  classes: unlabeled, every file kept. Otherwise a file directly in the
  shared folder has no class and is skipped.
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
  shared = len(os.path.commonprefix([folders for _, _, folders in placed])) if placed else 0
  classes = sorted({"/".join(folders[shared:]) for _, _, folders in placed} - {""})
  labelled = len(classes) >= 2
  if not labelled:
    classes = []
  examples = collections.defaultdict(list)
  for f, split, folders in placed:
    name = "/".join(folders[shared:]) if labelled else ""
    if labelled and not name:
      skipped.append((f, "not in a class folder (the dataset has class folders beside it)"))
      continue
    examples[split or "train"].append((f, name))

  if not {"validation", "test"} & set(examples) and examples["train"]:
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
  splits_of = collections.defaultdict(list)
  for split, split_examples in sorted(examples.items()):
    for f, name in split_examples:
      splits_of[name].append((f, split))
  for name in classes:
    if len(splits_of[name]) == 1:
      warnings.append(f"class {name!r} has 1 image ({splits_of[name][0][0]}), in "
                      f"{splits_of[name][0][1]} only")
    if "train" not in {split for _, split in splits_of[name]}:
      warnings.append(f"class {name!r} has no image in train: a kNN or classifier fitted on "
                      "train never predicts it")
  return dict(examples), classes, skipped, warnings


def _examples(src, split, split_examples, *, labelled, max_pixels, image_size, skipped, small,
              counts):
  """Yields TFDS's (key, example) pairs of a split, decoding as it goes.

  Files that fail to decode go to skipped, images whose shorter side is
  below image_size to small; counts[split] (set when the split starts)
  counts the examples of each class.
  """
  counts[split] = collections.Counter()
  for rel, name in split_examples:
    try:
      image = images.load_image(os.path.join(src, rel), max_pixels=max_pixels,
                                shorter_side=image_size or None)
    except ImageError as e:
      skipped.append((rel, e.reason))
      continue
    if image_size and min(image.shape[:2]) < image_size:
      small.append((rel, image.shape[1], image.shape[0]))
    counts[split][name] += 1
    example = {"image": image, "file_name": rel}
    if labelled:
      example["label"] = name
    yield rel, example


def _previous_report(final: str):
  """The report of the dataset in `final`, or None (absent or not prepare_images's)."""
  try:
    with open(os.path.join(final, VERSION, REPORT)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _store(tmp, name, *, encoding, classes, split_datasets, description):
  """Writes the dataset with TFDS into tmp/name/VERSION (no download, no GCS lookup)."""
  features = {"image": tfds.features.Image(shape=(None, None, 3), encoding_format=encoding),
              "file_name": tfds.features.Text()}
  if classes:
    features["label"] = tfds.features.ClassLabel(names=classes)
  tfds.dataset_builders.store_as_tfds_dataset(
      name=name, version=VERSION, features=tfds.features.FeaturesDict(features),
      split_datasets=split_datasets, data_dir=tmp, description=description,
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))


def _replace(new: str, final: str, aside: str):
  """Renames new to final; an existing final is moved to aside first and back on failure."""
  if os.path.exists(final):
    os.rename(final, aside)
  try:
    os.rename(new, final)
  except OSError:
    if os.path.exists(aside):
      os.rename(aside, final)
    raise


def _first(skipped, n=3) -> str:
  return "; ".join(f"{f}: {reason}" for f, reason in skipped[:n]) + (
      f"; ... ({len(skipped) - n} more)" if len(skipped) > n else "")


def prepare(src: str, name: str, data_dir: str, *, image_size: int, encoding: str,
            max_pixels: int, holdout_fraction: float, seed: int, overwrite: bool) -> dict:
  """Prepares src as the TFDS dataset data_dir/name (module docstring); returns its report.

  The report (also written to data_dir/name/VERSION/prepare_report.json):
  src, name, fingerprint, options, classes ([] when unlabeled), splits
  {split: {'images': n, 'per_class': {class: n} or {}}}, files (the number
  of entries found, hidden ones included), skipped
  [{'file', 'reason'}], smaller_than_image_size [{'file', 'width',
  'height'}] and warnings.

  Raises:
    JobError: a bad argument, src missing or not a folder, a symbolic link
      loop, no decodable image (in train), or an existing dataset of that
      name from other files or options without overwrite. Nothing under
      data_dir/name has changed then.
  """
  if not re.fullmatch(r"[a-z][a-z0-9_]*", name or ""):
    raise JobError(f"--name={name!r}: must be lowercase letters, digits and '_', starting "
                   "with a letter (a TFDS dataset name)")
  try:
    tfds.builder_cls(name)
  except tfds.core.registered.DatasetNotFoundError:
    pass
  else:
    raise JobError(f"--name={name!r}: is a registered TFDS dataset, which jobs would read "
                   "instead; choose another name")
  if not 0 < holdout_fraction < 1:
    raise JobError(f"--holdout_fraction={holdout_fraction}: must be in (0, 1)")
  src, data_dir = os.path.abspath(src), os.path.abspath(data_dir)
  files, skipped = images.list_files(src, flag="--src")
  num_entries = len(files) + len(skipped)
  if (os.path.realpath(data_dir) + os.sep).startswith(os.path.realpath(src) + os.sep):
    raise JobError(f"--data_dir={data_dir!r}: is inside --src={src!r}; choose a folder "
                   "outside it")
  options = dict(image_size=image_size, format=encoding, max_pixels=max_pixels,
                 holdout_fraction=holdout_fraction, seed=seed)
  digest = fingerprint(src, files, options)
  final = os.path.join(data_dir, name)
  previous = _previous_report(final)
  if previous and previous.get("fingerprint") == digest:
    logging.info("%s already holds %s prepared from the same files with the same options.",
                 final, src)
    return previous
  if os.path.exists(final) and not overwrite:
    what = (f"a dataset prepared from other files or options (from {previous.get('src')}, "
            "see its prepare_report.json)" if previous else
            "something prepare_images did not write")
    raise JobError(f"--name={name!r}: {final} already holds {what}; pass --overwrite to "
                   "replace it")

  readable = []
  for rel in files:  # Headers only: the layout needs to know which files are images.
    try:
      with images.open_image(os.path.join(src, rel), max_pixels=max_pixels):
        readable.append(rel)
    except ImageError as e:
      skipped.append((rel, e.reason))
  examples, classes, layout_skipped, warnings = layout(
      readable, holdout_fraction=holdout_fraction, seed=seed)
  skipped += layout_skipped
  if not examples.get("train"):
    raise JobError(f"--src={src!r}: no image to prepare for the train split ({num_entries} "
                   "files" + (f"; skipped: {_first(skipped)})" if skipped else ")"))

  os.makedirs(data_dir, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{name}.preparing.", dir=data_dir)
  try:
    small, counts = [], {}
    split_datasets = {split: _examples(src, split, split_examples, labelled=bool(classes),
                                       max_pixels=max_pixels, image_size=image_size,
                                       skipped=skipped, small=small, counts=counts)
                      for split, split_examples in sorted(examples.items())}
    try:
      _store(tmp, name, encoding=encoding, classes=classes, split_datasets=split_datasets,
             description=f"Images of {src}, prepared by contrastive_jax.data.prepare_images.")
    except AssertionError:  # TFDS refuses a split that yielded no example.
      last = list(counts)[-1] if counts else None
      if last is None or counts[last]:
        raise
      raise JobError(f"--src={src!r}: no image of split {last!r} could be decoded; "
                     f"skipped: {_first(skipped)}") from None
    report = dict(
        src=src, name=name, fingerprint=digest, options=options, classes=classes,
        splits={split: dict(images=sum(c.values()),
                            per_class=dict(sorted(c.items())) if classes else {})
                for split, c in sorted(counts.items())},
        files=num_entries, skipped=[dict(file=f, reason=r) for f, r in sorted(skipped)],
        smaller_than_image_size=[dict(file=f, width=w, height=h) for f, w, h in sorted(small)],
        warnings=warnings)
    with open(os.path.join(tmp, name, VERSION, REPORT), "w") as f:
      json.dump(report, f, indent=1)
    with _ctrl_c_deferred("moving the dataset into place"):
      _replace(os.path.join(tmp, name), final, os.path.join(tmp, "previous"))
  finally:
    with _ctrl_c_deferred("removing the temporary folder"):
      shutil.rmtree(tmp, ignore_errors=True)
  return report


@contextlib.contextmanager
def _ctrl_c_deferred(doing: str):
  """Runs the block to its end even on Ctrl-C (SIGINT), which is then only logged.

  For the last steps of prepare: the renames (interrupted between them, the
  previous dataset would be left aside in the temporary folder, which is then
  removed) and the removal of the temporary folder. Ctrl-C before them ends
  prepare in KeyboardInterrupt with data_dir/name unchanged. Outside the main
  thread (where signal handlers cannot be set) the block just runs.
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


def summary(report: dict, data_dir: str) -> str:
  """Console lines saying what was prepared, what was skipped and why, and the warnings."""
  path = os.path.join(data_dir, report["name"], VERSION)
  splits = ", ".join(f"{s} {v['images']}" for s, v in report["splits"].items())
  kind = f"{len(report['classes'])} classes" if report["classes"] else "unlabeled"
  lines = [f"{report['name']}: {splits} images, {kind}; in {path} "
           f"(read it with --config.dataset={report['name']} --config.data_dir={data_dir})"]
  skipped = [(s["file"], s["reason"]) for s in report["skipped"]]
  if skipped:
    lines.append(f"skipped {len(skipped)} of {report['files']} files (all listed in "
                 f"{os.path.join(path, REPORT)}): {_first(skipped)}")
  if report["smaller_than_image_size"]:
    lines.append(f"{len(report['smaller_than_image_size'])} images have a shorter side below "
                 f"--image_size={report['options']['image_size']} (listed in the report): "
                 "stored as they are; training crops upscale them")
  lines += [f"warning: {w}" for w in report["warnings"]]
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  metrics.quiet_library_logs()
  Image.MAX_IMAGE_PIXELS = None  # --max_pixels is the limit (images.open_image checks it).
  try:
    report = prepare(_SRC.value, _NAME.value, _DATA_DIR.value, image_size=_IMAGE_SIZE.value,
                     encoding=_FORMAT.value, max_pixels=_MAX_PIXELS.value,
                     holdout_fraction=_HOLDOUT_FRACTION.value, seed=_SEED.value,
                     overwrite=_OVERWRITE.value)
  except JobError as e:
    sys.exit(f"error: {e}")
  except KeyboardInterrupt:
    final = os.path.join(os.path.abspath(_DATA_DIR.value), _NAME.value)
    sys.exit(f"error: interrupted (Ctrl-C): nothing was replaced: {final} is as it was, and "
             "no partly written copy is left")
  print(summary(report, os.path.abspath(_DATA_DIR.value)), flush=True)


if __name__ == "__main__":
  flags.mark_flags_as_required(["src", "name", "data_dir"])
  app.run(main)

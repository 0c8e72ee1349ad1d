"""Prepares a folder of image files as a TFDS dataset, usable by name like cifar10.

  python -m contrastive_jax.data.prepare_images --src=DIR --name=NAME --data_dir=DIR2

writes DIR2/NAME/1.0.0/ (TFDS's on-disk format in ArrayRecord files, which
can be read at random; records serialized by TFDS's features, metadata by
tfds.folder_dataset.write_metadata) and its report,
DIR2/NAME/1.0.0/prepare_report.json. Jobs then read it with
--config.dataset=NAME --config.data_dir=DIR2.

Decoding, resizing, encoding and writing run as an Apache Beam pipeline (the
[beam] extra: pip install -e '.[beam]') whose elements are shards (see
shard_examples): each worker writes whole shard files, and only paths and
counts pass between processes. By default Beam's DirectRunner with one worker
process per core (--direct_num_workers), or any Beam runner (--runner, with
more pipeline options in --beam_options, e.g. Dataflow's project, region and
temp_location). --src and --data_dir may be gs:// folders; a runner with
remote workers needs both there. The stored order is by a hash of each
file's path, so any contiguous part of a split holds every class, and the
dataset is the same for any runner and number of workers.

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

The layout is computed from the file list alone (no file is opened before the
Beam stage): a file that is not an image counts for it, e.g. it can be held
out, or make its folder a class; it is then skipped in the Beam stage.

Every file is tried; a file Pillow cannot read or decode, one claiming more
than --max_pixels pixels, one outside the split folders or outside any class
folder, and hidden files and folders (names starting with '.') are skipped,
counted and listed in the report with the reason. Images are stored with
their shorter side at most --image_size (never upscaled); smaller ones are
listed in the report too: the input pipeline's crops upscale them (bilinear).

Preparing the same files (the same paths, sizes and modification times; on
gs://, sizes and CRC32C checksums) with the same options again changes
nothing; other files or options under an existing name are refused unless
--overwrite. The dataset is written to a temporary folder in data_dir and
renamed into place, so a failed or interrupted preparation leaves the previous
one intact; Ctrl-C ends it with one line saying so (the temporary folder is
removed; DirectRunner's worker processes, which a terminal's Ctrl-C reaches
too, print their own tracebacks before it), and one during the final renames
waits for them.
"""
import collections
import contextlib
import hashlib
import importlib
import json
import logging as std_logging
import os
import re
import shlex
import signal
import sys
import threading
import uuid
import zlib

from absl import app
from absl import flags
from absl import logging
import numpy as np
from PIL import Image
import tensorflow as tf
import tensorflow_datasets as tfds

from contrastive_jax.core.errors import JobError
from contrastive_jax.core import gcs
from contrastive_jax.core import metrics
from contrastive_jax.data import images

VERSION = "1.0.0"
REPORT = "prepare_report.json"
SPLIT_FOLDERS = ("train", "validation", "test")
# Files per shard: the bounds of shard_examples's choice.
_MIN_SHARD, _MAX_SHARD = 100, 1000
# Runners that import more than Beam's base install when they start: (a module they
# need, what installs it).
_RUNNER_PACKAGES = {"DataflowRunner": ("apache_beam.runners.dataflow.internal.apiclient",
                                       "pip install 'apache-beam[gcp]==2.77.0'")}

_SRC = flags.DEFINE_string("src", None, "Folder of image files (any depth), local or gs://.")
_NAME = flags.DEFINE_string("name", None, "Dataset name: lowercase letters, digits and '_'.")
_DATA_DIR = flags.DEFINE_string("data_dir", None,
                                "TFDS data directory to write the dataset to, local or gs://.")
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
_RUNNER = flags.DEFINE_string("runner", "DirectRunner",
                              "Apache Beam runner, e.g. DirectRunner (this machine) or "
                              "DataflowRunner.")
_DIRECT_NUM_WORKERS = flags.DEFINE_integer(
    "direct_num_workers", 0, "DirectRunner's worker processes; 0: one per local core; 1: in "
    "this process (no worker to start: quicker for a few thousand files).", lower_bound=0)
_BEAM_OPTIONS = flags.DEFINE_string(
    "beam_options", "", "More Beam pipeline options, as on a command line, e.g. "
    "'--project=P --region=R --temp_location=gs://B/tmp' for Dataflow.")


def _absolute(path: str) -> str:
  return path if path.startswith("gs://") else os.path.abspath(path)


def _list_gcs(src: str):
  """(files, skipped, stamps) of a gs:// folder: one listing, no object read.

  stamps {file: 'size crc32c'}. Hidden entries: the first hidden part of the
  path, once. Raises JobError when nothing is under src.
  """
  from google.cloud import storage  # pylint: disable=g-import-not-at-top  (only for gs://)
  bucket, _, prefix = src[len("gs://"):].partition("/")
  prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
  files, hidden, stamps = [], set(), {}
  for blob in storage.Client().list_blobs(bucket, prefix=prefix):
    rel = blob.name[len(prefix):]
    if not rel or rel.endswith("/"):  # A folder marker.
      continue
    parts = rel.split("/")
    first_hidden = next((i for i, part in enumerate(parts) if part.startswith(".")), None)
    if first_hidden is not None:
      hidden.add("/".join(parts[:first_hidden + 1]))
      continue
    files.append(rel)
    stamps[rel] = f"{blob.size} {blob.crc32c}"
  if not files and not hidden:
    raise JobError(f"--src={src!r}: does not exist or holds no file")
  return sorted(files), [(f, "hidden") for f in sorted(hidden)], stamps


def list_source(src: str):
  """Every file below src (local or gs://) and what identifies its content, cheaply.

  Returns:
    (files, skipped, stamps): files relative, '/'-separated and sorted;
    skipped [(file, reason)] (images.list_files' reasons, or hidden on gs://);
    stamps {file: str}, 'size mtime_ns' locally, 'size crc32c' on gs://.
  Raises:
    JobError: src missing, not a folder or a symbolic link loop (images.list_files).
  """
  if src.startswith("gs://"):
    return _list_gcs(src)
  files, skipped = images.list_files(src, flag="--src")
  stamps = {}
  for rel in files:
    try:
      stat = os.stat(os.path.join(src, rel))
      stamps[rel] = f"{stat.st_size} {stat.st_mtime_ns}"
    except OSError as e:
      stamps[rel] = f"error {e.errno}"  # Reported as skipped later.
  return files, skipped, stamps


def fingerprint(files, stamps: dict, options: dict) -> str:
  """sha256 of the options and of every file's relative path and stamp (list_source)."""
  digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
  for rel in files:
    digest.update(rel.encode() + b"\0" + stamps[rel].encode() + b"\0")
  return digest.hexdigest()


def layout(files, *, holdout_fraction: float, seed: int):
  """Assigns image files to splits and classes.

  Args:
    files: relative paths of the files listed (images or not: the files that
      turn out not to be images are skipped later, where they are decoded).
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


def beam_args(runner: str, direct_num_workers: int, beam_options: str):
  """Beam's pipeline arguments for the flags --runner, --direct_num_workers, --beam_options.

  DirectRunner is run as FnApiRunner, the local runner it falls back to:
  Beam 2.77's DirectRunner first tries Prism, a Go binary it downloads from
  GitHub, which ignores direct_num_workers. It runs direct_num_workers worker
  processes (0: one per local core); processes, not threads, since decoding
  in threads of one process would share one interpreter lock; one worker runs
  in this process. beam_options is split as a shell would.
  """
  if runner != "DirectRunner":
    return [f"--runner={runner}"] + shlex.split(beam_options)
  workers = direct_num_workers or os.cpu_count()
  mode = "multi_processing" if workers > 1 else "in_memory"
  return ["--runner=FnApiRunner", f"--direct_num_workers={workers}",
          f"--direct_running_mode={mode}"] + shlex.split(beam_options)


def _import_beam():
  """The prepare_beam module. Raises JobError when Apache Beam is not installed."""
  try:
    from contrastive_jax.data import prepare_beam  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    if e.name is None or not e.name.startswith("apache_beam"):
      raise
    raise JobError("prepare_images runs on Apache Beam, which is not installed: pip install "
                   "-e '.[beam]' (or pip install apache-beam==2.77.0)") from None
  return prepare_beam


def _previous_report(final: str):
  """The report of the dataset in `final`, or None (absent or not prepare_images's)."""
  try:
    with tf.io.gfile.GFile(os.path.join(final, VERSION, REPORT)) as f:
      return json.load(f)
  except (tf.errors.OpError, ValueError):
    return None


def features(encoding: str, classes) -> tfds.features.FeaturesDict:
  """The dataset's features (module docstring); 'label' only when classes is not empty."""
  found = {"image": tfds.features.Image(shape=(None, None, 3), encoding_format=encoding),
           "file_name": tfds.features.Text()}
  if classes:
    found["label"] = tfds.features.ClassLabel(names=classes)
  return tfds.features.FeaturesDict(found)


def shard_examples(examples: dict) -> dict:
  """{split: [(file, class)]} -> {split: shards, each [(file, class)]}, in the stored order.

  A split's files are ordered by a hash of their path (blake2b), not by class:
  evaluation on several hosts and tfds.even_splits read contiguous parts, which
  must each hold every class. They are then cut into contiguous shards of
  equal size (+-1). Files per shard: one 64th of all files, but at least
  _MIN_SHARD (few shard files for small folders) and at most _MAX_SHARD (one
  shard is a few seconds of one worker's work, about 30 MB at 256 px). Both
  depend on the files only, so the dataset is the same for any number of
  workers; at least 64 equal shards from 6,400 files on divide evenly among a
  few workers.
  """
  total = sum(len(split_examples) for split_examples in examples.values())
  per_shard = min(max(-(-total // 64), _MIN_SHARD), _MAX_SHARD)
  sharded = {}
  for split, split_examples in sorted(examples.items()):
    ordered = sorted(split_examples,
                     key=lambda example: hashlib.blake2b(example[0].encode()).digest())
    n = len(ordered)
    num_shards = -(-n // per_shard)
    sharded[split] = [ordered[i * n // num_shards:(i + 1) * n // num_shards]
                      for i in range(num_shards)]
  return sharded


def _shard_paths(tmp: str, name: str, split: str, index: int, num_shards: int):
  """(list file, ArrayRecord file in TFDS's naming, done file) of a shard, in tmp."""
  stem = os.path.join(tmp, "shards", f"{split}-{index:05d}")
  records = os.path.join(tmp, name, VERSION,
                         f"{name}-{split}.array_record-{index:05d}-of-{num_shards:05d}")
  return f"{stem}.files.jsonl", records, f"{stem}.done.json"


def _read_done(path: str):
  """A shard's done file (prepare_beam.WriteShard), or None when it was not written."""
  try:
    with tf.io.gfile.GFile(path) as f:
      return json.load(f)
  except tf.errors.NotFoundError:
    return None


def _write_metadata(folder: str, feature_dict, shard_lengths: dict, num_bytes: dict,
                    description: str) -> None:
  """TFDS's metadata (dataset_info.json, features.json, ...) of the shards in folder.

  With TFDS's tfds.folder_dataset.write_metadata (for datasets written
  outside TFDS), given each split's shard lengths (in shard order) and bytes.
  Its check of the data reads with as_dataset, which TFDS 4.9.10 cannot for
  ArrayRecord; tests read the result with as_data_source instead.
  """
  tfds.folder_dataset.write_metadata(
      data_dir=folder, features=feature_dict, version=VERSION, check_data=False,
      split_infos=[tfds.core.SplitInfo(name=split, shard_lengths=lengths,
                                       num_bytes=num_bytes[split])
                   for split, lengths in sorted(shard_lengths.items())],
      description=description)


def _rename(src: str, dst: str) -> None:
  """Renames the folder src to dst: locally at once; on gs://, file by file (not atomic).

  On gs:// each object is renamed by itself: TensorFlow's rename of a gs://
  folder failed (HTTP 404) on the GCS emulator of the tests.
  """
  if not src.startswith("gs://"):
    tf.io.gfile.rename(src, dst)
    return
  for folder, _, names in tf.io.gfile.walk(src):
    rel = folder[len(src):].strip("/")
    for name in names:
      tf.io.gfile.rename(f"{folder.rstrip('/')}/{name}",
                         "/".join(part for part in (dst, rel, name) if part))


def _replace(new: str, final: str, aside: str):
  """Renames new to final (_rename); an existing final is moved to aside first, back on failure."""
  if tf.io.gfile.exists(final):
    _rename(final, aside)
  try:
    _rename(new, final)
  except (OSError, tf.errors.OpError):
    if tf.io.gfile.exists(aside):
      _rename(aside, final)
    raise


def _first(skipped, n=3) -> str:
  return "; ".join(f"{f}: {reason}" for f, reason in skipped[:n]) + (
      f"; ... ({len(skipped) - n} more)" if len(skipped) > n else "")


def _pipeline_error(runner: str, error: Exception) -> str:
  """One line for a pipeline that failed: the runner, the error and, if known, the fix."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  lines = lines or [type(error).__name__]
  if lines[0].endswith(":"):  # A heading with its items below, e.g. Dataflow's missing options.
    lines = [" ".join(lines)[:1000]]
  if isinstance(error, ImportError):
    fix = _RUNNER_PACKAGES.get(runner, (None, "install the runner's package"))[1]
    return f"--runner={runner}: cannot start ({lines[-1]}); {fix}"
  return f"the Beam pipeline failed on {runner}: {type(error).__name__}: {lines[0]}"


def _is_ctrl_c(error: BaseException) -> bool:
  """Whether error is, or was raised for, a KeyboardInterrupt (Beam wraps them)."""
  while error is not None:
    if isinstance(error, KeyboardInterrupt) or str(error).startswith("KeyboardInterrupt"):
      return True
    error = error.__cause__ or error.__context__
  return False


def _check_written(runner: str, shards: dict, done: dict) -> None:
  """Raises JobError unless every file of every shard was written or reported as skipped.

  shards {split: [[(file, class)]]}; done {split: [done file or None]} (None:
  the shard was not written). A runner that drops an element, or a shard's
  records, would otherwise give a smaller dataset.
  """
  for split, split_shards in shards.items():
    listed = sum(len(shard) for shard in split_shards)
    written = sum(d["examples"] for d in done[split] if d)
    reported = sum(len(d["skipped"]) for d in done[split] if d)
    if written + reported != listed:
      raise JobError(f"the Beam pipeline on {runner} lost files: split {split!r} has "
                     f"{written} examples, but {listed - reported} of its {listed} files "
                     "were not reported as skipped; nothing was replaced")


def prepare(src: str, name: str, data_dir: str, *, image_size: int, encoding: str,
            max_pixels: int, holdout_fraction: float, seed: int, overwrite: bool,
            beam_args=("--runner=FnApiRunner",)) -> dict:
  """Prepares src as the TFDS dataset data_dir/name (module docstring); returns its report.

  Args:
    beam_args: Beam pipeline arguments (see the function beam_args); the
      default runs Beam's FnApiRunner in this process, on one worker.

  The report (also written to data_dir/name/VERSION/prepare_report.json):
  src, name, fingerprint, options, classes ([] when unlabeled), splits
  {split: {'images': n, 'per_class': {class: n} or {}}}, files (the number
  of entries found, hidden ones included), skipped
  [{'file', 'reason'}], smaller_than_image_size [{'file', 'width',
  'height'}] and warnings.

  Raises:
    JobError: a bad argument, src missing or not a folder, a symbolic link
      loop, no Google Cloud credentials for a gs:// path, Apache Beam or the
      runner not installed, no decodable image (in a split), an existing
      dataset of that name from other files or options without overwrite,
      or the pipeline failing (e.g. a worker dying). Nothing under
      data_dir/name has changed then, and no temporary folder is left.
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
  gcs.check_credentials(src, "--src")
  gcs.check_credentials(data_dir, "--data_dir")
  prepare_beam = _import_beam()
  beam_options = prepare_beam.pipeline_options(beam_args)
  runner = prepare_beam.runner_name(beam_options)
  try:
    prepare_beam.create_runner(runner)
    if runner in _RUNNER_PACKAGES:
      importlib.import_module(_RUNNER_PACKAGES[runner][0])
  except ValueError as e:
    raise JobError(f"--runner={runner}: {e}") from None
  except ImportError as e:
    raise JobError(_pipeline_error(runner, e)) from None
  src, data_dir = _absolute(src), _absolute(data_dir)
  if runner == "DataflowRunner" and not (src.startswith("gs://")
                                         and data_dir.startswith("gs://")):
    raise JobError(f"--runner={runner}: its workers read --src={src!r} and write "
                   f"--data_dir={data_dir!r}: both must be gs:// folders")
  files, skipped, stamps = list_source(src)
  num_entries = len(files) + len(skipped)
  if (os.path.realpath(data_dir) + os.sep).startswith(os.path.realpath(src) + os.sep):
    raise JobError(f"--data_dir={data_dir!r}: is inside --src={src!r}; choose a folder "
                   "outside it")
  options = dict(image_size=image_size, format=encoding, max_pixels=max_pixels,
                 holdout_fraction=holdout_fraction, seed=seed)
  digest = fingerprint(files, stamps, options)
  final = os.path.join(data_dir, name)
  previous = _previous_report(final)
  if previous and previous.get("fingerprint") == digest:
    logging.info("%s already holds %s prepared from the same files with the same options.",
                 final, src)
    return previous
  if tf.io.gfile.exists(final) and not overwrite:
    what = (f"a dataset prepared from other files or options (from {previous.get('src')}, "
            "see its prepare_report.json)" if previous else
            "something prepare_images did not write")
    if previous and tf.io.gfile.glob(os.path.join(final, VERSION, "*.tfrecord-*")):
      # TFRecord shards: a dataset whose fingerprint hashed file contents, not stamps.
      what = (f"a TFRecord dataset prepared by an earlier version (from {previous.get('src')}), "
              "which training reads as a stream; pass --overwrite to prepare it again as "
              "ArrayRecord, read in a fresh order every epoch")
      raise JobError(f"--name={name!r}: {final} already holds {what}")
    raise JobError(f"--name={name!r}: {final} already holds {what}; pass --overwrite to "
                   "replace it")

  # From the file list alone: opening 10^7 files here would be a one-process pass.
  examples, classes, layout_skipped, warnings = layout(
      files, holdout_fraction=holdout_fraction, seed=seed)
  skipped += layout_skipped
  if not examples.get("train"):
    raise JobError(f"--src={src!r}: no image to prepare for the train split ({num_entries} "
                   "files" + (f"; skipped: {_first(skipped)})" if skipped else ")"))

  tf.io.gfile.makedirs(data_dir)
  tmp = os.path.join(data_dir, f".{name}.preparing.{uuid.uuid4().hex[:12]}")
  try:
    counts, failed, small = _write(prepare_beam, tmp, src, name, runner, examples, classes,
                                   beam_options, max_pixels=max_pixels,
                                   image_size=image_size, encoding=encoding)
    skipped += failed
    warnings += [f"class {c!r}: no image of it could be decoded (its label is kept)"
                 for c in classes if not any(counts[split][c] for split in counts)]
    report = dict(
        src=src, name=name, fingerprint=digest, options=options, classes=classes,
        splits={split: dict(images=sum(c.values()),
                            per_class=dict(sorted(c.items())) if classes else {})
                for split, c in counts.items()},
        files=num_entries, skipped=[dict(file=f, reason=r) for f, r in sorted(skipped)],
        smaller_than_image_size=[dict(file=f, width=w, height=h) for f, w, h in sorted(small)],
        warnings=warnings)
    with tf.io.gfile.GFile(os.path.join(tmp, name, VERSION, REPORT), "w") as f:
      json.dump(report, f, indent=1)
    with _ctrl_c_deferred("moving the dataset into place"):
      _replace(os.path.join(tmp, name), final, os.path.join(tmp, "previous"))
  finally:
    with _ctrl_c_deferred("removing the temporary folder"):
      if tf.io.gfile.exists(tmp):
        tf.io.gfile.rmtree(tmp)
  return report


def _write(prepare_beam, tmp, src, name, runner, examples, classes, beam_options, *,
           max_pixels, image_size, encoding):
  """Writes the dataset tmp/name/VERSION on Beam, but for its report.

  Each shard's list file goes to tmp/shards; the pipeline writes the shards
  (prepare_beam.WriteShard); then this process checks that no file was lost
  and writes TFDS's metadata.

  Returns:
    (counts, failed, small): counts {split: Counter of classes} written;
    failed [(file, reason)] skipped by the workers; small [(file, width,
    height)], images with a shorter side below image_size.
  Raises:
    JobError: a failed pipeline, lost files, a split without any decoded image.
    KeyboardInterrupt: Ctrl-C during the pipeline.
  """
  shards = shard_examples(examples)
  paths = {split: [_shard_paths(tmp, name, split, i, len(split_shards))
                   for i in range(len(split_shards))]
           for split, split_shards in shards.items()}
  for folder in (os.path.join(tmp, "shards"), os.path.join(tmp, name, VERSION)):
    tf.io.gfile.makedirs(folder)
  for split, split_shards in shards.items():
    for shard, (list_path, _, _) in zip(split_shards, paths[split]):
      with tf.io.gfile.GFile(list_path, "w") as f:
        f.write("".join(json.dumps(example) + "\n" for example in shard))
  feature_dict = features(encoding, classes)
  write_shard = prepare_beam.WriteShard(src, os.path.join(tmp, "shards"), feature_dict,
                                        max_pixels=max_pixels, image_size=image_size)
  try:
    prepare_beam.write_shards([p for split in sorted(paths) for p in paths[split]],
                              beam_options, write_shard)
  except Exception as e:  # pylint: disable=broad-except  (any runner's, any failure)
    if _is_ctrl_c(e):  # Beam re-raises a DoFn's KeyboardInterrupt as a RuntimeError.
      raise KeyboardInterrupt from e
    raise JobError(_pipeline_error(runner, e)) from e
  done = {split: [_read_done(done_path) for _, _, done_path in paths[split]]
          for split in paths}
  _check_written(runner, shards, done)
  failed = {split: sorted(tuple(s) for d in done[split] for s in d["skipped"])
            for split in done}
  for split in done:
    if not any(d["examples"] for d in done[split]):
      raise JobError(f"--src={src!r}: no image of split {split!r} could be decoded; "
                     f"skipped: {_first(failed[split])}")
  _write_metadata(os.path.join(tmp, name, VERSION), feature_dict,
                  {split: [d["examples"] for d in done[split]] for split in done},
                  {split: sum(d["num_bytes"] for d in done[split]) for split in done},
                  description=f"Images of {src}, prepared by "
                              "contrastive_jax.data.prepare_images.")
  counts = {split: sum((collections.Counter(d["per_class"]) for d in done[split]),
                       collections.Counter()) for split in sorted(done)}
  small = [tuple(s) for split in done for d in done[split] for s in d["small"]]
  return counts, [s for split in failed for s in failed[split]], small


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
  # Beam logs its progress, and a failed DoFn's traceback before raising the error, which
  # prepare reports in one line.
  std_logging.getLogger("apache_beam").setLevel(std_logging.WARNING)
  logging.get_absl_handler().addFilter(
      lambda record: not (record.exc_info and record.name.startswith("apache_beam")))
  Image.MAX_IMAGE_PIXELS = None  # --max_pixels is the limit (images.open_image checks it).
  try:
    report = prepare(_SRC.value, _NAME.value, _DATA_DIR.value, image_size=_IMAGE_SIZE.value,
                     encoding=_FORMAT.value, max_pixels=_MAX_PIXELS.value,
                     holdout_fraction=_HOLDOUT_FRACTION.value, seed=_SEED.value,
                     overwrite=_OVERWRITE.value,
                     beam_args=beam_args(_RUNNER.value, _DIRECT_NUM_WORKERS.value,
                                         _BEAM_OPTIONS.value))
  except JobError as e:
    sys.exit(f"error: {e}")
  except KeyboardInterrupt:
    final = os.path.join(_absolute(_DATA_DIR.value), _NAME.value)
    sys.exit(f"error: interrupted (Ctrl-C): nothing was replaced: {final} is as it was, and "
             "no partly written copy is left")
  print(summary(report, _absolute(_DATA_DIR.value)), flush=True)


if __name__ == "__main__":
  flags.mark_flags_as_required(["src", "name", "data_dir"])
  app.run(main)

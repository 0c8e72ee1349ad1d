"""The prepare job (config.job='prepare'): a folder of image files as a TFDS dataset.

  python -m contrastive_jax.main --config=configs/prepare.py --workdir=/tmp/tfds \
      --config.src=/photos --config.name=photos

The workdir is the TFDS data directory the dataset is written into:
WORKDIR/NAME/1.0.0/ (TFDS's on-disk format in ArrayRecord files, which can be
read at random; data/tfds_folder.py) with its report, prepare_report.json.
Jobs then read it with --config.dataset=NAME --config.data_dir=WORKDIR. src
and the workdir may be gs:// folders; a runner with remote workers needs both
there.

Steps: list src and lay its files out into splits and classes
(data/layout.py); order and cut each split into shards and write them on
Apache Beam (data/prepare_beam.py: the [beam] extra); check that every file
was written or skipped; write TFDS's metadata and the report; rename the
dataset into place (data/tfds_folder.py).

Features: 'image' (uint8 [H, W, 3], stored JPEG or PNG), 'file_name' (the
path relative to src, '/'-separated) and, when the folder has classes,
'label' (ClassLabel, names sorted). Every file is tried; a file Pillow cannot
read or decode, one claiming more than config.max_pixels pixels, one outside
the split folders or outside any class folder, hidden files and folders
(names starting with '.') and links that lead nowhere or back to themselves
are skipped, counted and listed in the report with the reason. Images are
stored with their shorter side at most config.image_size (never upscaled);
smaller ones are listed in the report too: the input pipeline's crops
upscale them (bilinear).

Preparing the same files (the same paths, sizes and modification times; on
gs://, sizes and CRC32C checksums) with the same options again changes
nothing; other files or options under an existing name are refused unless
config.overwrite. The job holds the workdir's lock while it writes (so one
preparation at a time per data directory; files.workdir_lock), builds the
dataset in a temporary folder there and renames it into place: a failure,
Ctrl-C or a full disk ends it in one line with the previous dataset intact
and the temporary folder removed, and the temporary folder of a preparation
that was killed is removed by the next one of the same name. Not a training
loop, so not run by runner.run.
"""

import collections
import contextlib
import json
import logging as std_logging
import os
import re

from absl import logging
import tensorflow as tf
import tensorflow_datasets as tfds

from contrastive_jax.core import files
from contrastive_jax.core import gcs
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import Interrupted
from contrastive_jax.core.errors import JobError
from contrastive_jax.core.errors import NoSpaceError
from contrastive_jax.data import layout
from contrastive_jax.data import tfds_folder

FORMATS = ("jpeg", "png")


def check_config(config):
  """Raises ConfigError for fields that cannot run, before any file is listed."""
  if not config.src:
    raise ConfigError("src", config.src, "a folder of image files, local or gs://")
  if not re.fullmatch(r"[a-z][a-z0-9_]*", config.name or ""):
    raise ConfigError(
      "name",
      config.name,
      "lowercase letters, digits and '_', starting with a letter (a TFDS dataset name)",
    )
  try:
    tfds.builder_cls(config.name)
  except tfds.core.registered.DatasetNotFoundError:
    pass
  else:
    raise ConfigError(
      "name",
      config.name,
      "a name TFDS does not know: it is a registered TFDS dataset, which jobs would read instead",
    )
  for field, value, low in (
    ("image_size", config.image_size, 0),
    ("max_pixels", config.max_pixels, 1),
    ("seed", config.seed, 0),
    ("beam.direct_num_workers", config.beam.direct_num_workers, 0),
  ):
    if value < low:
      raise ConfigError(field, value, f"an integer >= {low}")
  if config.format not in FORMATS:
    raise ConfigError("format", config.format, f"one of {list(FORMATS)}")
  if not 0 < config.holdout_fraction < 1:
    raise ConfigError("holdout_fraction", config.holdout_fraction, "in (0, 1)")


def _import_beam():
  """The prepare_beam module. Raises JobError when Apache Beam is not installed.

  Beam's import logs that BigQuery's clients are missing (apitools,
  bigquery_storage), which no preparation needs: those records are dropped.
  """
  quiet, root = _QuietBeamImport(), std_logging.getLogger()
  filtered = [root] + root.handlers  # The root logger's own records, and its children's.
  for where in filtered:
    where.addFilter(quiet)
  try:
    from contrastive_jax.data import prepare_beam  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    if e.name is None or not e.name.startswith("apache_beam"):
      raise
    raise JobError(
      "the prepare job runs on Apache Beam, which is not installed: pip install "
      "-e '.[beam]' (or pip install apache-beam==2.77.0)"
    ) from None
  finally:
    for where in filtered:
      where.removeFilter(quiet)
  return prepare_beam


class _QuietBeamImport(std_logging.Filter):
  """Drops Beam's INFO records and its warning that apitools (BigQuery's client) is missing."""

  def filter(self, record):
    if record.getMessage().startswith("apitools not found"):
      return False
    return not (record.name.startswith("apache_beam") and record.levelno < std_logging.WARNING)


def run(config, workdir: str) -> dict:
  """Prepares config.src as the TFDS dataset WORKDIR/config.name; returns its report.

  The report (also written to WORKDIR/NAME/1.0.0/prepare_report.json): src,
  name, fingerprint, options, classes ([] when unlabeled), splits {split:
  {'images': n, 'per_class': {class: n} or {}}}, files (the number of entries
  found, hidden ones included), skipped [{'file', 'reason'}],
  smaller_than_image_size [{'file', 'width', 'height'}] and warnings.

  Raises:
    ConfigError: see check_config.
    JobError: src missing or not a folder, a symbolic link loop of folders,
      no Google Cloud credentials for a gs:// path, Apache Beam or the
      runner not installed, no decodable image (in a split), an existing
      dataset of that name from other files or options without
      config.overwrite, another job in the workdir, the pipeline failing
      (e.g. a worker dying; prepare_beam.PipelineError); NoSpaceError for a
      full disk, Interrupted for Ctrl-C. WORKDIR/NAME is unchanged then, and
      no temporary folder is left; a WORKDIR that did not exist before is
      removed (its lock file with it).
  """
  check_config(config)
  data_dir = files.prepare_workdir(workdir)
  src = files.resolve_dir(config.src)
  gcs.check_credentials(src, "config.src")
  prepare_beam = _import_beam()
  runner = prepare_beam.choose_runner(
    config.beam.runner, config.beam.direct_num_workers, config.beam.options, "config.beam.runner"
  )
  if runner.name == "DataflowRunner" and not (
    src.startswith("gs://") and data_dir.startswith("gs://")
  ):
    raise ConfigError(
      "beam.runner",
      config.beam.runner,
      f"a local runner when config.src={src!r} or --workdir={data_dir!r} is "
      "not on gs://: its workers read and write both",
    )
  listed, skipped, stamps = layout.list_source(src, "config.src")
  num_entries = len(listed) + len(skipped)
  if (os.path.realpath(data_dir) + os.sep).startswith(os.path.realpath(src) + os.sep):
    raise JobError(
      f"--workdir={data_dir!r}: is inside config.src={src!r}; choose a folder outside it"
    )
  options = dict(
    image_size=config.image_size,
    format=config.format,
    max_pixels=config.max_pixels,
    holdout_fraction=config.holdout_fraction,
    seed=config.seed,
  )
  digest = layout.fingerprint(listed, stamps, options)
  final = os.path.join(data_dir, config.name)
  previous = _unchanged(final, digest, config)
  if previous:
    return previous

  examples, classes, layout_skipped, warnings = layout.layout(
    listed, holdout_fraction=config.holdout_fraction, seed=config.seed
  )
  skipped += layout_skipped
  if not examples.get("train"):
    raise JobError(
      f"config.src={src!r}: no image to prepare for the train split "
      f"({num_entries} files" + (f"; skipped: {_first(skipped)})" if skipped else ")")
    )
  encoding = prepare_beam.Encoding(config.image_size, config.format, config.max_pixels)

  fresh = not tf.io.gfile.exists(data_dir)
  tf.io.gfile.makedirs(data_dir)
  with files.workdir_lock(data_dir), _removed_if_left_empty(data_dir, fresh):
    previous = _unchanged(final, digest, config)  # Again: a job that held the lock may have.
    if previous:
      return previous
    for folder in tfds_folder.remove_stale(data_dir, config.name):
      logging.info("Removed %s, the temporary folder of a preparation that did not finish.", folder)
    kept = (
      f"the previous {final} is kept as it was"
      if tf.io.gfile.exists(final)
      else f"no {final} was written"
    )
    kept += ", and no partly written copy is left"
    staging = None
    try:
      staging = tfds_folder.Staging(data_dir, config.name)
      counts, failed, small = _write(
        prepare_beam, staging, src, runner, examples, classes, encoding
      )
      skipped += failed
      warnings += [
        f"class {c!r}: no image of it could be decoded (its label is kept)"
        for c in classes
        if not any(counts[split][c] for split in counts)
      ]
      report = dict(
        src=src,
        name=config.name,
        fingerprint=digest,
        options=options,
        classes=classes,
        splits={
          split: dict(images=sum(c.values()), per_class=dict(sorted(c.items())) if classes else {})
          for split, c in counts.items()
        },
        files=num_entries,
        skipped=[dict(file=f, reason=r) for f, r in sorted(skipped)],
        smaller_than_image_size=[dict(file=f, width=w, height=h) for f, w, h in sorted(small)],
        warnings=warnings,
      )
      files.write_atomic(
        os.path.join(staging.dataset, tfds_folder.VERSION, tfds_folder.REPORT),
        json.dumps(report, indent=1),
      )
      staging.replace()
    except prepare_beam.PipelineError as e:
      if e.disk_full:
        raise NoSpaceError(_no_space(config.name, data_dir, kept)) from None
      raise JobError(f"{e}; {kept}") from None
    except KeyboardInterrupt:
      raise Interrupted(f"interrupted (Ctrl-C): {kept}") from None
    except Exception as e:  # pylint: disable=broad-except  (tf.io.gfile's, OSError, ...)
      if not files.is_disk_full(e):
        raise
      raise NoSpaceError(_no_space(config.name, data_dir, kept)) from None
    finally:
      if staging is not None:
        staging.remove()
  _log_summary(report, data_dir)
  return report


@contextlib.contextmanager
def _removed_if_left_empty(data_dir: str, fresh: bool):
  """Removes data_dir when the block fails and it was made for this job (fresh) and holds
  nothing but the workdir lock's file: a refused or interrupted preparation into a new
  folder leaves no folder behind. Done while the lock is held, so no other preparation
  has written there; a folder with anything else in it is kept."""
  try:
    yield
  except BaseException:
    try:
      if fresh and set(tf.io.gfile.listdir(data_dir)) <= {files.LOCK}:
        files.remove_tree(data_dir)
    except Exception as e:  # pylint: disable=broad-except  # The job's own error is the one to report.
      logging.warning("Could not remove %s, made for this preparation: %s", data_dir, e)
    raise


def _no_space(name: str, data_dir: str, kept: str) -> str:
  return (
    f"no space left on device while preparing {name} in {data_dir}: {kept}; free space "
    "and start the same command again"
  )


def _unchanged(final: str, digest: str, config):
  """The report of the dataset in final if it was prepared from the same files and options.

  None when there is none to keep (absent, or config.overwrite with another one).

  Raises:
    JobError: final holds something else and config.overwrite is False.
  """
  previous = tfds_folder.previous_report(final)
  if previous and previous.get("fingerprint") == digest:
    logging.info(
      "%s already holds %s prepared from %s with the same files and options: %s; nothing written.",
      final,
      config.name,
      previous.get("src"),
      _contents(previous),
    )
    return previous
  if not tf.io.gfile.exists(final) or config.overwrite:
    return None
  if previous and tf.io.gfile.glob(os.path.join(final, tfds_folder.VERSION, "*.tfrecord-*")):
    # TFRecord datasets (fingerprinted by file contents, not stamps) are streamed in training.
    raise JobError(
      f"config.name={config.name!r}: {final} already holds a TFRecord dataset "
      f"(from {previous.get('src')}), which training reads as a stream; pass "
      "--config.overwrite=True to prepare it again as ArrayRecord, read in a fresh "
      "order every epoch"
    )
  what = (
    f"a dataset prepared from other files or options (from {previous.get('src')}, see "
    "its prepare_report.json)"
    if previous
    else "something the prepare job did not write"
  )
  raise JobError(
    f"config.name={config.name!r}: {final} already holds {what}; pass "
    "--config.overwrite=True to replace it"
  )


def _write(prepare_beam, staging, src: str, runner, examples: dict, classes, encoding):
  """Writes the dataset in staging.dataset on Beam, but for its report.

  Each shard's list file goes to the staging folder; the pipeline writes the
  shards (prepare_beam.run_pipeline); then this process checks that no file
  was lost and writes TFDS's metadata.

  Returns:
    (counts, failed, small): counts {split: Counter of classes} written;
    failed [(file, reason)] skipped by the workers; small [(file, width,
    height)], images with a shorter side below the image size.
  Raises:
    JobError: lost files, a split without any decoded image;
      prepare_beam.PipelineError, KeyboardInterrupt: see run_pipeline.
  """
  shards = prepare_beam.shard_examples(examples)
  elements = prepare_beam.write_lists(staging, shards)
  prepare_beam.run_pipeline(
    [e for split in sorted(elements) for e in elements[split]],
    runner,
    staging,
    src,
    encoding,
    classes,
  )
  done = {
    split: [prepare_beam.read_done(done_path) for _, _, done_path in elements[split]]
    for split in elements
  }
  _check_written(runner.name, shards, done)
  failed = {split: sorted(tuple(s) for d in done[split] for s in d["skipped"]) for split in done}
  for split in done:
    if not any(d["examples"] for d in done[split]):
      raise JobError(
        f"config.src={src!r}: no image of split {split!r} could be decoded; "
        f"skipped: {_first(failed[split])}"
      )
  feature_dict = tfds_folder.features(encoding.format, classes)
  tfds_folder.write_metadata(
    os.path.join(staging.dataset, tfds_folder.VERSION),
    feature_dict,
    {split: [d["examples"] for d in done[split]] for split in done},
    {split: sum(d["num_bytes"] for d in done[split]) for split in done},
    description=f"Images of {src}, prepared by contrastive_jax's prepare job.",
  )
  counts = {
    split: sum((collections.Counter(d["per_class"]) for d in done[split]), collections.Counter())
    for split in sorted(done)
  }
  small = [tuple(s) for split in done for d in done[split] for s in d["small"]]
  return counts, [s for split in failed for s in failed[split]], small


def _check_written(runner_name: str, shards: dict, done: dict) -> None:
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
      raise JobError(
        f"the Beam pipeline on {runner_name} lost files: split {split!r} has "
        f"{written} examples, but {listed - reported} of its {listed} files "
        "were not reported as skipped; nothing was replaced"
      )


def _first(skipped, n=3) -> str:
  return "; ".join(f"{f}: {reason}" for f, reason in skipped[:n]) + (
    f"; ... ({len(skipped) - n} more)" if len(skipped) > n else ""
  )


def _contents(report: dict) -> str:
  """'train 236, test 60 records, 60 classes' (or 'unlabeled') of a report."""
  order = sorted(
    report["splits"],
    key=lambda s: (
      s not in layout.SPLIT_FOLDERS,
      layout.SPLIT_FOLDERS.index(s) if s in layout.SPLIT_FOLDERS else 0,
      s,
    ),
  )
  splits = ", ".join(f"{s} {report['splits'][s]['images']}" for s in order)
  kind = f"{len(report['classes'])} classes" if report["classes"] else "unlabeled"
  return f"{splits} records, {kind}"


def _log_summary(report: dict, data_dir: str) -> None:
  """Logs what was skipped and why and the warnings, then one line: what was written, where."""
  path = os.path.join(data_dir, report["name"], tfds_folder.VERSION)
  skipped = [(s["file"], s["reason"]) for s in report["skipped"]]
  if skipped:
    logging.warning(
      "Skipped %d of %d files (all listed in %s): %s",
      len(skipped),
      report["files"],
      os.path.join(path, tfds_folder.REPORT),
      _first(skipped),
    )
  if report["smaller_than_image_size"]:
    logging.info(
      "%d images have a shorter side below config.image_size=%d (listed in the "
      "report): stored as they are; training crops upscale them.",
      len(report["smaller_than_image_size"]),
      report["options"]["image_size"],
    )
  for warning in report["warnings"]:
    logging.warning("%s", warning)
  logging.info(
    "Wrote %s to %s: %s; train on it with --config.dataset=%s --config.data_dir=%s",
    report["name"],
    path,
    _contents(report),
    report["name"],
    data_dir,
  )

"""The Apache Beam stage of the prepare job: each shard's files decoded, resized and written.

Imports apache_beam (the [beam] extra), so the prepare job imports this module
only when it prepares a folder: the base install reads prepared datasets
without Beam.

Each element of the pipeline is one shard (shard_examples): the paths of its
list file (JSON lines [file, class], written by write_lists), of the
ArrayRecord file to write and of a small JSON file saying what was written
(examples, per-class counts, skipped files with reasons, images smaller than
image_size). The DoFn decodes and encodes the shard's files and writes both
files itself, so no record travels between workers or through the runner:
only paths do. Writing a shard again (a retried bundle) replaces it whole.

run_pipeline runs it. Beam's local runner with several worker processes runs
in a driver process of its own (this module's main, in a process group of its
own): a terminal's Ctrl-C reaches only the job, which then ends the driver's
group, and a worker that dies (kill -9, the out-of-memory killer) ends the
whole group at once, where Beam's runner would wait for it forever and leave
the other workers running.
"""

import collections
import contextlib
import dataclasses
import hashlib
import importlib
import json
import logging as std_logging
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import uuid

import apache_beam as beam
from array_record.python.array_record_module import ArrayRecordWriter
from PIL import Image
import tensorflow as tf

from contrastive_jax.core import files
from contrastive_jax.core.errors import ImageError
from contrastive_jax.core.errors import JobError
from contrastive_jax.data import images
from contrastive_jax.data import tfds_folder

# Files per shard: the bounds of shard_examples's choice.
MIN_SHARD, MAX_SHARD = 100, 1000
# Runners that import more than Beam's base install when they start: (a module they
# need, what installs it).
_RUNNER_PACKAGES = {
  "DataflowRunner": (
    "apache_beam.runners.dataflow.internal.apiclient",
    "pip install 'apache-beam[gcp]==2.77.0'",
  )
}
_WORKER_EXIT = re.compile(r"Worker subprocess exited with return code (-?\d+)")


@dataclasses.dataclass(frozen=True)
class Encoding:
  """How each image is stored.

  Attributes:
    image_size: the largest stored shorter side in pixels (larger images are
      downscaled keeping the aspect ratio, never upscaled); 0 keeps every size.
    format: 'jpeg' (quality 95) or 'png'.
    max_pixels: files whose header claims more pixels (width x height) are
      skipped before decoding.
  """

  image_size: int
  format: str
  max_pixels: int


@dataclasses.dataclass(frozen=True)
class Runner:
  """The Beam runner a pipeline runs on.

  Attributes:
    name: as Beam names it, e.g. 'FnApiRunner' or 'DataflowRunner'.
    args: Beam's pipeline arguments, command-line style.
    driver: whether the pipeline runs in a driver process of its own (Beam's
      local runner with several worker processes; module docstring).
  """

  name: str
  args: tuple
  driver: bool


def choose_runner(name: str, direct_num_workers: int, options: str, field: str) -> Runner:
  """The Runner of a runner name, DirectRunner's worker count and more options; checked.

  DirectRunner is run as FnApiRunner, the local runner it falls back to:
  Beam 2.77's DirectRunner first tries Prism, a Go binary it downloads from
  GitHub, which ignores direct_num_workers. It runs direct_num_workers worker
  processes (0: one per local core), processes, not threads, since decoding in
  threads of one process would share one interpreter lock; one worker runs in
  this process. options is split as a shell would.

  Raises:
    JobError: a runner Beam does not know, or whose package is not installed
      (naming the fix); the message starts with field=name.
  """
  if name == "DirectRunner":
    workers = direct_num_workers or os.cpu_count()
    mode = "multi_processing" if workers > 1 else "in_memory"
    args = [
      "--runner=FnApiRunner",
      f"--direct_num_workers={workers}",
      f"--direct_running_mode={mode}",
    ]
  else:
    args, workers = [f"--runner={name}"], 1
  args += shlex.split(options)
  view = pipeline_options(args).view_as(beam.options.pipeline_options.StandardOptions)
  chosen = view.runner or "DirectRunner"
  chosen = chosen if chosen.endswith("Runner") else chosen + "Runner"
  try:
    beam.runners.create_runner(chosen)
    if chosen in _RUNNER_PACKAGES:
      importlib.import_module(_RUNNER_PACKAGES[chosen][0])
  except ValueError as e:
    raise JobError(f"{field}={name!r}: {e}") from None
  except ImportError as e:
    fix = _RUNNER_PACKAGES.get(chosen, (None, "install the runner's package"))[1]
    raise JobError(f"{field}={name!r}: cannot start ({_lines(e)[-1]}); {fix}") from None
  return Runner(chosen, tuple(args), driver=chosen == "FnApiRunner" and workers > 1)


def pipeline_options(args):
  """beam PipelineOptions of command-line style args, e.g. ['--runner=DataflowRunner']."""
  return beam.options.pipeline_options.PipelineOptions(list(args))


def shard_examples(examples: dict) -> dict:
  """{split: [(file, class)]} -> {split: shards, each [(file, class)]}, in the stored order.

  A split's files are ordered by a hash of their path (blake2b), not by class:
  evaluation on several hosts and tfds.even_splits read contiguous parts, which
  must each hold every class. They are then cut into contiguous shards of
  equal size (+-1). Files per shard: one 64th of all files, but at least
  MIN_SHARD (few shard files for small folders) and at most MAX_SHARD (one
  shard is a few seconds of one worker's work, about 30 MB at 256 px). Both
  depend on the files only, so the dataset is the same for any number of
  workers; at least 64 equal shards from 6,400 files on divide evenly among a
  few workers.
  """
  total = sum(len(split_examples) for split_examples in examples.values())
  per_shard = min(max(-(-total // 64), MIN_SHARD), MAX_SHARD)
  sharded = {}
  for split, split_examples in sorted(examples.items()):
    ordered = sorted(
      split_examples, key=lambda example: hashlib.blake2b(example[0].encode()).digest()
    )
    n = len(ordered)
    num_shards = -(-n // per_shard)
    sharded[split] = [
      ordered[i * n // num_shards : (i + 1) * n // num_shards] for i in range(num_shards)
    ]
  return sharded


def write_lists(staging: tfds_folder.Staging, shards: dict) -> dict:
  """Writes each shard's list file in the staging folder; returns the pipeline's elements.

  Returns:
    {split: [(list file, records file, done file)]}, in shard order: the
    records file in the dataset's VERSION folder under TFDS's name, the other
    two in staging.path/shards.
  """
  scratch = _scratch(staging)
  version = os.path.join(staging.dataset, tfds_folder.VERSION)
  for folder in (scratch, version):
    tf.io.gfile.makedirs(folder)
  elements = {}
  for split, split_shards in shards.items():
    elements[split] = []
    for i, shard in enumerate(split_shards):
      stem = os.path.join(scratch, f"{split}-{i:05d}")
      element = (
        f"{stem}.files.jsonl",
        os.path.join(version, tfds_folder.records_name(staging.name, split, i, len(split_shards))),
        f"{stem}.done.json",
      )
      with tf.io.gfile.GFile(element[0], "w") as f:
        f.write("".join(json.dumps(example) + "\n" for example in shard))
      elements[split].append(element)
  return elements


def _scratch(staging: tfds_folder.Staging) -> str:
  """The folder of the shards' list and done files and of records being written."""
  return os.path.join(staging.path, "shards")


def read_done(path: str):
  """A shard's done file (WriteShard), or None when it was not written."""
  try:
    with tf.io.gfile.GFile(path) as f:
      return json.load(f)
  except tf.errors.NotFoundError:
    return None


def read_image(path: str, *, max_pixels: int, shorter_side: int | None):
  """images.load_image of a local or gs:// path; uint8 [H, W, 3].

  Raises:
    ImageError: the file cannot be read or decoded (images.load_image).
  """
  if not path.startswith("gs://"):
    return images.load_image(path, max_pixels=max_pixels, shorter_side=shorter_side)
  try:
    with tf.io.gfile.GFile(path, "rb") as f:
      return images.load_image(f, max_pixels=max_pixels, shorter_side=shorter_side)
  except tf.errors.OpError as e:
    raise ImageError(path, f"cannot be read ({e.message})") from None


def write_atomically(path: str, scratch: str, write) -> None:
  """Calls write(local_path), then puts that file at path (local or gs://) in one step.

  For writers that need a local path (ArrayRecordWriter); content held in
  memory goes through core.files.write_atomic.

  Locally the file is written in scratch (a folder on path's file system) and
  renamed over path; for gs:// it is written to a local temporary file and
  copied (an object appears whole on GCS). So path is either absent, as it
  was, or complete, and writing it twice leaves the second copy.
  """
  if path.startswith("gs://"):
    fd, local = tempfile.mkstemp(suffix=".part")
    os.close(fd)
    try:
      write(local)
      tf.io.gfile.copy(local, path, overwrite=True)
    finally:
      os.remove(local)
    return
  part = os.path.join(scratch, f"{uuid.uuid4().hex}.part")
  try:
    write(part)
    os.replace(part, path)
  finally:
    if os.path.exists(part):
      os.remove(part)


def _write_records(path: str, records) -> None:
  # group_size:1, as TFDS's own ArrayRecord writer: each record can be read alone.
  writer = ArrayRecordWriter(path, "group_size:1")
  try:
    for record in records:
      writer.write(record)
  finally:
    writer.close()


def read_list(path: str):
  """The [file, class] pairs of a shard's list file (JSON lines), local or gs://."""
  with tf.io.gfile.GFile(path) as f:
    return [json.loads(line) for line in f]


class WriteShard(beam.DoFn):
  """A shard (list, records, done paths) -> its ArrayRecord file and done file.

  Each file of the list, in order, becomes one record: TFDS's serialization
  (features.serialize_example) of {'image': uint8 [H, W, 3], 'file_name':
  file} and, when labelled, 'label': the class name. A file read_image
  cannot read is skipped (listed in the done file with the reason); any other
  exception fails the pipeline. The done file (JSON) is written after the
  records, so it exists only for a complete shard: {'examples': n,
  'num_bytes': size of the records file, 'per_class': {class: n},
  'skipped': [[file, reason]], 'small': [[file, width, height]]}.
  """

  def __init__(self, src: str, scratch: str, encoding: Encoding, classes):
    super().__init__()
    self._src, self._scratch, self._encoding = src, scratch, encoding
    self._features = tfds_folder.features(encoding.format, classes)

  def setup(self):
    # encoding.max_pixels is the limit (images.open_image checks it), in every worker.
    Image.MAX_IMAGE_PIXELS = None

  def _records(self, pairs, done: dict):
    labelled = "label" in self._features
    size = self._encoding.image_size
    for rel, name in pairs:
      try:
        image = read_image(
          f"{self._src}/{rel}", max_pixels=self._encoding.max_pixels, shorter_side=size or None
        )
      except ImageError as e:
        done["skipped"].append([rel, e.reason])
        continue
      if size and min(image.shape[:2]) < size:
        done["small"].append([rel, image.shape[1], image.shape[0]])
      example = {"image": image, "file_name": rel}
      if labelled:
        example["label"] = name
      done["examples"] += 1
      done["per_class"][name] += 1
      yield self._features.serialize_example(example)

  def process(self, element):
    list_path, records_path, done_path = element
    done = dict(examples=0, per_class=collections.Counter(), skipped=[], small=[])
    pairs = read_list(list_path)
    write_atomically(
      records_path, self._scratch, lambda path: _write_records(path, self._records(pairs, done))
    )
    done["num_bytes"] = tf.io.gfile.stat(records_path).length
    files.write_atomic(done_path, json.dumps(done))
    yield done_path


def write_shards(elements, options, write_shard: WriteShard) -> None:
  """Runs the pipeline of options over elements [(list, records, done paths)]; waits for it.

  Create redistributes the shards among the workers (it reshuffles more than
  one element); each is written by write_shard. Raises what the runner raises.
  """
  with beam.Pipeline(options=options) as pipeline:
    _ = pipeline | "Shards" >> beam.Create(list(elements)) | "Write" >> beam.ParDo(write_shard)


class PipelineError(JobError):
  """The pipeline failed; the message is one line naming the runner and the cause.

  Attributes:
    disk_full: the cause is a full disk (files.is_disk_full).
  """

  def __init__(self, message: str, disk_full: bool = False):
    self.disk_full = disk_full
    super().__init__(message)


def _lines(error: BaseException) -> list:
  return [line.strip() for line in str(error).splitlines() if line.strip()] or [
    type(error).__name__
  ]


def _failure(runner_name: str, error: BaseException) -> dict:
  """What a failed pipeline reports: {'error': one line, 'disk_full', 'ctrl_c'}.

  Beam re-raises a worker's exception as a RuntimeError whose message is the
  worker's traceback flattened; a full disk and Ctrl-C are told apart by the
  messages of the chain (files.is_disk_full, _is_ctrl_c), anything else by
  its first line.
  """
  if files.is_disk_full(error):
    return dict(
      error=f"the Beam pipeline on {runner_name} found no space left on device",
      disk_full=True,
      ctrl_c=False,
    )
  lines = _lines(error)
  if lines[0].endswith(":"):  # A heading with its items below, e.g. Dataflow's missing options.
    lines = [" ".join(lines)[:1000]]
  return dict(
    error=f"the Beam pipeline failed on {runner_name}: {type(error).__name__}: {lines[0]}",
    disk_full=False,
    ctrl_c=_is_ctrl_c(error),
  )


def _is_ctrl_c(error: BaseException) -> bool:
  """Whether error is, or was raised for, a KeyboardInterrupt (Beam wraps them)."""
  while error is not None:
    if isinstance(error, KeyboardInterrupt) or str(error).startswith("KeyboardInterrupt"):
      return True
    error = error.__cause__ or error.__context__
  return False


class _QuietBeam(std_logging.Filter):
  """Drops Beam's records below WARNING, and the tracebacks of the failures it then raises."""

  def filter(self, record):
    if not record.name.startswith("apache_beam"):
      return True
    return record.levelno >= std_logging.WARNING and not record.exc_info


@contextlib.contextmanager
def _quiet_beam_logs():
  """Keeps Beam's progress lines and its logged tracebacks off the console for the block.

  The failure they report is raised and said in one line by run_pipeline's caller.
  The filter is on every handler of the root logger (absl's, under main.py), where
  Beam's records end.
  """
  handlers, quiet = list(std_logging.getLogger().handlers), _QuietBeam()
  for handler in handlers:
    handler.addFilter(quiet)
  try:
    yield
  finally:
    for handler in handlers:
      handler.removeFilter(quiet)


def run_pipeline(
  elements, runner_spec: Runner, staging: tfds_folder.Staging, src: str, encoding: Encoding, classes
) -> None:
  """Writes the shards of elements [(list, records, done paths)] on runner_spec's runner.

  In this process, or in a driver process (runner_spec.driver; module
  docstring) that holds staging.owner (tfds_folder.hold) and is gone, with
  all its workers, when this returns or raises.

  Raises:
    PipelineError: the pipeline failed: a DoFn raised, a worker process died,
      the disk is full (its disk_full set).
    KeyboardInterrupt: Ctrl-C.
  """
  if runner_spec.driver:
    result = _run_driver(
      dict(
        elements=list(elements),
        args=list(runner_spec.args),
        src=src,
        scratch=_scratch(staging),
        encoding=dataclasses.asdict(encoding),
        classes=list(classes),
        runner=runner_spec.name,
        hold=None if staging.owner.startswith("gs://") else staging.owner,
      )
    )
  else:
    try:
      with _quiet_beam_logs():
        write_shards(
          elements,
          pipeline_options(runner_spec.args),
          WriteShard(src, _scratch(staging), encoding, classes),
        )
      return
    except Exception as e:  # pylint: disable=broad-except  (any runner's, any failure)
      result = _failure(runner_spec.name, e)
  if result.get("ctrl_c"):
    raise KeyboardInterrupt
  if "error" in result:
    raise PipelineError(result["error"], result.get("disk_full", False))


def _run_driver(spec: dict) -> dict:
  """Runs main() of this module in a new session with spec; returns what it reported.

  The driver reads spec from its stdin, and ends its process group (itself
  and its workers) when its stdin closes: when this process ends in any way.
  It writes its result (a JSON line) to a pipe of its own; its and its
  workers' output (Beam's and TensorFlow's logs) go to another, of which the
  last lines are kept to explain a driver that reported nothing. Whatever
  happens, the driver's process group is killed before this returns.
  """
  result_read, result_write = os.pipe()
  # The driver and its workers import this very package, wherever it is installed.
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  path = os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
  proc = subprocess.Popen(  # pylint: disable=consider-using-with
    [sys.executable, "-m", __name__, str(result_write)],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    pass_fds=(result_write,),
    start_new_session=True,
    env=dict(os.environ, PYTHONPATH=path),
  )
  os.close(result_write)
  tail = collections.deque(maxlen=20)
  reader = threading.Thread(target=lambda: tail.extend(proc.stdout), daemon=True)
  reader.start()
  try:
    proc.stdin.write((json.dumps(spec) + "\n").encode())
    proc.stdin.flush()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # Still a zombie: its group stays.
  finally:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join()
    proc.stdin.close()
    proc.stdout.close()
    with os.fdopen(result_read) as f:
      reported = f.read()
  if reported.strip():
    return json.loads(reported)
  last = next(
    (line.decode(errors="replace").strip() for line in reversed(tail) if line.strip()), "no output"
  )
  return dict(
    error=f"the Beam pipeline's driver process exited with status {proc.returncode} "
    f"before reporting ({last})"
  )


def _worker_exit(code: int) -> str:
  """What a worker's exit status (shell style: 128 + N for signal N) says, in words."""
  number = -code if code < 0 else code - 128 if code > 128 else None
  if number is None:
    return f"exited with status {code}"
  name = signal.Signals(number).name if number in signal.valid_signals() else "?"
  cause = " (kill -9, or the system ran out of memory)" if number == signal.SIGKILL else ""
  return f"was killed by signal {number}, {name}{cause}"


def _end_group(report, result: dict):
  """Reports result and kills this driver's process group: itself and every worker.

  The report is lost when the job that reads it is gone (a broken pipe).
  """
  with contextlib.suppress(OSError):
    report(result)
  os.killpg(0, signal.SIGKILL)


def main(argv) -> None:
  """The driver (module docstring): argv [_, result fd]; the spec on stdin (run_pipeline)."""
  out = os.fdopen(int(argv[1]), "w")

  def report(result):
    out.write(json.dumps(result) + "\n")
    out.flush()

  spec = json.loads(sys.stdin.readline())
  name = spec["runner"]
  # Open, so locked, until this process ends: the staging folder is in use (tfds_folder.hold).
  held = tfds_folder.hold(spec["hold"]) if spec["hold"] else None  # noqa: F841

  def orphaned():
    sys.stdin.read()  # EOF: the job that started this driver is gone.
    _end_group(report, dict(error="the job that started the Beam driver ended"))

  def worker_failed(hook):
    exit_code = _WORKER_EXIT.search(str(hook.exc_value))
    if hook.thread is not None and hook.thread.name == "run_worker" and exit_code:
      _end_group(
        report,
        dict(
          error=f"the Beam pipeline failed on {name}: a worker process "
          f"{_worker_exit(int(exit_code[1]))}"
        ),
      )
    threading.__excepthook__(hook)

  threading.Thread(target=orphaned, daemon=True).start()
  threading.excepthook = worker_failed
  try:
    write_shards(
      [tuple(e) for e in spec["elements"]],
      pipeline_options(spec["args"]),
      WriteShard(spec["src"], spec["scratch"], Encoding(**spec["encoding"]), spec["classes"]),
    )
  except BaseException as e:  # pylint: disable=broad-except
    _end_group(report, _failure(name, e))
  report({})


if __name__ == "__main__":
  main(sys.argv)

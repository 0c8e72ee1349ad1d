"""The Apache Beam stage of prepare_images: each shard's files decoded, resized and written.

Imports apache_beam (the [beam] extra), so prepare_images imports this module
only when it prepares a folder: the base install reads prepared datasets
without Beam.

Each element of the pipeline is one shard: the paths of its list file (JSON
lines [file, class], written by prepare_images), of the ArrayRecord file to
write and of a small JSON file saying what was written (examples, per-class
counts, skipped files with reasons, images smaller than --image_size). The
DoFn decodes and encodes the shard's files and writes both files itself, so
no record travels between workers or through the runner: only paths do.
Writing a shard again (a retried bundle) replaces it whole.
"""
import collections
import json
import os
import tempfile
import uuid

import apache_beam as beam
from array_record.python.array_record_module import ArrayRecordWriter
from PIL import Image
import tensorflow as tf

from contrastive_jax.core import files
from contrastive_jax.core.errors import ImageError
from contrastive_jax.data import images


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

  def __init__(self, src: str, scratch: str, features, *, max_pixels: int, image_size: int):
    super().__init__()
    self._src, self._scratch, self._features = src, scratch, features
    self._max_pixels, self._image_size = max_pixels, image_size

  def setup(self):
    # --max_pixels is the limit (images.open_image checks it); main() sets this in its own
    # process only, and workers may be other processes.
    Image.MAX_IMAGE_PIXELS = None

  def _records(self, pairs, done: dict):
    labelled = "label" in self._features
    for rel, name in pairs:
      try:
        image = read_image(f"{self._src}/{rel}", max_pixels=self._max_pixels,
                           shorter_side=self._image_size or None)
      except ImageError as e:
        done["skipped"].append([rel, e.reason])
        continue
      if self._image_size and min(image.shape[:2]) < self._image_size:
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
    write_atomically(records_path, self._scratch,
                     lambda path: _write_records(path, self._records(pairs, done)))
    done["num_bytes"] = tf.io.gfile.stat(records_path).length
    files.write_atomic(done_path, json.dumps(done))
    yield done_path


def write_shards(shards, options, write_shard: WriteShard) -> None:
  """Runs the pipeline of options over shards [(list, records, done paths)]; waits for it.

  Create redistributes the shards among the workers (it reshuffles more than
  one element); each is written by write_shard. Raises what the runner raises.
  """
  with beam.Pipeline(options=options) as pipeline:
    _ = (pipeline
         | "Shards" >> beam.Create(list(shards))
         | "Write" >> beam.ParDo(write_shard))


def pipeline_options(args):
  """beam PipelineOptions of command-line style args, e.g. ['--runner=DataflowRunner']."""
  return beam.options.pipeline_options.PipelineOptions(list(args))


def runner_name(options) -> str:
  """The runner options select, as Beam names it ('Dataflow' is 'DataflowRunner')."""
  name = options.view_as(beam.options.pipeline_options.StandardOptions).runner or "DirectRunner"
  return name if name.endswith("Runner") else name + "Runner"


def create_runner(name: str):
  """Beam's runner of that name. Raises ValueError for a name Beam does not know."""
  return beam.runners.create_runner(name)

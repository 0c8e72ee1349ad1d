"""The Apache Beam stage of prepare_images: decoding and resizing image files in parallel.

Imports apache_beam (the [beam] extra), so prepare_images imports this module
only when it prepares a folder: the base install reads prepared datasets
without Beam.

Each split is one PTransform, given to TFDS's store_as_tfds_dataset, which
applies it to its pipeline and writes its (key, example) output (key: the
file's path relative to --src, so the written order is the same on any number
of workers). Files that fail, and images smaller than --image_size, leave the
DoFn on tagged outputs, written as JSON lines to text files that prepare_images
reads after the pipeline.
"""
import json

import apache_beam as beam
from PIL import Image
import tensorflow as tf

from contrastive_jax.core.errors import ImageError
from contrastive_jax.data import images

SKIPPED = "skipped"  # Tagged output: [file, reason].
SMALL = "small"  # Tagged output: [file, width, height].


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


class DecodeImage(beam.DoFn):
  """(file, class) -> (file, example) of TFDS's features; failures to tagged outputs.

  The example is {'image': uint8 [H, W, 3], 'file_name': file} and, when
  labelled, 'label': the class name. An ImageError is a skip ([file, reason]
  on SKIPPED); any other exception fails the pipeline.
  """

  def __init__(self, src: str, *, labelled: bool, max_pixels: int, image_size: int):
    super().__init__()
    self._src, self._labelled = src, labelled
    self._max_pixels, self._image_size = max_pixels, image_size

  def setup(self):
    # --max_pixels is the limit (images.open_image checks it); main() sets this in its own
    # process only, and workers may be other processes.
    Image.MAX_IMAGE_PIXELS = None

  def process(self, element):
    rel, name = element
    try:
      image = read_image(f"{self._src}/{rel}", max_pixels=self._max_pixels,
                         shorter_side=self._image_size or None)
    except ImageError as e:
      yield beam.pvalue.TaggedOutput(SKIPPED, json.dumps([rel, e.reason]))
      return
    if self._image_size and min(image.shape[:2]) < self._image_size:
      yield beam.pvalue.TaggedOutput(SMALL, json.dumps([rel, image.shape[1], image.shape[0]]))
    example = {"image": image, "file_name": rel}
    if self._labelled:
      example["label"] = name
    yield rel, example


def read_list(path: str):
  """Yields the [file, class] pairs of a list file (JSON lines)."""
  with tf.io.gfile.GFile(path) as f:
    for line in f:
      yield json.loads(line)


class PrepareSplit(beam.PTransform):
  """Pipeline -> PCollection of a split's (file, example); writes its skipped and small files.

  Reads the split's file lists (JSON lines [file, class] in list files of a
  few thousand lines: files, not an in-memory list, so that millions of files
  do not go into the pipeline's graph; read whole by a plain FlatMap rather than
  split between workers by ReadFromText), redistributes the pairs (Reshuffle: otherwise
  each list's files are decoded by the worker that read it) and decodes them
  with DecodeImage. The SKIPPED and SMALL outputs go to text files
  OUT_PREFIX.skipped-*.jsonl and OUT_PREFIX.small-*.jsonl.
  """

  def __init__(self, list_files, out_prefix: str, decode: DecodeImage):
    super().__init__()
    self._list_files, self._out_prefix, self._decode = list(list_files), out_prefix, decode

  def expand(self, pipeline):
    outputs = (pipeline
               | "Lists" >> beam.Create(self._list_files)
               | "Read" >> beam.FlatMap(read_list)
               | "Redistribute" >> beam.Reshuffle()
               | "Decode" >> beam.ParDo(self._decode).with_outputs(SKIPPED, SMALL,
                                                                  main="examples"))
    for tag in (SKIPPED, SMALL):
      _ = outputs[tag] | f"Write_{tag}" >> beam.io.WriteToText(
          f"{self._out_prefix}.{tag}", file_name_suffix=".jsonl")
    return outputs.examples


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

"""Writes CIFAR-10 (or another TFDS dataset of equal-size images) as an .npz that reads without TF.

  python benchmarks/make_device_data.py --data_dir=../shared/tensorflow_datasets \\
      --out=/tmp/cifar10.npz --splits=train --encoding=encoded

--encoding=encoded stores the image files exactly as TFDS stores them
(device_data.save_encoded_npz); reading needs numpy and PIL, and PIL's decode of a
JPEG may differ from TensorFlow's. --encoding=raw stores the decoded uint8 arrays
with zlib (device_data.save_npz): numpy only and the exact pixels, but about three
times the size. Prints the file's size and the time device_data.load_npz takes to
read each split back.

Measured on the shared CIFAR-10 copy, whose files are JPEGs (about 900 bytes an
image; TFDS's own cifar10 stores PNGs), first 5,000 training images: decoded uint8
15.4 MB, zlib-9 14.3 MB, lzma-6 11.8 MB, lzma-6 of planar 2-D deltas 9.2 MB (the
best lossless form of the decoded pixels tried: about 92 MB for the train split,
beyond a 64 MiB budget), WebP lossless 8.1 MB, the stored JPEG files 4.6 MB. Whole
splits, encoded: train and test 53.4 MiB, train alone about 44.5 MiB; PIL decodes
the 50,000 training images in about 25 s on a loaded 2-core machine, within 4 grey
levels of TensorFlow's decode (about 1 on average: not TF's pixels).
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from contrastive_jax.core import runtime

if __name__ == "__main__":
  runtime.setup()  # Every process setting first, before the imports below (core/runtime.py).

from absl import app
from absl import flags
import numpy as np
import tensorflow_datasets as tfds

from contrastive_jax.data import device_data

FLAGS = flags.FLAGS


def define_flags():
  """The script's flags (not defined at import, so tests can load the module)."""
  flags.DEFINE_string("dataset", "cifar10", "TFDS dataset name")
  flags.DEFINE_string("data_dir", None, "TFDS data_dir (default: TFDS_DATA_DIR)")
  flags.DEFINE_string("out", "/tmp/cifar10.npz", "the .npz to write")
  flags.DEFINE_list("splits", ["train", "test"], "the splits to store")
  flags.DEFINE_enum(
    "encoding", "encoded", ["encoded", "raw"], "image files as stored, or decoded uint8 + zlib"
  )


def read(dataset: str, data_dir, split: str, encoded: bool):
  """(images, labels) of split in TFDS's order: its files' bytes [N] if encoded, else uint8
  arrays [N, H, W, 3] (TensorFlow's decode); labels int32 [N]."""
  builder = tfds.builder(dataset, data_dir=data_dir)
  ds = builder.as_dataset(
    split=split,
    shuffle_files=False,
    decoders={"image": tfds.decode.SkipDecoding()} if encoded else None,
  )
  images, labels = [], []
  for example in tfds.as_numpy(ds):
    images.append(example["image"])
    labels.append(example["label"])
  return (images if encoded else np.stack(images)), np.asarray(labels, np.int32)


def main(argv):
  del argv
  encoded = FLAGS.encoding == "encoded"
  splits = {s: read(FLAGS.dataset, FLAGS.data_dir, s, encoded) for s in FLAGS.splits}
  (device_data.save_encoded_npz if encoded else device_data.save_npz)(FLAGS.out, splits)
  print(f"{FLAGS.out}: {os.path.getsize(FLAGS.out) / 2**20:.1f} MiB ({FLAGS.encoding})")
  for split in FLAGS.splits:
    start = time.time()
    images, labels = device_data.load_npz(FLAGS.out, split)
    print(
      f"  {split}: {images.shape} {images.dtype}, {len(labels)} labels, "
      f"read back in {time.time() - start:.1f} s"
    )


if __name__ == "__main__":
  define_flags()
  app.run(main)

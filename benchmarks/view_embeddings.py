"""Embeddings of many random views of each image of a dataset: real-image rows at catalogue scale.

  python benchmarks/view_embeddings.py --config.pretrain_workdir=/tmp/simclr_runlocal \
      --config.dataset=cifar10 --config.split=train+test --views=17 --out=/tmp/cifar10_views.npz
      # CIFAR-10's 60,000 images x 17 = 1,020,000 rows
  python benchmarks/ann.py --views_file=/tmp/cifar10_views.npz --queries=1000

A catalogue holds several photos of most products: other crops, mirrored, at other
sizes. Each row here is one such photo of one image of the embed config's dataset and
split (configs/embed.py with its --config overrides, read as the embed job reads them;
images of one size): a window of --area_min to 1 of its area drawn by torchvision's
sampler, resized to the encoder's input and mirrored with probability 1/2 (on the
device, data/device_samplers.one_view, keys from --seed), embedded as the embed job embeds
(restore.embed_model: the encoder's L2-normalised h). ann.py's --views_file holds out
every view of --queries images and searches one view of each, as a new product's photo.

Writes --out (numpy's npz): 'embeddings' float32 [N x V, D] and 'image' int32 [N x V],
the image (its index in the split's read order) each row is a view of; rows view-major.
"""

import os
import sys
import time

# Run the package this script sits in, not another installed copy of it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from contrastive_jax.core import runtime

if __name__ == "__main__":
  runtime.setup()  # Every process setting first, before the imports below (core/runtime.py).

from absl import app
from absl import flags
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.data import crop_spec
from contrastive_jax.data import device_data
from contrastive_jax.data import device_samplers
from contrastive_jax.data import sources
from contrastive_jax.training import restore

FLAGS = flags.FLAGS


def define_flags():
  """Registers the command-line flags (not at import, so that tests can import this file)."""
  config_flags.DEFINE_config_file(
    "config",
    os.path.join(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "embed.py"
    ),
    "The embed job's config.",
  )
  flags.DEFINE_string("out", None, "The npz file written.", required=True)
  flags.DEFINE_integer("views", 17, "Views of each image.")
  flags.DEFINE_float("area_min", 0.4, "Smallest window, a fraction of the image's area.")
  flags.DEFINE_integer("batch", 1000, "Views embedded per call.")
  flags.DEFINE_integer("seed", 0, "Seed of the views' windows and mirrors.")


def views_fn(size: int, resize: str, area_min: float, seed: int):
  """(images uint8 [B, H, W, 3], positions int32 [B], view int32) -> uint8 [B, size, size, 3]:
  view `view` of each image, its key from (seed, its position, view)."""
  crop = crop_spec.CropSpec("torchvision", area_min, resize)

  def one(image, position, view):
    key = device_samplers.view_key(seed, position, view)
    return device_samplers.one_view(image, key, size, crop, (area_min, 1.0))

  return jax.jit(jax.vmap(one, in_axes=(0, 0, None)))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = FLAGS.config
  if not config.dataset:
    raise app.UsageError("--config.dataset: must name a dataset of images of one size (cifar10)")
  model = restore.embed_model(config, mesh_lib.make_mesh())
  source = sources.get_source(config, {"split": config.split})
  images, _ = device_data.read_split(source, config.split)
  make_views = views_fn(model.eval_crop.size, model.eval_crop.resize, FLAGS.area_min, FLAGS.seed)
  start, rows = time.perf_counter(), []
  for view in range(FLAGS.views):
    for first in range(0, len(images), FLAGS.batch):
      batch = jnp.asarray(images[first : first + FLAGS.batch])
      positions = jnp.arange(first, first + len(batch), dtype=jnp.int32)
      rows.append(np.asarray(model.embed(make_views(batch, positions, view))))
    print(f"view {view + 1} of {FLAGS.views}: {time.perf_counter() - start:.0f} s", flush=True)
  embeddings = np.concatenate(rows)
  image = np.tile(np.arange(len(images), dtype=np.int32), FLAGS.views)
  np.savez(FLAGS.out, embeddings=embeddings, image=image)
  print(
    f"wrote {embeddings.shape[0]} x {embeddings.shape[1]} rows of {len(images)} images "
    f"to {FLAGS.out}"
  )


if __name__ == "__main__":
  define_flags()
  app.run(main)

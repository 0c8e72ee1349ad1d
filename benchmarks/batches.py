"""The fixed random batch the step benchmarks time, TensorFlow-free (device.py imports it)."""

import jax
import numpy as np

from contrastive_jax.core import mesh as mesh_lib


def random_batch(config, mesh, num_views: int = 2):
  """A fixed uint8 batch [B, num_views, S, S, 3] with zero labels, and with DINO's
  config.local_crops its local views [B, N, s, s, 3], sharded as the jobs shard."""
  rng, size, b = np.random.default_rng(0), config.image_size, config.batch_size
  batch = {
    "image": rng.integers(0, 256, (b, num_views, size, size, 3), np.uint8),
    "label": np.zeros(b, np.int32),
  }
  local = config.get("local_crops")
  if local:
    shape = (b, local.number, local.size, local.size, 3)
    batch["local_image"] = rng.integers(0, 256, shape, np.uint8)
  return jax.device_put(batch, mesh_lib.batch_sharded(mesh))

"""Times convolutions forward and backward as XLA lowers them, as patches times kernel and
as models/conv.py runs them.

  python benchmarks/conv_lowering.py

For each shape of the ResNets' CIFAR-sized runs (batch 512 = 256 images x 2 views),
the seconds of one jitted gradient of sum(conv(x, w)^2) with respect to x and w (w
alone for the stems, whose input x, 3 channels of images, takes no gradient in training):
lax.conv_general_dilated against models/conv.py's patches_conv, their ratio, which
lowering models/conv.py's rules pick on the CPU (uses_matrix, whose lowering is
matrix_conv; uses_patches; uses_space_to_depth, whose forward is space_to_depth_conv and
gradients XLA's) and the time of that pick
(conv.conv_general_dilated). Prints a table.
"""

import os
import sys
import time

# Time the package this script sits in, not another installed copy of it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from contrastive_jax.core import runtime

if __name__ == "__main__":
  runtime.setup()  # Every process setting first, before the imports below (core/runtime.py).

import jax  # pylint: disable=g-import-not-at-top
from jax import lax
import jax.numpy as jnp
import numpy as np

from contrastive_jax.models import conv

# (batch, map side, channels in, channels out, kernel, stride, padding).
SHAPES = (
  (512, 32, 3, 16, 7, 2, ((3, 3), (3, 3))),  # runlocal's ImageNet stem at width 0.25.
  (512, 32, 3, 64, 7, 2, ((3, 3), (3, 3))),  # The ImageNet stem at full width.
  (512, 8, 16, 16, 3, 1, "SAME"),
  (512, 8, 16, 32, 3, 2, ((1, 1), (1, 1))),
  (512, 8, 16, 32, 1, 2, ((0, 0), (0, 0))),
  (512, 4, 32, 32, 3, 1, "SAME"),
  (512, 4, 32, 64, 3, 2, ((1, 1), (1, 1))),
  (512, 4, 32, 64, 1, 2, ((0, 0), (0, 0))),
  (512, 2, 64, 64, 3, 1, "SAME"),
  (512, 2, 64, 128, 3, 2, ((1, 1), (1, 1))),
  (512, 2, 64, 128, 1, 2, ((0, 0), (0, 0))),
  (512, 1, 128, 128, 3, 1, "SAME"),
  (512, 32, 3, 64, 3, 1, "SAME"),  # The CIFAR stem at full width.
  (512, 32, 64, 64, 3, 1, "SAME"),
  (512, 32, 64, 128, 3, 2, ((1, 1), (1, 1))),
  (512, 16, 128, 128, 3, 1, "SAME"),
  (512, 16, 128, 256, 3, 2, ((1, 1), (1, 1))),
  (512, 32, 64, 128, 1, 2, ((0, 0), (0, 0))),
  (512, 16, 128, 256, 1, 2, ((0, 0), (0, 0))),
  (512, 8, 64, 128, 3, 2, ((1, 1), (1, 1))),  # Width 1 on 32 px from the ImageNet stem.
  (512, 8, 128, 256, 3, 2, ((1, 1), (1, 1))),
  (512, 8, 256, 256, 3, 1, "SAME"),
  (512, 8, 256, 512, 3, 2, ((1, 1), (1, 1))),
  (512, 8, 256, 512, 1, 2, ((0, 0), (0, 0))),
  (512, 4, 512, 512, 3, 1, "SAME"),
)


def _xla(x, w, stride, padding):
  return lax.conv_general_dilated(x, w, (stride, stride), padding, dimension_numbers=conv.NHWC)


def _patches(x, w, stride, padding):
  return conv.patches_conv(x, w, (stride, stride), padding)


def _picked(x, w, stride, padding):
  return conv.conv_general_dilated(x, w, (stride, stride), padding, dimension_numbers=conv.NHWC)


def pick(x, w, stride) -> str:
  """The lowering models/conv.py's rules pick for this convolution on the CPU."""
  if conv.uses_matrix(x.shape, w.shape):
    return "matrix"
  if conv.uses_space_to_depth(w.shape, (stride, stride)):
    return "space-to-depth forward"
  return "patches" if conv.uses_patches(x.shape, w.shape, (stride, stride)) else "XLA"


def seconds(fn, x, w, stride, padding, repeats=5):
  """The fastest of `repeats` calls of the jitted gradient, after one compiling call."""
  argnums = (1,) if x.shape[-1] == 3 else (0, 1)  # A stem's images take no gradient.
  grad = jax.jit(
    jax.grad(lambda x, w: jnp.sum(jnp.square(fn(x, w, stride, padding))), argnums=argnums)
  )
  jax.block_until_ready(grad(x, w))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(grad(x, w))
    best = min(best, time.perf_counter() - start)
  return best


def main():
  rng = np.random.default_rng(0)
  flags = os.environ.get("XLA_FLAGS", "")
  print(f"JAX {jax.__version__}, {jax.devices()[0].device_kind}, XLA_FLAGS={flags!r}")
  print("| input | kernel | XLA (ms) | patches (ms) | XLA / patches | rules pick | picked (ms) |")
  print("|---|---|---|---|---|---|---|")
  for batch, side, cin, cout, kernel, stride, padding in SHAPES:
    x = jnp.asarray(rng.standard_normal((batch, side, side, cin), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((kernel, kernel, cin, cout), dtype=np.float32) * 0.1)
    xla = seconds(_xla, x, w, stride, padding)
    patches = seconds(_patches, x, w, stride, padding)
    picked = seconds(_picked, x, w, stride, padding)
    print(
      f"| {batch}x{side}x{side}x{cin} | {kernel}x{kernel}x{cout} stride {stride} "
      f"| {xla * 1e3:.2f} | {patches * 1e3:.2f} | {xla / patches:.2f} | {pick(x, w, stride)} "
      f"| {picked * 1e3:.2f} |",
      flush=True,
    )


if __name__ == "__main__":
  main()

"""Convolutions lowered as patches times kernel where XLA's CPU convolution is slow.

XLA:CPU runs a convolution and its two gradients with its own convolution
kernels, which are several times slower than a matrix product of the same
arithmetic on the small feature maps of CIFAR-sized inputs: a 3x3 convolution
of batch 512 on 2x2 maps of 64 channels took 10.1 ms forward and backward,
1.7 ms as a product of its patches [N*H*W, 9*C] with the kernel [9*C, O]; a
stride-2 one from 4x4 maps, 3.3 ms against 1.0 ms (this project's 2-core
x86-64 VM, JAX 0.10.2; benchmarks/conv_lowering.py prints the table). On
larger maps of few channels at stride 1 XLA's own is faster (8x8 maps of 16
channels: 3.8 ms against 16.1 ms). `conv_general_dilated` takes
lax.conv_general_dilated's arguments and picks the faster lowering by shape on
the CPU; every other backend gets lax.conv_general_dilated. Both compute the
same sums, in another order: the results agree to float32 rounding.
"""

import jax
from jax import lax
import jax.numpy as jnp

# Stride-1 convolutions take the patches lowering on input maps of at most SMALL_MAP
# pixels a side or of at least WIDE channels; strided ones with kernels below LARGE_KERNEL.
SMALL_MAP = 2
WIDE = 128
LARGE_KERNEL = 7


def uses_patches(lhs_shape, rhs_shape, window_strides) -> bool:
  """Whether an NHWC x HWIO convolution takes the patches lowering on the CPU.

  From benchmarks/conv_lowering.py's table (this project's 2-core VM, JAX
  0.10.2): patches win at every stride > 1 but for the 7x7 stem (0.91x), and
  at stride 1 on 1x1 and 2x2 maps (2.4x to 5.8x) and 128 channels or more
  (1.45x, 1.53x); XLA's own wins on 8x8 maps of 16 channels (4x) and is within
  noise at 32 to 64 channels.
  """
  if max(window_strides) > 1:
    return max(rhs_shape[:2]) < LARGE_KERNEL
  return max(lhs_shape[1:3]) <= SMALL_MAP or lhs_shape[3] >= WIDE


def patches_conv(lhs, rhs, window_strides, padding, precision=None):
  """lhs [N, H, W, C] (NHWC) convolved with rhs [kh, kw, C, O] (HWIO) as a matrix product.

  The im2col lowering: the kh x kw shifted (and strided) views of the padded
  input, concatenated along channels in the kernel's (i, j, c) order, times
  the kernel reshaped to [kh*kw*C, O]. padding: 'SAME', 'VALID' or
  ((top, bottom), (left, right)); precision: the product's (lax.Precision).
  Returns [N, H', W', O] in lhs's dtype.
  """
  n, h, w, c = lhs.shape
  kh, kw, _, o = rhs.shape
  if isinstance(padding, str):
    padding = lax.padtype_to_pads((h, w), (kh, kw), window_strides, padding)
  (top, bottom), (left, right) = padding
  sh, sw = window_strides
  x = jnp.pad(lhs, ((0, 0), (top, bottom), (left, right), (0, 0)))
  ho, wo = (h + top + bottom - kh) // sh + 1, (w + left + right - kw) // sw + 1
  views = [
    lax.slice(x, (0, i, j, 0), (n, i + (ho - 1) * sh + 1, j + (wo - 1) * sw + 1, c), (1, sh, sw, 1))
    for i in range(kh)
    for j in range(kw)
  ]
  patches = views[0] if len(views) == 1 else jnp.concatenate(views, axis=-1)
  return jnp.dot(patches, rhs.reshape(kh * kw * c, o), precision=precision)


def conv_general_dilated(
  lhs,
  rhs,
  window_strides,
  padding,
  lhs_dilation=None,
  rhs_dilation=None,
  dimension_numbers=None,
  feature_group_count=1,
  precision=None,
):
  """lax.conv_general_dilated, as patches times kernel for the shapes where that is faster
  on the CPU (uses_patches); flax.linen.Conv's conv_general_dilated argument.

  The patches lowering needs NHWC inputs, HWIO kernels, no dilation and one
  feature group; any other convolution, and every convolution off the CPU,
  is lax.conv_general_dilated's.
  """
  plain = (
    jax.default_backend() != "cpu"
    or any(d != 1 for d in (lhs_dilation or ()) + (rhs_dilation or ()))
    or feature_group_count != 1
    or lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    != lax.conv_dimension_numbers(lhs.shape, rhs.shape, ("NHWC", "HWIO", "NHWC"))
    or not uses_patches(lhs.shape, rhs.shape, window_strides)
  )
  if plain:
    return lax.conv_general_dilated(
      lhs,
      rhs,
      window_strides,
      padding,
      lhs_dilation=lhs_dilation,
      rhs_dilation=rhs_dilation,
      dimension_numbers=dimension_numbers,
      feature_group_count=feature_group_count,
      precision=precision,
    )
  return patches_conv(lhs, rhs, tuple(window_strides), padding, precision)

"""Convolutions and the max-pool lowered for the CPU where XLA's own are slow.

XLA:CPU runs a convolution and its two gradients with its own convolution
kernels, which are several times slower than a matrix product of the same
arithmetic on the small feature maps of CIFAR-sized inputs; on larger maps at
stride 1 XLA's own is faster (docs/throughput.md has every figure;
benchmarks/conv_lowering.py prints the table, with XLA's own convolutions as
core/xla_flags.py sets them). `conv_general_dilated` takes
lax.conv_general_dilated's arguments and picks the faster lowering by shape on
the CPU; every other backend, and the CPU with CONTRASTIVE_JAX_CPU_TWEAKS=0
(core/runtime.py), gets lax.conv_general_dilated. Both compute the same sums, in
another order: the results agree to float32 rounding.

On maps of at most as many pixels as the kernel has taps (2x2 and 1x1 maps
under a 3x3 kernel) most of the patches' entries are padding: such a
convolution runs as one product of the flattened input [N, H*W*C] with the
convolution's matrix [H*W*C, H'*W'*O], built from the kernel (matrix_conv),
which leaves the padding's products out.

A strided convolution with a large kernel (the ResNet's 7x7 stride-2 stem) runs
forward as a stride-1 convolution of the input's space-to-depth rearrangement
(each s x s block of pixels one pixel of s*s*C channels) with the kernel
zero-padded to a multiple of s and rearranged alike, the faster on one core and
on two. Its gradients stay XLA's own, which are faster than the rearranged ones.

XLA:CPU runs a max-pool's gradient (select-and-scatter) as a reduce-window
over the values and four index arrays, then a scatter: a quarter of the SimCLR
runlocal step for the ResNet stem's pool. `max_pool` takes the maximum of the
window's strided views instead, and its gradient goes to the first maximum of
each window as XLA's does, through masks and pads of the same views.
"""

import functools

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from contrastive_jax.core import runtime

# Stride-1 convolutions take the patches lowering on input maps of at most SMALL_MAP pixels
# a side; strided ones with kernels below LARGE_KERNEL on input maps of at most SMALL_INPUT
# values (height x width x channels) per image.
SMALL_MAP = 2
SMALL_INPUT = 1024
LARGE_KERNEL = 7
NHWC = ("NHWC", "HWIO", "NHWC")  # The dimension numbers every lowering here takes.


def lowers() -> bool:
  """Whether conv_general_dilated and max_pool take this module's lowerings: on JAX's CPU
  backend unless CONTRASTIVE_JAX_CPU_TWEAKS=0 (core/runtime.py). Read at trace time."""
  return jax.default_backend() == "cpu" and runtime.cpu_tweaks()


def explicit_pads(spatial_shape, window, strides, padding) -> tuple:
  """padding ('SAME', 'VALID' or pairs) as ((top, bottom), (left, right)) of ints, for a
  window sliding with strides over an input of spatial_shape (height, width)."""
  if isinstance(padding, str):
    padding = lax.padtype_to_pads(spatial_shape, window, strides, padding)
  return tuple((int(lo), int(hi)) for lo, hi in padding)


def uses_space_to_depth(rhs_shape, window_strides) -> bool:
  """Whether an NHWC x HWIO convolution runs forward as space_to_depth_conv on the CPU:
  equal strides above 1 and a kernel of LARGE_KERNEL or more (the 7x7 stride-2 stem)."""
  stride_h, stride_w = window_strides
  return stride_h == stride_w > 1 and max(rhs_shape[:2]) >= LARGE_KERNEL


def uses_matrix(lhs_shape, rhs_shape) -> bool:
  """Whether an NHWC x HWIO convolution runs as matrix_conv on the CPU: an input map of
  at most as many pixels as the kernel has taps, where the matrix holds fewer products
  (H*W*C x H'*W'*O) than the patches times kernel (H'*W' x kh*kw*C x O)."""
  return lhs_shape[1] * lhs_shape[2] <= rhs_shape[0] * rhs_shape[1]


def uses_patches(lhs_shape, rhs_shape, window_strides) -> bool:
  """Whether an NHWC x HWIO convolution takes the patches lowering on the CPU.

  From benchmarks/conv_lowering.py's table (docs/throughput.md), forward and both
  gradients, with XLA's own convolutions (core/xla_flags.py): patches win at stride 2
  with 3x3 kernels on inputs of 8x8x16, 4x4x32 and 2x2x64 and at stride 1 on 1x1 and
  2x2 maps; XLA's own wins for the 7x7 stem (weight gradient alone; its forward is
  space-to-depth's: uses_space_to_depth), stride 1 on 4x4 maps or larger and strided
  kernels on inputs of more than SMALL_INPUT values. The 1x1 strided shortcuts on small
  maps take under a millisecond either way.
  """
  h, w, channels = lhs_shape[1:4]
  if max(window_strides) > 1:
    return max(rhs_shape[:2]) < LARGE_KERNEL and h * w * channels <= SMALL_INPUT
  return max(h, w) <= SMALL_MAP


def _window_views(x, window, strides):
  """{(i, j): view} for each position (i, j) of a kh x kw window in row-major order: the
  [N, H', W', C] view x[:, i::s_h, j::s_w, :] of the (padded) NHWC x that the window's
  (i, j) entry covers as it slides with strides (s_h, s_w), H' = (H - kh) // s_h + 1."""
  n, h, w, c = x.shape
  (kh, kw), (sh, sw) = window, strides
  ho, wo = (h - kh) // sh + 1, (w - kw) // sw + 1
  return {
    (i, j): lax.slice(
      x, (0, i, j, 0), (n, i + (ho - 1) * sh + 1, j + (wo - 1) * sw + 1, c), (1, sh, sw, 1)
    )
    for i in range(kh)
    for j in range(kw)
  }


def patches_conv(lhs, rhs, window_strides, padding, precision=None):
  """lhs [N, H, W, C] (NHWC) convolved with rhs [kh, kw, C, O] (HWIO) as a matrix product.

  The im2col lowering: the kh x kw shifted (and strided) views of the padded
  input, concatenated along channels in the kernel's (i, j, c) order, times
  the kernel reshaped to [kh*kw*C, O]. padding: 'SAME', 'VALID' or
  ((top, bottom), (left, right)); precision: the product's (lax.Precision).
  Returns [N, H', W', O] in lhs's dtype.
  """
  kh, kw, c, o = rhs.shape
  (top, bottom), (left, right) = explicit_pads(lhs.shape[1:3], (kh, kw), window_strides, padding)
  # lax.pad, unlike jnp.pad, takes a negative pad, which crops.
  x = lax.pad(
    lhs, jnp.zeros((), lhs.dtype), ((0, 0, 0), (top, bottom, 0), (left, right, 0), (0, 0, 0))
  )
  views = list(_window_views(x, (kh, kw), window_strides).values())
  patches = views[0] if len(views) == 1 else jnp.concatenate(views, axis=-1)
  return jnp.dot(patches, rhs.reshape(kh * kw * c, o), precision=precision)


def _taps(spatial_shape, window, stride: int, pads):
  """(S, (H', W')): S [H*W, H'*W', kh*kw] float32, S[a, b, t] = 1 where input pixel a
  (row-major) lies under tap t (row-major) of output pixel b's window, else 0, and the
  output's height and width. Output pixel (y, x) reads
  padded row s*y + i, which is input row s*y + i - top: tap i of input row p is
  p - s*y + top, and likewise for columns."""
  (h, w), (kh, kw), ((top, bottom), (left, right)) = spatial_shape, window, pads
  ho, wo = (h + top + bottom - kh) // stride + 1, (w + left + right - kw) // stride + 1
  p, q, y, x = np.meshgrid(np.arange(h), np.arange(w), np.arange(ho), np.arange(wo), indexing="ij")
  i, j = p - stride * y + top, q - stride * x + left
  inside = (0 <= i) & (i < kh) & (0 <= j) & (j < kw)
  taps = np.zeros((h, w, ho, wo, kh * kw), np.float32)
  taps[p[inside], q[inside], y[inside], x[inside], (i * kw + j)[inside]] = 1.0
  return taps.reshape(h * w, ho * wo, kh * kw), (ho, wo)


def _batch_sharding(x):
  """x's sharding with its batch axis's spec alone: the reshapes here keep the batch's
  sharding (explicit sharding asks for it), the other axes whole."""
  sharding = jax.typeof(x).sharding
  return sharding.update(spec=jax.P((*sharding.spec, None)[0]))


def matrix_conv(lhs, rhs, stride: int, padding, precision=None):
  """lhs [N, H, W, C] (NHWC) convolved with rhs [kh, kw, C, O] (HWIO) at stride s on both
  axes, as one product of lhs flattened to [N, H*W*C] with the convolution's matrix.

  The matrix M [H*W*C, H'*W'*O] (doubly block Toeplitz) holds at row (p, q, c) and
  column (y, x, o) the kernel's entry w[i, j, c, o] of the tap (i, j) = (p - s y + top,
  q - s x + left) through which output pixel (y, x) reads input pixel (p, q), and 0 for
  the pairs no tap joins: the convolution's products without those with its zero
  padding. M is a product of the kernel with a constant 0/1 tensor (_taps), so its
  gradient is a product too. A non-finite weight makes the column of its output channel
  non-finite everywhere in M (0 x inf), as it makes that channel non-finite at every
  pixel under XLA's convolution, which multiplies the padding by it. padding: 'SAME',
  'VALID' or ((top, bottom), (left, right)); precision: lax.Precision. The spatial axes
  must not be sharded (the batch may be). Returns [N, H', W', O] in lhs's dtype.
  """
  kh, kw, c, o = rhs.shape
  n, h, w = lhs.shape[:3]
  pads = explicit_pads((h, w), (kh, kw), (stride, stride), padding)
  taps, (ho, wo) = _taps((h, w), (kh, kw), stride, pads)
  matrix = jnp.einsum(
    "abt,tco->acbo", taps.astype(rhs.dtype), rhs.reshape(kh * kw, c, o), precision=precision
  ).reshape(h * w * c, ho * wo * o)
  batch = _batch_sharding(lhs)
  flat = jnp.reshape(lhs, (n, h * w * c), out_sharding=batch)
  out = jnp.dot(flat, matrix, precision=precision)
  return out.reshape(n, ho, wo, o, out_sharding=batch)


def space_to_depth_conv(lhs, rhs, stride: int, padding, precision=None):
  """lhs [N, H, W, C] (NHWC) convolved with rhs [kh, kw, C, O] (HWIO) at stride s on both
  axes, as a stride-1 convolution of the padded input's space-to-depth rearrangement.

  With the input padded (and cut) to s (Ho - 1 + k') rows, k' = ceil(kh / s) (and
  likewise for columns), pixel (a, b) of the rearranged input holds the block
  x[s a : s a + s, s b : s b + s, :] as s*s*C channels in (row, column, channel)
  order, and the kernel zero-padded to s k' x s k' taps becomes [k'h, k'w, s*s*C, O]
  in the same order: out[y, x] = sum over blocks (p, q) of the block at (y + p, x + q)
  times the kernel's block (p, q), the same products as the strided convolution's
  plus products with zeros. So a non-finite input value also reaches, as NaN
  (0 x inf), the outputs whose zero-padded window covers it but whose true window
  does not (the stem reads finite images). padding: 'SAME', 'VALID' or ((top,
  bottom), (left, right)) of non-negative pads; precision: lax.Precision. The
  spatial axes must not be sharded (the batch may be). Returns [N, Ho, Wo, O] in
  lhs's dtype.
  """
  kh, kw, c, o = rhs.shape
  n, h, w = lhs.shape[:3]
  (top, bottom), (left, right) = explicit_pads((h, w), (kh, kw), (stride, stride), padding)
  blocks_h, blocks_w = -(-kh // stride), -(-kw // stride)
  rows = stride * ((h + top + bottom - kh) // stride + blocks_h)
  cols = stride * ((w + left + right - kw) // stride + blocks_w)
  x = jnp.pad(lhs, ((0, 0), (top, max(rows - h - top, 0)), (left, max(cols - w - left, 0)), (0, 0)))
  batch = _batch_sharding(lhs)
  x = x[:, :rows, :cols].reshape(
    n, rows // stride, stride, cols // stride, stride, c, out_sharding=batch
  )
  x = x.transpose(0, 1, 3, 2, 4, 5)
  x = x.reshape(n, rows // stride, cols // stride, stride * stride * c, out_sharding=batch)
  k = jnp.pad(rhs, ((0, stride * blocks_h - kh), (0, stride * blocks_w - kw), (0, 0), (0, 0)))
  k = k.reshape(blocks_h, stride, blocks_w, stride, c, o).transpose(0, 2, 1, 3, 4, 5)
  k = k.reshape(blocks_h, blocks_w, stride * stride * c, o)
  return lax.conv_general_dilated(
    x, k, (1, 1), "VALID", dimension_numbers=NHWC, precision=precision
  )


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _space_to_depth_forward(lhs, rhs, stride, padding, precision):
  """space_to_depth_conv, differentiated as XLA's strided convolution (_space_to_depth_jvp)."""
  return space_to_depth_conv(lhs, rhs, stride, padding, precision)


def _space_to_depth_jvp(stride, padding, precision, primals, tangents):
  """The tangent is XLA's strided convolution of each input's tangent (bilinear), so that
  JAX's transpose of it, the gradient, is XLA's own weight and input gradient."""
  lhs, rhs = primals
  out = _space_to_depth_forward(lhs, rhs, stride, padding, precision)
  conv = functools.partial(
    lax.conv_general_dilated,
    window_strides=(stride, stride),
    padding=padding,
    dimension_numbers=NHWC,
    precision=precision,
  )
  terms = [
    conv(tangent, rhs) if i == 0 else conv(lhs, tangent)
    for i, tangent in enumerate(tangents)
    if not isinstance(tangent, jax.custom_derivatives.SymbolicZero)
  ]
  return out, functools.reduce(jnp.add, terms) if terms else jnp.zeros_like(out)


_space_to_depth_forward.defjvp(_space_to_depth_jvp, symbolic_zeros=True)


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
  """lax.conv_general_dilated, as one product with the convolution's matrix (uses_matrix),
  patches times kernel (uses_patches) or forward through space-to-depth
  (uses_space_to_depth) for the shapes where that is faster on the CPU;
  flax.linen.Conv's conv_general_dilated argument.

  All need NHWC inputs, HWIO kernels, no dilation, one feature group and an output of
  at least one pixel, the matrix equal strides and unsharded spatial axes, and
  space-to-depth non-negative padding and unsharded spatial axes; any other
  convolution, and every convolution where lowers() is False, is
  lax.conv_general_dilated's.
  """
  window_strides = tuple(window_strides)
  eligible = (
    lowers()
    and all(d == 1 for d in (lhs_dilation or ()) + (rhs_dilation or ()))
    and feature_group_count == 1
    and lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    == lax.conv_dimension_numbers(lhs.shape, rhs.shape, NHWC)
  )
  if eligible:
    pads = explicit_pads(lhs.shape[1:3], rhs.shape[:2], window_strides, padding)
    # A convolution without an output pixel is left to XLA's (an empty output).
    eligible = all(
      size + lo + hi >= k for size, (lo, hi), k in zip(lhs.shape[1:3], pads, rhs.shape[:2])
    )
  if eligible:
    spatial_sharding = (*jax.typeof(lhs).sharding.spec, None, None, None, None)[1:4]
    unsharded = all(axes is None for axes in spatial_sharding)
    if uses_matrix(lhs.shape, rhs.shape) and window_strides[0] == window_strides[1] and unsharded:
      return matrix_conv(lhs, rhs, window_strides[0], pads, precision)
    if (
      uses_space_to_depth(rhs.shape, window_strides)
      and min(min(pair) for pair in pads) >= 0
      and unsharded
    ):
      return _space_to_depth_forward(lhs, rhs, window_strides[0], pads, precision)
    if uses_patches(lhs.shape, rhs.shape, window_strides):
      return patches_conv(lhs, rhs, window_strides, pads, precision)
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


def max_pool(x, window, strides, padding):
  """flax.linen.max_pool(x, window, strides, padding) of NHWC x [N, H, W, C] (floating).

  padding: 'SAME', 'VALID' or ((top, bottom), (left, right)), padded with -inf. Where
  lowers(), the maximum of the window's strided views, differentiated through
  _views_max_pool's JVP (forward and reverse mode); elsewhere, and for a
  padding below 0 or a window wider than the padded input, flax's
  (lax.reduce_window). Returns [N, H', W', C] in x's dtype; values equal flax's,
  gradients to float rounding (a pixel under several windows sums their gradients
  in another order), but for a window holding a NaN, which passes none (its output
  is NaN).
  """
  window, strides = tuple(window), tuple(strides)
  pads = explicit_pads(x.shape[1:3], window, strides, padding)
  fits = all(
    lo >= 0 and hi >= 0 and size + lo + hi >= w
    for size, (lo, hi), w in zip(x.shape[1:3], pads, window)
  )
  if not lowers() or not fits:
    return nn.max_pool(x, window, strides=strides, padding=padding)
  return _views_max_pool(x, window, strides, pads)


def _padded_views(x, window, strides, padding, value):
  """_window_views of x padded with `value` by padding ((top, bottom), (left, right))."""
  padded = jnp.pad(x, ((0, 0), *padding, (0, 0)), constant_values=value)
  return _window_views(padded, window, strides).values()


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _views_max_pool(x, window, strides, padding):
  return functools.reduce(jnp.maximum, _padded_views(x, window, strides, padding, -jnp.inf))


@_views_max_pool.defjvp
def _views_max_pool_jvp(window, strides, padding, primals, tangents):
  """Each window's output tangent is the tangent of the window's first maximum in
  row-major order, the element XLA's select-and-scatter (reduce_window's transpose in
  JAX) gives the gradient to. Linear in the tangent through masks and strided slices,
  so JAX transposes it for the gradient: masks and pads with interior padding."""
  (x,), (tangent,) = primals, tangents
  views = list(_padded_views(x, window, strides, padding, -jnp.inf))
  out = functools.reduce(jnp.maximum, views)
  zero = jnp.zeros((), tangent.dtype)
  taken, shares = jnp.zeros(out.shape, bool), []
  for view, view_tangent in zip(views, _padded_views(tangent, window, strides, padding, 0)):
    first = (view == out) & ~taken
    taken = taken | first
    shares.append(jnp.where(first, view_tangent, zero))
  return out, functools.reduce(jnp.add, shares)

"""Each train step's batch drawn on the device from a split held there (device_data.py).

One jitted call per step (make_batch_fn, train_batches):

  order   the global batch of step s holds stream positions p = s B ... s B + B - 1;
          position p reads record perm_e(p mod N) of the split, e = p // N, where
          perm_e is jax.random.permutation of a key that is a function of (seed,
          e) (epoch_order_array): TensorFlow-free, so that the path runs where
          only JAX is installed. It is not the host pipeline's order (TF's
          index_shuffle cipher), as the crops below are not the host's draws.
  crops   each view's window is drawn with jax.random from a key that is a function
          of (seed, p, view), with the distribution of crops.py's sampler
          (crop_window: 'tensorflow', 'torchvision', 'byol'), and resized to
          image_size with crop_spec.RESIZES' kernel (resize_weights), then flipped
          left-right with p 1/2. Views are uint8, rounded and clipped, as the
          host's. Multi-crop's local views (config.local_crops) are drawn the same
          way at their own size and area range, as view indices after the global
          views'.

Everything is a function of (seed, step), so the batches from start_step s equal
an uninterrupted run's. The draws are not the host's (jax.random, not TF's
stateless ops): the same distributions, other samples, so switching a run
between the two paths changes what it computes (the field is not one a resume
may change).

Multi-host: every process holds the whole split and runs the same program; the
output is sharded along the batch over the mesh, so each device computes its own
rows of the one global batch (the batch of a one-process run of the same config).
"""

import math
from typing import Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.data import crop_spec
from contrastive_jax.data import device_data

# Tags folded into the seed's key so that the crops' and the order's draws are not the
# train step's (methods.run_keys draws from jax.random.key(seed) too), nor each other's.
_CROP_STREAM = 0x43524F50
_ORDER_STREAM = 0x4F524452


# --- Crop windows --------------------------------------------------------------------------


def _lrint(x):
  """C's lrintf: round half to even, to int32."""
  return jnp.round(x).astype(jnp.int32)


def _offsets(key, height, width, h, w):
  """Top and left uniform over the integers that keep an h x w crop inside the image."""
  top_key, left_key = jax.random.split(key)
  top = jax.random.randint(top_key, (), 0, height - h + 1)
  left = jax.random.randint(left_key, (), 0, width - w + 1)
  return top, left


def _area_and_ratio(key, shape, area_min, area_max, area):
  """Target area U[area_min, area_max) x area and aspect ratio exp(U[log 3/4, log 4/3)),
  float32."""
  u = jax.random.uniform(key, shape + (2,))
  log_lo, log_hi = math.log(crop_spec.ASPECT_RANGE[0]), math.log(crop_spec.ASPECT_RANGE[1])
  return area * (area_min + (area_max - area_min) * u[..., 0]), jnp.exp(
    log_lo + (log_hi - log_lo) * u[..., 1]
  )


def _tensorflow_window(key, height, width, area_min, area_max):
  """TF's sample_distorted_bounding_box kernel with SimCLR's arguments (crops.py docstring):

  per attempt a ratio uniform in [3/4, 4/3], the height uniform among the
  integers from the one that gives area_min to the largest that fits within
  area_max, nudged by one to meet the area range; an attempt counts if it fits
  and covers at least min_object_covered of the image; the first of 100 wins,
  else the whole image; the offsets uniform in [0, H - h) and [0, W - w).
  (tests/test_recipes.py transcribes the kernel in numpy.)
  """
  ratio_key, height_key, offset_key = jax.random.split(key, 3)
  n = crop_spec.SIMCLR_MAX_ATTEMPTS
  lo, hi = crop_spec.ASPECT_RANGE
  ratio = jax.random.uniform(ratio_key, (n,)) * (hi - lo) + lo
  min_area = jnp.float32(area_min * width * height)
  max_area = jnp.float32(area_max * width * height)
  ch = _lrint(jnp.sqrt(min_area / ratio))
  max_h = _lrint(jnp.sqrt(max_area / ratio))
  too_wide = _lrint(max_h * ratio) > width
  max_h = jnp.where(too_wide, jnp.floor((width + 0.5 - 1e-7) / ratio).astype(jnp.int32), max_h)
  max_h = jnp.where(too_wide & (_lrint(max_h * ratio) > width), max_h - 1, max_h)
  max_h = jnp.minimum(max_h, height)
  ch = jnp.minimum(ch, max_h)
  extra = jnp.floor(jax.random.uniform(height_key, (n,)) * (max_h - ch + 1)).astype(jnp.int32)
  ch = ch + jnp.where(ch < max_h, jnp.minimum(extra, max_h - ch), 0)
  cw = _lrint(ch * ratio)
  small = cw * ch < min_area
  ch = jnp.where(small, ch + 1, ch)
  cw = jnp.where(small, _lrint(ch * ratio), cw)
  large = cw * ch > max_area
  ch = jnp.where(large, ch - 1, ch)
  cw = jnp.where(large, _lrint(ch * ratio), cw)
  area = cw * ch
  valid = (min_area <= area) & (area <= max_area) & (cw > 0) & (cw <= width)
  valid &= (ch > 0) & (ch <= height)
  valid &= area / jnp.float32(width * height) >= jnp.float32(crop_spec.SIMCLR_MIN_OBJECT_COVERED)
  first = jnp.argmax(valid)
  found = valid[first]
  h = jnp.where(found, ch[first], height)
  w = jnp.where(found, cw[first], width)
  # The kernel's offsets are Uniform(H - h) (0 when the crop spans the side): a crop
  # never touches the bottom or right edge unless it spans that side.
  top_key, left_key = jax.random.split(offset_key)
  top = jax.random.randint(top_key, (), 0, jnp.maximum(height - h, 1))
  left = jax.random.randint(left_key, (), 0, jnp.maximum(width - w, 1))
  return top, left, h, w


def _torchvision_window(key, height, width, area_min, area_max):
  """torchvision's RandomResizedCrop.get_params, as crops._torchvision_window."""
  draw_key, offset_key = jax.random.split(key)
  target, ratio = _area_and_ratio(
    draw_key, (crop_spec.TORCHVISION_ATTEMPTS,), area_min, area_max, float(height * width)
  )
  ws, hs = _lrint(jnp.sqrt(target * ratio)), _lrint(jnp.sqrt(target / ratio))
  fits = (ws > 0) & (ws <= width) & (hs > 0) & (hs <= height)
  first = jnp.argmax(fits)
  found = fits[first]
  # The fallback: a centre crop of the whole image, clamped to the aspect range
  # (height and width are static, so this is Python arithmetic).
  in_ratio = width / height
  fallback_h = (
    round(width / crop_spec.ASPECT_RANGE[0]) if in_ratio < crop_spec.ASPECT_RANGE[0] else height
  )
  fallback_w = (
    round(height * crop_spec.ASPECT_RANGE[1]) if in_ratio > crop_spec.ASPECT_RANGE[1] else width
  )
  h = jnp.where(found, hs[first], fallback_h)
  w = jnp.where(found, ws[first], fallback_w)
  top, left = _offsets(offset_key, height, width, h, w)
  top = jnp.where(found, top, (height - h) // 2)
  left = jnp.where(found, left, (width - w) // 2)
  return top, left, h, w


def _byol_window(key, height, width, area_min, area_max):
  """BYOL's _decode_and_random_crop: one draw, each side clamped to [1, the image's]."""
  draw_key, offset_key = jax.random.split(key)
  target, ratio = _area_and_ratio(draw_key, (), area_min, area_max, float(height * width))
  w = jnp.clip(_lrint(jnp.sqrt(target * ratio)), 1, width)
  h = jnp.clip(_lrint(jnp.sqrt(target / ratio)), 1, height)
  top, left = _offsets(offset_key, height, width, h, w)
  return top, left, h, w


_WINDOWS = {
  "tensorflow": _tensorflow_window,
  "torchvision": _torchvision_window,
  "byol": _byol_window,
}


def crop_window(key, height: int, width: int, sampler: str, area_min: float, area_max: float = 1.0):
  """(top, left, crop height, crop width), int32 scalars: `sampler`'s crop of a height x width
  image, its area fraction drawn from [area_min, area_max).

  The device twin of crops.crop_window (same distribution, drawn with
  jax.random from `key`); height and width are static Python ints.
  """
  return _WINDOWS[sampler](key, height, width, area_min, area_max)


# --- Resize --------------------------------------------------------------------------------


def _triangle(x):
  return jnp.maximum(1.0 - jnp.abs(x), 0.0)


def _keys_cubic(x):
  """Keys' cubic convolution kernel with a = -0.5 (TF's bicubic resizes and PIL's BICUBIC)."""
  x = jnp.abs(x)
  near = (1.5 * x - 2.5) * x * x + 1.0
  far = ((-0.5 * x + 2.5) * x - 4.0) * x + 2.0
  return jnp.where(x <= 1.0, near, jnp.where(x < 2.0, far, 0.0))


_KERNELS = {"bilinear": _triangle, "bicubic": _keys_cubic}


def resize_weights(start, length, size: int, in_size: int, resize: str):
  """float32 [size, in_size]: the weights that resize pixels [start, start + length) of an axis
  of in_size pixels to `size` pixels with crop_spec.RESIZES[resize].

  Output pixel i samples the window at (i + 0.5) length / size (half-pixel
  centres); input pixel j weighs kernel((j - start + 0.5 - that) k), k =
  min(size / length, 1) when the resize antialiases (a kernel stretched over
  the pixels a shrunk output pixel covers) else 1; pixels outside the window
  weigh 0 and each row is normalised to sum 1. These are the weights of TF's
  ScaleAndTranslate (tf.image.resize with antialias) and of its half-pixel
  bicubic resize, which also zeroes and renormalises taps outside the image.
  """
  method, antialias = crop_spec.RESIZES[resize]
  kernel = _KERNELS[method]
  length = length.astype(jnp.float32) if hasattr(length, "astype") else jnp.float32(length)
  scale = size / length
  k = jnp.minimum(scale, 1.0) if antialias else 1.0
  centre = (jnp.arange(size, dtype=jnp.float32) + 0.5) / scale  # [size], window coordinates.
  x = jnp.arange(in_size, dtype=jnp.float32) - start + 0.5  # [in_size], window coordinates.
  inside = (x > 0) & (x < length)
  weights = jnp.where(inside[None, :], kernel((x[None, :] - centre[:, None]) * k), 0.0)
  return weights / jnp.sum(weights, axis=1, keepdims=True)


def resized_crop(image, window, size: int, resize: str):
  """uint8 image [H, W, 3] cropped to window (top, left, h, w) and resized to [size, size, 3],
  rounded (half to even) and clipped to uint8, as crops.resize_and_flip's resize."""
  top, left, h, w = window
  wy = resize_weights(top, h, size, image.shape[0], resize)
  wx = resize_weights(left, w, size, image.shape[1], resize)
  out = jnp.einsum(
    "sh,hwc,tw->stc", wy, image.astype(jnp.float32), wx, precision=jax.lax.Precision.HIGHEST
  )
  return jnp.clip(jnp.round(out), 0, 255).astype(jnp.uint8)


# --- Batches -------------------------------------------------------------------------------


def view_key(seed: int, position, view):
  """The key of the view `view` of stream position `position` (int32 scalars) of run `seed`."""
  key = jax.random.fold_in(jax.random.key(seed), _CROP_STREAM)
  return jax.random.fold_in(jax.random.fold_in(key, position), view)


def one_view(image, key, size: int, crop: crop_spec.CropSpec, area_range: tuple):
  """crops.random_resized_crop's view on the device: uint8 [size, size, 3] of uint8 image
  [H, W, 3], its window (crop's sampler, area fraction in area_range = (min, max)) drawn
  from key, resized with crop's resize, flipped left-right with p 1/2."""
  crop_key, flip_key = jax.random.split(key)
  window = crop_window(crop_key, image.shape[0], image.shape[1], crop.sampler, *area_range)
  view = resized_crop(image, window, size, crop.resize)
  return jnp.where(jax.random.uniform(flip_key) < 0.5, view, view[:, ::-1])


def batch_positions(step, batch: int):
  """int32 [batch]: the stream positions of step `step`'s global batch."""
  return step * batch + jnp.arange(batch, dtype=jnp.int32)


def make_batch_fn(
  *,
  num: int,
  batch: int,
  num_views: int,
  image_size: int,
  crop: crop_spec.CropSpec,
  seed: int,
  mesh,
  local_crops: Optional[crop_spec.LocalCrops] = None,
):
  """The jitted (split, this_epoch, next_epoch, epoch, step) -> global batch of step `step`.

  split: device_data.Split of num records; this_epoch, next_epoch: int32 [num], the
  permutations (epoch_order_array) of epochs `epoch` and `epoch` + 1, where
  epoch = step batch // num (a batch is at most num long, so it spans at most
  both). Returns {'image': uint8 [batch, num_views, S, S, 3], 'label': int32
  [batch]}, and with local_crops (multi-crop) 'local_image': uint8 [batch, N, s, s, 3],
  N = local_crops.number views of s = local_crops.size pixels at area fractions in
  [area_min, area_max) (the sampler's own: TF's covers at least 0.1), drawn as the
  global views (view indices num_views onwards);
  sharded along the batch over the mesh: what input_pipeline.train_batches yields.
  """

  def views(images, positions, first: int, count: int, size: int, area_range: tuple):
    """uint8 [batch, count, size, size, 3]: views first .. first + count - 1 of each image."""
    indices = jnp.arange(first, first + count)
    keys = jax.vmap(lambda p: jax.vmap(lambda v: view_key(seed, p, v))(indices))(positions)
    per_image = jax.vmap(lambda k, image: one_view(image, k, size, crop, area_range), (0, None))
    return jax.vmap(per_image)(keys, images)

  def fn(split, this_epoch, next_epoch, epoch, step):
    positions = batch_positions(step, batch)
    place = positions % num
    index = jnp.where(positions // num == epoch, this_epoch[place], next_epoch[place])
    images = split.images[index]
    out = {
      "image": views(images, positions, 0, num_views, image_size, (crop.area_min, 1.0)),
      "label": split.labels[index],
    }
    if local_crops is not None:
      local_range = (local_crops.area_min, local_crops.area_max)
      out["local_image"] = views(
        images, positions, num_views, local_crops.number, local_crops.size, local_range
      )
    return out

  return jax.jit(fn, out_shardings=mesh_lib.batch_sharded(mesh))


def epoch_order_array(num: int, seed: int, epoch: int) -> jax.Array:
  """int32 [num]: the record read at each place of epoch `epoch` of run `seed`, a permutation
  of [0, num) drawn by jax.random.permutation (threefry: the same on every backend)."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _ORDER_STREAM), epoch)
  return jax.random.permutation(key, num).astype(jnp.int32)


class _Orders:
  """Epoch permutations on the mesh, the two latest kept."""

  def __init__(self, num: int, seed: int, mesh):
    self.num, self.seed, self.sharding = num, seed, mesh_lib.replicated(mesh)
    self.cache = {}

  def __call__(self, epoch: int):
    if epoch not in self.cache:
      self.cache[epoch] = jax.jit(
        epoch_order_array, static_argnums=(0, 1), out_shardings=self.sharding
      )(self.num, self.seed, epoch)
      for old in [e for e in self.cache if e < epoch - 1]:
        del self.cache[old]
    return self.cache[epoch]


def train_batches(split: device_data.Split, config, mesh, *, image_size: int, num_views: int = 2):
  """A job's start_step -> iterator of global training batches from the device (module docstring).

  Reads config.batch_size (global), crop (crop_spec.CropSpec's fields), seed and
  local_crops (crop_spec.LocalCrops' fields, optional: multi-crop's views);
  batch_size must be at most N (the pretrain job checks it). The iterator
  yields what input_pipeline.train_batches yields.
  """
  num = split.images.shape[0]
  batch = config.batch_size
  local_crops = config.get("local_crops")
  fn = make_batch_fn(
    num=num,
    batch=batch,
    num_views=num_views,
    image_size=image_size,
    crop=crop_spec.CropSpec(**config.crop),
    seed=config.seed,
    mesh=mesh,
    local_crops=crop_spec.LocalCrops(**local_crops) if local_crops else None,
  )
  orders = _Orders(num, config.seed, mesh)

  def batches(start_step: int) -> Iterator[dict]:
    step = start_step
    while True:
      epoch = step * batch // num
      yield fn(split, orders(epoch), orders(epoch + 1), np.int32(epoch), np.int32(step))
      step += 1

  return batches

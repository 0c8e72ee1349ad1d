"""Random resized crops of the three references, drawn on the host with stateless tf ops.

Each reference draws its crop window its own way, and the distributions of
crop area and aspect ratio differ (tests/test_recipes.py simulates each
reference algorithm in numpy and compares):

  'tensorflow'  SimCLR (google-research/simclr data_util.crop_and_resize):
                tf.image.sample_distorted_bounding_box with the whole image as
                the object, min_object_covered 0.1, area in [area_min, area_max],
                aspect ratio (width / height) uniform in [3/4, 4/3], 100
                attempts; the kernel draws the crop height uniformly among the
                integers that fit the area range, so the area is not uniform;
                if every attempt fails, the whole image. Crops smaller than
                10% of the image never cover 10% of the object, so the
                effective smallest area is max(area_min, 0.1).
  'torchvision' MoCo (torchvision.transforms.RandomResizedCrop.get_params):
                area uniform in [area_min, area_max] of the image, log aspect ratio
                uniform in [log 3/4, log 4/3], width and height rounded, up to
                10 attempts until the crop fits; else a centre crop of the
                whole image clamped to the aspect range.
  'byol'        BYOL (deepmind-research byol/utils/dataset.py
                _decode_and_random_crop): one draw, area and log aspect ratio
                as torchvision's, width and height each clamped to the image.

Every draw is a stateless function of the seed it is given (the input pipeline
derives it from (seed, process, stream position)), so a resumed run crops
exactly as an uninterrupted one.

The crop is then resized to a square: 'tf_bicubic' is tf.image.resize's
bicubic without antialiasing (SimCLR, BYOL), 'pil_bilinear' and 'pil_bicubic'
antialias when shrinking as PIL's resize does (torchvision on PIL images: MoCo
bilinear, solo-learn bicubic). Views stay uint8 (rounded and clipped), which
keeps host-to-device transfers small; the references keep float32 here, a
difference of at most half a grey level.
"""

import math

import tensorflow as tf

from contrastive_jax.data.crop_spec import ASPECT_RANGE
from contrastive_jax.data.crop_spec import RESIZES
from contrastive_jax.data.crop_spec import SIMCLR_MAX_ATTEMPTS
from contrastive_jax.data.crop_spec import SIMCLR_MIN_OBJECT_COVERED
from contrastive_jax.data.crop_spec import TORCHVISION_ATTEMPTS


def _rounded(x):
  # tf.round rounds half to even, as Python's round() in torchvision and BYOL.
  return tf.cast(tf.round(x), tf.int32)


def _tensorflow_window(height, width, seed, area_min, area_max):
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
    tf.stack([height, width, 3]),
    bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
    seed=seed,
    min_object_covered=SIMCLR_MIN_OBJECT_COVERED,
    aspect_ratio_range=ASPECT_RANGE,
    area_range=(area_min, area_max),
    max_attempts=SIMCLR_MAX_ATTEMPTS,
    use_image_if_no_bounding_boxes=True,
  )
  return begin[0], begin[1], size[0], size[1]


def _area_and_ratio(shape, seed, area_min, area_max, area):
  """Area fraction U[area_min, area_max) times `area`, aspect ratio exp(U[log 3/4, log 4/3))."""
  u = tf.random.stateless_uniform(shape + [2], seed)
  target = area * (area_min + (area_max - area_min) * u[..., 0])
  log_lo, log_hi = math.log(ASPECT_RANGE[0]), math.log(ASPECT_RANGE[1])
  return target, tf.exp(log_lo + (log_hi - log_lo) * u[..., 1])


def _offsets(seed, height, width, h, w):
  """Top and left uniform over the integers that keep the crop inside the image."""
  top_seed, left_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
  top = tf.random.stateless_uniform([], top_seed, 0, height - h + 1, dtype=tf.int32)
  left = tf.random.stateless_uniform([], left_seed, 0, width - w + 1, dtype=tf.int32)
  return top, left


def _torchvision_window(height, width, seed, area_min, area_max):
  draw_seed, offset_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
  h_f, w_f = tf.cast(height, tf.float32), tf.cast(width, tf.float32)
  # All attempts drawn at once; the first one that fits wins, as in the loop.
  target, ratio = _area_and_ratio([TORCHVISION_ATTEMPTS], draw_seed, area_min, area_max, h_f * w_f)
  ws, hs = _rounded(tf.sqrt(target * ratio)), _rounded(tf.sqrt(target / ratio))
  fits = (ws > 0) & (ws <= width) & (hs > 0) & (hs <= height)
  first = tf.argmax(tf.cast(fits, tf.int32))
  # The fallback: a centre crop of the whole image, clamped to the aspect range.
  in_ratio = w_f / h_f
  fallback_h = tf.where(in_ratio < ASPECT_RANGE[0], _rounded(w_f / ASPECT_RANGE[0]), height)
  fallback_w = tf.where(in_ratio > ASPECT_RANGE[1], _rounded(h_f * ASPECT_RANGE[1]), width)
  found = tf.reduce_any(fits)
  h = tf.where(found, hs[first], fallback_h)
  w = tf.where(found, ws[first], fallback_w)
  top, left = _offsets(offset_seed, height, width, h, w)
  top = tf.where(found, top, (height - h) // 2)
  left = tf.where(found, left, (width - w) // 2)
  return top, left, h, w


def _byol_window(height, width, seed, area_min, area_max):
  draw_seed, offset_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
  area = tf.cast(height * width, tf.float32)
  target, ratio = _area_and_ratio([], draw_seed, area_min, area_max, area)
  # At least one pixel: a tiny image (the prepare job never upscales) would round to an
  # empty window, which cannot be resized.
  w = tf.clip_by_value(_rounded(tf.sqrt(target * ratio)), 1, width)
  h = tf.clip_by_value(_rounded(tf.sqrt(target / ratio)), 1, height)
  top, left = _offsets(offset_seed, height, width, h, w)
  return top, left, h, w


_WINDOWS = {
  "tensorflow": _tensorflow_window,
  "torchvision": _torchvision_window,
  "byol": _byol_window,
}


def crop_window(height, width, seed, sampler: str, area_min: float, area_max: float = 1.0):
  """(top, left, crop height, crop width), int32 scalars, of `sampler`'s crop of an image.

  height, width: int32 scalar tensors, the image's size; seed: int32/int64
  [2], a stateless-op seed; area_min, area_max: the range of the area fraction
  drawn (the references' scale / area_range; area_max < 1 for DINO's local crops).
  """
  return _WINDOWS[sampler](
    tf.cast(height, tf.int32), tf.cast(width, tf.int32), seed, area_min, area_max
  )


def _split(seed):
  """The crop window's and the flip's seeds, [2] each, from a view's seed [2]."""
  return tf.unstack(tf.random.experimental.stateless_split(seed, 2))


def resize_and_flip(crop, flip_seed, size: int, resize: str):
  """uint8 crop [h, w, 3] resized to [size, size] (RESIZES[resize]), flipped with p 1/2.

  Returns uint8 [size, size, 3], rounded and clipped.
  """
  method, antialias = RESIZES[resize]
  crop = tf.image.resize(crop, [size, size], method=method, antialias=antialias)
  crop = tf.cast(tf.clip_by_value(tf.round(crop), 0, 255), tf.uint8)
  # A cond, not a tf.where over both images: the mirrored copy is made only
  # when it is kept, and of uint8 pixels (a where of float32 views cost a
  # quarter of the host pipeline's time).
  return tf.cond(
    tf.random.stateless_uniform([], flip_seed) < 0.5, lambda: crop, lambda: tf.reverse(crop, [1])
  )


def random_resized_crop(
  image, seed, size: int, sampler: str, area_min: float, resize: str, area_max: float = 1.0
):
  """A random crop of uint8 image [H, W, 3], resized to [size, size] and flipped with p 1/2.

  The crop window is crop_window's; the resize is RESIZES[resize]. Returns
  uint8 [size, size, 3].
  """
  crop_seed, flip_seed = _split(seed)
  shape = tf.shape(image)
  top, left, h, w = crop_window(shape[0], shape[1], crop_seed, sampler, area_min, area_max)
  return resize_and_flip(image[top : top + h, left : left + w], flip_seed, size, resize)


# Pixels decoded around the crop windows of a JPEG: its decoder upsamples the
# chroma at a window's edge as at the image's edge, which changes the outermost
# pixel (by up to 28 grey levels measured on the shared photos); one pixel of
# margin already gives exactly the pixels of a whole decode on every window
# tested, 8 (a DCT block) leaves room for any chroma subsampling.
JPEG_MARGIN = 8


def decode_random_resized_crops(
  encoded, seeds, size: int, sampler: str, area_min: float, resize: str, area_max: float = 1.0
):
  """random_resized_crop of an encoded image with each of seeds [V, 2]: uint8 [V, size, size, 3].

  Exactly random_resized_crop of the decoded image (same windows, same
  pixels), but a JPEG is decoded only over the union of the V windows (plus
  JPEG_MARGIN pixels, so that its pixels equal a whole decode's), its size
  read from its header (tf.io.extract_jpeg_shape). Other formats
  (tf.io.decode_image: PNG, GIF, BMP, WebP) are decoded whole.
  """
  split = [_split(seeds[v]) for v in range(seeds.shape[0])]

  def windows(shape):  # [V, 4] int32: top, left, height, width.
    return tf.stack(
      [
        tf.stack(crop_window(shape[0], shape[1], crop_seed, sampler, area_min, area_max))
        for crop_seed, _ in split
      ]
    )

  def views(image, boxes):
    return tf.stack(
      [
        resize_and_flip(image[t : t + h, l : l + w], flip_seed, size, resize)
        for (t, l, h, w), (_, flip_seed) in zip(
          (tf.unstack(box) for box in tf.unstack(boxes)), split
        )
      ]
    )

  def jpeg():
    shape = tf.io.extract_jpeg_shape(encoded)
    boxes = windows(shape)
    top = tf.maximum(tf.reduce_min(boxes[:, 0]) - JPEG_MARGIN, 0)
    left = tf.maximum(tf.reduce_min(boxes[:, 1]) - JPEG_MARGIN, 0)
    bottom = tf.minimum(tf.reduce_max(boxes[:, 0] + boxes[:, 2]) + JPEG_MARGIN, shape[0])
    right = tf.minimum(tf.reduce_max(boxes[:, 1] + boxes[:, 3]) + JPEG_MARGIN, shape[1])
    image = tf.image.decode_and_crop_jpeg(
      encoded, tf.stack([top, left, bottom - top, right - left]), channels=3
    )
    return views(image, boxes - tf.stack([top, left, 0, 0]))

  def other():
    image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
    return views(image, windows(tf.shape(image)))

  return tf.cond(tf.io.is_jpeg(encoded), jpeg, other)

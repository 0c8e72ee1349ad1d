"""On-device image augmentations, run inside the jitted train step.

The host pipeline (crops.py) does the random resized crop and flip; the
photometric ops here (color jitter, grayscale, Gaussian blur, solarize) run on
the accelerator, one PRNG key per example, so they cost no host CPU.

The references implement the same-named ops differently, and each view's
settings say whose ops to use:
  color_ops 'tensorflow': tf.image.adjust_contrast (each channel around its
    own mean) and adjust_saturation (HSV saturation scaled and clipped to
    [0, 1]), as SimCLR (google-research/simclr data_util.color_jitter) and
    BYOL (deepmind-research byol/utils/augmentations.py) use them;
  color_ops 'torchvision': torchvision's ColorJitter (contrast: blend with the
    mean of the grayscale image; saturation: blend with the grayscale image),
    as MoCo (facebookresearch/moco main_moco.py) and solo-learn use it;
  brightness_op 'add' adds U[-b, b] (tf.image.random_brightness: SimCLR v1,
    BYOL), 'multiply' multiplies by U[max(0, 1 - b), 1 + b] (SimCLR v2's tf2
    code, torchvision);
  grayscale_first: grayscale before jitter (MoCo v1's order) instead of after;
  blur_padding 'zeros' (TensorFlow/JAX 'SAME' convolutions: SimCLR, BYOL) or
    'edge' (PIL's blur repeats the border pixels: MoCo v2).

The ops take an image as float32 colour planes [3, H, W] (channel first) with
values in [0, 1]; every op clips back to [0, 1]. Planes keep each op's
arithmetic on contiguous rows, which XLA:CPU vectorises: on [3, 32, 32]
images the hue shift ran 14x faster than on channel-last [32, 32, 3] ones.
augment_image and augment_batch take and return channel-last images.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from contrastive_jax.core.errors import ConfigError

# ITU-R BT.601 luma weights, as in tf.image.rgb_to_grayscale and torchvision
# (numpy: importing a module must not touch a device, or
# jax.distributed.initialize fails after it).
_LUMA = np.array([0.2989, 0.5870, 0.1140], np.float32)
COLOR_OPS = ("tensorflow", "torchvision")
BRIGHTNESS_OPS = ("add", "multiply")
BLUR_PADDINGS = ("zeros", "edge")


@dataclasses.dataclass(frozen=True)
class ViewAugment:
  """Photometric augmentation settings of one view (all probabilities in [0, 1]).

  brightness: the jitter range b (see brightness_op); contrast, saturation:
  factors drawn from U[max(0, 1 - s), 1 + s]; hue: a hue shift drawn from
  U[-hue, hue] (in turns, hue <= 0.5). The four are applied in random order,
  together with probability color_jitter_prob, each followed by a clip to
  [0, 1]. color_ops, brightness_op, grayscale_first and blur_padding choose the
  reference's version of the ops (module docstring).
  """

  brightness: float = 0.0
  contrast: float = 0.0
  saturation: float = 0.0
  hue: float = 0.0
  color_jitter_prob: float = 0.0
  grayscale_prob: float = 0.0
  blur_prob: float = 0.0
  blur_sigma_min: float = 0.1
  blur_sigma_max: float = 2.0
  solarize_prob: float = 0.0
  color_ops: str = "torchvision"
  brightness_op: str = "multiply"
  grayscale_first: bool = False
  blur_padding: str = "zeros"

  @classmethod
  def from_config(cls, cfg, field: str) -> "ViewAugment":
    """Builds and checks settings from a ConfigDict; field names it in errors.

    Raises:
      ConfigError: unknown key, a probability outside [0, 1], a negative
        jitter strength, hue > 0.5, a blur sigma range that is not
        0 < min <= max, or an unknown color_ops, brightness_op or blur_padding.
    """
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    for key in cfg:
      if key not in types:
        raise ConfigError(f"{field}.{key}", cfg[key], f"one of the known keys {sorted(types)}")
    choices = {
      "color_ops": COLOR_OPS,
      "brightness_op": BRIGHTNESS_OPS,
      "blur_padding": BLUR_PADDINGS,
    }
    for name, allowed in choices.items():
      if name in cfg and cfg[name] not in allowed:
        raise ConfigError(f"{field}.{name}", cfg[name], f"one of {list(allowed)}")
    if not isinstance(cfg.get("grayscale_first", False), bool):
      raise ConfigError(f"{field}.grayscale_first", cfg["grayscale_first"], "True or False")
    view = cls(**{k: v if types[k] in (str, bool) else float(v) for k, v in cfg.items()})
    for name in ("color_jitter_prob", "grayscale_prob", "blur_prob", "solarize_prob"):
      if not 0.0 <= getattr(view, name) <= 1.0:
        raise ConfigError(f"{field}.{name}", getattr(view, name), "in [0, 1]")
    for name in ("brightness", "contrast", "saturation"):
      if getattr(view, name) < 0:
        raise ConfigError(f"{field}.{name}", getattr(view, name), ">= 0")
    if not 0.0 <= view.hue <= 0.5:
      raise ConfigError(f"{field}.hue", view.hue, "in [0, 0.5]")
    if not 0 < view.blur_sigma_min <= view.blur_sigma_max:
      raise ConfigError(
        f"{field}.blur_sigma_min",
        view.blur_sigma_min,
        f"in (0, blur_sigma_max={view.blur_sigma_max}]",
      )
    return view


def to_grayscale(x):
  """Planes [3, ...] -> [3, ...] with the luma in every plane."""
  luma = _LUMA[0] * x[0] + _LUMA[1] * x[1] + _LUMA[2] * x[2]
  return jnp.broadcast_to(luma, x.shape)


def _wrap(x, period: float):
  """x modulo period in [0, period): floor, not the remainder's fmod call, so that XLA:CPU
  vectorises it."""
  return x - period * jnp.floor(x / period)


def rgb_to_hsv(x):
  """Planes [3, ...] RGB in [0, 1] -> HSV planes, hue in turns [0, 1)."""
  r, g, b = x[0], x[1], x[2]
  maxc = jnp.maximum(jnp.maximum(r, g), b)
  delta = maxc - jnp.minimum(jnp.minimum(r, g), b)
  safe = jnp.where(delta > 0, delta, 1.0)
  h = jnp.where(
    maxc == r, (g - b) / safe, jnp.where(maxc == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe)
  )
  h = h / 6.0  # In [-1/6, 5/6): only negatives wrap.
  h = jnp.where(delta > 0, jnp.where(h < 0, h + 1.0, h), 0.0)
  s = jnp.where(maxc > 0, delta / jnp.where(maxc > 0, maxc, 1.0), 0.0)
  return jnp.stack([h, s, maxc])


def hsv_to_rgb(x):
  """Inverse of rgb_to_hsv, planes [3, ...]."""
  h, s, v = x[0], x[1], x[2]

  # Standard piecewise-linear form: channel n uses k = (n + 6h) mod 6.
  def channel(n):
    k = _wrap(n + h * 6.0, 6.0)
    return v - v * s * jnp.clip(jnp.minimum(k, 4.0 - k), 0.0, 1.0)

  return jnp.stack([channel(5.0), channel(3.0), channel(1.0)])


def adjust_brightness(x, value, op: str):
  """x + value ('add': tf.image.adjust_brightness) or x * value ('multiply':
  SimCLR v2's random_brightness, torchvision's adjust_brightness before its clamp)."""
  return x + value if op == "add" else x * value


def adjust_contrast(x, factor, color_ops: str):
  """Contrast of planes x [3, H, W] scaled by factor about a mean.

  'tensorflow': each channel about its own mean over the image
  (tf.image.adjust_contrast); 'torchvision': every channel about the mean of
  the grayscale image (torchvision.transforms.functional.adjust_contrast,
  before its clamp).
  """
  if color_ops == "tensorflow":
    mean = jnp.mean(x, axis=(1, 2), keepdims=True)
  else:
    mean = jnp.mean(to_grayscale(x)[0])
  return (x - mean) * factor + mean


def adjust_saturation(x, factor, color_ops: str):
  """Saturation of planes x [3, ...] in [0, 1] scaled by factor.

  'tensorflow': the HSV saturation s times factor, clipped to [0, 1], hue and
  value kept (tf.image.adjust_saturation). Each channel is c = v - v s g(h)
  with g depending on the hue only, so the new one is v - (s' / s)(v - c),
  s' / s = min(factor, 1 / s): computed so, in RGB, without the HSV round trip.
  'torchvision': a blend with the grayscale image, gray + factor (x - gray)
  (torchvision's adjust_saturation before its clamp).
  """
  if color_ops == "tensorflow":
    v = jnp.maximum(jnp.maximum(x[0], x[1]), x[2])
    chroma = v - jnp.minimum(jnp.minimum(x[0], x[1]), x[2])
    ratio = jnp.where(chroma > 0, jnp.minimum(factor, v / jnp.where(chroma > 0, chroma, 1.0)), 0.0)
    return v - ratio * (v - x)
  gray = to_grayscale(x)
  return gray + (x - gray) * factor


def adjust_hue(x, delta):
  """Hue of planes x [3, ...] in [0, 1] shifted by delta turns, wrapped (tf.image.adjust_hue;
  torchvision's adjust_hue, without its uint8 rounding of the hue)."""
  hsv = rgb_to_hsv(x)
  return hsv_to_rgb(jnp.stack([_wrap(hsv[0] + delta, 1.0), hsv[1], hsv[2]]))


def _factor(key, strength):
  return jax.random.uniform(key, (), minval=max(0.0, 1.0 - strength), maxval=1.0 + strength)


def color_jitter(x, key, view: ViewAugment):
  """Brightness, contrast, saturation and hue jitter of planes x [3, H, W] in a random order,
  each clipped.

  Every reference applies the four in a random order and clips to [0, 1]
  after each (SimCLR's color_jitter_rand, BYOL's _color_transform_single_image,
  torchvision's ColorJitter, whose blends clamp), and skips those of strength
  0; which version of each op is view.color_ops' and view.brightness_op's.
  """
  perm_key, b_key, c_key, s_key, h_key = jax.random.split(key, 5)
  if view.brightness_op == "add":
    brightness = jax.random.uniform(b_key, (), minval=-view.brightness, maxval=view.brightness)
  else:
    brightness = _factor(b_key, view.brightness)
  ops = [
    (view.brightness, lambda y: adjust_brightness(y, brightness, view.brightness_op)),
    (view.contrast, lambda y: adjust_contrast(y, _factor(c_key, view.contrast), view.color_ops)),
    (
      view.saturation,
      lambda y: adjust_saturation(y, _factor(s_key, view.saturation), view.color_ops),
    ),
    (
      view.hue,
      lambda y: adjust_hue(y, jax.random.uniform(h_key, (), minval=-view.hue, maxval=view.hue)),
    ),
  ]
  clipped = [lambda y, f=f: jnp.clip(f(y), 0.0, 1.0) for strength, f in ops if strength > 0]
  if not clipped:
    return x
  order = jax.random.permutation(perm_key, len(clipped))
  if view.hue == 0:
    for position in range(len(clipped)):
      x = jax.lax.switch(order[position], clipped, x)
    return x
  # Batched (vmap), a switch evaluates every branch and selects: the hue shift, the costly
  # op, would run at every position. So the hue (last in `clipped`) runs once, between the
  # other ops' positions before it and those after it, each as a switch over the cheap ops.
  cheap, hue = clipped[:-1], clipped[-1]
  hue_position = jnp.argmax(order == len(cheap))
  cheap_order = jnp.where(
    jnp.arange(len(cheap)) < hue_position, order[:-1], order[1:]
  )  # `order` without the hue.
  for k in range(len(cheap)):
    x = jnp.where(k < hue_position, jax.lax.switch(cheap_order[k], cheap, x), x)
  x = hue(x)
  for k in range(len(cheap)):
    x = jnp.where(k >= hue_position, jax.lax.switch(cheap_order[k], cheap, x), x)
  return x


def gaussian_blur(x, sigma, padding: str = "zeros"):
  """Separable Gaussian blur of planes x [C, H, W] with a kernel of about 10% of the side.

  The kernel has radius H // 20 (SimCLR's int((H // 10) / 2), BYOL's
  int(H / 10 / 2)): 1 at 32 px, 11 at 224 px, none below 20 px. padding
  'zeros' is the references' 'SAME' convolution; 'edge' repeats the border
  pixels as PIL's blur does (MoCo v2, whose blur is PIL's three-box
  approximation of this Gaussian).
  """
  height, width = x.shape[1:]
  radius = height // 20
  if radius == 0:
    return x
  offsets = jnp.arange(-radius, radius + 1, dtype=jnp.float32)
  weights = jnp.exp(-(offsets**2) / (2.0 * sigma**2))
  weights = weights / jnp.sum(weights)
  padded = jnp.pad(
    x,
    ((0, 0), (radius, radius), (radius, radius)),
    mode="constant" if padding == "zeros" else "edge",
  )
  size = 2 * radius + 1
  rows = sum(weights[i] * padded[:, i : i + height, :] for i in range(size))
  return sum(weights[i] * rows[:, :, i : i + width] for i in range(size))


def solarize(x, threshold=0.5):
  """Inverts pixels at or above the threshold (BYOL, Table 6)."""
  return jnp.where(x < threshold, x, 1.0 - x)


def augment_image(image, key, view: ViewAugment):
  """Augments one image: uint8 or float [H, W, 3] -> float32 [H, W, 3] in [0, 1].

  Order: color jitter then grayscale (or grayscale first, MoCo v1), blur,
  solarize; the flip, done on the host, commutes with all of them. The ops run
  on the image's colour planes (module docstring).
  """
  x = jnp.moveaxis(image.astype(jnp.float32), -1, 0)
  if image.dtype == jnp.uint8:
    x = x / 255.0
  keys = jax.random.split(key, 6)

  def jitter(x):
    if view.color_jitter_prob == 0:
      return x
    apply = jax.random.bernoulli(keys[0], view.color_jitter_prob)
    return jnp.where(apply, color_jitter(x, keys[1], view), x)

  def grayscale(x):
    if view.grayscale_prob == 0:
      return x
    return jnp.where(jax.random.bernoulli(keys[2], view.grayscale_prob), to_grayscale(x), x)

  x = jitter(grayscale(x)) if view.grayscale_first else grayscale(jitter(x))
  if view.blur_prob > 0:
    sigma = jax.random.uniform(keys[3], (), minval=view.blur_sigma_min, maxval=view.blur_sigma_max)
    x = jnp.where(
      jax.random.bernoulli(keys[4], view.blur_prob), gaussian_blur(x, sigma, view.blur_padding), x
    )
  if view.solarize_prob > 0:
    x = jnp.where(jax.random.bernoulli(keys[5], view.solarize_prob), solarize(x), x)
  return jnp.moveaxis(x, 0, -1)


def augment_batch(images, key, view: ViewAugment):
  """Augments [B, H, W, 3] images with one key per example -> float32 [B, H, W, 3]."""
  keys = jax.random.split(key, images.shape[0])
  return jax.vmap(lambda im, k: augment_image(im, k, view))(images, keys)

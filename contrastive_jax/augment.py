"""On-device image augmentations, run inside the jitted train step.

The host pipeline (input_pipeline.py) does the random resized crop and flip; the
photometric ops here (color jitter, grayscale, Gaussian blur, solarize) run on the
accelerator, one PRNG key per example, so they cost no host CPU. Recipes:
SimCLR (Chen et al. 2020, Appendix A), MoCo v2 (Chen et al. 2020b), BYOL
(Grill et al. 2020, Table 6).

Images are float32 [H, W, 3] with values in [0, 1]; every op clips back to
[0, 1].
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from contrastive_jax.errors import ConfigError

# ITU-R BT.601 luma weights, as in tf.image.rgb_to_grayscale (numpy: importing a
# module must not touch a device, or jax.distributed.initialize fails after it).
_LUMA = np.array([0.2989, 0.5870, 0.1140], np.float32)


@dataclasses.dataclass(frozen=True)
class ViewAugment:
  """Photometric augmentation settings of one view (all probabilities in [0, 1]).

  brightness, contrast, saturation: jitter factors are drawn from
  U[max(0, 1 - s), 1 + s]; hue: a hue shift drawn from U[-hue, hue] (in turns,
  hue <= 0.5). The four are applied in random order, together with probability
  color_jitter_prob.
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

  @classmethod
  def from_config(cls, cfg, field: str) -> "ViewAugment":
    """Builds and checks settings from a ConfigDict; field names it in errors.

    Raises:
      ConfigError: unknown key, a probability outside [0, 1], a negative
        jitter strength, hue > 0.5 or a blur sigma range that is not 0 < min <= max.
    """
    known = {f.name for f in dataclasses.fields(cls)}
    for key in cfg:
      if key not in known:
        raise ConfigError(f"{field}.{key}", cfg[key], f"one of the known keys {sorted(known)}")
    view = cls(**{k: float(v) for k, v in cfg.items()})
    for name in ("color_jitter_prob", "grayscale_prob", "blur_prob", "solarize_prob"):
      if not 0.0 <= getattr(view, name) <= 1.0:
        raise ConfigError(f"{field}.{name}", getattr(view, name), "in [0, 1]")
    for name in ("brightness", "contrast", "saturation"):
      if getattr(view, name) < 0:
        raise ConfigError(f"{field}.{name}", getattr(view, name), ">= 0")
    if not 0.0 <= view.hue <= 0.5:
      raise ConfigError(f"{field}.hue", view.hue, "in [0, 0.5]")
    if not 0 < view.blur_sigma_min <= view.blur_sigma_max:
      raise ConfigError(f"{field}.blur_sigma_min", view.blur_sigma_min,
                        f"in (0, blur_sigma_max={view.blur_sigma_max}]")
    return view


def to_grayscale(x):
  """[H, W, 3] -> [H, W, 3] with the luma in every channel."""
  return jnp.broadcast_to(jnp.dot(x, _LUMA)[..., None], x.shape)


def rgb_to_hsv(x):
  """[..., 3] RGB in [0, 1] -> HSV, hue in turns [0, 1)."""
  r, g, b = x[..., 0], x[..., 1], x[..., 2]
  maxc, minc = jnp.max(x, -1), jnp.min(x, -1)
  delta = maxc - minc
  safe = jnp.where(delta > 0, delta, 1.0)
  h = jnp.where(maxc == r, (g - b) / safe,
                jnp.where(maxc == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe))
  h = jnp.where(delta > 0, (h / 6.0) % 1.0, 0.0)
  s = jnp.where(maxc > 0, delta / jnp.where(maxc > 0, maxc, 1.0), 0.0)
  return jnp.stack([h, s, maxc], -1)


def hsv_to_rgb(x):
  """Inverse of rgb_to_hsv."""
  h, s, v = x[..., 0], x[..., 1], x[..., 2]
  # Standard piecewise-linear form: channel n uses k = (n + 6h) mod 6.
  def channel(n):
    k = (n + h * 6.0) % 6.0
    return v - v * s * jnp.clip(jnp.minimum(k, 4.0 - k), 0.0, 1.0)
  return jnp.stack([channel(5.0), channel(3.0), channel(1.0)], -1)


def _jitter_factor(key, strength):
  return jax.random.uniform(key, (), minval=max(0.0, 1.0 - strength), maxval=1.0 + strength)


def color_jitter(x, key, view: ViewAugment):
  """Brightness, contrast, saturation and hue jitter in a random order."""
  perm_key, b_key, c_key, s_key, h_key = jax.random.split(key, 5)

  def brightness(y):
    return y * _jitter_factor(b_key, view.brightness)

  def contrast(y):
    mean = jnp.mean(jnp.dot(y, _LUMA))
    return (y - mean) * _jitter_factor(c_key, view.contrast) + mean

  def saturation(y):
    gray = to_grayscale(y)
    return gray + (y - gray) * _jitter_factor(s_key, view.saturation)

  def hue(y):
    delta = jax.random.uniform(h_key, (), minval=-view.hue, maxval=view.hue)
    hsv = rgb_to_hsv(y)
    return hsv_to_rgb(hsv.at[..., 0].set((hsv[..., 0] + delta) % 1.0))

  ops = [lambda y, f=f: jnp.clip(f(y), 0.0, 1.0)
         for f in (brightness, contrast, saturation, hue)]
  order = jax.random.permutation(perm_key, len(ops))
  return jax.lax.fori_loop(0, len(ops), lambda i, y: jax.lax.switch(order[i], ops, y), x)


def gaussian_blur(x, sigma):
  """Separable Gaussian blur with a kernel of 10% of the image side (SimCLR)."""
  radius = max(1, x.shape[0] // 20)
  offsets = jnp.arange(-radius, radius + 1, dtype=jnp.float32)
  weights = jnp.exp(-offsets**2 / (2.0 * sigma**2))
  weights = weights / jnp.sum(weights)
  padded = jnp.pad(x, ((radius, radius), (radius, radius), (0, 0)), mode="reflect")
  size = 2 * radius + 1
  rows = sum(weights[i] * padded[i:i + x.shape[0], :, :] for i in range(size))
  return sum(weights[i] * rows[:, i:i + x.shape[1], :] for i in range(size))


def solarize(x, threshold=0.5):
  """Inverts pixels at or above the threshold (BYOL, Table 6)."""
  return jnp.where(x < threshold, x, 1.0 - x)


def augment_image(image, key, view: ViewAugment):
  """Augments one image: uint8 or float [H, W, 3] -> float32 [H, W, 3] in [0, 1]."""
  x = image.astype(jnp.float32)
  if image.dtype == jnp.uint8:
    x = x / 255.0
  keys = jax.random.split(key, 6)
  if view.color_jitter_prob > 0:
    apply = jax.random.bernoulli(keys[0], view.color_jitter_prob)
    x = jnp.where(apply, color_jitter(x, keys[1], view), x)
  if view.grayscale_prob > 0:
    x = jnp.where(jax.random.bernoulli(keys[2], view.grayscale_prob), to_grayscale(x), x)
  if view.blur_prob > 0:
    sigma = jax.random.uniform(keys[3], (), minval=view.blur_sigma_min, maxval=view.blur_sigma_max)
    x = jnp.where(jax.random.bernoulli(keys[4], view.blur_prob), gaussian_blur(x, sigma), x)
  if view.solarize_prob > 0:
    x = jnp.where(jax.random.bernoulli(keys[5], view.solarize_prob), solarize(x), x)
  return x


def augment_batch(images, key, view: ViewAugment):
  """Augments [B, H, W, 3] images with one key per example -> float32 [B, H, W, 3]."""
  keys = jax.random.split(key, images.shape[0])
  return jax.vmap(lambda im, k: augment_image(im, k, view))(images, keys)


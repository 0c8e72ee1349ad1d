"""Each preset against its reference's own definition.

Crop samplers against numpy transcriptions of the reference algorithms (TF's
sample_distorted_bounding_box kernel, torchvision's RandomResizedCrop, BYOL's
_decode_and_random_crop); color ops against tf.image and torchvision's
formulas; blur against SimCLR's depthwise convolution; heads, weight-decay
masks and initialisations per method; the optimizers' update rules against
numpy transcriptions of SimCLR's, BYOL's and solo-learn's LARS. The old variant
names' recipes pinned; one crop spec (config.crop) in every config and preset, and
older saved configs' flat crop fields upgraded; DINO's configs against main_dino.py's
arguments of the README command each names.
"""

import ast
import glob
import json
import math
import os
import re

from helpers import CONFIG_DIR
from helpers import load_config
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from scipy import ndimage
from scipy import stats
import tensorflow as tf

from contrastive_jax import config_files
from contrastive_jax import models
from contrastive_jax import recipes
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import VariantError
from contrastive_jax.data import augment
from contrastive_jax.data import crop_spec
from contrastive_jax.data import crops
from contrastive_jax.methods import optim
from contrastive_jax.models import heads
from contrastive_jax.models import resnet
from contrastive_jax.training import probe_presets

# --- Crop samplers -------------------------------------------------------------------------


def _lrint(x):
  return int(np.rint(np.float32(x)))  # C's lrintf: round half to even.


def tf_kernel_crop(h, w, area_min, rng):
  """tensorflow/core/kernels/image/sample_distorted_bounding_box_op.cc (GenerateRandomCrop
  and SatisfiesOverlapConstraints) with SimCLR's arguments: the whole image as the box,
  min_object_covered 0.1, aspect ratio [3/4, 4/3], 100 attempts, else the whole image."""
  min_area, max_area = np.float32(area_min * w * h), np.float32(w * h)
  for _ in range(100):
    ratio = np.float32(rng.random() * (4 / 3 - 3 / 4) + 3 / 4)
    ch = _lrint(np.sqrt(min_area / ratio))
    max_h = _lrint(np.sqrt(max_area / ratio))
    if _lrint(max_h * ratio) > w:
      max_h = int((w + 0.5 - 1e-7) / ratio)
      if _lrint(max_h * ratio) > w:
        max_h -= 1
    max_h = min(max_h, h)
    ch = min(ch, max_h)
    if ch < max_h:
      ch += rng.integers(0, max_h - ch + 1)
    cw = _lrint(ch * ratio)
    if cw * ch < min_area:
      ch += 1
      cw = _lrint(ch * ratio)
    if cw * ch > max_area:
      ch -= 1
      cw = _lrint(ch * ratio)
    if not (min_area <= cw * ch <= max_area and 0 < cw <= w and 0 < ch <= h):
      continue
    if cw * ch / (w * h) >= np.float32(0.1):  # The crop covers >= 10% of the object.
      return ch, cw
  return h, w


def torchvision_crop(h, w, area_min, rng):
  """torchvision.transforms.RandomResizedCrop.get_params (scale (area_min, 1), ratio (3/4, 4/3))."""
  for _ in range(10):
    target = h * w * rng.uniform(area_min, 1.0)
    ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
    cw, ch = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
    if 0 < cw <= w and 0 < ch <= h:
      return ch, cw
  if w / h < 3 / 4:
    return int(round(w / (3 / 4))), w
  if w / h > 4 / 3:
    return h, int(round(h * 4 / 3))
  return h, w


def byol_crop(h, w, area_min, rng):
  """BYOL's byol/utils/dataset.py _decode_and_random_crop: one draw, sides clamped."""
  target = rng.uniform(area_min, 1.0) * h * w
  ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
  return (
    min(int(round(math.sqrt(target / ratio))), h),
    min(int(round(math.sqrt(target * ratio))), w),
  )


REFERENCE_CROPS = {"tensorflow": tf_kernel_crop, "torchvision": torchvision_crop, "byol": byol_crop}


def sampled_windows(sampler, h, w, n, area_min=0.08, area_max=1.0):
  """n windows (top, left, height, width) of crops.crop_window with seeds (0, i)."""
  fn = tf.function(
    lambda seeds: tf.map_fn(
      lambda s: tf.stack(crops.crop_window(h, w, s, sampler, area_min, area_max)),
      seeds,
      fn_output_signature=tf.int32,
    )
  )
  return fn(tf.stack([tf.zeros([n], tf.int64), tf.range(n, dtype=tf.int64)], 1)).numpy()


@pytest.mark.parametrize("h,w", [(32, 32), (168, 224)])
def test_crop_area_and_aspect_distributions_match_the_reference_algorithms(h, w):
  # Two-sample Kolmogorov-Smirnov on 4000 crops each: the critical distance at
  # alpha = 1e-3 is 1.95 sqrt(2 / 4000) = 0.044 (conservative for these
  # discrete sizes). The three references differ from each other by at least
  # 0.08 on these shapes, so the test tells them apart.
  n, critical = 4000, 1.95 * math.sqrt(2 / 4000)
  rng = np.random.default_rng(0)
  reference = {
    name: np.array([fn(h, w, 0.08, rng) for _ in range(n)]) for name, fn in REFERENCE_CROPS.items()
  }
  for sampler in crop_spec.SAMPLERS:
    windows = sampled_windows(sampler, h, w, n)
    top, left, ch, cw = windows.T
    assert np.all((top >= 0) & (left >= 0) & (top + ch <= h) & (left + cw <= w))
    ref = reference[sampler]
    area = ch * cw / (h * w)
    assert stats.ks_2samp(area, ref[:, 0] * ref[:, 1] / (h * w)).statistic < critical, sampler
    assert stats.ks_2samp(cw / ch, ref[:, 1] / ref[:, 0]).statistic < critical, sampler
    for other, other_ref in reference.items():
      if other != sampler:
        assert stats.ks_2samp(area, other_ref[:, 0] * other_ref[:, 1] / (h * w)).statistic > 0.06


def test_crop_fallbacks_and_offsets():
  # A 10 x 1000 image: no crop of >= 8% of it has an aspect ratio in [3/4, 4/3].
  seeds = [tf.constant([0, i], tf.int64) for i in range(20)]
  windows = {
    s: [np.array(crops.crop_window(10, 1000, seed, s, 0.08)) for seed in seeds]
    for s in crop_spec.SAMPLERS
  }
  for window in windows["tensorflow"]:  # TF's kernel: the whole image.
    np.testing.assert_array_equal(window, [0, 0, 10, 1000])
  for window in windows["torchvision"]:  # Centre crop at the widest allowed ratio.
    np.testing.assert_array_equal(window, [0, (1000 - 13) // 2, 10, round(10 * 4 / 3)])
  for top, left, ch, cw in windows["byol"]:  # Height clamped, width drawn.
    assert (top, ch) == (0, 10) and 24 <= cw <= 116 and 0 <= left <= 1000 - cw
  # Offsets are uniform over every position that fits, both ends included.
  top, left, ch, _ = sampled_windows("torchvision", 32, 32, 2000, area_min=0.25).T
  slack = 32 - ch
  assert np.any(top == slack) and np.any(top == 0)
  assert abs(np.mean(top / np.maximum(slack, 1)) - 0.5) < 0.05
  # A stateless function of the seed: the same seed, the same window.
  np.testing.assert_array_equal(
    sampled_windows("byol", 32, 32, 5), sampled_windows("byol", 32, 32, 5)
  )


# --- Colour operations ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def image():
  return np.random.default_rng(0).uniform(size=(6, 5, 3)).astype(np.float32)


def _gray(x):
  return np.tensordot(x, [0.2989, 0.587, 0.114], axes=(-1, -1))[..., None]


def _planes(image):
  """[H, W, 3] -> the ops' colour planes [3, H, W]."""
  return jnp.moveaxis(jnp.asarray(image), -1, 0)


def _image(planes):
  return np.moveaxis(np.asarray(planes), 0, -1)


def test_tensorflow_style_ops_equal_tf_image(image):
  x = _planes(image)
  for f in (0.3, 1.7):
    np.testing.assert_allclose(
      _image(augment.adjust_contrast(x, f, "tensorflow")),
      tf.image.adjust_contrast(image, f),
      atol=1e-6,
    )
    np.testing.assert_allclose(
      _image(augment.adjust_saturation(x, f, "tensorflow")),
      tf.image.adjust_saturation(image, f),
      atol=1e-5,
    )
  for d in (-0.3, 0.1):
    np.testing.assert_allclose(
      _image(augment.adjust_hue(x, d)), tf.image.adjust_hue(image, d), atol=1e-5
    )
    np.testing.assert_allclose(
      _image(augment.adjust_brightness(x, d, "add")),
      tf.image.adjust_brightness(image, d),
      atol=1e-6,
    )
  np.testing.assert_allclose(
    _image(augment.to_grayscale(x))[..., :1], tf.image.rgb_to_grayscale(image), atol=1e-6
  )


def test_torchvision_style_ops_equal_its_blend_formulas(image):
  # torchvision.transforms.functional: adjust_brightness blends with black,
  # adjust_contrast with the mean of the grayscale image, adjust_saturation
  # with the grayscale image: blend(img, other, f) = f img + (1 - f) other.
  x = _planes(image)
  for f in (0.3, 1.7):
    np.testing.assert_allclose(
      _image(augment.adjust_brightness(x, f, "multiply")), f * image, atol=1e-6
    )
    np.testing.assert_allclose(
      _image(augment.adjust_contrast(x, f, "torchvision")),
      f * image + (1 - f) * _gray(image).mean(),
      atol=1e-6,
    )
    np.testing.assert_allclose(
      _image(augment.adjust_saturation(x, f, "torchvision")),
      f * image + (1 - f) * _gray(image),
      atol=1e-6,
    )


def _jittered(view, value, n=2000):
  """color_jitter of a 1 x 1 image of one gray level under n keys."""
  x = jnp.full((3, 1, 1), value, jnp.float32)
  keys = jax.random.split(jax.random.PRNGKey(0), n)
  return np.asarray(jax.jit(jax.vmap(lambda k: augment.color_jitter(x, k, view)))(keys))[:, 0, 0, 0]


def test_brightness_switch_draws_the_references_distributions():
  # SimCLR v1 / BYOL: x + U[-b, b]; SimCLR v2 / torchvision: x * U[1 - b, 1 + b]. A gray
  # image is unchanged by contrast, saturation and hue. KS against the uniform
  # law, 2000 draws: 1.95 / sqrt(2000) = 0.044 at alpha 1e-3.
  add = augment.ViewAugment(brightness=0.4, brightness_op="add", color_ops="tensorflow")
  mul = augment.ViewAugment(brightness=0.4, brightness_op="multiply")
  critical = 1.95 / math.sqrt(2000)
  assert stats.kstest(_jittered(add, 0.5) - 0.5, stats.uniform(-0.4, 0.8).cdf).statistic < critical
  assert stats.kstest(_jittered(mul, 0.5) / 0.5, stats.uniform(0.6, 0.8).cdf).statistic < critical


def test_jitter_clips_after_each_op_and_grayscale_order(image):
  # Brightness + 0.8 then contrast: without the clip in between, contrast
  # would spread values above 1 (SimCLR clips after every op).
  view = augment.ViewAugment(
    brightness=0.8, contrast=0.8, color_jitter_prob=1.0, brightness_op="add", color_ops="tensorflow"
  )
  keys = jax.random.split(jax.random.PRNGKey(1), 64)
  augmented = jax.jit(
    jax.vmap(lambda k, view: augment.augment_image(jnp.asarray(image), k, view), in_axes=(0, None)),
    static_argnums=1,
  )
  out = augmented(keys, view)
  assert float(out.min()) >= 0 and float(out.max()) <= 1
  # MoCo v1: grayscale first, then the jitter, whose hue and saturation leave
  # a gray image gray; after the jitter (MoCo v2, SimCLR, BYOL) the hue shift
  # changes the gray levels.
  first = augment.ViewAugment(
    hue=0.5, color_jitter_prob=1.0, grayscale_prob=1.0, grayscale_first=True
  )
  after = augment.ViewAugment(hue=0.5, color_jitter_prob=1.0, grayscale_prob=1.0)
  gray = np.broadcast_to(_gray(image), image.shape)
  np.testing.assert_allclose(augmented(keys[:2], first), [gray, gray], atol=1e-5)
  assert not np.allclose(augmented(keys[:2], after), [gray, gray], atol=1e-3)


def test_blur_equals_simclrs_depthwise_convolution_and_pils_edge_padding():
  x = np.random.default_rng(2).uniform(size=(40, 40, 3)).astype(np.float32)
  sigma, radius = 1.3, 40 // 10 // 2  # SimCLR: kernel_size = height // 10, radius = size / 2.
  t = np.arange(-radius, radius + 1, dtype=np.float32)
  k = np.exp(-(t**2) / (2 * sigma**2))
  k /= k.sum()
  horizontal = np.tile(k.reshape(1, -1, 1, 1), [1, 1, 3, 1])
  vertical = np.tile(k.reshape(-1, 1, 1, 1), [1, 1, 3, 1])
  simclr = tf.nn.depthwise_conv2d(
    tf.nn.depthwise_conv2d(x[None], horizontal, [1] * 4, "SAME"), vertical, [1] * 4, "SAME"
  )[0]
  np.testing.assert_allclose(
    _image(augment.gaussian_blur(_planes(x), sigma, "zeros")), simclr, atol=1e-6
  )
  edge = ndimage.correlate1d(
    ndimage.correlate1d(x, k, axis=0, mode="nearest"), k, axis=1, mode="nearest"
  )
  np.testing.assert_allclose(
    _image(augment.gaussian_blur(_planes(x), sigma, "edge")), edge, atol=1e-6
  )


# --- Heads, initialisation and weight decay per method -------------------------------------


def test_simclr_head_ends_in_a_dense_without_bias_and_a_bn_without_offset():
  # SimCLR's model_util.projection_head: linear_layer(use_bias=True, use_bn=True)
  # for the middle layer (Dense without bias, BN with scale and offset, ReLU),
  # linear_layer(use_bias=False, use_bn=True) last (BN with center=False).
  head = models.build_mlp(load_config("simclr_cifar10").projector, "float32")
  x = jax.random.normal(jax.random.PRNGKey(0), (64, 512))
  variables = head.init(jax.random.PRNGKey(1), x, train=False)
  shapes = jax.tree.map(np.shape, variables["params"])
  assert shapes == {
    "Dense_0": {"kernel": (512, 512)},
    "BatchNorm_0": {"scale": (512,), "bias": (512,)},
    "Dense_1": {"kernel": (512, 128)},
    "BatchNorm_1": {"scale": (128,)},
  }
  z, _ = head.apply(variables, x, train=True, mutable=["batch_stats"])
  # Train mode: each output dimension has batch mean 0 (no offset) and std scale = 1.
  np.testing.assert_allclose(z.mean(0), 0, atol=1e-5)
  np.testing.assert_allclose(z.std(0), 1, atol=1e-3)
  # MoCo v2's head: nn.Linear twice, with biases, no BN.
  moco = models.build_mlp(load_config("moco_v2_imagenet").projector, "float32")
  shapes = jax.tree.map(np.shape, moco.init(jax.random.PRNGKey(1), x, train=False)["params"])
  assert shapes == {
    "Dense_0": {"kernel": (512, 2048), "bias": (2048,)},
    "Dense_1": {"kernel": (2048, 128), "bias": (128,)},
  }


# Per config: (conv init, last BN scale of each block zero, head init, every parameter
# decayed), from each reference's code: SimCLR (tf variance_scaling_initializer,
# batch_norm_relu(init_zero=True), linear_layer's normal(0.01), LARS excluding BN and
# biases), MoCo (torchvision's ResNet and nn.Linear, torch.optim.SGD's weight_decay),
# BYOL (Haiku's defaults, BlockV1's zero scale_init, exclude_bias_and_norm) and
# solo-learn's BYOL (torchvision's ResNet and nn.Linear, LARS excluding bias and norm).
METHOD_INITS = {
  "simclr_imagenet": ("variance_scaling", True, "normal_0.01", False),
  "simclr_cifar10": ("variance_scaling", True, "normal_0.01", False),
  "moco_v1_imagenet": ("he_normal", False, "torch", True),
  "moco_v2_imagenet": ("he_normal", False, "torch", True),
  "moco_v2_cifar10": ("he_normal", False, "torch", True),
  "byol_imagenet": ("variance_scaling", True, "lecun_normal", False),
  "byol_cifar10": ("he_normal", False, "torch", False),
}


@pytest.mark.parametrize("name", sorted(METHOD_INITS))
def test_each_config_initialises_and_decays_as_its_reference(name):
  config = load_config(name)
  conv_init, zero_init, head_init, decay_all = METHOD_INITS[name]
  assert (
    config.model.conv_init,
    config.model.zero_init_residual,
    config.projector.init,
    config.optimizer.weight_decay_mask,
  ) == (conv_init, zero_init, head_init, "all" if decay_all else "kernels")
  if "predictor" in config:
    assert config.predictor.init == head_init
  # SimCLR feeds [0, 1] pixels; MoCo and BYOL standardise them.
  identity = tuple(config.model.input_mean) == (0, 0, 0) and tuple(config.model.input_std) == (
    1,
    1,
    1,
  )
  assert identity == name.startswith("simclr")


def test_initialisations_and_weight_decay_masks_are_the_references():
  key = jax.random.PRNGKey(0)
  # Convolutions: He-normal fan-out, variance 2 / fan_out (torchvision's
  # kaiming_normal_(mode='fan_out')), or variance 1 / fan_in (TF's and Haiku's
  # variance scaling, truncated normal rescaled to keep the variance). 36864
  # draws: the sample variance is within 2% (5 standard errors) of the law's.
  shape = (3, 3, 64, 64)
  for name, variance in (("he_normal", 2 / (9 * 64)), ("variance_scaling", 1 / (9 * 64))):
    kernel = resnet.CONV_INITS[name](key, shape)
    assert np.var(kernel) == pytest.approx(variance, rel=0.02), name
  # Dense layers on 512 inputs: std 1/sqrt(512) (lecun_normal), 0.01, and PyTorch's
  # U(+-1/sqrt(512)) for kernel and bias (std bound / sqrt(3)).
  bound = 1 / math.sqrt(512)
  for name, std in (
    ("lecun_normal", bound),
    ("normal_0.01", 0.01),
    ("torch", bound / math.sqrt(3)),
  ):
    kernel_init, bias_init = heads._dense_inits(name, 512)  # pylint: disable=protected-access
    assert np.std(kernel_init(key, (512, 256))) == pytest.approx(std, rel=0.02), name
  kernel_init, bias_init = heads._dense_inits("torch", 512)  # pylint: disable=protected-access
  bias = bias_init(key, (256,))
  assert np.abs(kernel_init(key, (512, 256))).max() <= bound and 0 < np.abs(bias).max() <= bound
  # The wiring, on a one-block ResNet: the block's last BN scale is 0 or 1, and the
  # decay mask is every leaf ('all') or the kernels only ('kernels').
  for zero_init in (True, False):
    model = heads.ContrastiveModel(
      encoder=resnet.ResNet(
        ("basic", (1,)), width=0.0625, stem="cifar", zero_init_residual=zero_init
      ),
      projector=heads.MLP((8,), 4, final_bn=True),
    )
    params = model.init(key, jnp.zeros((1, 8, 8, 3)), train=False)["params"]  # Eager: cheaper.
    block = params["encoder"]["BasicBlock_0"]
    np.testing.assert_array_equal(block["BatchNorm_1"]["scale"], 0.0 if zero_init else 1.0)
    np.testing.assert_array_equal(block["BatchNorm_0"]["scale"], 1.0)
  for which in ("all", "kernels"):
    flat = {
      jax.tree_util.keystr(p): v
      for p, v in jax.tree_util.tree_leaves_with_path(optim.decay_mask(params, which))
    }
    assert all(
      decayed == (which == "all" or key.endswith("['kernel']")) for key, decayed in flat.items()
    )
    assert any(key.endswith("['bias']") for key in flat)


# --- Optimizers ----------------------------------------------------------------------------


def _two_steps(cfg, w, grads, lrs):
  schedule = lambda step: jnp.asarray(lrs)[step]
  tx = optim.build_optimizer(ml_collections.ConfigDict(cfg), schedule)
  params = {"kernel": jnp.asarray(w), "bias": jnp.zeros(2)}
  state = tx.init(params)
  for g in grads:
    updates, state = tx.update({"kernel": jnp.asarray(g), "bias": jnp.ones(2)}, state, params)
    params = optax.apply_updates(params, updates)
  return np.asarray(params["kernel"]), np.asarray(params["bias"])


def test_lars_variants_follow_their_references_update_rules():
  rng = np.random.default_rng(0)
  w0 = rng.normal(size=(3, 4))
  grads = rng.normal(size=(2, 3, 4))
  lrs, m, wd, eta = (0.5, 2.0), 0.9, 0.1, 0.02

  def reference(w, trust, lr_in_momentum):
    v = np.zeros_like(w)
    for g, lr in zip(grads, lrs):
      u = g + wd * w
      step = trust(w, g) * u
      v = m * v + (lr * step if lr_in_momentum else step)
      w = w - (v if lr_in_momentum else lr * v)
    return w

  simclr = lambda w, g: eta * np.linalg.norm(w) / np.linalg.norm(g + wd * w)
  lars = recipes.optimizer("lars", 1.0, wd, trust_coefficient=eta)
  # SimCLR's LARSOptimizer: next_v = m v + lr * trust * (g + wd w); w -= next_v.
  np.testing.assert_allclose(
    _two_steps(dict(lars, lr_before_momentum=True), w0, grads, lrs)[0],
    reference(w0, simclr, True),
    rtol=1e-5,
  )
  # BYOL's optimizers.lars: mu = m mu + trust * (g + wd w); w -= lr * mu.
  np.testing.assert_allclose(
    _two_steps(lars, w0, grads, lrs)[0], reference(w0, simclr, False), rtol=1e-5
  )
  # solo-learn's LARS with clip_lars_lr: ratio eta |w| / (|g| + wd |w| + 1e-8), then
  # min(ratio / lr, 1); torch's momentum; biases excluded (plain SGD on them).
  larc = recipes.optimizer("larc", 1.0, wd, trust_coefficient=eta)
  for scale in (1.0, 1e-3):  # The ratio clipped at the lr, and not.
    lrs_here = (lrs[0] * scale, lrs[1] * scale)
    kernel, bias = _two_steps(larc, w0, grads, lrs_here)
    w, v = w0, np.zeros_like(w0)
    for g, lr in zip(grads, lrs_here):
      ratio = eta * np.linalg.norm(w) / (np.linalg.norm(g) + wd * np.linalg.norm(w) + 1e-8)
      v = m * v + min(ratio / lr, 1) * (g + wd * w)
      w = w - lr * v
    np.testing.assert_allclose(kernel, w, rtol=1e-5)
    np.testing.assert_allclose(bias, -lrs_here[0] - lrs_here[1] * (m + 1), rtol=1e-6)
  # MoCo's torch.optim.SGD(weight_decay=wd): every parameter decayed, bias included.
  sgd = recipes.optimizer("sgd", 1.0, wd, weight_decay_mask="all")
  _, bias = _two_steps(sgd, w0, grads, lrs)
  v1 = 1.0
  b1 = -lrs[0] * v1
  v2 = m * v1 + (1.0 + wd * b1)
  np.testing.assert_allclose(bias, b1 - lrs[1] * v2, rtol=1e-6)


# --- Config arguments and the crop spec ----------------------------------------------------

# (config file, old variant name) -> fields that variant gives, from its docstring and the
# reference it names: the old names keep computing what they did.
OLD_VARIANTS = {
  ("simclr_cifar10", "runlocal"): {
    "batch_size": 256,
    "duration": "1500 steps",
    "model.width": 0.25,
    "model.stem": "imagenet",
    "model.dtype": "float32",
    "projector.hidden_dims": (128,),
    "crop": dict(sampler="tensorflow", area_min=0.08, resize="tf_bicubic"),
    "evaluators.knn.every": "500 steps",
    "optimizer.warmup_epochs": 1.0,
  },
  ("moco_v2_cifar10", "runlocal"): {
    "batch_size": 256,
    "duration": "1500 steps",
    "moco.bn_group_size": 32,
    "crop": dict(sampler="torchvision", area_min=0.08, resize="pil_bilinear"),
  },
  ("byol_cifar10", "runlocal"): {
    "duration": "1200 steps",
    "evaluators.knn.every": "400 steps",
    "model.conv_init": "variance_scaling",
    "model.width": 0.25,
    "optimizer.name": "lars",
    "optimizer.weight_decay": 1.5e-6,
    "projector.hidden_dims": (512,),
    "crop": dict(sampler="byol", area_min=0.08, resize="tf_bicubic"),
  },
  ("mocov3_cifar10", "runlocal_vit"): {
    "model.name": "vit_tiny",
    "model.width": 0.5,
    "model.depth": 4,
    "model.patch_size": 8,
    "model.dtype": "float32",
    "optimizer.name": "adamw",
    "optimizer.base_lr": 1e-3,
    "optimizer.warmup_epochs": 0.5,
    "duration": "800 steps",
    "evaluators.online_probe.every": "400 steps",
    "predictor.final_bn": True,
    "predictor.hidden_dims": (512,),
    "projector.out_dim": 128,
    "crop": dict(sampler="torchvision", area_min=0.08, resize="pil_bicubic"),
  },
  ("mocov3_imagenet", "resnet50"): {
    "model.name": "resnet50",
    "duration": "100 epochs",
    "optimizer.base_lr": 0.6,
    "optimizer.weight_decay": 1e-6,
    "moco.momentum": 0.99,
    "temperature": 1.0,
    "crop": dict(sampler="torchvision", area_min=0.2, resize="pil_bilinear"),
  },
  ("mocov3_imagenet", "resnet50_1000ep"): {
    "duration": "1000 epochs",
    "optimizer.base_lr": 0.3,
    "optimizer.weight_decay": 1.5e-6,
    "moco.momentum": 0.996,
  },
  ("mocov3_imagenet", "vit_small"): {
    "model.name": "vit_small",
    "model.dtype": "bfloat16",
    "duration": "300 epochs",
    "optimizer.base_lr": 1.5e-4,
    "optimizer.warmup_epochs": 40.0,
  },
  ("byol_imagenet", "300ep"): {
    "duration": "300 epochs",
    "optimizer.base_lr": 0.3,
    "optimizer.weight_decay": 1e-6,
    "byol.tau_base": 0.99,
  },
  ("simclr_imagenet", "1000ep"): {"duration": "1000 epochs", "optimizer.base_lr": 0.3},
  ("moco_v2_imagenet", "800ep"): {"duration": "800 epochs"},
}


def _field(config, dotted):
  for part in dotted.split("."):
    config = config[part]
  return config.to_dict() if isinstance(config, ml_collections.ConfigDict) else config


@pytest.mark.parametrize("name,variant", sorted(OLD_VARIANTS))
def test_old_variant_names_keep_their_recipes(name, variant):
  config = load_config(name, variant)
  assert {k: _field(config, k) for k in OLD_VARIANTS[name, variant]} == (
    OLD_VARIANTS[name, variant]
  )


def _crops(tree, path=""):
  """(path, crop spec) of every 'crop' in a nested dict, and every flat crop_* field."""
  for key, value in tree.items():
    if key == "crop" or key.startswith("crop_"):
      yield path + key, value
    elif isinstance(value, dict):
      yield from _crops(value, f"{path}{key}.")


def test_every_config_and_probe_preset_spells_the_crop_alike():
  names = [os.path.basename(p)[:-3] for p in glob.glob(os.path.join(CONFIG_DIR, "*.py"))]
  found = {
    f"preset {name}.{path}": crop
    for name, preset in probe_presets.LINEAR_PROBE_PRESETS.items()
    for path, crop in _crops(preset)
  }
  for name in names:
    for arg in ("", "runlocal"):
      try:
        config = load_config(name, arg)
      except VariantError:
        continue
      found.update({f"{name}:{arg} {path}": crop for path, crop in _crops(config.to_dict())})
  assert len(found) > 20
  for where, crop in found.items():
    assert where.endswith(" crop") or where.endswith(".crop"), where
    assert set(crop) == {"sampler", "area_min", "resize"}, where
    if crop["sampler"] is not None:  # The probe's are None until a preset fills them.
      assert crop_spec.CropSpec(**crop).sampler in crop_spec.SAMPLERS, where


def test_upgrade_config_reads_the_flat_crop_fields_of_older_saved_configs():
  current = load_config("byol_cifar10", "runlocal")
  assert current.format_version == config_files.FORMAT_VERSION == 1
  # A saved config as the format before format_version wrote it (JSON: lists for tuples).
  old = json.loads(json.dumps(current.to_dict()))
  del old["format_version"]
  crop = old.pop("crop")
  old.update(
    crop_sampler=crop["sampler"], crop_area_min=crop["area_min"], crop_resize=crop["resize"]
  )
  saved = ml_collections.ConfigDict(old)
  upgraded = config_files.upgrade_config(saved)
  assert upgraded.crop.to_dict() == dict(sampler="byol", area_min=0.08, resize="tf_bicubic")
  assert upgraded.to_dict() == json.loads(json.dumps(current.to_dict()))
  assert "crop_sampler" in saved and "format_version" not in saved  # Left as it was.
  # A current one passes unchanged; a newer one is refused in one line.
  again = config_files.upgrade_config(upgraded)
  assert again.to_dict() == upgraded.to_dict()
  newer = ml_collections.ConfigDict(dict(upgraded.to_dict(), format_version=2))
  with pytest.raises(
    ConfigError,
    match=r"^config.format_version=2: must be at most 1: the "
    r"config was written by a newer version",
  ):
    config_files.upgrade_config(newer)


def test_probe_presets_fill_the_crop_and_a_given_field_wins():
  config = load_config("linear_probe", "runlocal")
  config.crop.area_min = 0.5
  filled = probe_presets.fill_probe_preset(config, "byol")
  assert filled.crop.to_dict() == dict(sampler="byol", area_min=0.5, resize="tf_bicubic")
  crop_spec.check_config(filled)
  filled.crop.sampler = "tensorflw"
  with pytest.raises(ConfigError, match=r"^config.crop.sampler='tensorflw': must be one of "):
    crop_spec.check_config(filled)


# --- DINO's configs against the reference README's commands ----------------------------------

# main_dino.py's argparse defaults (facebookresearch/dino), the arguments its commands change.
MAIN_DINO_DEFAULTS = dict(
  arch="vit_small",
  patch_size=16,
  out_dim=65536,
  norm_last_layer=True,
  momentum_teacher=0.996,
  use_bn_in_head=False,
  warmup_teacher_temp=0.04,
  teacher_temp=0.04,
  warmup_teacher_temp_epochs=0,
  weight_decay=0.04,
  weight_decay_end=0.4,
  clip_grad=3.0,
  batch_size_per_gpu=64,
  epochs=100,
  freeze_last_layer=1,
  lr=0.0005,
  warmup_epochs=10,
  min_lr=1e-6,
  optimizer="adamw",
  global_crops_scale=(0.4, 1.0),
  local_crops_number=8,
  local_crops_scale=(0.05, 0.4),
  drop_path_rate=0.1,
)
# (config, variant) -> (GPUs, the README's command line, its published (kNN, linear) or None).
DINO_COMMANDS = {
  ("dino_imagenet", "vit_small"): (8, "--arch vit_small", (69.3, 74.0)),
  ("dino_imagenet", "vit_small_300ep"): (
    16,  # run_with_submitit.py's --nodes 2 --ngpus 8.
    "--arch vit_small --epochs 300 --teacher_temp 0.07 --warmup_teacher_temp_epochs 30 "
    "--norm_last_layer false",
    (73.3, 76.0),
  ),
  ("dino_imagenet", "resnet50"): (
    8,
    "--arch resnet50 --optimizer sgd --lr 0.03 --weight_decay 1e-4 --weight_decay_end 1e-4 "
    "--global_crops_scale 0.14 1 --local_crops_scale 0.05 0.14",
    None,
  ),
  ("dino_images", ""): (
    8,
    "--arch resnet50 --optimizer sgd --lr 0.03 --weight_decay 1e-4 --weight_decay_end 1e-4 "
    "--global_crops_scale 0.14 1 --local_crops_scale 0.05 0.14",
    None,
  ),
}


def parse_main_dino(command: str) -> dict:
  """main_dino.py's arguments of a command line: its defaults, the command's values parsed
  as the defaults' types (nargs '+' for the crop scales, bool_flag's 'false'/'true')."""
  args, tokens = dict(MAIN_DINO_DEFAULTS), command.split()
  while tokens:
    key = tokens.pop(0)[2:]
    values = []
    while tokens and not tokens[0].startswith("--"):
      values.append(tokens.pop(0))
    default = MAIN_DINO_DEFAULTS[key]
    if isinstance(default, tuple):
      args[key] = tuple(float(v) for v in values)
    elif isinstance(default, bool):
      args[key] = values[0] == "true"
    else:
      args[key] = type(default)(values[0])
  return args


@pytest.mark.parametrize("name,variant", sorted(DINO_COMMANDS))
def test_dino_configs_pin_the_reference_readme_commands(name, variant):
  gpus, command, targets = DINO_COMMANDS[name, variant]
  ref = parse_main_dino(command)
  config = load_config(name, variant)
  if name == "dino_images":  # Its stated departures: the other image-folder configs' scale.
    assert (config.model.name, config.batch_size, config.duration) == (
      "resnet18",
      256,
      "200 epochs",
    )
    assert config.image_size == 224 and config.evaluators.knn.k == 20
  else:
    assert config.model.name == ref["arch"]
    assert config.batch_size == gpus * ref["batch_size_per_gpu"]
    assert config.duration == f"{ref['epochs']} epochs"
    assert (config.dataset, config.image_size) == ("imagenet2012", 224)
  if ref["arch"] == "vit_small":
    # DINO's vit_small: patch 16, D 384, 6 heads, a learned position embedding.
    m = config.model
    assert (m.patch_size, models.encoder_width(m), m.num_heads) == (ref["patch_size"], 384, 6)
    assert m.position_embedding == "learned" and not m.random_patch_projection
  else:
    # torchvision's resnet50() as main_dino.py builds it: He-normal (fan-out) init, last BN
    # scale 1.
    assert (config.model.conv_init, config.model.zero_init_residual) == ("he_normal", False)
  assert config.dino.to_dict() == dict(
    out_dim=ref["out_dim"],
    hidden_dim=2048,  # DINOHead's defaults.
    bottleneck_dim=256,
    num_layers=3,
    use_bn_in_head=ref["use_bn_in_head"],
    norm_last_layer=ref["norm_last_layer"],
    momentum_teacher=ref["momentum_teacher"],
    student_temp=0.1,  # DINOLoss's defaults.
    warmup_teacher_temp=ref["warmup_teacher_temp"],
    teacher_temp=ref["teacher_temp"],
    warmup_teacher_temp_epochs=ref["warmup_teacher_temp_epochs"],
    center_momentum=0.9,
    # main_dino.py passes --drop_path_rate to its ViTs only (vits.__dict__[arch](...)).
    drop_path_rate=ref["drop_path_rate"] if ref["arch"].startswith("vit") else 0.0,
  )
  o = config.optimizer
  assert (o.name, o.base_lr, o.lr_scaling, o.momentum) == (
    ref["optimizer"],
    ref["lr"],
    "linear",
    0.9,
  )
  assert (o.warmup_epochs, o.schedule, o.final_lr) == (
    ref["warmup_epochs"],
    "cosine",
    ref["min_lr"],
  )
  assert o.weight_decay == ref["weight_decay"] and o.weight_decay_mask == "kernels"
  # A constant weight decay (start == end) is written without an end.
  assert (o.weight_decay_end or o.weight_decay) == ref["weight_decay_end"]
  assert (o.clip_per_tensor, o.freeze_last_layer_epochs) == (
    ref["clip_grad"],
    ref["freeze_last_layer"],
  )
  assert config.crop.to_dict() == dict(
    sampler="torchvision", area_min=ref["global_crops_scale"][0], resize="pil_bicubic"
  )
  assert ref["global_crops_scale"][1] == 1.0
  assert config.local_crops.to_dict() == dict(
    number=ref["local_crops_number"],
    size=96,
    area_min=ref["local_crops_scale"][0],
    area_max=ref["local_crops_scale"][1],
  )
  views = [
    augment.ViewAugment.from_config(config.augment[v], v) for v in ("view1", "view2", "local")
  ]
  assert [(v.blur_prob, v.solarize_prob) for v in views] == [(1.0, 0.0), (0.1, 0.2), (0.5, 0.0)]
  for v in views:
    assert (v.brightness, v.contrast, v.saturation, v.hue) == (0.4, 0.4, 0.2, 0.1)
    assert (v.color_jitter_prob, v.grayscale_prob) == (0.8, 0.2)
  assert (config.evaluators.knn.k, config.evaluators.knn.temperature) == (20, 0.07)
  with open(os.path.join(CONFIG_DIR, name + ".py")) as f:
    doc = f.read()
  assert command.split("--arch")[1].split()[0] in doc
  if targets:
    assert f"kNN {targets[0]}%, linear {targets[1]}%" in doc
  for arg in ("", "runlocal"):
    try:
      checked = load_config(name, arg)
    except VariantError:
      continue
    optim.check_optimizer_config(checked.optimizer)
    crop_spec.check_local_crops(checked)


def test_upgrade_config_gives_an_older_dino_config_no_stochastic_depth():
  current = load_config("dino_cifar10", "runlocal")
  old = current.to_dict()
  del old["dino"]["drop_path_rate"]
  upgraded = config_files.upgrade_config(ml_collections.ConfigDict(old))
  assert upgraded.dino.drop_path_rate == 0.0
  assert upgraded.to_dict() == current.to_dict()  # The runlocal trains without it too.


def test_upgrade_config_gives_older_models_and_heads_the_networks_they_trained():
  # A ResNet config and its projector as written before their fields existed.
  current = load_config("moco_v2_cifar10", "runlocal")
  old = json.loads(json.dumps(current.to_dict()))
  for field in (
    "input_mean",
    "input_std",
    "zero_init_residual",
    "conv_init",
    "padding",
    "stage_projection",
  ):
    del old["model"][field]
  del old["projector"]["init"]
  upgraded = config_files.upgrade_config(ml_collections.ConfigDict(old))
  model = upgraded.model
  assert (model.zero_init_residual, model.conv_init, model.padding) == (True, "he_normal", "legacy")
  assert model.stage_projection is False
  assert (tuple(model.input_mean), tuple(model.input_std)) == ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
  assert upgraded.projector.init == "lecun_normal"
  encoder = models.build_encoder(model)
  assert (encoder.padding, encoder.conv_init, encoder.zero_init_residual) == (
    "legacy",
    "he_normal",
    True,
  )
  assert models.build_mlp(upgraded.projector, "float32").dense_init == "lecun_normal"
  # A ViT gets the input fields only; a current config passes unchanged.
  vit_config = load_config("mocov3_cifar10", "runlocal_vit")
  old = json.loads(json.dumps(vit_config.to_dict()))
  del old["model"]["input_mean"], old["model"]["input_std"]
  upgraded = config_files.upgrade_config(ml_collections.ConfigDict(old))
  assert tuple(upgraded.model.input_std) == (1.0, 1.0, 1.0) and "padding" not in upgraded.model
  again = config_files.upgrade_config(current)
  assert again.to_dict() == current.to_dict()


def test_every_config_file_says_what_it_sets_and_links_its_docs_page():
  docs = os.path.join(os.path.dirname(CONFIG_DIR), "docs")
  for path in sorted(glob.glob(os.path.join(CONFIG_DIR, "*.py"))):
    with open(path) as f:
      doc = ast.get_docstring(ast.parse(f.read())) or ""
    pages = re.findall(r"docs/([a-z_]+\.md)", doc)
    assert pages, f"{path}: its docstring names no docs/*.md page"
    for page in pages:
      assert os.path.isfile(os.path.join(docs, page)), f"{path}: no docs/{page}"

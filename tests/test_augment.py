"""On-device augmentations against independent references; key separation."""

import colorsys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.data import augment
from contrastive_jax.methods import common


def test_hsv_round_trip_matches_colorsys():
  rgb = np.random.default_rng(0).uniform(size=(200, 3)).astype(np.float32)
  rgb[:3] = [[0.5, 0.5, 0.5], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]  # Gray, pure red, black.
  hsv = np.asarray(augment.rgb_to_hsv(jnp.asarray(rgb.T))).T  # Planes [3, N].
  ref = np.array([colorsys.rgb_to_hsv(*p) for p in rgb])
  np.testing.assert_allclose(hsv, ref, atol=1e-5)
  np.testing.assert_allclose(augment.hsv_to_rgb(jnp.asarray(hsv.T)).T, rgb, atol=1e-5)


def test_grayscale_blur_and_solarize_hand_cases():
  x = jnp.array([[[1.0]], [[0.0]], [[0.0]]])  # Planes [3, 1, 1].
  np.testing.assert_allclose(augment.to_grayscale(x), [[[0.2989]]] * 3, rtol=1e-6)
  constant = jnp.full((3, 20, 20), 0.3)
  np.testing.assert_allclose(augment.gaussian_blur(constant, 1.0, "edge"), constant, atol=1e-6)
  # Zero padding (the references' 'SAME' convolution) darkens the border only.
  zeros = augment.gaussian_blur(constant, 1.0, "zeros")
  np.testing.assert_allclose(zeros[:, 1:-1, 1:-1], constant[:, 1:-1, 1:-1], atol=1e-6)
  assert float(zeros[0, 0, 5]) < 0.3
  impulse = jnp.zeros((3, 20, 20)).at[:, 10, 10].set(1.0)
  blurred = augment.gaussian_blur(impulse, 1.0)
  w = np.exp(-(np.arange(-1, 2) ** 2) / 2.0)
  w /= w.sum()  # Radius 1 for a 20-pixel side (10% kernel).
  np.testing.assert_allclose(blurred[0, 9:12, 9:12], np.outer(w, w), atol=1e-6)
  np.testing.assert_allclose(
    augment.solarize(jnp.array([0.2, 0.5, 0.9])), [0.2, 0.5, 0.1], atol=1e-6
  )


def test_color_jitter_stays_in_range_and_changes_images():
  view = augment.ViewAugment(
    brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1, color_jitter_prob=1.0
  )
  images = jnp.asarray(np.random.default_rng(1).integers(0, 256, (8, 16, 16, 3)), jnp.uint8)
  out = augment.augment_batch(images, jax.random.PRNGKey(0), view)
  assert out.dtype == jnp.float32 and float(out.min()) >= 0 and float(out.max()) <= 1
  assert not np.allclose(out, images / 255.0, atol=1e-3)
  identity = augment.augment_batch(images, jax.random.PRNGKey(0), augment.ViewAugment())
  np.testing.assert_allclose(identity, images / 255.0, atol=1e-7)


def _jitter_in_drawn_order(planes, key, view):
  """Reference: the four ops one after another in the permutation drawn from key, each
  clipped, on one image, eagerly (no switch, no batching)."""
  perm_key, b_key, c_key, s_key, h_key = jax.random.split(key, 5)
  factor = lambda k, s: jax.random.uniform(k, (), minval=max(0.0, 1.0 - s), maxval=1.0 + s)
  ops = [
    lambda y: augment.adjust_brightness(y, factor(b_key, view.brightness), "multiply"),
    lambda y: augment.adjust_contrast(y, factor(c_key, view.contrast), view.color_ops),
    lambda y: augment.adjust_saturation(y, factor(s_key, view.saturation), view.color_ops),
    lambda y: augment.adjust_hue(
      y, jax.random.uniform(h_key, (), minval=-view.hue, maxval=view.hue)
    ),
  ]
  order = np.asarray(jax.random.permutation(perm_key, 4))
  for op in order:
    planes = jnp.clip(ops[op](planes), 0.0, 1.0)
  return planes, int(np.argmax(order == 3))


@pytest.mark.parametrize("color_ops", augment.COLOR_OPS)
def test_batched_color_jitter_applies_the_drawn_order_to_each_image(color_ops):
  view = augment.ViewAugment(
    brightness=0.8, contrast=0.8, saturation=0.8, hue=0.4, color_ops=color_ops
  )
  planes = jnp.asarray(np.random.default_rng(2).uniform(size=(48, 3, 6, 6)), jnp.float32)
  keys = jax.random.split(jax.random.PRNGKey(3), 48)
  out = jax.jit(jax.vmap(lambda x, k: augment.color_jitter(x, k, view)))(planes, keys)
  hue_positions = set()
  for x, key, got in zip(planes, keys, out):
    want, hue_position = _jitter_in_drawn_order(x, key, view)
    # Float32 rounding of the HSV round trip, jitted against eager; a wrong order or a
    # missed clip moves pixels by 1e-2 and more at these strengths.
    np.testing.assert_allclose(got, want, atol=1e-5)
    hue_positions.add(hue_position)
  assert hue_positions == {0, 1, 2, 3}


def test_view_keys_differ_across_steps_devices_and_views():
  rng = jax.random.PRNGKey(0)
  keys = {
    tuple(np.asarray(common.view_key(rng, s, d, v)))
    for s in range(3)
    for d in range(8)
    for v in range(2)
  }
  assert len(keys) == 3 * 8 * 2


def test_augmentations_differ_across_devices_and_views_in_shard_map():
  mesh = mesh_lib.make_mesh()
  view = augment.ViewAugment(
    brightness=0.8, contrast=0.8, saturation=0.8, hue=0.2, color_jitter_prob=1.0
  )
  image = np.random.default_rng(2).integers(0, 256, (1, 1, 8, 8, 3), np.uint8)
  images = jax.device_put(
    np.tile(image, (8, 2, 1, 1, 1)), mesh_lib.batch_sharded(mesh)
  )  # Same image everywhere.
  fn = jax.jit(
    jax.shard_map(
      lambda im, rng, step: jnp.stack(common.augmented_views(im, rng, step, (view, view)), 1),
      mesh=mesh,
      in_specs=(jax.P(mesh_lib.DATA_AXIS), jax.P(), jax.P()),
      out_specs=jax.P(mesh_lib.DATA_AXIS),
    )
  )
  out = np.asarray(fn(images, jax.random.PRNGKey(0), jnp.int32(0))).reshape(16, -1)
  assert len({row.tobytes() for row in out}) == 16
  again = np.asarray(fn(images, jax.random.PRNGKey(0), jnp.int32(0))).reshape(16, -1)
  np.testing.assert_array_equal(out, again)  # A function of (rng, step) alone.

"""BYOL: tau schedule, loss vs numpy, target EMA, asymmetric views, 8 devices vs one."""

from helpers import load_config
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_simclr import numeric_grad

from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.data import augment
from contrastive_jax.methods import byol
from contrastive_jax.methods import common
from contrastive_jax.methods import pretraining


def test_tau_schedule_first_middle_last():
  # tau_k = 1 - (1 - 0.996) (cos(pi k / K) + 1) / 2 with K = 100.
  values = [float(common.ema_momentum(0.996, k, 100, "cosine")) for k in (0, 50, 100)]
  np.testing.assert_allclose(values, [0.996, 0.998, 1.0], rtol=1e-7)
  assert float(common.ema_momentum(0.99, 30, 100, "constant")) == pytest.approx(0.99)


def byol_loss_numpy(p1, p2, z1, z2):
  def reg(p, z):
    p = p / np.linalg.norm(p, axis=1, keepdims=True)
    z = z / np.linalg.norm(z, axis=1, keepdims=True)
    return np.mean(2 - 2 * np.sum(p * z, axis=1))

  return reg(p1, z2) + reg(p2, z1)


def test_loss_value_and_gradient_match_numpy_and_spare_the_target():
  rng = np.random.default_rng(0)
  p1, p2, z1, z2 = rng.normal(size=(4, 5, 3))
  args = [jnp.asarray(a, jnp.float32) for a in (p1, p2, z1, z2)]
  np.testing.assert_allclose(byol.byol_loss(*args), byol_loss_numpy(p1, p2, z1, z2), rtol=1e-5)
  g = jax.grad(lambda *a: byol.byol_loss(*a), argnums=(0, 1, 2, 3))(*args)
  np.testing.assert_allclose(
    g[0], numeric_grad(lambda a: byol_loss_numpy(a, p2, z1, z2), p1), atol=1e-5
  )
  np.testing.assert_allclose(
    g[1], numeric_grad(lambda a: byol_loss_numpy(p1, a, z1, z2), p2), atol=1e-5
  )
  assert not np.any(g[2]) and not np.any(g[3])  # No gradient reaches the target.


def test_views_get_their_own_settings():
  config = load_config("byol_imagenet")
  v1, v2 = pretraining.views(config)
  assert (v1.blur_prob, v1.solarize_prob, v2.blur_prob, v2.solarize_prob) == (1.0, 0.0, 0.1, 0.2)
  # Applied per view: solarize always on view 1, never on view 2.
  mesh = mesh_lib.make_mesh()
  images = np.random.default_rng(1).integers(0, 256, (8, 2, 8, 8, 3), np.uint8)
  first, second = augment.ViewAugment(solarize_prob=1.0), augment.ViewAugment()
  fn = jax.jit(
    jax.shard_map(
      lambda im: common.augmented_views(im, jax.random.PRNGKey(0), 0, (first, second)),
      mesh=mesh,
      in_specs=jax.P(mesh_lib.DATA_AXIS),
      out_specs=jax.P(mesh_lib.DATA_AXIS),
    )
  )
  x1, x2 = fn(jax.device_put(images, mesh_lib.batch_sharded(mesh)))
  np.testing.assert_allclose(x1, augment.solarize(images[:, 0] / 255.0), atol=1e-6)
  np.testing.assert_allclose(x2, images[:, 1] / 255.0, atol=1e-6)


def tiny_byol_config():
  config = load_config("byol_cifar10", "runlocal")
  config.batch_size = 16
  config.model.name, config.model.width = "resnet10", 0.0625
  config.projector.hidden_dims = (16,)
  config.predictor.hidden_dims = (16,)
  for view in ("view1", "view2"):  # Identity: augmentation keys depend on the device.
    config.augment[view] = dict(color_jitter_prob=0.0)
  return config


def stem_stats_per_view(model_config, params, batch_stats, images):
  """The stem BN's running (mean, var) after BYOL's reference step, written out in numpy:
  each view its own forward pass (deepmind-research byol_experiment.py apply_once_fn per
  view), so the BN normalises each view with that view's batch statistics and its
  running averages (decay 0.9) take view 1's, then view 2's. images: uint8 [B, 2, S, S, 3]."""
  kernel = np.asarray(params["encoder"]["stem_conv"]["kernel"], np.float64)  # [3, 3, 3, C]
  mean = np.asarray(batch_stats["encoder"]["stem_bn"]["mean"], np.float64)
  var = np.asarray(batch_stats["encoder"]["stem_bn"]["var"], np.float64)
  k = kernel.shape[0]  # The stem: 3x3 stride 1 ('cifar') or 7x7 stride 2 ('imagenet').
  stride = 1 if model_config.stem == "cifar" else 2
  side = images.shape[2]
  if model_config.padding == "same":  # Haiku's 'SAME' (BYOL): an odd total pads after more.
    total = max(0, (-(-side // stride) - 1) * stride + k - side)
    before, after = total // 2, total - total // 2
  else:  # A stem pads k // 2 on each side under the other rules.
    before = after = k // 2
  size = (side + before + after - k) // stride + 1
  for v in range(2):  # Identity augmentation: the views are the host crops.
    x = (images[:, v] / 255.0 - np.asarray(model_config.input_mean)) / np.asarray(
      model_config.input_std
    )
    x = np.pad(x, ((0, 0), (before, after), (before, after), (0, 0)))
    y = sum(
      np.einsum(
        "bhwc,cd->bhwd",
        x[:, i : i + stride * size : stride, j : j + stride * size : stride],
        kernel[i, j],
      )
      for i in range(k)
      for j in range(k)
    )
    mean = 0.9 * mean + 0.1 * y.mean(axis=(0, 1, 2))
    var = 0.9 * var + 0.1 * y.var(axis=(0, 1, 2))
  return mean, var


def test_eight_devices_equal_one_device_and_target_follows_the_ema():
  images = np.random.default_rng(0).integers(0, 256, (2, 16, 2, 32, 32, 3), np.uint8)
  config = tiny_byol_config()
  states = []
  for mesh in (mesh_lib.make_mesh(), mesh_lib.make_mesh(jax.devices()[:1])):
    run = pretraining.setup(config, mesh, steps_per_epoch=10, num_steps=4)
    state = run.init()
    state0 = jax.device_get(state)
    target0 = state0.extra["target_params"]
    # The target network has its own initialisation, not a copy of the online one.
    assert not np.allclose(
      target0["encoder"]["stem_conv"]["kernel"], state0.params["encoder"]["stem_conv"]["kernel"]
    )
    state, m1 = run.train_step(
      state, {"image": jax.device_put(images[0], mesh_lib.batch_sharded(mesh))}
    )
    # BN statistics per view in both networks, as the reference's separate forward passes
    # (one pass over both views would give 0.1 of the joint batch's mean instead).
    for params, before, after in (
      (state0.params, state0.batch_stats, state.batch_stats),
      (
        state0.extra["target_params"],
        state0.extra["target_batch_stats"],
        state.extra["target_batch_stats"],
      ),
    ):
      mean, var = stem_stats_per_view(config.model, params, before, images[0])
      after = jax.device_get(after)["encoder"]["stem_bn"]
      np.testing.assert_allclose(after["mean"], mean, rtol=1e-4, atol=1e-6)
      np.testing.assert_allclose(after["var"], var, rtol=1e-4, atol=1e-6)
    # After step k = 0: target = tau_0 target + (1 - tau_0) online, tau_0 = tau_base.
    tau = config.byol.tau_base
    online = jax.device_get(state.params)
    expected = jax.tree.map(
      lambda t, o: tau * t + (1 - tau) * o,
      target0,
      {k: online[k] for k in ("encoder", "projector")},
    )
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
      jax.device_get(state.extra["target_params"]),
      expected,
    )
    state, m2 = run.train_step(
      state, {"image": jax.device_put(images[1], mesh_lib.batch_sharded(mesh))}
    )
    states.append((jax.device_get(state), float(m1["loss"]), float(m2["loss"])))
  (s8, *l8), (s1, *l1) = states
  np.testing.assert_allclose(l8, l1, rtol=1e-4)
  for a, b in zip(jax.tree.leaves(s8.params), jax.tree.leaves(s1.params)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)  # Float summation order.


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("byol.tau_base", 1.2, "config.byol.tau_base=1.2: must be in [0, 1]"),
    ("predictor.out_dim", 0, "config.predictor.out_dim=0: must be an integer > 0"),
  ],
)
def test_bad_byol_config(field, value, message):
  config = tiny_byol_config()
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(byol.ConfigError) as error:
    byol.check_config(config, 50_000)
  assert message in str(error.value)

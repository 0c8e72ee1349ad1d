"""MoCo: queue, EMA, InfoNCE, shuffle BN, and 8 devices vs one."""

import re

from helpers import load_config
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_simclr import numeric_grad

from contrastive_jax import models
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.methods import common
from contrastive_jax.methods import moco
from contrastive_jax.methods import pretraining
from contrastive_jax.models import heads


def test_queue_is_fifo_with_pointer_sequence_like_numpy():
  K, B, D = 8, 2, 3
  queue, ptr = jnp.zeros((K, D)), jnp.int32(0)
  ref_queue, ref_ptrs, ptrs = np.zeros((K, D)), [], []
  history = []
  for step in range(7):
    keys = np.full((B, D), step + 1.0) + np.arange(B)[:, None] / 10
    queue, ptr = moco.enqueue(queue, ptr, jnp.asarray(keys))
    ptrs.append(int(ptr))
    history.extend(keys)
    ref_queue = np.zeros((K, D))
    # The queue holds the newest K keys; key number n sits in slot n mod K.
    for n in range(max(0, len(history) - K), len(history)):
      ref_queue[n % K] = history[n]
    ref_ptrs.append(len(history) % K)
    np.testing.assert_allclose(queue, ref_queue, rtol=1e-6)
  assert ptrs == ref_ptrs == [2, 4, 6, 0, 2, 4, 6]


def info_nce_numpy(q, k, queue, t):
  q = q / np.linalg.norm(q, axis=1, keepdims=True)
  k = k / np.linalg.norm(k, axis=1, keepdims=True)
  losses, hits = [], []
  for i in range(len(q)):
    logits = np.array([q[i] @ k[i]] + [q[i] @ n for n in queue]) / t
    losses.append(-logits[0] + np.log(np.sum(np.exp(logits))))
    hits.append(np.argmax(logits) == 0)
  return np.mean(losses), np.mean(hits)


def test_info_nce_value_and_gradient_match_numpy():
  rng = np.random.default_rng(0)
  q, k = rng.normal(size=(2, 4, 5))
  queue = rng.normal(size=(6, 5))
  queue /= np.linalg.norm(queue, axis=1, keepdims=True)
  loss, top1 = moco.info_nce(jnp.asarray(q), jnp.asarray(k), jnp.asarray(queue), 0.2)
  ref_loss, ref_top1 = info_nce_numpy(q, k, queue, 0.2)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(top1, ref_top1)
  grad_q = jax.grad(
    lambda a: moco.info_nce(a, jnp.asarray(k, jnp.float32), jnp.asarray(queue, jnp.float32), 0.2)[0]
  )(jnp.asarray(q, jnp.float32))
  np.testing.assert_allclose(
    grad_q, numeric_grad(lambda a: info_nce_numpy(a, k, queue, 0.2)[0], q), atol=1e-5
  )


def test_ema_update_on_every_leaf():
  target = {"a": jnp.array([1.0, 2.0]), "b": {"c": jnp.array(3.0)}}
  online = {"a": jnp.array([5.0, 6.0]), "b": {"c": jnp.array(-1.0)}}
  out = common.ema_update(target, online, 0.9)
  np.testing.assert_allclose(out["a"], [0.9 * 1 + 0.1 * 5, 0.9 * 2 + 0.1 * 6], rtol=1e-6)
  np.testing.assert_allclose(out["b"]["c"], 0.9 * 3 - 0.1, rtol=1e-6)
  grads = jax.grad(lambda o: common.ema_update(target, o, 0.5)["b"]["c"])(online)
  assert float(grads["b"]["c"]) == 0.0  # Never differentiated.


def test_shuffle_then_unshuffle_is_identity_and_moves_keys_to_other_groups():
  mesh = mesh_lib.make_mesh()
  B = 64
  perm = jax.random.permutation(jax.random.PRNGKey(3), B)
  ids = jax.device_put(jnp.arange(B), mesh_lib.batch_sharded(mesh))
  fn = jax.jit(
    jax.shard_map(
      lambda x, p: (moco.shuffle_rows(x, p), moco.unshuffle_rows(moco.shuffle_rows(x, p), p)),
      mesh=mesh,
      in_specs=(jax.P(mesh_lib.DATA_AXIS), jax.P()),
      out_specs=(jax.P(mesh_lib.DATA_AXIS), jax.P()),
    )
  )
  shuffled, restored = fn(ids, perm)
  np.testing.assert_array_equal(restored, np.arange(B))
  # Example i's query is encoded on device i // 8; its key on the device that got it.
  key_device = np.empty(B, int)
  key_device[np.asarray(shuffled)] = np.arange(B) // 8
  same = np.mean(key_device == np.arange(B) // 8)
  assert same < 0.3  # 1/8 expected by chance; 1.0 without the shuffle.


def tiny_moco_config():
  config = load_config("moco_v2_cifar10", "runlocal")
  config.batch_size = 16
  config.model.name, config.model.width = "resnet10", 0.0625
  config.moco.queue_size = 64
  config.moco.bn_group_size = 8  # 2 groups; on 8 devices, one image of each per device.
  for view in ("view1", "view2"):  # Identity: augmentation keys depend on the device.
    config.augment[view] = dict(color_jitter_prob=0.0, grayscale_prob=0.0)
  # The full learning rate from step 0, so that step 0 moves the query encoder; and one
  # config for both tests below, whose 8-device train step is then compiled once
  # (pretraining.setup keeps the programs of a config it has built).
  config.optimizer.warmup_epochs = 0
  return config


def run_steps(config, mesh, images, steps=3):
  run = pretraining.setup(config, mesh, steps_per_epoch=10, num_steps=100)
  state = run.init()
  losses = []
  for i in range(steps):
    state, metrics = run.train_step(
      state, {"image": jax.device_put(images[i], mesh_lib.batch_sharded(mesh))}
    )
    losses.append(float(metrics["loss"]))
  return state, losses


def test_eight_devices_equal_one_device_with_the_same_bn_groups():
  # Group g holds global rows g, g + 2, ...: on 8 devices each device holds one
  # image of each group, on 1 device all of them; the groups are the same.
  images = np.random.default_rng(0).integers(0, 256, (3, 16, 2, 32, 32, 3), np.uint8)
  config = tiny_moco_config()
  state8, losses8 = run_steps(config, mesh_lib.make_mesh(), images)
  state1, losses1 = run_steps(config, mesh_lib.make_mesh(jax.devices()[:1]), images)
  np.testing.assert_allclose(losses8, losses1, rtol=1e-4)
  for a, b in zip(
    jax.tree.leaves(jax.device_get(state8.params)), jax.tree.leaves(jax.device_get(state1.params))
  ):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)  # Float summation order.
  # Keys pass through BN over 8-image groups, which amplifies float rounding.
  np.testing.assert_allclose(state8.extra["queue"], state1.extra["queue"], atol=3e-4)
  assert int(state8.extra["queue_ptr"]) == int(state1.extra["queue_ptr"]) == 48
  # Every device holds the identical queue.
  shards = [np.asarray(s.data) for s in state8.extra["queue"].addressable_shards]
  assert len(shards) == 8 and all(np.array_equal(shards[0], s) for s in shards)
  # The newest keys are unit vectors; the key encoder moved towards the query encoder.
  np.testing.assert_allclose(np.linalg.norm(state8.extra["queue"][:48], axis=1), 1.0, rtol=1e-5)
  init = pretraining.setup(config, mesh_lib.make_mesh(), 10, 100).init()
  for k0, k, q in zip(
    jax.tree.leaves(init.extra["key_params"]),
    jax.tree.leaves(state8.extra["key_params"]),
    jax.tree.leaves(state8.params),
  ):
    assert np.linalg.norm(k - q) <= np.linalg.norm(k0 - q) + 1e-6


def test_keys_come_from_shuffled_bn_groups_and_key_encoder_follows_the_ema():
  config = tiny_moco_config()  # Without warm-up: step 0 moves the query encoder.
  mesh = mesh_lib.make_mesh()
  run = pretraining.setup(config, mesh, steps_per_epoch=10, num_steps=100)
  state0 = jax.device_get(run.init())
  images = np.random.default_rng(5).integers(0, 256, (2, 16, 2, 32, 32, 3), np.uint8)
  state1, _ = run.train_step(
    run.init(), {"image": jax.device_put(images[0], mesh_lib.batch_sharded(mesh))}
  )
  state1_host = jax.device_get(state1)
  state2, _ = run.train_step(
    state1, {"image": jax.device_put(images[1], mesh_lib.batch_sharded(mesh))}
  )

  # Reference keys of step 0, written out: the key encoder (an EMA of two
  # equal encoders, so the initial one) encodes 2 BN groups of 8 rows each,
  # group g holding the images at shuffled positions g, g + 2, ...
  # (order[g::2]), in train mode, with each group's own BN statistics.
  model = heads.ContrastiveModel(
    encoder=models.build_encoder(config.model),
    projector=models.build_mlp(config.projector, "float32"),
  )
  x = images[0][:, 1] / np.float32(255)

  def keys(order):
    out = np.zeros((16, config.projector.out_dim), np.float32)
    for g in range(2):
      rows = order[g::2]
      (_, z), _ = model.apply(
        {"params": state0.params, "batch_stats": state0.batch_stats},
        x[rows],
        train=True,
        mutable=["batch_stats"],
      )
      out[rows] = z / np.linalg.norm(z, axis=1, keepdims=True)
    return out

  perm = np.asarray(jax.random.permutation(common.shuffle_key(state0.rng, 0), 16))
  # BN over 8 rows amplifies float rounding: agreement to 2e-4, while the
  # unshuffled groups give keys that differ by orders of magnitude more.
  np.testing.assert_allclose(state1_host.extra["queue"][:16], keys(perm), atol=2e-4)
  assert np.abs(keys(np.arange(16)) - keys(perm)).max() > 0.05  # The shuffle matters.
  np.testing.assert_array_equal(state1_host.extra["queue"][16:], state0.extra["queue"][16:])

  # Step 1's key encoder: m * (step 0's key encoder) + (1 - m) * (query encoder after step 0).
  m = config.moco.momentum
  expected = jax.tree.map(
    lambda k, q: m * k + (1 - m) * q, state1_host.extra["key_params"], state1_host.params
  )
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
    jax.device_get(state2.extra["key_params"]),
    expected,
  )
  # ... and the query encoder did move (warm-up off), so the check is not 0 = 0.
  assert not np.allclose(
    state1_host.params["encoder"]["stem_conv"]["kernel"],
    state0.params["encoder"]["stem_conv"]["kernel"],
  )


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("moco.queue_size", 100, "multiple of batch_size (16)"),
    ("moco.queue_size", 60_000, "at most the train split's size (50000)"),
    ("moco.momentum", 1.5, "config.moco.momentum=1.5: must be in [0, 1]"),
    ("temperature", -0.1, "config.temperature=-0.1: must be > 0"),
    ("moco.bn_group_size", 4, "a multiple of the device count (8)"),
    ("moco.bn_group_size", 24, "that divides batch_size (16)"),
    ("moco.bn_group_size", 16, "into >= 2 groups"),
  ],
)
def test_bad_moco_config(field, value, message):
  config = tiny_moco_config()
  section, _, name = field.rpartition(".")
  (config[section] if section else config)[name] = value
  with pytest.raises(moco.ConfigError, match=re.escape(message)):
    moco.check_config(config, 50_000)

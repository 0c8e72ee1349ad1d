"""The device data path (data/device_data.py, device_samplers.py) against the host pipeline
it stands in for: crop distributions and resizes against crops.py's, flips, the epoch order, exact
resume, a short pretraining run on CIFAR-10, the bad-input lines, the .npz files."""

import json
import math
import re

from helpers import TFDS_DIR
from helpers import load_benchmark
from helpers import tiny_config
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from scipy import stats
import tensorflow as tf
from test_recipes import sampled_windows

from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.data import crop_spec
from contrastive_jax.data import device_data
from contrastive_jax.data import device_samplers
from contrastive_jax.jobs import pretrain
from contrastive_jax.training import runner


def device_windows(sampler, h, w, n, area_min=0.08, area_max=1.0):
  """n windows (top, left, height, width) of device_samplers.crop_window with keys 0..n-1."""
  window = lambda i: device_samplers.crop_window(
    jax.random.key(i), h, w, sampler, area_min, area_max
  )
  fn = jax.jit(jax.vmap(lambda i: jnp.stack(window(i))))
  return np.asarray(fn(jnp.arange(n)))


@pytest.mark.parametrize(
  "h,w,area_range",
  [(32, 32, (0.08, 1.0)), (168, 224, (0.08, 1.0)), (32, 32, (0.05, 0.4)), (168, 224, (0.05, 0.4))],
)  # The last two: DINO's local crops.
def test_device_crops_draw_the_host_samplers_distributions(h, w, area_range):
  # Two-sample Kolmogorov-Smirnov on 4000 crops each, as test_recipes: the critical
  # distance at alpha = 1e-3 is 1.95 sqrt(2 / 4000) = 0.044; over the whole area range
  # the samplers differ from each other by more than 0.06 (checked there), so a swapped
  # sampler fails (at 0.05-0.4, torchvision's first attempt always fits: byol's there).
  n, critical = 4000, 1.95 * math.sqrt(2 / 4000)
  for sampler in crop_spec.SAMPLERS:
    top, left, ch, cw = device_windows(sampler, h, w, n, *area_range).T
    assert np.all((top >= 0) & (left >= 0) & (ch > 0) & (cw > 0))
    assert np.all((top + ch <= h) & (left + cw <= w)), sampler
    host_top, _, hch, hcw = sampled_windows(sampler, h, w, n, *area_range).T
    area, host_area = ch * cw / (h * w), hch * hcw / (h * w)
    assert stats.ks_2samp(area, host_area).statistic < critical, sampler
    assert stats.ks_2samp(cw / ch, hcw / hch).statistic < critical, sampler
    # Offsets uniform over the positions each sampler allows (TF's kernel never
    # reaches the last one): the same distribution of top / slack as the host's.
    slack, host_slack = h - ch, h - hch
    fraction = top[slack > 0] / slack[slack > 0]
    host_fraction = host_top[host_slack > 0] / host_slack[host_slack > 0]
    assert stats.ks_2samp(fraction, host_fraction).statistic < critical, sampler


def test_device_crop_fallbacks_equal_the_hosts():
  # A 10 x 1000 image: no crop of >= 8% of it has an aspect ratio in [3/4, 4/3].
  windows = {s: device_windows(s, 10, 1000, 20) for s in crop_spec.SAMPLERS}
  np.testing.assert_array_equal(windows["tensorflow"], [[0, 0, 10, 1000]] * 20)
  np.testing.assert_array_equal(
    windows["torchvision"], [[0, (1000 - 13) // 2, 10, round(10 * 4 / 3)]] * 20
  )
  for top, left, ch, cw in windows["byol"]:
    assert (top, ch) == (0, 10) and 24 <= cw <= 116 and 0 <= left <= 1000 - cw


def test_device_resize_equals_tf_image_resize_within_a_grey_level():
  # Up- and downscaling windows, every RESIZES name: the weights are TF's, so only a
  # value within float error of a half rounds the other way.
  rng = np.random.default_rng(0)
  image = rng.integers(0, 256, (32, 40, 3), dtype=np.uint8)
  for resize, (method, antialias) in crop_spec.RESIZES.items():
    for _ in range(40):
      h, w = int(rng.integers(1, 33)), int(rng.integers(1, 41))
      top, left = int(rng.integers(0, 33 - h)), int(rng.integers(0, 41 - w))
      size = int(rng.choice([16, 32, 48]))
      want = tf.image.resize(
        image[top : top + h, left : left + w], [size, size], method=method, antialias=antialias
      )
      want = np.clip(np.round(want.numpy()), 0, 255)
      got = device_samplers.resized_crop(jnp.asarray(image), (top, left, h, w), size, resize)
      assert np.abs(np.asarray(got, np.int32) - want).max() <= 1, (resize, h, w, size)


def _split(images, labels):
  mesh = mesh_lib.make_mesh()
  return device_data.to_mesh(images, labels, mesh), mesh


def _config(batch, sampler="torchvision", seed=3):
  return ml_collections.ConfigDict(
    dict(
      batch_size=batch,
      crop=dict(sampler=sampler, area_min=0.08, resize="pil_bilinear"),
      seed=seed,
    )
  )


def test_views_flip_with_probability_one_half_and_keep_the_hosts_batch_layout():
  # A horizontal ramp stays increasing left to right through any crop and resize;
  # a flipped view decreases. 2000 views: 4 standard deviations of the fraction are
  # 4 sqrt(0.25 / 2000) = 0.045. Multi-crop's local views likewise (3000 of them).
  ramp = np.broadcast_to((np.arange(32) * 8)[None, :, None], (32, 32, 3)).astype(np.uint8)
  split, mesh = _split(np.stack([ramp] * 8), np.arange(8))
  config = _config(200)
  config.local_crops = dict(number=3, size=8, area_min=0.05, area_max=0.4)
  batches = device_samplers.train_batches(split, config, mesh, image_size=16)(0)
  batches = [jax.device_get(next(batches)) for _ in range(5)]
  views = np.concatenate([b["image"] for b in batches])
  local = np.concatenate([b["local_image"] for b in batches])
  assert views.shape == (1000, 2, 16, 16, 3) and views.dtype == np.uint8
  assert local.shape == (1000, 3, 8, 8, 3) and local.dtype == np.uint8
  for x in (views, local):
    columns = x.astype(np.int32).mean(axis=(2, 4))  # [1000, views, size]
    flipped = columns[..., 0] > columns[..., -1]
    assert abs(flipped.mean() - 0.5) < 0.045
    assert np.all(columns[..., 0] != columns[..., -1])
  # A local window has at most 0.4 of the area at an aspect ratio of at most 4/3, so at
  # most 23 of the ramp's 32 columns (values 8 apart): its grey levels span at most 176
  # (the bilinear weights are non-negative, so a view's levels stay within its window's).
  # Areas under 0.08, which the global views never draw, give windows of at most 7
  # columns, about 2% of the local views: their spans are at most 48.
  red = local[..., 0].astype(np.int32)
  span = red.max(axis=(2, 3)) - red.min(axis=(2, 3))
  assert span.max() <= 176 and span.min() <= 48


def test_each_epoch_reads_every_record_once_in_a_seeded_order_and_a_resume_is_exact():
  # Labels are the record indices: batch labels are the records read. 96 records,
  # batch 24: four batches an epoch.
  num, batch, seed = 96, 24, 3
  rng = np.random.default_rng(1)
  images = rng.integers(0, 256, (num, 12, 12, 3), dtype=np.uint8)
  split, mesh = _split(images, np.arange(num))
  config = _config(batch, "tensorflow", seed)
  config.local_crops = dict(number=2, size=6, area_min=0.05, area_max=0.4)
  batches = device_samplers.train_batches(split, config, mesh, image_size=12)
  straight = [jax.device_get(next(it)) for it in [batches(0)] for _ in range(12)]
  read = np.concatenate([b["label"] for b in straight]).reshape(3, num)
  assert straight[0]["label"].dtype == np.int32
  for epoch in range(3):  # Every record once an epoch, in epoch_order_array's order.
    np.testing.assert_array_equal(np.sort(read[epoch]), np.arange(num))
    np.testing.assert_array_equal(read[epoch], device_samplers.epoch_order_array(num, seed, epoch))
  assert np.any(read[0] != read[1]) and np.any(read[1] != read[2])
  assert np.any(read[0] != device_samplers.epoch_order_array(num, seed + 1, 0))
  resumed = batches(6)
  for step in range(6, 12):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(next(resumed)), straight[step])
  # Views of one image differ; the two views are drawn independently.
  assert np.any(straight[0]["image"][:, 0] != straight[0]["image"][:, 1])
  # The local views leave the global views' draws as they are without them.
  del config.local_crops
  plain = device_samplers.train_batches(split, config, mesh, image_size=12)(0)
  np.testing.assert_array_equal(jax.device_get(next(plain))["image"], straight[0]["image"])


def test_a_batch_spanning_two_epochs_reads_the_end_of_one_and_the_start_of_the_next():
  num, batch, seed = 12, 8, 0
  split, mesh = _split(np.zeros((num, 4, 4, 3), np.uint8), np.arange(num))
  batches = device_samplers.train_batches(
    split, _config(batch, "tensorflow", seed), mesh, image_size=4
  )
  labels = np.concatenate(
    [jax.device_get(next(it))["label"] for it in [batches(0)] for _ in range(3)]
  )
  want = np.concatenate([device_samplers.epoch_order_array(num, seed, e) for e in (0, 1)])
  np.testing.assert_array_equal(labels, want)  # Step 1: places 8-11 of epoch 0, 0-3 of 1.


@pytest.mark.parametrize(
  "method, variant",
  [("simclr", "runlocal"), ("dino", "runlocal_resnet,local_crops=2")],
)  # TF's crops; torchvision's, bicubic, with multi-crop's local views.
def test_pretraining_on_the_device_trains_with_a_finite_loss(tmp_path, method, variant):
  config = tiny_config(method, variant)
  if method == "dino":
    config.dino.update(out_dim=32, hidden_dim=16, bottleneck_dim=8)
  config.on_device_data = True
  config.evaluators = {}  # Read through the host pipeline, not the device's: test_runner's.
  config.duration = "3 steps"
  config.checkpoint_every = "3 steps"
  state, _ = runner.run(pretrain, config, str(tmp_path))
  assert int(state.step) == 3
  with open(tmp_path / "metrics.jsonl") as f:
    losses = [row["loss"] for row in map(json.loads, f) if "loss" in row]
  assert len(losses) == 3 and np.all(np.isfinite(losses))


def test_bad_inputs_are_one_config_error_line():
  with pytest.raises(ConfigError) as error:
    device_data.check_fits(
      device_data.split_bytes(50_000, 32, 32), 2**27, "a test's 128 MiB", "cifar10 train"
    )
  message = str(error.value)
  assert "\n" not in message and message.startswith("config.on_device_data=True")
  assert "needs 0.14 GiB" in message and "may use 0.12 GiB" in message

  class Folder:
    name, features = "photos", {"image": type("F", (), {"shape": (None, None, 3)})()}

  with pytest.raises(ConfigError, match="no single size"):
    device_data.check_config(
      ml_collections.ConfigDict(dict(train_split="train", batch_size=8)), Folder(), 10
    )


def test_npz_round_trip_needs_only_numpy(tmp_path):
  images = np.random.default_rng(0).integers(0, 256, (5, 4, 4, 3), dtype=np.uint8)
  path = str(tmp_path / "d.npz")
  device_data.save_npz(path, {"train": (images, np.arange(5))})
  got_images, got_labels = device_data.load_npz(path, "train")
  np.testing.assert_array_equal(got_images, images)
  assert got_labels.dtype == np.int32 and list(got_labels) == list(range(5))
  with pytest.raises(ConfigError, match=r"one of the splits in .*\['train'\]"):
    device_data.load_npz(path, "test")
  with pytest.raises(ConfigError, match="no such file"):
    device_data.load_npz(str(tmp_path / "none.npz"), "train")


def test_a_file_that_is_no_npz_of_save_npz_is_one_config_error_naming_it(tmp_path):
  images = np.zeros((4, 2, 2, 3), np.uint8)
  whole = str(tmp_path / "whole.npz")
  device_data.save_npz(whole, {"train": (images, np.arange(4))})
  data = open(whole, "rb").read()
  bad = {
    "garbage.npz": (bytes(range(256)) * 8, "neither a zip archive nor an .npy array"),
    "truncated.npz": (data[: len(data) // 2], "no whole zip archive, truncated or damaged"),
  }
  encoded = str(tmp_path / "encoded.npz")
  device_data.save_encoded_npz(encoded, {"train": ([b"no image", b"\x89PNG"], [0, 1])})
  flat = str(tmp_path / "flat.npz")
  np.savez(flat, **{"train/images": np.zeros((4, 2, 2), np.uint8), "train/labels": np.arange(4)})
  for name, (content, _) in bad.items():
    (tmp_path / name).write_bytes(content)
  cases = [(str(tmp_path / name), why) for name, (_, why) in bad.items()]
  cases += [
    (encoded, "its image file 0 cannot be decoded"),
    (flat, re.escape("holds images uint8 [4, 2, 2] and labels [4], not uint8 [N, H, W, 3]")),
  ]
  for path, why in cases:
    with pytest.raises(ConfigError) as raised:
      device_data.load_npz(path, "train")
    line = str(raised.value)
    assert "\n" not in line and line.startswith(f"config.device_data_file={path!r}"), line
    assert re.search(why, line), line


def test_make_device_data_stores_tfds_files_and_labels(tmp_path):
  # The files as TFDS stores them (the shared copy's are JPEGs), read back with numpy
  # and PIL: byte for byte the same files; PIL's pixels within 4 grey levels of TF's
  # (about 1 on average: the two libjpeg builds decode alike only up to that).
  script = load_benchmark("make_device_data")
  split = "test[:64]"
  files, labels = script.read("cifar10", TFDS_DIR, split, encoded=True)
  path = str(tmp_path / "c.npz")
  device_data.save_encoded_npz(path, {"test": (files, labels)})
  with np.load(path) as data:
    offsets = data["test/offsets"]
    assert [data["test/encoded"][a:b].tobytes() for a, b in zip(offsets, offsets[1:])] == files
  images, got_labels = device_data.load_npz(path, "test")
  want_images, want_labels = script.read("cifar10", TFDS_DIR, split, encoded=False)
  assert images.shape == (64, 32, 32, 3) and images.dtype == np.uint8
  difference = np.abs(images.astype(np.int32) - want_images)
  assert difference.max() <= 4 and difference.mean() < 1.5  # Measured: 4 and 0.98.
  np.testing.assert_array_equal(got_labels, want_labels)

"""Image files and folders as datasets: images.load_image, the prepare job and reading them.

Small real photos from ../shared/images (clothing JPEGs, chest X-ray PNGs),
converted and damaged here; every expected pixel comes from numpy.
"""

import glob
import importlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib

from array_record.python.array_record_data_source import ArrayRecordDataSource
import gcs_emulator
from google.auth.compute_engine import _metadata
from helpers import SHARED
from helpers import load_config
from helpers import receive_ctrl_c
from helpers import subprocess_env
from helpers import tiny_config
import jax
import numpy as np
from PIL import Image
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from contrastive_jax.core import files
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import ImageError
from contrastive_jax.core.errors import JobError
from contrastive_jax.core.errors import NoSpaceError
from contrastive_jax.data import crop_spec
from contrastive_jax.data import images
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import layout
from contrastive_jax.data import prepare_images
from contrastive_jax.data import sources
from contrastive_jax.data import tfds_folder
from contrastive_jax.jobs import prepare as prepare_job
from contrastive_jax.jobs import pretrain
from contrastive_jax.training import runner

PHOTOS = sorted(glob.glob(os.path.join(SHARED, "images", "clothing", "train", "*", "*.jpg")))
XRAYS = sorted(glob.glob(os.path.join(SHARED, "images", "chest_xray", "images", "*.png")))
BIG = 10**8  # max_pixels that every real file here passes.


def prepare(src, name, data_dir, beam=None, **fields):
  """The prepare job (configs/prepare.py) on src into data_dir; its report.

  32 px, one Beam worker in this process, as --config.FIELD=VALUE would set
  fields (beam: fields of config.beam).
  """
  config = load_config("prepare")
  config.src = None if src is None else str(src)
  config.name, config.image_size, config.max_pixels = name, 32, BIG
  config.beam.direct_num_workers = 1
  config.update(fields)
  config.beam.update(beam or {})
  return prepare_job.run(config, str(data_dir))


def photo(width=40, height=30) -> np.ndarray:
  """A small real photo, uint8 [height, width, 3]."""
  with Image.open(PHOTOS[0]) as im:
    return np.asarray(im.convert("RGB").resize((width, height)))


def png_header(width, height) -> bytes:
  """A PNG of a signature, an IHDR chunk claiming width x height RGB, and IEND: no pixels."""

  def chunk(kind, body):
    return (
      struct.pack(">I", len(body))
      + kind
      + body
      + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    )

  ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
  return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def truncated(src, dst):
  with open(src, "rb") as f:
    content = f.read()
  with open(dst, "wb") as f:
    f.write(content[: len(content) // 2])
  return dst


def test_modes_and_formats_become_rgb(tmp_path):
  rgb = photo()
  path = lambda name: str(tmp_path / name)
  gray = np.asarray(Image.fromarray(rgb).convert("L"))
  Image.fromarray(gray).save(path("gray.png"))
  alpha = np.random.default_rng(0).integers(0, 256, gray.shape, np.uint8)
  Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(path("rgba.png"))
  Image.fromarray((gray.astype(np.uint16) * 257 + 100)).save(path("gray16.png"))
  palette = Image.fromarray(rgb).quantize(16)
  palette.save(path("palette.png"), transparency=0)
  Image.fromarray(rgb).save(path("lossless.webp"), lossless=True)
  Image.fromarray(rgb).save(path("photo.bmp"))
  Image.fromarray(rgb).convert("CMYK").save(path("cmyk.jpg"), quality=95)
  red, blue = (np.full((8, 10, 3), c, np.uint8) for c in ((255, 0, 0), (0, 0, 255)))
  Image.fromarray(red).save(
    path("anim.gif"), save_all=True, append_images=[Image.fromarray(blue)], duration=100
  )
  exif = Image.Exif()
  exif[0x0112] = 6  # Orientation: shown rotated 90 degrees clockwise.
  Image.fromarray(rgb).save(path("rotated.png"), exif=exif)

  load = lambda name: images.load_image(path(name), max_pixels=BIG)
  for name in (
    "gray.png",
    "rgba.png",
    "gray16.png",
    "palette.png",
    "lossless.webp",
    "photo.bmp",
    "cmyk.jpg",
    "anim.gif",
    "rotated.png",
  ):
    assert load(name).dtype == np.uint8 and load(name).shape[2] == 3, name
  np.testing.assert_array_equal(load("gray.png"), np.repeat(gray[..., None], 3, axis=2))
  a = alpha[..., None] / 255.0
  np.testing.assert_allclose(load("rgba.png"), rgb * a + 255 * (1 - a), atol=1)  # On white.
  np.testing.assert_array_equal(
    load("gray16.png")[..., 0], np.round((gray.astype(np.float64) * 257 + 100) / 257)
  )
  index = np.asarray(palette)
  colors = np.array(palette.getpalette()[:48], np.uint8).reshape(16, 3)[index]
  colors[index == 0] = 255  # The transparent index.
  np.testing.assert_array_equal(load("palette.png"), colors)
  np.testing.assert_array_equal(load("lossless.webp"), rgb)
  np.testing.assert_array_equal(load("photo.bmp"), rgb)
  assert np.abs(load("cmyk.jpg").astype(int) - rgb).mean() < 8  # Lossy, but the same photo.
  np.testing.assert_array_equal(load("anim.gif"), red)  # The first frame.
  np.testing.assert_array_equal(load("rotated.png"), np.rot90(rgb, k=-1))


def test_shorter_side_downscales_keeping_the_aspect_ratio():
  with Image.open(PHOTOS[0]) as im:
    width, height = im.size
    full = np.asarray(im.convert("RGB"), np.float64)
  small = images.load_image(PHOTOS[0], max_pixels=BIG, shorter_side=32)
  scale = 32 / min(width, height)
  assert small.shape == (round(height * scale), round(width * scale), 3)
  assert np.abs(small.mean(axis=(0, 1)) - full.mean(axis=(0, 1))).max() < 3
  tiny = images.load_image(PHOTOS[0], max_pixels=BIG, shorter_side=10_000)
  assert tiny.shape == full.shape  # Never upscaled.


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
  d = tmp_path_factory.mktemp("bad")
  (d / "notes.jpg").write_text("not an image")
  (d / "bomb.png").write_bytes(png_header(100_000, 100_000))
  (d / "big.png").write_bytes(png_header(5_000, 5_000))
  (d / "folder.png").mkdir()
  return {
    "truncated.jpg": truncated(PHOTOS[0], d / "truncated.jpg"),
    "truncated.png": truncated(XRAYS[0], d / "truncated.png"),
    "notes.jpg": d / "notes.jpg",
    "bomb.png": d / "bomb.png",
    "big.png": d / "big.png",
    "folder.png": d / "folder.png",
    "missing.jpg": d / "missing.jpg",
  }


@pytest.mark.parametrize(
  "name,reason",
  [
    ("truncated.jpg", "truncated"),
    ("truncated.png", "truncated"),
    ("notes.jpg", "not an image"),
    ("missing.jpg", "No such file"),
    ("folder.png", "Is a directory"),
    ("bomb.png", "too many pixels"),
    ("big.png", "5000 x 5000 = 25,000,000 pixels, more than max_pixels=1,000,000"),
  ],
)
def test_unreadable_file_is_one_error_naming_it(bad_files, name, reason, monkeypatch):
  # Pillow's own limit (its default), which an in-process preparation lifts.
  monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 89_478_485)
  with pytest.raises(ImageError, match=reason) as e:
    images.load_image(str(bad_files[name]), max_pixels=1_000_000)
  assert str(e.value).startswith(str(bad_files[name]) + ": ")


def test_layout_maps_paths_to_splits_and_classes():
  nested = (
    [f"val/Fruit/Apple/{i}.jpg" for i in range(20)]
    + [f"val/Vegetables/Pepper/Red/{i}.jpg" for i in range(10)]
    + ["val/Fruit/Kiwi/only.jpg"]
  )
  examples, classes, skipped, warnings = layout.layout(nested, holdout_fraction=0.25, seed=0)
  # The shared leading folder 'val' is not part of the class.
  assert classes == ["Fruit/Apple", "Fruit/Kiwi", "Vegetables/Pepper/Red"]
  test = collections_count(examples["test"])
  assert test == {"Fruit/Apple": 5, "Vegetables/Pepper/Red": 2}  # round(0.25 n), stratified.
  assert ("val/Fruit/Kiwi/only.jpg", "Fruit/Kiwi") in examples["train"] and not skipped
  assert warnings == ["class 'Fruit/Kiwi' has 1 image (val/Fruit/Kiwi/only.jpg), in train only"]
  again = layout.layout(nested, holdout_fraction=0.25, seed=0)[0]
  other = layout.layout(nested, holdout_fraction=0.25, seed=1)[0]
  assert again == examples and other["test"] != examples["test"]

  # One folder, however deep: unlabeled; the test split is held out of all files.
  flat = [f"images/{i}.png" for i in range(10)]
  examples, classes, _, _ = layout.layout(flat, holdout_fraction=0.1, seed=0)
  assert classes == [] and len(examples["test"]) == 1 and len(examples["train"]) == 9

  # Split folders; files outside them, or beside class folders, are skipped.
  tree = [
    "train/hat/a.jpg",
    "train/shoes/b.jpg",
    "train/c.jpg",
    "test/hat/d.jpg",
    "e.jpg",
    "extra/f.jpg",
  ]
  examples, classes, skipped, warnings = layout.layout(tree, holdout_fraction=0.1, seed=0)
  assert classes == ["hat", "shoes"]
  assert examples == {
    "train": [("train/hat/a.jpg", "hat"), ("train/shoes/b.jpg", "shoes")],
    "test": [("test/hat/d.jpg", "hat")],
  }
  assert [f for f, _ in skipped] == ["e.jpg", "extra/f.jpg", "train/c.jpg"]
  assert "class 'shoes' has 1 image (train/shoes/b.jpg), in train only" in warnings

  # Files at the top beside one folder of classes: the classes are below that folder.
  grocery = [
    "LICENSE",
    "classes.csv",
    "val/Fruit/Apple/a.jpg",
    "val/Fruit/Kiwi/b.jpg",
    "val/Milk/c.jpg",
    "val/notes.txt",
  ]
  examples, classes, skipped, _ = layout.layout(grocery, holdout_fraction=0.5, seed=0)
  assert classes == ["Fruit/Apple", "Fruit/Kiwi", "Milk"]
  assert [f for f, _ in skipped] == ["LICENSE", "classes.csv", "val/notes.txt"]
  assert {reason for _, reason in skipped} == {
    "not in a class folder (the dataset has class folders beside it)"
  }
  # One folder beside top-level files: unlabeled, every file kept.
  examples, classes, skipped, _ = layout.layout(
    ["README.txt", "photos/a.jpg", "photos/b.jpg"], holdout_fraction=0.5, seed=0
  )
  assert classes == [] and not skipped
  assert sorted(f for split in examples.values() for f, _ in split) == [
    "README.txt",
    "photos/a.jpg",
    "photos/b.jpg",
  ]


@pytest.mark.parametrize(
  "folder,splits,num_classes,first,skipped",
  [
    ("clothing", {"train", "validation", "test"}, 10, "dress", ["LICENSE"]),
    ("grocery", {"train", "test"}, 60, "Fruit/Apple/Golden-Delicious", ["LICENSE", "classes.csv"]),
    ("chest_xray", {"train", "test"}, 0, None, []),
  ],
)
def test_shared_folders_lay_out_into_their_splits_and_class_folders(
  folder, splits, num_classes, first, skipped
):
  listed, hidden, _ = layout.list_source(os.path.join(SHARED, "images", folder), "config.src")
  examples, classes, layout_skipped, _ = layout.layout(listed, holdout_fraction=0.1, seed=0)
  assert set(examples) == splits and len(classes) == num_classes and not hidden
  assert (classes[0] if classes else None) == first
  assert [f for f, _ in layout_skipped] == skipped
  assert not any(c.startswith(("val/", "train/")) for c in classes)


def collections_count(split_examples):
  counts = {}
  for _, name in split_examples:
    counts[name] = counts.get(name, 0) + 1
  return counts


def _make_source(root):
  """train/{hat,shoes} and test/{hat,shoes} of real photos, a grayscale X-ray, a tiny image,
  a truncated photo, a licence file and a hidden file."""
  for split, n in (("train", 3), ("test", 1)):
    for c, cls in enumerate(("hat", "shoes")):
      os.makedirs(root / split / cls)
      for i in range(n):
        shutil.copy(
          PHOTOS[(c * 4 + i) if split == "train" else 3 + 4 * c], root / split / cls / f"{i}.jpg"
        )
  shutil.copy(XRAYS[0], root / "train" / "shoes" / "xray.png")
  Image.fromarray(photo(8, 6)).save(root / "train" / "hat" / "tiny.png")
  truncated(PHOTOS[10], root / "train" / "hat" / "broken.jpg")
  (root / "LICENSE").write_text("CC0")
  (root / ".DS_Store").write_bytes(b"\0\1")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  src = tmp_path_factory.mktemp("src")
  _make_source(src)
  data_dir = tmp_path_factory.mktemp("tfds")
  report = prepare(src, "mini", data_dir)
  return src, str(data_dir), report


def _examples(name, data_dir, split):
  """The split's examples in their stored order, read at random (ArrayRecord)."""
  source = tfds.builder(name, data_dir=data_dir).as_data_source(split=split)
  return [
    {k: v.decode() if isinstance(v, bytes) else v for k, v in source[i].items()}
    for i in range(len(source))
  ]


def test_prepared_folder_reads_by_name_with_labels_and_file_names(prepared):
  _, data_dir, report = prepared
  builder = tfds.builder("mini", data_dir=data_dir)
  assert set(builder.info.features) == {"image", "label", "file_name"}
  assert builder.info.features["label"].names == ["hat", "shoes"]
  source = sources.TfdsSource("mini", data_dir)
  assert source.num_classes == 2
  assert (source.num_examples("train", "f"), source.num_examples("test", "f")) == (8, 2)
  train = _examples("mini", data_dir, "train")
  assert sorted((ex["file_name"], ex["label"]) for ex in train) == [
    ("train/hat/0.jpg", 0),
    ("train/hat/1.jpg", 0),
    ("train/hat/2.jpg", 0),
    ("train/hat/tiny.png", 0),
    ("train/shoes/0.jpg", 1),
    ("train/shoes/1.jpg", 1),
    ("train/shoes/2.jpg", 1),
    ("train/shoes/xray.png", 1),
  ]
  for ex in train:
    shorter = 6 if ex["file_name"].endswith("tiny.png") else 32
    assert ex["image"].dtype == np.uint8 and min(ex["image"].shape[:2]) == shorter
  assert builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD
  # The layout is computed from the file list: LICENSE is outside the split folders.
  assert report["skipped"] == [
    {"file": ".DS_Store", "reason": "hidden"},
    {"file": "LICENSE", "reason": "outside the train/, validation/ and test/ folders"},
    {"file": "train/hat/broken.jpg", "reason": report["skipped"][2]["reason"]},
  ]
  assert "truncated" in report["skipped"][2]["reason"]
  assert report["smaller_than_image_size"] == [
    {"file": "train/hat/tiny.png", "width": 8, "height": 6}
  ]
  assert report["splits"]["train"] == {"images": 8, "per_class": {"hat": 4, "shoes": 4}}
  on_disk = os.path.join(data_dir, "mini", "1.0.0", "prepare_report.json")
  assert os.path.exists(on_disk) and sorted(os.listdir(data_dir)) == [files.LOCK, "mini"]


def test_pipelines_crop_variable_sizes_and_upscale_small_images(prepared):
  _, data_dir, _ = prepared
  source = sources.TfdsSource("mini", data_dir)
  # 48 px crops: every stored image (32 px, one 8 x 6) is smaller. Cached images are
  # decoded once; uncached ones stay encoded until the crop (large folders).
  for cache in (True, False):
    train = input_pipeline.train_dataset(
      source,
      "train",
      local_batch=8,
      image_size=48,
      crop=crop_spec.CropSpec("tensorflow", 0.08, "tf_bicubic"),
      seed=0,
      start_step=0,
      cache=cache,
      shuffle_buffer=8,
      threads=1,
    )
    batch = next(iter(tfds.as_numpy(train)))
    assert batch["image"].shape == (8, 2, 48, 48, 3) and batch["image"].dtype == np.uint8
  ev = input_pipeline.eval_dataset(
    source,
    "train",
    local_batch=8,
    eval_crop=input_pipeline.EvalCrop(48, 0.875, "pil_bilinear"),
    threads=1,
  )
  assert next(iter(tfds.as_numpy(ev)))["image"].shape == (8, 48, 48, 3)
  one_pixel = np.full((1, 1, 3), 7, np.uint8)
  np.testing.assert_array_equal(
    input_pipeline.center_crop(one_pixel, 4, 0.875, "tf_bicubic").numpy(), np.full((4, 4, 3), 7)
  )


def test_preparing_again_is_a_no_op_and_new_files_need_overwrite(prepared, tmp_path):
  src, data_dir, report = prepared
  shard = glob.glob(os.path.join(data_dir, "mini", "1.0.0", "*train.array_record*"))[0]
  mtime = os.stat(shard).st_mtime_ns
  assert prepare(src, "mini", data_dir) == report
  assert os.stat(shard).st_mtime_ns == mtime  # Nothing rewritten.

  # The same folder prepared elsewhere: the same examples in the same order.
  copy = prepare(src, "mini", tmp_path)
  assert copy["fingerprint"] == report["fingerprint"]
  for split in ("train", "test"):
    for a, b in zip(
      _examples("mini", data_dir, split), _examples("mini", str(tmp_path), split), strict=True
    ):
      assert a["file_name"] == b["file_name"] and np.array_equal(a["image"], b["image"])

  shutil.copy(PHOTOS[20], src / "train" / "hat" / "new.jpg")
  try:
    with pytest.raises(
      JobError,
      match="already holds a dataset prepared from other files or "
      r"options .* pass --config.overwrite=True",
    ):
      prepare(src, "mini", tmp_path)
    assert sources.TfdsSource("mini", str(tmp_path)).num_examples("train", "f") == 8  # Intact.
    prepare(src, "mini", tmp_path, overwrite=True)
    assert sources.TfdsSource("mini", str(tmp_path)).num_examples("train", "f") == 9
    assert sorted(os.listdir(tmp_path)) == [files.LOCK, "mini"]  # No temporary folder left.
  finally:
    os.remove(src / "train" / "hat" / "new.jpg")


def test_folder_of_files_that_are_not_images_is_a_class_with_a_warning(tmp_path):
  # The layout comes from the file list: notes/ is a class before any file is decoded.
  for name, path in (("hat", PHOTOS[0]), ("shoes", PHOTOS[4]), ("hat", PHOTOS[1])):
    os.makedirs(tmp_path / "src" / name, exist_ok=True)
    shutil.copy(path, tmp_path / "src" / name)
  os.makedirs(tmp_path / "src" / "notes")
  (tmp_path / "src" / "notes" / "todo.txt").write_text("not an image")
  report = prepare(tmp_path / "src", "notes", tmp_path / "tfds")
  assert report["classes"] == ["hat", "notes", "shoes"]
  assert report["skipped"] == [
    {"file": "notes/todo.txt", "reason": "not an image Pillow can decode"}
  ]
  assert "class 'notes': no image of it could be decoded (its label is kept)" in report["warnings"]


def _bad_source(tmp_path, kind):
  """(--src, match) for a folder that cannot be prepared."""
  if kind == "missing":
    return tmp_path / "nowhere", "does not exist"
  if kind == "file":
    return truncated(PHOTOS[0], tmp_path / "a.jpg"), "is not a folder"
  src = tmp_path / "src"
  src.mkdir()
  if kind == "empty":
    return src, "no image to prepare for the train split \\(0 files\\)"
  if kind == "no_images":  # In train; validation has one.
    (src / "train").mkdir()
    (src / "train" / "a.txt").write_text("text")
    truncated(PHOTOS[0], src / "train" / "b.jpg")
    (src / "validation").mkdir()
    shutil.copy(PHOTOS[1], src / "validation")
    return src, (
      "no image of split .train. could be decoded; skipped: train/a.txt: not an "
      "image Pillow can decode; train/b.jpg: cannot be decoded: truncated"
    )
  if kind == "loop":
    (src / "cats").mkdir()
    shutil.copy(PHOTOS[0], src / "cats" / "a.jpg")
    os.symlink(src, src / "cats" / "again")
    return src, f"symbolic link loop: {src}/cats/again points to {src}"
  raise ValueError(kind)


@pytest.mark.parametrize("kind", ["missing", "file", "empty", "no_images", "loop"])
def test_bad_folder_is_one_error_naming_it_and_writes_nothing(tmp_path, kind):
  src, match = _bad_source(tmp_path, kind)
  data_dir = tmp_path / "tfds"
  with pytest.raises(JobError, match=match) as e:
    prepare(src, "bad", data_dir)
  assert str(e.value).startswith(f"config.src='{src}'")
  assert not data_dir.exists() or set(os.listdir(data_dir)) <= {files.LOCK}  # The job's lock.


@pytest.mark.parametrize(
  "fields,data_dir,match",
  [
    (dict(name="My-Photos"), None, "^config.name='My-Photos': must be lowercase"),
    (dict(name="cifar10"), None, "^config.name='cifar10': must be a name TFDS does not know"),
    (dict(holdout_fraction=1.0), None, "^config.holdout_fraction=1.0: must be in \\(0, 1\\)"),
    (dict(format="gif"), None, "^config.format='gif': must be one of \\['jpeg', 'png'\\]"),
    (dict(image_size=-1), None, "^config.image_size=-1: must be an integer >= 0"),
    (dict(src=None), None, "^config.src=None: must be a folder of image files"),
    (
      dict(beam=dict(direct_num_workers=-2)),
      None,
      "^config.beam.direct_num_workers=-2: must be an integer >= 0",
    ),
    ({}, "inside", "is inside config.src"),
  ],
)
def test_bad_arguments_are_refused(prepared, tmp_path, fields, data_dir, match):
  src = prepared[0]
  data_dir = src / "tfds" if data_dir else tmp_path
  with pytest.raises(JobError, match=match):
    prepare(fields.pop("src", src), fields.pop("name", "ok"), data_dir, **fields)
  assert not os.listdir(tmp_path)


def test_unlabeled_folder_pretrains_and_refuses_label_evaluators(tmp_path):
  src = tmp_path / "xrays" / "images"
  src.mkdir(parents=True)
  for path in XRAYS[:18]:
    shutil.copy(path, src)
  report = prepare(src.parent, "xrays", tmp_path / "tfds")
  assert report["classes"] == [] and report["splits"]["train"]["images"] == 16
  config = tiny_config()
  config.dataset, config.data_dir, config.train_split = "xrays", str(tmp_path / "tfds"), "train"
  with pytest.raises(
    ConfigError,
    match="config.evaluators.knn.kind='knn': must be an evaluator "
    "that needs no labels: dataset 'xrays' has none .*--config.evaluators='{}'",
  ):
    runner.run(pretrain, config, str(tmp_path / "refused"))
  # Without evaluators the job builds: no online probe, unlabeled batches (label -1).
  # (Compiling its step here would cost minutes of the suite; the README's chest_xray
  # run pretrains on such a folder.)
  config.evaluators = {}
  task = pretrain.build(config, mesh_lib.make_mesh(), None, str(tmp_path / "built"))
  assert task.num_classes is None and task.eval_model.logits is None
  assert jax.eval_shape(task.init).probe == {}
  batch = next(task.train_batches(0))
  assert batch["image"].shape == (16, 2, 32, 32, 3)
  np.testing.assert_array_equal(batch["label"], -1)


@pytest.mark.parametrize("name", ["simclr_images", "moco_v2_images", "byol_images", "dino_images"])
def test_image_folder_configs_pass_their_checks(name):
  for variant in ("", "runlocal"):
    config = load_config(name, variant)
    pretrain.check_config(config, num_devices=8)
    assert 64 <= config.image_size <= 224 and config.dataset == "clothing"


def test_the_old_command_says_the_new_one():
  old = [
    "prepare_images",
    "--src=/photos",
    "--name",
    "photos",
    "--data_dir=/tmp/tfds",
    "--image_size=0",
    "--overwrite",
    "--direct_num_workers=2",
    "--beam_options=--a=1 --b=2",
  ]
  assert prepare_images.main(old) == (
    "error: image folders are prepared by the prepare job now; run: python -m "
    "contrastive_jax.main --config=configs/prepare.py --workdir=/tmp/tfds "
    "--config.src=/photos --config.name=photos --config.image_size=0 "
    "--config.overwrite=True --config.beam.direct_num_workers=2 "
    "'--config.beam.options=--a=1 --b=2'"
  )
  assert prepare_images.main(["prepare_images", "--bogus=1"]).startswith(
    "error: '--bogus=1' is not a flag of this command; image folders are prepared by the "
    "prepare job: python -m contrastive_jax.main --config=configs/prepare.py"
  )


def test_command_line_error_is_one_line(tmp_path):
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "contrastive_jax.main",
      "--config=configs/prepare.py",
      f"--config.src={tmp_path}/nowhere",
      "--config.name=x",
      f"--workdir={tmp_path}/tfds",
    ],
    capture_output=True,
    text=True,
    env=subprocess_env(),
    timeout=300,
    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  )
  assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
  assert done.stderr.strip().splitlines()[-1] == (
    f"error: config.src='{tmp_path}/nowhere': does not exist"
  )


def _files_and_contents(folder):
  """{relative path: bytes} of every file below folder but the lock (which names its holder)."""
  found = {}
  for directory, _, names in os.walk(folder):
    for name in set(names) - {files.LOCK}:
      with open(os.path.join(directory, name), "rb") as f:
        found[os.path.relpath(os.path.join(directory, name), folder)] = f.read()
  return found


def test_one_and_two_workers_write_the_same_dataset(prepared, tmp_path):
  src, data_dir, report = prepared  # Prepared on one worker, in this process.
  two = prepare(src, "mini", tmp_path, beam=dict(direct_num_workers=2))  # A driver process.
  assert two == report
  for split in ("train", "test"):
    records = _records(data_dir, split)
    assert len(records) == report["splits"][split]["images"]
    assert _records(str(tmp_path), split) == records  # The same records, in the same order.


def _records(data_dir, split):
  """The stored records of a split of 'mini', in order, as tf.train.Example.

  Parsed: their bytes differ from one process to the next, since protobuf writes
  the map of an Example's features in an order it varies; their content does not.
  """
  shards = sorted(
    glob.glob(os.path.join(data_dir, "mini", "1.0.0", f"mini-{split}.array_record-*"))
  )
  source = ArrayRecordDataSource(shards)
  return [tf.train.Example.FromString(source[i]) for i in range(len(source))]


def test_without_apache_beam_prepare_says_what_to_install(prepared, tmp_path, monkeypatch):
  import contrastive_jax.data  # pylint: disable=g-import-not-at-top

  monkeypatch.setitem(sys.modules, "apache_beam", None)  # Importing it raises ImportError.
  monkeypatch.delitem(sys.modules, "contrastive_jax.data.prepare_beam", raising=False)
  monkeypatch.delattr(contrastive_jax.data, "prepare_beam", raising=False)
  with pytest.raises(
    JobError,
    match=r"^the prepare job runs on Apache Beam, which is not "
    r"installed: pip install -e '\.\[beam\]'",
  ):
    prepare(prepared[0], "mini", tmp_path)
  assert not os.listdir(tmp_path)


def _dataflow_installed():
  try:
    importlib.import_module("apache_beam.runners.dataflow.internal.apiclient")
    return True
  except ImportError:
    return False


@pytest.mark.parametrize(
  "runner,match",
  [
    (
      "NoSuchRunner",
      r"^config.beam.runner='NoSuchRunner': Unexpected pipeline runner: "
      "NoSuchRunner",
    ),
    pytest.param(
      "DataflowRunner",
      r"^config.beam.runner='DataflowRunner': cannot start "
      r"\(.*\); pip "
      r"install 'apache-beam\[gcp\]==2.77.0'$",
      marks=pytest.mark.skipif(_dataflow_installed(), reason="apache-beam[gcp] is installed"),
    ),
  ],
)
def test_runner_that_cannot_start_is_one_error_naming_what_to_install(
  prepared, tmp_path, runner, match
):
  with pytest.raises(JobError, match=match):
    prepare(prepared[0], "mini", tmp_path, beam=dict(runner=runner))
  assert not os.listdir(tmp_path)


def test_failing_worker_replaces_nothing_and_leaves_no_temporary_folder(
  prepared, tmp_path, monkeypatch
):
  src, prepared_dir, _ = prepared
  data_dir = tmp_path / "tfds"
  shutil.copytree(prepared_dir, data_dir)
  before = _files_and_contents(data_dir)
  load_image = images.load_image

  def dies_on_the_xray(path, **kwargs):  # Not an ImageError: no skip, a failure.
    if path.endswith("xray.png"):
      raise RuntimeError("the worker died")
    return load_image(path, **kwargs)

  monkeypatch.setattr(images, "load_image", dies_on_the_xray)
  with pytest.raises(
    JobError,
    match=r"^the Beam pipeline failed on FnApiRunner: "
    r"RuntimeError: the worker died",
  ) as e:
    prepare(src, "mini", data_dir, overwrite=True, image_size=48)  # Other options: replaces.
  assert "\n" not in str(e.value)
  assert str(e.value).endswith(
    f"; the previous {data_dir}/mini is kept as it was, and no partly written copy is left"
  )
  assert _files_and_contents(data_dir) == before  # No temporary folder either.


def test_files_a_runner_loses_are_an_error_not_a_smaller_dataset(prepared, tmp_path, monkeypatch):
  from contrastive_jax.data import prepare_beam  # pylint: disable=g-import-not-at-top

  read_list = prepare_beam.read_list
  # A file of a shard that no worker reads (a runner losing it, as ReadFromText can).
  monkeypatch.setattr(
    prepare_beam,
    "read_list",
    lambda path: [pair for pair in read_list(path) if pair[0] != "train/shoes/xray.png"],
  )
  with pytest.raises(
    JobError,
    match=r"^the Beam pipeline on FnApiRunner lost files: split "
    r"'train' has 7 examples, but 8 of its 9 files were not reported as "
    r"skipped; nothing was replaced$",
  ):
    prepare(prepared[0], "mini", tmp_path)
  assert os.listdir(tmp_path) == [files.LOCK]


def test_gs_source_is_listed_and_read_as_a_local_one(prepared, tmp_path, monkeypatch):
  src, data_dir, report = prepared
  (tmp_path / "gcs").mkdir()
  emulator = gcs_emulator.start(str(tmp_path / "gcs"), "bucket")
  try:
    for name in _files_and_contents(src):  # Every file of the local source, hidden ones too.
      with open(src / name, "rb") as f:
        gcs_emulator.upload(emulator, f"photos/{name}", f.read())
    for name, value in emulator.env.items():
      monkeypatch.setenv(name, value)
    on_gs = prepare("gs://bucket/photos", "mini", tmp_path / "tfds")
  finally:
    emulator.stop()
  assert on_gs["src"] == "gs://bucket/photos" and on_gs["fingerprint"] != report["fingerprint"]
  for key in ("classes", "splits", "skipped", "smaller_than_image_size", "warnings", "files"):
    assert on_gs[key] == report[key], key
  for split in ("train", "test"):
    assert _records(str(tmp_path / "tfds"), split) == _records(data_dir, split)


def _copy_down(gs_folder, local_folder):
  """A gs:// folder's files, copied to local_folder (ArrayRecord reads local files)."""
  for directory, _, names in tf.io.gfile.walk(gs_folder):
    rel = directory[len(gs_folder) :].strip("/")
    os.makedirs(os.path.join(local_folder, rel), exist_ok=True)
    for name in names:
      tf.io.gfile.copy(f"{directory.rstrip('/')}/{name}", os.path.join(local_folder, rel, name))


def test_gs_data_dir_gets_the_same_dataset(prepared, tmp_path, monkeypatch):
  src, data_dir, report = prepared
  (tmp_path / "gcs").mkdir()
  emulator = gcs_emulator.start(str(tmp_path / "gcs"), "bucket")
  try:
    for name, value in emulator.env.items():
      monkeypatch.setenv(name, value)
    on_gs = prepare(src, "mini", "gs://bucket/tfds")
    assert tf.io.gfile.listdir("gs://bucket/tfds") == ["mini/"]  # No temporary folder left.
    _copy_down("gs://bucket/tfds", str(tmp_path / "copy"))
  finally:
    emulator.stop()
  assert on_gs == report
  for split in ("train", "test"):
    assert _records(str(tmp_path / "copy"), split) == _records(data_dir, split)
  assert [ex["file_name"] for ex in _examples("mini", str(tmp_path / "copy"), "train")] == [
    ex["file_name"] for ex in _examples("mini", data_dir, "train")
  ]


def test_gs_source_without_credentials_is_one_clear_error(tmp_path, monkeypatch):
  for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # No gcloud credentials file there.
  monkeypatch.setattr(_metadata, "is_on_gce", lambda request: False)  # As test_gcs.py.
  with pytest.raises(
    JobError, match="^config.src=gs://no-credentials/photos: no Google Cloud credentials"
  ):
    prepare("gs://no-credentials/photos", "photos", tmp_path / "tfds")
  assert not (tmp_path / "tfds").exists()


# Installed as sitecustomize.py in every Python process of a prepare job: the job, Beam's
# driver and its workers. Each image decode says so with a file named by its process id in
# $DECODING_DIR, then blocks: a fault comes while the pipeline is under way.
_BLOCKING_DECODER = """
import os
import time
from contrastive_jax.data import images

def blocked(*args, **kwargs):
  open(os.path.join(os.environ["DECODING_DIR"], str(os.getpid())), "w").close()
  time.sleep(3600)

images.load_image = blocked
"""


def _blocking_hook(tmp_path):
  """(PYTHONPATH entry, decoding dir): a folder holding _BLOCKING_DECODER as sitecustomize.py."""
  (tmp_path / "hook").mkdir()
  (tmp_path / "hook" / "sitecustomize.py").write_text(_BLOCKING_DECODER)
  decoding = tmp_path / "decoding"
  decoding.mkdir()
  return str(tmp_path / "hook"), decoding


def _wait_for_decoding(decoding, job_running) -> int:
  """The process id of the first process that decodes an image (_BLOCKING_DECODER)."""
  for _ in range(3000):  # An event, not a duration: at most 300 s for the job to start.
    if os.listdir(decoding) or not job_running():
      break
    time.sleep(0.1)
  assert os.listdir(decoding), "the prepare job ended or decoded nothing"
  return int(os.listdir(decoding)[0])


def _gone(group: int) -> bool:
  """Whether process group `group` has ended: killed processes leave it once reaped."""
  for _ in range(600):  # An event, not a duration: SIGKILL ends them, at most 60 s to reap.
    try:
      os.killpg(group, 0)
    except ProcessLookupError:
      return True
    time.sleep(0.1)
  return False


def _kept_line(data_dir) -> str:
  return f"the previous {data_dir}/mini is kept as it was, and no partly written copy is left"


@pytest.mark.parametrize("workers", [1, 2])
def test_prepare_ctrl_c_ends_in_one_line_replaces_nothing_and_stops_its_workers(
  prepared, tmp_path, workers
):
  src, prepared_dir, _ = prepared
  data_dir = tmp_path / "tfds"
  shutil.copytree(prepared_dir, data_dir)
  before = _files_and_contents(data_dir)
  hook, decoding = _blocking_hook(tmp_path)
  env = subprocess_env(DECODING_DIR=str(decoding))
  env["PYTHONPATH"] = os.pathsep.join([hook, env["PYTHONPATH"]])  # Every process decodes so.
  log = tmp_path / "stderr"
  with open(log, "w") as stderr:  # In a session of its own: a terminal's foreground job.
    job = subprocess.Popen(
      [
        sys.executable,
        "-m",
        "contrastive_jax.main",
        "--config=configs/prepare.py",
        f"--config.src={src}",
        "--config.name=mini",
        f"--workdir={data_dir}",
        "--config.image_size=48",
        "--config.overwrite=True",  # Other options: it replaces.
        f"--config.beam.direct_num_workers={workers}",
      ],
      stdout=stderr,
      stderr=subprocess.STDOUT,
      env=env,
      start_new_session=True,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
      preexec_fn=receive_ctrl_c,
    )
  try:
    group = os.getpgid(_wait_for_decoding(decoding, lambda: job.poll() is None))
    assert any(name.startswith(".mini.preparing.") for name in os.listdir(data_dir))
    os.killpg(job.pid, signal.SIGINT)  # A terminal's Ctrl-C: to its foreground process group.
    job.wait(timeout=120)
  finally:
    job.kill()
    job.wait()
  output = log.read_text()
  assert job.returncode == 1, output[-3000:]
  for noise in ("Traceback", "KeyboardInterrupt", "Worker subprocess"):
    assert noise not in output, output[-3000:]
  assert output.strip().splitlines()[-1] == f"error: interrupted (Ctrl-C): {_kept_line(data_dir)}"
  assert _files_and_contents(data_dir) == before  # No temporary folder either.
  assert _gone(group)  # Nothing left running (Beam's driver's group with 2 workers).


def _group(group: int) -> list:
  """The process ids of process group `group`, from /proc."""
  members = []
  for stat in glob.glob("/proc/[0-9]*/stat"):
    try:
      with open(stat) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # It ended meanwhile.
      continue
    if int(fields[2]) == group:
      members.append(int(os.path.basename(os.path.dirname(stat))))
  return members


def test_prepare_ctrl_c_into_a_new_folder_leaves_no_folder(prepared, tmp_path):
  src = prepared[0]
  data_dir = tmp_path / "new" / "tfds"  # Neither exists before.
  hook, decoding = _blocking_hook(tmp_path)
  env = subprocess_env(DECODING_DIR=str(decoding))
  env["PYTHONPATH"] = os.pathsep.join([hook, env["PYTHONPATH"]])
  log = tmp_path / "stderr"
  with open(log, "w") as stderr:
    job = subprocess.Popen(
      [
        sys.executable,
        "-m",
        "contrastive_jax.main",
        "--config=configs/prepare.py",
        f"--config.src={src}",
        "--config.name=mini",
        f"--workdir={data_dir}",
        "--config.image_size=48",
        "--config.beam.direct_num_workers=1",
      ],
      stdout=stderr,
      stderr=subprocess.STDOUT,
      env=env,
      start_new_session=True,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
      preexec_fn=receive_ctrl_c,
    )
  try:
    _wait_for_decoding(decoding, lambda: job.poll() is None)
    assert os.path.exists(data_dir / files.LOCK)  # It is writing there, holding the lock.
    # One worker decodes in the job's own process, so the job is its group's only process:
    # a terminal's Ctrl-C (to the group) is the same signal as `kill -INT` of the job alone.
    assert _group(job.pid) == [job.pid]
    os.killpg(job.pid, signal.SIGINT)
    job.wait(timeout=120)
  finally:
    job.kill()
    job.wait()
  output = log.read_text()
  assert job.returncode == 1, output[-3000:]
  assert output.strip().splitlines()[-1] == (
    f"error: interrupted (Ctrl-C): no {data_dir}/mini was written, and no partly written "
    "copy is left"
  )
  assert not os.path.exists(data_dir)  # Nor its .lock; the folder above it was the user's.
  assert os.listdir(tmp_path / "new") == []


def test_prepare_refused_by_its_runner_into_a_new_folder_leaves_no_folder(prepared, tmp_path):
  # Beam knows SparkRunner, so choose_runner accepts it; it fails when the pipeline runs
  # (no Spark job server here), after the job made the folder and took its lock.
  data_dir = tmp_path / "tfds"
  with pytest.raises(JobError, match=r"^the Beam pipeline failed on SparkRunner: .*; no "):
    prepare(prepared[0], "mini", data_dir, beam=dict(runner="SparkRunner"))
  assert not os.path.exists(data_dir)
  # Into a folder that was there before, the folder and what it held stay.
  data_dir.mkdir()
  (data_dir / "other").write_text("kept")
  with pytest.raises(JobError, match="SparkRunner"):
    prepare(prepared[0], "mini", data_dir, beam=dict(runner="SparkRunner"))
  assert sorted(os.listdir(data_dir)) == [files.LOCK, "other"]


def test_prepare_worker_killed_ends_in_one_line_and_stops_the_others(
  prepared, tmp_path, monkeypatch
):
  src, prepared_dir, _ = prepared
  data_dir = tmp_path / "tfds"
  shutil.copytree(prepared_dir, data_dir)
  before = _files_and_contents(data_dir)
  hook, decoding = _blocking_hook(tmp_path)
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([hook, os.environ.get("PYTHONPATH", "")]))
  monkeypatch.setenv("DECODING_DIR", str(decoding))  # For Beam's driver and its workers.
  killed = {}

  def kill_a_worker():
    worker = _wait_for_decoding(decoding, lambda: True)
    killed["group"] = os.getpgid(worker)
    os.kill(worker, signal.SIGKILL)

  killer = threading.Thread(target=kill_a_worker)
  killer.start()
  try:
    with pytest.raises(JobError) as e:  # Beam's runner alone would wait for it forever.
      prepare(src, "mini", data_dir, overwrite=True, image_size=48, beam=dict(direct_num_workers=2))
  finally:
    killer.join()
  assert str(e.value) == (
    "the Beam pipeline failed on FnApiRunner: a worker process was killed by signal 9, "
    f"SIGKILL (kill -9, or the system ran out of memory); {_kept_line(data_dir)}"
  )
  assert _files_and_contents(data_dir) == before
  assert killed["group"] != os.getpgid(0)  # Beam's driver and its workers: a group of their own,
  assert _gone(killed["group"])  # ended: the other worker too.


def test_prepare_removes_its_stale_temporary_folders_and_keeps_live_ones(prepared, tmp_path):
  src, prepared_dir, _ = prepared
  data_dir = tmp_path / "tfds"
  shutil.copytree(prepared_dir, data_dir)
  killed = subprocess.run(  # A preparation killed (kill -9) while it wrote.
    [
      sys.executable,
      "-c",
      "import os, sys\n"
      "from contrastive_jax.data import tfds_folder\n"
      "staging = tfds_folder.Staging(sys.argv[1], 'mini')\n"
      "open(os.path.join(staging.path, 'part'), 'w').write('half')\n"
      "os.kill(os.getpid(), 9)",
      str(data_dir),
    ],
    env=subprocess_env(),
    timeout=300,
  )
  assert killed.returncode == -signal.SIGKILL
  (stale,) = [n for n in os.listdir(data_dir) if n.startswith(".mini.preparing.")]
  live = tfds_folder.Staging(str(data_dir), "mini")  # Held open: a preparation under way.
  unowned = data_dir / ".mini.preparing.0123456789ab"  # No owner file: not provably one.
  unowned.mkdir()
  other = tfds_folder.Staging(str(data_dir), "other")  # Another name's.
  other.remove()
  other = tfds_folder.Staging(str(data_dir), "other")
  try:
    assert stale != os.path.basename(live.path)
    prepare(src, "mini", data_dir, overwrite=True, image_size=48)
    assert sorted(n for n in os.listdir(data_dir) if n.startswith(".")) == sorted(
      [files.LOCK, os.path.basename(live.path), unowned.name, os.path.basename(other.path)]
    )
  finally:
    live.remove()
    other.remove()
  assert sources.TfdsSource("mini", str(data_dir)).num_examples("train", "f") == 8


@pytest.fixture
def small_disk(tmp_path):
  """A 700 kB tmpfs at tmp_path/disk (as tests/test_interruptions.py's): room for the
  `prepared` dataset (32 px, 288 kB in pages), not for it again at full size (720 kB)."""
  mount = tmp_path / "disk"
  mount.mkdir()
  made = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(mount)], capture_output=True, text=True
  )
  if made.returncode:
    pytest.skip(f"cannot mount a tmpfs here (root needed): {made.stderr.strip()}")
  try:
    yield mount
  finally:
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.parametrize("workers", [1, 2])
def test_prepare_on_a_full_disk_ends_in_one_line_and_keeps_the_previous_dataset(
  prepared, small_disk, workers
):
  src, prepared_dir, _ = prepared
  data_dir = small_disk / "tfds"
  shutil.copytree(prepared_dir, data_dir)  # 32 px: it fits; at full size it does not.
  before = _files_and_contents(data_dir)
  with pytest.raises(NoSpaceError) as e:
    prepare(
      src, "mini", data_dir, overwrite=True, image_size=0, beam=dict(direct_num_workers=workers)
    )
  assert str(e.value) == (
    f"no space left on device while preparing mini in {data_dir}: "
    f"{_kept_line(data_dir)}; free space and start the same command again"
  )
  assert _files_and_contents(data_dir) == before


def test_a_link_to_itself_is_skipped_and_listed_by_prepare_and_embed(tmp_path):
  src = tmp_path / "src"
  for name, path in (("hat", PHOTOS[0]), ("shoes", PHOTOS[4]), ("hat", PHOTOS[1])):
    os.makedirs(src / name, exist_ok=True)
    shutil.copy(path, src / name)
  os.symlink("self", src / "hat" / "self")
  reason = "symbolic link loop: it never leads to a file"
  assert images.list_files(str(src), flag="config.src")[1] == [("hat/self", reason)]
  report = prepare(src, "linked", tmp_path / "tfds")
  assert {"file": "hat/self", "reason": reason} in report["skipped"]
  assert sum(split["images"] for split in report["splits"].values()) == 3
  folder = sources.FolderSource(str(src), max_pixels=BIG, shorter_side=32)
  assert len(list(folder.read(folder.SPLIT, drop_remainder=False))) == 3
  assert folder.unreadable == [(f"{src}/hat/self", reason)]


def test_shards_hold_files_in_hashed_order_of_equal_sizes():
  from contrastive_jax.data import prepare_beam  # pylint: disable=g-import-not-at-top

  examples = {
    "train": [(f"{c}/{i}.jpg", c) for c in ("a", "b") for i in range(125)],
    "test": [(f"{c}/t{i}.jpg", c) for c in ("a", "b") for i in range(5)],
  }
  shards = prepare_beam.shard_examples(examples)  # 100 files a shard at most, here.
  assert [len(s) for s in shards["train"]] == [83, 83, 84]
  assert [len(s) for s in shards["test"]] == [10]
  train = [e for shard in shards["train"] for e in shard]
  assert sorted(train) == sorted(examples["train"])
  for shard in shards["train"]:  # Not class by class: a contiguous part holds both.
    assert 30 < sum(c == "a" for _, c in shard) < 53
  reordered = {"train": examples["train"][::-1], "test": examples["test"]}
  assert prepare_beam.shard_examples(reordered) == shards  # A function of the files.


def test_many_shards_one_empty_read_as_one(prepared, tmp_path, monkeypatch):
  src, data_dir, report = prepared
  from contrastive_jax.data import prepare_beam  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(prepare_beam, "MIN_SHARD", 1)  # A shard per file: broken.jpg's empty.
  many = prepare(src, "mini", tmp_path)
  assert many == report
  shards = glob.glob(os.path.join(tmp_path, "mini", "1.0.0", "mini-train.array_record-*"))
  assert len(shards) == 9
  for split in ("train", "test"):
    assert _records(str(tmp_path), split) == _records(data_dir, split)
    assert [ex["file_name"] for ex in _examples("mini", str(tmp_path), split)] == [
      ex["file_name"] for ex in _examples("mini", data_dir, split)
    ]


def test_shard_written_twice_is_replaced_whole(prepared, tmp_path):
  from contrastive_jax.data import prepare_beam  # pylint: disable=g-import-not-at-top

  src = prepared[0]
  shard = [["train/hat/0.jpg", "hat"], ["train/hat/broken.jpg", "hat"]]
  (tmp_path / "files.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in shard))
  write = prepare_beam.WriteShard(
    str(src),
    str(tmp_path),
    prepare_beam.Encoding(image_size=32, format="jpeg", max_pixels=BIG),
    ["hat", "shoes"],
  )
  write.setup()
  element = (str(tmp_path / "files.jsonl"), str(tmp_path / "records"), str(tmp_path / "done"))
  contents = []
  for _ in range(2):  # As a retried bundle.
    assert list(write.process(element)) == [str(tmp_path / "done")]
    contents.append(ArrayRecordDataSource([str(tmp_path / "records")])[0])
    done = json.loads((tmp_path / "done").read_text())
    assert (done["examples"], done["per_class"]) == (1, {"hat": 1})
    assert [f for f, _ in done["skipped"]] == ["train/hat/broken.jpg"]
    assert sorted(os.listdir(tmp_path)) == ["done", "files.jsonl", "records"]  # No .part.
  assert tf.train.Example.FromString(contents[0]) == tf.train.Example.FromString(contents[1])


def test_a_dataset_of_an_earlier_version_is_named_as_such(prepared, tmp_path):
  # TFRecord shards and a fingerprint of the contents: the same files, another digest.
  src, _, report = prepared
  old = tmp_path / "mini" / "1.0.0"
  old.mkdir(parents=True)
  (old / "mini-train.tfrecord-00000-of-00001").write_bytes(b"")
  (old / "prepare_report.json").write_text(json.dumps(dict(report, fingerprint="0" * 64)))
  with pytest.raises(
    JobError,
    match="already holds a TFRecord dataset .* pass "
    "--config.overwrite=True to prepare it again as ArrayRecord",
  ):
    prepare(src, "mini", tmp_path)

"""Image files and folders as datasets: images.load_image, prepare_images and reading them.

Small real photos from ../shared/images (clothing JPEGs, chest X-ray PNGs),
converted and damaged here; every expected pixel comes from numpy.
"""
import glob
import json
import importlib
import os
import shutil
import signal
import struct
import subprocess
import sys
import zlib

from absl import flags
from array_record.python.array_record_data_source import ArrayRecordDataSource
from absl.testing import flagsaver
from google.auth.compute_engine import _metadata
import jax
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from PIL import Image

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import ImageError
from contrastive_jax.core.errors import JobError
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.data import images
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import prepare_images
from contrastive_jax.data import sources
from contrastive_jax.jobs import pretrain
from contrastive_jax.jobs import runner
import gcs_emulator
from helpers import SHARED
from helpers import load_config
from helpers import subprocess_env
from helpers import tiny_config

PHOTOS = sorted(glob.glob(os.path.join(SHARED, "images", "clothing", "train", "*", "*.jpg")))
XRAYS = sorted(glob.glob(os.path.join(SHARED, "images", "chest_xray", "images", "*.png")))
BIG = 10**8  # max_pixels that every real file here passes.
_KWARGS = dict(image_size=32, encoding="jpeg", max_pixels=BIG, holdout_fraction=0.1, seed=0)


def photo(width=40, height=30) -> np.ndarray:
  """A small real photo, uint8 [height, width, 3]."""
  with Image.open(PHOTOS[0]) as im:
    return np.asarray(im.convert("RGB").resize((width, height)))


def png_header(width, height) -> bytes:
  """A PNG of a signature, an IHDR chunk claiming width x height RGB, and IEND: no pixels."""
  def chunk(kind, body):
    return (struct.pack(">I", len(body)) + kind + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
  ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
  return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def truncated(src, dst):
  with open(src, "rb") as f:
    content = f.read()
  with open(dst, "wb") as f:
    f.write(content[:len(content) // 2])
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
  Image.fromarray(red).save(path("anim.gif"), save_all=True,
                            append_images=[Image.fromarray(blue)], duration=100)
  exif = Image.Exif()
  exif[0x0112] = 6  # Orientation: shown rotated 90 degrees clockwise.
  Image.fromarray(rgb).save(path("rotated.png"), exif=exif)

  load = lambda name: images.load_image(path(name), max_pixels=BIG)
  for name in ("gray.png", "rgba.png", "gray16.png", "palette.png", "lossless.webp", "photo.bmp",
               "cmyk.jpg", "anim.gif", "rotated.png"):
    assert load(name).dtype == np.uint8 and load(name).shape[2] == 3, name
  np.testing.assert_array_equal(load("gray.png"), np.repeat(gray[..., None], 3, axis=2))
  a = alpha[..., None] / 255.0
  np.testing.assert_allclose(load("rgba.png"), rgb * a + 255 * (1 - a), atol=1)  # On white.
  np.testing.assert_array_equal(load("gray16.png")[..., 0],
                                np.round((gray.astype(np.float64) * 257 + 100) / 257))
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
  return {"truncated.jpg": truncated(PHOTOS[0], d / "truncated.jpg"),
          "truncated.png": truncated(XRAYS[0], d / "truncated.png"),
          "notes.jpg": d / "notes.jpg", "bomb.png": d / "bomb.png", "big.png": d / "big.png",
          "folder.png": d / "folder.png", "missing.jpg": d / "missing.jpg"}


@pytest.mark.parametrize("name,reason", [
    ("truncated.jpg", "truncated"), ("truncated.png", "truncated"),
    ("notes.jpg", "not an image"), ("missing.jpg", "No such file"),
    ("folder.png", "Is a directory"), ("bomb.png", "too many pixels"),
    ("big.png", "5000 x 5000 = 25,000,000 pixels, more than max_pixels=1,000,000")])
def test_unreadable_file_is_one_error_naming_it(bad_files, name, reason, monkeypatch):
  # Pillow's own limit (its default), which an in-process preparation lifts.
  monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 89_478_485)
  with pytest.raises(ImageError, match=reason) as e:
    images.load_image(str(bad_files[name]), max_pixels=1_000_000)
  assert str(e.value).startswith(str(bad_files[name]) + ": ")


def test_layout_maps_paths_to_splits_and_classes():
  nested = [f"val/Fruit/Apple/{i}.jpg" for i in range(20)] + [
      f"val/Vegetables/Pepper/Red/{i}.jpg" for i in range(10)] + ["val/Fruit/Kiwi/only.jpg"]
  examples, classes, skipped, warnings = prepare_images.layout(nested, holdout_fraction=0.25,
                                                               seed=0)
  # The shared leading folder 'val' is not part of the class.
  assert classes == ["Fruit/Apple", "Fruit/Kiwi", "Vegetables/Pepper/Red"]
  test = collections_count(examples["test"])
  assert test == {"Fruit/Apple": 5, "Vegetables/Pepper/Red": 2}  # round(0.25 n), stratified.
  assert ("val/Fruit/Kiwi/only.jpg", "Fruit/Kiwi") in examples["train"] and not skipped
  assert warnings == ["class 'Fruit/Kiwi' has 1 image (val/Fruit/Kiwi/only.jpg), in train only"]
  again = prepare_images.layout(nested, holdout_fraction=0.25, seed=0)[0]
  other = prepare_images.layout(nested, holdout_fraction=0.25, seed=1)[0]
  assert again == examples and other["test"] != examples["test"]

  # One folder, however deep: unlabeled; the test split is held out of all files.
  flat = [f"images/{i}.png" for i in range(10)]
  examples, classes, _, _ = prepare_images.layout(flat, holdout_fraction=0.1, seed=0)
  assert classes == [] and len(examples["test"]) == 1 and len(examples["train"]) == 9

  # Split folders; files outside them, or beside class folders, are skipped.
  tree = ["train/hat/a.jpg", "train/shoes/b.jpg", "train/c.jpg", "test/hat/d.jpg", "e.jpg",
          "extra/f.jpg"]
  examples, classes, skipped, warnings = prepare_images.layout(tree, holdout_fraction=0.1,
                                                               seed=0)
  assert classes == ["hat", "shoes"]
  assert examples == {"train": [("train/hat/a.jpg", "hat"), ("train/shoes/b.jpg", "shoes")],
                      "test": [("test/hat/d.jpg", "hat")]}
  assert [f for f, _ in skipped] == ["e.jpg", "extra/f.jpg", "train/c.jpg"]
  assert "class 'shoes' has 1 image (train/shoes/b.jpg), in train only" in warnings


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
        shutil.copy(PHOTOS[(c * 4 + i) if split == "train" else 3 + 4 * c],
                    root / split / cls / f"{i}.jpg")
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
  report = prepare_images.prepare(str(src), "mini", str(data_dir), image_size=32,
                                  encoding="jpeg", max_pixels=BIG, holdout_fraction=0.1, seed=0,
                                  overwrite=False)
  return src, str(data_dir), report


def _examples(name, data_dir, split):
  """The split's examples in their stored order, read at random (ArrayRecord)."""
  source = tfds.builder(name, data_dir=data_dir).as_data_source(split=split)
  return [{k: v.decode() if isinstance(v, bytes) else v for k, v in source[i].items()}
          for i in range(len(source))]


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
      ("train/hat/0.jpg", 0), ("train/hat/1.jpg", 0), ("train/hat/2.jpg", 0),
      ("train/hat/tiny.png", 0), ("train/shoes/0.jpg", 1), ("train/shoes/1.jpg", 1),
      ("train/shoes/2.jpg", 1), ("train/shoes/xray.png", 1)]
  for ex in train:
    shorter = 6 if ex["file_name"].endswith("tiny.png") else 32
    assert ex["image"].dtype == np.uint8 and min(ex["image"].shape[:2]) == shorter
  assert builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD
  # The layout is computed from the file list: LICENSE is outside the split folders.
  assert report["skipped"] == [
      {"file": ".DS_Store", "reason": "hidden"},
      {"file": "LICENSE", "reason": "outside the train/, validation/ and test/ folders"},
      {"file": "train/hat/broken.jpg", "reason": report["skipped"][2]["reason"]}]
  assert "truncated" in report["skipped"][2]["reason"]
  assert report["smaller_than_image_size"] == [
      {"file": "train/hat/tiny.png", "width": 8, "height": 6}]
  assert report["splits"]["train"] == {"images": 8, "per_class": {"hat": 4, "shoes": 4}}
  on_disk = os.path.join(data_dir, "mini", "1.0.0", "prepare_report.json")
  assert os.path.exists(on_disk) and not glob.glob(os.path.join(data_dir, ".*"))


def test_pipelines_crop_variable_sizes_and_upscale_small_images(prepared):
  _, data_dir, _ = prepared
  source = sources.TfdsSource("mini", data_dir)
  # 48 px crops: every stored image (32 px, one 8 x 6) is smaller. Cached images are
  # decoded once; uncached ones stay encoded until the crop (large folders).
  for cache in (True, False):
    train = input_pipeline.train_dataset(source, "train", local_batch=8, image_size=48,
                                         crop_sampler="tensorflow", crop_area_min=0.08,
                                         crop_resize="tf_bicubic", seed=0, start_step=0, cache=cache,
                                         shuffle_buffer=8, threads=1)
    batch = next(iter(tfds.as_numpy(train)))
    assert batch["image"].shape == (8, 2, 48, 48, 3) and batch["image"].dtype == np.uint8
  ev = input_pipeline.eval_dataset(source, "train", local_batch=8, image_size=48,
                                   crop_fraction=0.875, crop_resize="pil_bilinear", threads=1)
  assert next(iter(tfds.as_numpy(ev)))["image"].shape == (8, 48, 48, 3)
  one_pixel = np.full((1, 1, 3), 7, np.uint8)
  np.testing.assert_array_equal(
      input_pipeline.center_crop(one_pixel, 4, 0.875, "tf_bicubic").numpy(), np.full((4, 4, 3), 7))


def test_preparing_again_is_a_no_op_and_new_files_need_overwrite(prepared, tmp_path):
  src, data_dir, report = prepared
  shard = glob.glob(os.path.join(data_dir, "mini", "1.0.0", "*train.array_record*"))[0]
  mtime = os.stat(shard).st_mtime_ns
  kwargs = dict(image_size=32, encoding="jpeg", max_pixels=BIG, holdout_fraction=0.1, seed=0)
  assert prepare_images.prepare(str(src), "mini", data_dir, overwrite=False, **kwargs) == report
  assert os.stat(shard).st_mtime_ns == mtime  # Nothing rewritten.

  # The same folder prepared elsewhere: the same examples in the same order.
  copy = prepare_images.prepare(str(src), "mini", str(tmp_path), overwrite=False, **kwargs)
  assert copy["fingerprint"] == report["fingerprint"]
  for split in ("train", "test"):
    for a, b in zip(_examples("mini", data_dir, split), _examples("mini", str(tmp_path), split),
                    strict=True):
      assert a["file_name"] == b["file_name"] and np.array_equal(a["image"], b["image"])

  shutil.copy(PHOTOS[20], src / "train" / "hat" / "new.jpg")
  try:
    with pytest.raises(JobError, match="already holds a dataset prepared from other files or "
                       "options .* pass --overwrite"):
      prepare_images.prepare(str(src), "mini", str(tmp_path), overwrite=False, **kwargs)
    assert sources.TfdsSource("mini", str(tmp_path)).num_examples("train", "f") == 8  # Intact.
    prepare_images.prepare(str(src), "mini", str(tmp_path), overwrite=True, **kwargs)
    assert sources.TfdsSource("mini", str(tmp_path)).num_examples("train", "f") == 9
    assert sorted(os.listdir(tmp_path)) == ["mini"]  # No temporary folder left.
  finally:
    os.remove(src / "train" / "hat" / "new.jpg")


def test_folder_of_files_that_are_not_images_is_a_class_with_a_warning(tmp_path):
  # The layout comes from the file list: notes/ is a class before any file is decoded.
  for name, path in (("hat", PHOTOS[0]), ("shoes", PHOTOS[4]), ("hat", PHOTOS[1])):
    os.makedirs(tmp_path / "src" / name, exist_ok=True)
    shutil.copy(path, tmp_path / "src" / name)
  os.makedirs(tmp_path / "src" / "notes")
  (tmp_path / "src" / "notes" / "todo.txt").write_text("not an image")
  report = prepare_images.prepare(str(tmp_path / "src"), "notes", str(tmp_path / "tfds"),
                                  overwrite=False, **_KWARGS)
  assert report["classes"] == ["hat", "notes", "shoes"]
  assert report["skipped"] == [{"file": "notes/todo.txt",
                                "reason": "not an image Pillow can decode"}]
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
    return src, ("no image of split .train. could be decoded; skipped: train/a.txt: not an "
                 "image Pillow can decode; train/b.jpg: cannot be decoded: truncated")
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
    prepare_images.prepare(str(src), "bad", str(data_dir), image_size=32, encoding="jpeg",
                           max_pixels=BIG, holdout_fraction=0.1, seed=0, overwrite=False)
  assert str(src) in str(e.value)
  assert not data_dir.exists() or not os.listdir(data_dir)


@pytest.mark.parametrize("name,fraction,data_dir,match", [
    ("My-Photos", 0.1, None, "--name='My-Photos': must be lowercase"),
    ("cifar10", 0.1, None, "--name='cifar10': is a registered TFDS dataset"),
    ("ok", 1.0, None, "--holdout_fraction=1.0: must be in \\(0, 1\\)"),
    ("ok", 0.1, "inside", "is inside --src")])
def test_bad_arguments_are_refused(prepared, tmp_path, name, fraction, data_dir, match):
  src = prepared[0]
  data_dir = str(src / "tfds") if data_dir else str(tmp_path)
  with pytest.raises(JobError, match=match):
    prepare_images.prepare(str(src), name, data_dir, image_size=32, encoding="jpeg",
                           max_pixels=BIG, holdout_fraction=fraction, seed=0, overwrite=False)


def test_unlabeled_folder_pretrains_and_refuses_label_evaluators(tmp_path):
  src = tmp_path / "xrays" / "images"
  src.mkdir(parents=True)
  for path in XRAYS[:18]:
    shutil.copy(path, src)
  report = prepare_images.prepare(str(src.parent), "xrays", str(tmp_path / "tfds"),
                                  image_size=32, encoding="jpeg", max_pixels=BIG,
                                  holdout_fraction=0.1, seed=0, overwrite=False)
  assert report["classes"] == [] and report["splits"]["train"]["images"] == 16
  config = tiny_config()
  config.dataset, config.data_dir, config.train_split = "xrays", str(tmp_path / "tfds"), "train"
  with pytest.raises(ConfigError, match="config.evaluators.knn.kind='knn': must be an evaluator "
                     "that needs no labels: dataset 'xrays' has none .*--config.evaluators='{}'"):
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


@pytest.mark.parametrize("name", ["simclr_images", "moco_v2_images", "byol_images"])
def test_image_folder_configs_pass_their_checks(name):
  for variant in ("", "runlocal"):
    config = load_config(name, variant)
    pretrain.check_config(config, num_devices=8)
    assert 64 <= config.image_size <= 224 and config.dataset == "clothing"


def test_command_line_error_is_one_line(tmp_path, monkeypatch):
  monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # main() sets it.
  flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(src=f"{tmp_path}/nowhere", name="x", data_dir=f"{tmp_path}/tfds"):
    with pytest.raises(SystemExit) as e:
      prepare_images.main(["prepare_images"])
  assert e.value.code == f"error: --src='{tmp_path}/nowhere': does not exist"


def _files_and_contents(folder):
  found = {}
  for directory, _, names in os.walk(folder):
    for name in names:
      with open(os.path.join(directory, name), "rb") as f:
        found[os.path.relpath(os.path.join(directory, name), folder)] = f.read()
  return found


def test_one_and_two_workers_write_the_same_dataset(prepared, tmp_path):
  src, data_dir, report = prepared  # Prepared on one worker, in this process.
  two = prepare_images.prepare(str(src), "mini", str(tmp_path), image_size=32, encoding="jpeg",
                               max_pixels=BIG, holdout_fraction=0.1, seed=0, overwrite=False,
                               beam_args=prepare_images.beam_args("DirectRunner", 2, ""))
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
  shards = sorted(glob.glob(os.path.join(data_dir, "mini", "1.0.0",
                                         f"mini-{split}.array_record-*")))
  source = ArrayRecordDataSource(shards)
  return [tf.train.Example.FromString(source[i]) for i in range(len(source))]


def test_without_apache_beam_prepare_says_what_to_install(prepared, tmp_path, monkeypatch):
  import contrastive_jax.data  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, "apache_beam", None)  # Importing it raises ImportError.
  monkeypatch.delitem(sys.modules, "contrastive_jax.data.prepare_beam", raising=False)
  monkeypatch.delattr(contrastive_jax.data, "prepare_beam", raising=False)
  with pytest.raises(JobError, match=r"^prepare_images runs on Apache Beam, which is not "
                     r"installed: pip install -e '\.\[beam\]'"):
    prepare_images.prepare(str(prepared[0]), "mini", str(tmp_path), overwrite=False, **_KWARGS)
  assert not os.listdir(tmp_path)


def _dataflow_installed():
  try:
    importlib.import_module("apache_beam.runners.dataflow.internal.apiclient")
    return True
  except ImportError:
    return False


@pytest.mark.parametrize("runner,match", [
    ("NoSuchRunner", r"^--runner=NoSuchRunner: Unexpected pipeline runner: NoSuchRunner"),
    pytest.param("DataflowRunner", r"^--runner=DataflowRunner: cannot start \(.*\); pip "
                 r"install 'apache-beam\[gcp\]==2.77.0'$", marks=pytest.mark.skipif(
                     _dataflow_installed(), reason="apache-beam[gcp] is installed"))])
def test_runner_that_cannot_start_is_one_error_naming_what_to_install(prepared, tmp_path,
                                                                      runner, match):
  with pytest.raises(JobError, match=match):
    prepare_images.prepare(str(prepared[0]), "mini", str(tmp_path), overwrite=False,
                           beam_args=[f"--runner={runner}"], **_KWARGS)
  assert not os.listdir(tmp_path)


def test_failing_worker_replaces_nothing_and_leaves_no_temporary_folder(prepared, tmp_path,
                                                                          monkeypatch):
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
  with pytest.raises(JobError, match=r"^the Beam pipeline failed on FnApiRunner: "
                     r"RuntimeError: the worker died") as e:
    prepare_images.prepare(str(src), "mini", str(data_dir), overwrite=True,
                           **dict(_KWARGS, image_size=48))  # Other options: a replacement.
  assert "\n" not in str(e.value)
  assert _files_and_contents(data_dir) == before  # No temporary folder either.


def test_files_a_runner_loses_are_an_error_not_a_smaller_dataset(prepared, tmp_path,
                                                                 monkeypatch):
  from contrastive_jax.data import prepare_beam  # pylint: disable=g-import-not-at-top
  read_list = prepare_beam.read_list
  # A file of a shard never read, as the previous design's ReadFromText did with 2 workers.
  monkeypatch.setattr(prepare_beam, "read_list",
                      lambda path: [pair for pair in read_list(path)
                                    if pair[0] != "train/shoes/xray.png"])
  with pytest.raises(JobError, match=r"^the Beam pipeline on FnApiRunner lost files: split "
                     r"'train' has 7 examples, but 8 of its 9 files were not reported as "
                     r"skipped; nothing was replaced$"):
    prepare_images.prepare(str(prepared[0]), "mini", str(tmp_path), overwrite=False, **_KWARGS)
  assert not os.listdir(tmp_path)


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
    on_gs = prepare_images.prepare("gs://bucket/photos", "mini", str(tmp_path / "tfds"),
                                   overwrite=False, **_KWARGS)
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
    rel = directory[len(gs_folder):].strip("/")
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
    on_gs = prepare_images.prepare(str(src), "mini", "gs://bucket/tfds", overwrite=False,
                                   **_KWARGS)
    assert tf.io.gfile.listdir("gs://bucket/tfds") == ["mini/"]  # No temporary folder left.
    _copy_down("gs://bucket/tfds", str(tmp_path / "copy"))
  finally:
    emulator.stop()
  assert on_gs == report
  for split in ("train", "test"):
    assert _records(str(tmp_path / "copy"), split) == _records(data_dir, split)
  assert [ex["file_name"] for ex in _examples("mini", str(tmp_path / "copy"), "train")] == [
      ex["file_name"] for ex in _examples("mini", data_dir, "train")]


def test_gs_source_without_credentials_is_one_clear_error(tmp_path, monkeypatch):
  for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # No gcloud credentials file there.
  monkeypatch.setattr(_metadata, "is_on_gce", lambda request: False)  # As test_gcs.py.
  with pytest.raises(JobError, match="^--src=gs://no-credentials/photos: no Google Cloud "
                     "credentials"):
    prepare_images.prepare("gs://no-credentials/photos", "photos", str(tmp_path / "tfds"),
                           overwrite=False, **_KWARGS)
  assert not (tmp_path / "tfds").exists()


# prepare_images' command line whose first image decode waits for Ctrl-C: the preparation
# cannot end before the test presses it, however loaded the machine. The decode runs in the
# main thread (one in-process worker), where SIGINT raises KeyboardInterrupt in the sleep.
_SLOW_PREPARE = """
import time
from absl import app
from contrastive_jax.data import images, prepare_images
def load_image_after_ctrl_c(*args, **kwargs):
  print("decoding", flush=True)
  while True:
    time.sleep(1)
images.load_image = load_image_after_ctrl_c
app.run(prepare_images.main)
"""


def test_ctrl_c_replaces_nothing_and_leaves_no_temporary_folder(prepared, tmp_path):
  src, prepared_dir, _ = prepared
  data_dir = tmp_path / "tfds"
  shutil.copytree(prepared_dir, data_dir)

  before = _files_and_contents(data_dir)
  log = tmp_path / "stderr"
  with open(log, "w") as stderr:  # Other options: it would replace the dataset.
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_PREPARE, f"--src={src}", "--name=mini",
                             f"--data_dir={data_dir}", "--image_size=48", "--overwrite",
                             "--direct_num_workers=1"],  # In this process: patched.
                            stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env=subprocess_env())
  try:
    for line in proc.stdout:  # TFDS prints its progress there too.
      if line == "decoding\n":
        break
    else:
      pytest.fail(f"prepare_images ended before decoding: {log.read_text()[-3000:]}")
    assert any(name.startswith(".mini.preparing.") for name in os.listdir(data_dir))
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
  finally:
    proc.kill()
    proc.wait()
  stderr = log.read_text()
  assert proc.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
  assert stderr.strip().splitlines()[-1] == (
      f"error: interrupted (Ctrl-C): nothing was replaced: {data_dir}/mini is as it was, and no "
      "partly written copy is left")
  assert _files_and_contents(data_dir) == before  # No temporary folder either.


def test_shards_hold_files_in_hashed_order_of_equal_sizes():
  examples = {"train": [(f"{c}/{i}.jpg", c) for c in ("a", "b") for i in range(125)],
              "test": [(f"{c}/t{i}.jpg", c) for c in ("a", "b") for i in range(5)]}
  shards = prepare_images.shard_examples(examples)  # 100 files a shard at most, here.
  assert [len(s) for s in shards["train"]] == [83, 83, 84]
  assert [len(s) for s in shards["test"]] == [10]
  train = [e for shard in shards["train"] for e in shard]
  assert sorted(train) == sorted(examples["train"])
  for shard in shards["train"]:  # Not class by class: a contiguous part holds both.
    assert 30 < sum(c == "a" for _, c in shard) < 53
  reordered = {"train": examples["train"][::-1], "test": examples["test"]}
  assert prepare_images.shard_examples(reordered) == shards  # A function of the files.


def test_many_shards_one_empty_read_as_one(prepared, tmp_path, monkeypatch):
  src, data_dir, report = prepared
  monkeypatch.setattr(prepare_images, "_MIN_SHARD", 1)  # A shard per file: broken.jpg's empty.
  many = prepare_images.prepare(str(src), "mini", str(tmp_path), overwrite=False, **_KWARGS)
  assert many == report
  shards = glob.glob(os.path.join(tmp_path, "mini", "1.0.0", "mini-train.array_record-*"))
  assert len(shards) == 9
  for split in ("train", "test"):
    assert _records(str(tmp_path), split) == _records(data_dir, split)
    assert [ex["file_name"] for ex in _examples("mini", str(tmp_path), split)] == [
        ex["file_name"] for ex in _examples("mini", data_dir, split)]


def test_shard_written_twice_is_replaced_whole(prepared, tmp_path):
  from contrastive_jax.data import prepare_beam  # pylint: disable=g-import-not-at-top
  src = prepared[0]
  shard = [["train/hat/0.jpg", "hat"], ["train/hat/broken.jpg", "hat"]]
  (tmp_path / "files.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in shard))
  write = prepare_beam.WriteShard(str(src), str(tmp_path),
                                  prepare_images.features("jpeg", ["hat", "shoes"]),
                                  max_pixels=BIG, image_size=32)
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
  # Earlier versions wrote TFRecord and fingerprinted contents: same files, other digest.
  src, _, report = prepared
  old = tmp_path / "mini" / "1.0.0"
  old.mkdir(parents=True)
  (old / "mini-train.tfrecord-00000-of-00001").write_bytes(b"")
  (old / "prepare_report.json").write_text(json.dumps(dict(report, fingerprint="0" * 64)))
  with pytest.raises(JobError, match="a TFRecord dataset prepared by an earlier version .* "
                     "pass --overwrite to prepare it again as ArrayRecord"):
    prepare_images.prepare(str(src), "mini", str(tmp_path), overwrite=False, image_size=32,
                           encoding="jpeg", max_pixels=BIG, holdout_fraction=0.1, seed=0)

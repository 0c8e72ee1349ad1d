"""Host pipeline and data sources on the real CIFAR-10 in ../shared."""
import inspect

import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image
from helpers import TFDS_DIR

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import sources


def _source(dataset="cifar10", data_dir=TFDS_DIR, splits=None):
  config = ml_collections.ConfigDict(dict(data_source="tfds", dataset=dataset, data_dir=data_dir))
  return sources.get_source(config, splits or {})


@pytest.fixture(scope="module")
def cifar():
  """The data source, and the raw TFDS cifar the references read independently."""
  return _source(splits={"train_split": "train"}), tfds.builder("cifar10", data_dir=TFDS_DIR)


def _train(cifar, start_step=0, area=0.08, **kw):
  args = dict(local_batch=8, image_size=32, crop_sampler="tensorflow", crop_area_min=area,
              crop_resize="tf_bicubic", seed=3, start_step=start_step,
              cache=False, shuffle_buffer=64, threads=1)
  args.update(kw)
  return input_pipeline.train_dataset(cifar[0], "train[:40]", **args)


def test_two_views_of_a_row_come_from_the_same_image(cifar):
  images = {im.tobytes() for im in
            tfds.as_numpy(cifar[1].as_dataset(split="train[:40]").map(lambda e: e["image"]))}
  # Full-area crops are the whole image, flipped or not: both views must be
  # that image (or its mirror), and the image must be in the split.
  batch = next(iter(tfds.as_numpy(_train(cifar, area=1.0))))["image"]
  assert batch.shape == (8, 2, 32, 32, 3) and batch.dtype == np.uint8
  for v1, v2 in batch:
    original = v1 if v1.tobytes() in images else v1[:, ::-1]
    assert original.tobytes() in images
    assert np.array_equal(v2, original) or np.array_equal(v2, original[:, ::-1])
  assert len({row[0].tobytes() for row in batch}) == 8


def test_random_crops_differ_between_views(cifar):
  batch = next(iter(tfds.as_numpy(_train(cifar))))["image"]
  assert not any(np.array_equal(v1, v2) for v1, v2 in batch)


def test_stream_from_a_later_step_equals_the_uninterrupted_stream(cifar):
  # 40 examples, batch 8: steps 4..7 cross the epoch boundary at step 5.
  full = [b["image"] for _, b in zip(range(10), tfds.as_numpy(_train(cifar, area=1.0)))]
  resumed = [b["image"] for _, b in
             zip(range(6), tfds.as_numpy(_train(cifar, area=1.0, start_step=4)))]
  for a, b in zip(full[4:], resumed):
    np.testing.assert_array_equal(a, b)
  # Full-area views are the image or its mirror: name each image by the smaller
  # of the two. Each epoch visits every image once, in a new order.
  names = [min(v.tobytes(), v[:, ::-1].tobytes()) for b in full for v in b[:, 0]]
  first, second = names[:40], names[40:80]
  assert len(set(first)) == 40 and set(first) == set(second) and first != second


def test_eval_dataset_counts_every_image_once(cifar):
  ds = input_pipeline.eval_dataset(cifar[0], "test[:37]", local_batch=8, image_size=32,
                                   crop_fraction=1.0, crop_resize="tf_bicubic", threads=1)
  batches = list(tfds.as_numpy(ds))
  assert len(batches) == 5
  mask = np.concatenate([b["mask"] for b in batches])
  assert mask.sum() == 37 and not mask[37:].any()
  labels = np.concatenate([b["label"] for b in batches])[mask]
  ref = [ex["label"] for ex in tfds.as_numpy(cifar[1].as_dataset(split="test[:37]"))]
  np.testing.assert_array_equal(labels, ref)
  first = next(iter(tfds.as_numpy(cifar[1].as_dataset(split="test[:1]"))))["image"]
  np.testing.assert_array_equal(batches[0]["image"][0], first)  # Unaugmented pixels.


def test_bad_dataset_split_and_data_dir_are_named(tmp_path):
  with pytest.raises(ConfigError, match="config.dataset='no_such_dataset'"):
    _source("no_such_dataset")
  with pytest.raises(ConfigError, match="config.train_split='validation'.*train"):
    _source(splits={"train_split": "validation"})
  with pytest.raises(ConfigError, match=r"config.train_split='test\[:0\]': must be a non-empty"):
    _source(splits={"train_split": "test[:0]"})
  with pytest.raises(ConfigError, match=f"config.data_dir='{tmp_path}'.*looked in {tmp_path}"):
    _source(data_dir=str(tmp_path))


def test_source_knows_sizes_and_classes(cifar):
  source = cifar[0]
  assert source.num_classes == 10
  assert source.num_examples("train", "f") == 50_000
  assert source.num_examples("test[:37]", "f") == 37
  assert sum(source.process_counts("test[:37]")) == 37


def test_every_source_has_the_source_interface(cifar, tmp_path):
  for kind in (sources.TfdsSource, sources.FolderSource, sources.LabelledSubset):
    for method in ("num_examples", "process_counts", "read"):
      assert (inspect.signature(getattr(kind, method))
              == inspect.signature(getattr(sources.Source, method))), (kind, method)
  for i in range(2):
    Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(tmp_path / f"{i}.png")
  folder = sources.FolderSource(str(tmp_path), max_pixels=10_000, shorter_side=8)
  subset = sources.LabelledSubset(cifar[0], "test[:100]", 0.1, seed=0)
  for source in (cifar[0], folder, subset):
    assert isinstance(source, sources.Source)
  # Names read with the images are the subset's own ids, in its order.
  named = list(tfds.as_numpy(subset.read("test[:100]", drop_remainder=False, names=True)))
  assert [name.decode() for _, _, name in named] == list(subset.ids)
  assert [int(label) for _, label, _ in named] == list(subset.labels)
  assert [name.decode() for _, _, name in tfds.as_numpy(
      folder.read(folder.SPLIT, drop_remainder=False, names=True))] == folder.files

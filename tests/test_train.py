"""End to end on the real CIFAR-10: train, SIGTERM, resume bit for bit; bad configs."""
import json
import os
import signal

import jax
import numpy as np
import pytest
from helpers import tiny_config

from contrastive_jax import checkpointing
from contrastive_jax import input_pipeline
from contrastive_jax import metrics as metrics_lib
from contrastive_jax import train
from contrastive_jax.errors import ConfigError


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.parametrize("method", ["simclr", "moco_v2", "byol"])
def test_killed_run_resumes_bit_for_bit(tmp_path, monkeypatch, method):
  config = tiny_config(method)
  straight = train.train(config, str(tmp_path / "straight"))

  with monkeypatch.context() as m:
    original = input_pipeline.device_batches

    def device_batches(ds, sharding, prefetch=2):
      is_train = len(ds.element_spec["image"].shape) == 5
      for i, batch in enumerate(original(ds, sharding, prefetch)):
        yield batch
        # The loop resumes this generator when it fetches the next batch, so
        # the signal arrives during step 2 and the run stops after it.
        if is_train and i == 0:
          os.kill(os.getpid(), signal.SIGTERM)

    m.setattr(input_pipeline, "device_batches", device_batches)
    stopped = train.train(config, str(tmp_path / "resumed"))
  assert int(stopped.step) == 2
  assert checkpointing.Checkpointer(str(tmp_path / "resumed" / "checkpoints")).latest_step() == 2

  resumed = train.train(config, str(tmp_path / "resumed"))
  assert int(resumed.step) == 4
  # Params, BN statistics, optimizer state and MoCo's queue / BYOL's target.
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), jax.device_get(straight))

  records = read_metrics(tmp_path / "resumed")
  assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
  for key in ("loss", "learning_rate", "images_per_sec"):
    assert all(key in r for r in records[1:])
  assert 0 <= records[0]["knn_top1"] <= 1 and 0 <= records[-1]["knn_top1"] <= 1
  straight_records = read_metrics(tmp_path / "straight")
  np.testing.assert_array_equal([r["loss"] for r in records[1:]],
                                [r["loss"] for r in straight_records[1:]])


@pytest.mark.parametrize("field,value,message", [
    ("temperature", 0.0, "config.temperature=0.0: must be > 0"),
    ("batch_size", 12, "config.batch_size=12: must be a positive multiple of the number of devices (8)"),
    ("model.name", "resnet7", "config.model.name='resnet7'"),
    ("method", "swav", "config.method='swav'"),
    ("dataset", "no_such_dataset", "config.dataset='no_such_dataset'"),
    ("train_split", "nope", "config.train_split='nope'"),
    ("augment.view1.grayscale_prob", 1.5, "config.augment.view1.grayscale_prob=1.5: must be in [0, 1]"),
])
def test_bad_config_fails_before_compute_naming_the_field(tmp_path, field, value, message):
  config = tiny_config()
  *path, last = field.split(".")
  node = config
  for part in path:
    node = node[part]
  node[last] = value
  with pytest.raises(ConfigError) as error:
    train.train(config, str(tmp_path))
  assert message in str(error.value)
  assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_workdir_from_another_model_is_refused(tmp_path):
  config = tiny_config()
  config.total_steps = 1
  train.train(config, str(tmp_path))
  config.model.width = 0.125
  with pytest.raises(ConfigError, match=r"config.model.width=0.125: must be 0.0625"):
    train.train(config, str(tmp_path))


def test_resumed_run_drops_metrics_of_steps_it_will_redo(tmp_path):
  with open(tmp_path / "metrics.jsonl", "w") as f:
    for step in range(6):
      f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
  writer = metrics_lib.create_writer(str(tmp_path), resumed_step=3)
  writer.write_scalars(4, {"loss": 2.0})
  writer.close()
  assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [
      (0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0)]
  metrics_lib.create_writer(str(tmp_path), resumed_step=None).close()  # A fresh start.
  assert read_metrics(tmp_path) == []

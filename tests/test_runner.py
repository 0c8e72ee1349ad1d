"""The job runner end to end on the real CIFAR-10: resume bit for bit, intervals in
epochs, the non-finite stop, bad configs and workdirs."""

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys

from helpers import CONFIG_DIR
from helpers import TFDS_DIR
from helpers import checkpoints_are_finite
from helpers import sigterm_after_first_train_batch
from helpers import tiny_config
import jax
import ml_collections
import numpy as np
from PIL import Image
import pytest

from contrastive_jax import config_files
from contrastive_jax.core import checkpointing
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import metrics as metrics_lib
from contrastive_jax.core import pictures
from contrastive_jax.core.errors import ABSENT
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.core.errors import NonFiniteError
from contrastive_jax.core.errors import ResumeError
from contrastive_jax.data import augment
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import sources
from contrastive_jax.jobs import pretrain
from contrastive_jax.methods import common
from contrastive_jax.methods import pretraining
from contrastive_jax.training import restore
from contrastive_jax.training import runner


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """method -> (config, workdir, final state) of the uninterrupted run of 4 steps of
  tiny_config(method, photometric=True), checkpointed at steps 3 and 4: made once per
  method, for the tests of this file that need such a run (a test that changes its workdir
  changes a copy)."""
  runs = {}

  def straight(method):
    if method not in runs:
      # With the photometric augmentations: one run of the suite resumes through all of them.
      config = tiny_config(method, photometric=True)
      config.checkpoint_every = "3 steps"  # So the checkpoint of step 2 is a preemption's own.
      workdir = str(tmp_path_factory.mktemp(f"straight_{method}"))
      state, _ = runner.run(pretrain, config, workdir)
      runs[method] = (config, workdir, state)
    config, workdir, state = runs[method]
    return config.copy_and_resolve_references(), workdir, state

  return straight


# SimCLR and MoCo v2's queue and key encoder; BYOL's target network is restored as the key
# encoder is (a tree of the train state, the same Orbax restore).
@pytest.mark.parametrize("method", ["simclr", "moco_v2"])
def test_killed_run_resumes_bit_for_bit(tmp_path, monkeypatch, method, straight_run):
  # The same config as the straight run's: its programs are reused (pretraining.setup).
  config, straight_workdir, straight = straight_run(method)

  with monkeypatch.context() as m:
    sigterm_after_first_train_batch(m)
    stopped, _ = runner.run(pretrain, config, str(tmp_path / "resumed"))
  assert int(stopped.step) == 2
  assert checkpointing.Checkpointer(str(tmp_path / "resumed" / "checkpoints")).latest_step() == 2

  resumed, results = runner.run(pretrain, config, str(tmp_path / "resumed"))
  assert int(resumed.step) == 4
  # Params, BN statistics, optimizer state, online probe, MoCo's queue / BYOL's target.
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), jax.device_get(straight))

  records = read_metrics(tmp_path / "resumed")
  assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
  for key in (
    "loss",
    "learning_rate",
    "grad_norm",
    "update_norm",
    "param_norm",
    "projection_std",
    "online_probe_loss",
  ):
    assert all(key in r for r in records[1:])
  # Rates are timed from the end of each run's first step (compilation excluded).
  assert "images_per_sec" not in records[1] and "images_per_sec" not in records[3]
  assert records[2]["images_per_sec"] > 0 and records[4]["images_per_sec"] > 0
  assert 0 <= records[0]["knn_top1"] <= 1 and "online_probe_top1" not in records[0]
  assert set(results) == {"knn_top1", "online_probe_top1", "online_probe_top5"}
  assert all(records[-1][k] == v for k, v in results.items())
  straight_records = read_metrics(straight_workdir)
  np.testing.assert_array_equal(
    [r["loss"] for r in records[1:]], [r["loss"] for r in straight_records[1:]]
  )
  if method == "simclr":
    check_views_picture(config, os.path.join(straight_workdir, "augmented_views.png"))


def check_views_picture(config, path):
  """The step-0 picture shows view v of batch row i as augment_image of the host crop with
  the key of its device and position: the train step's own pixels; the first
  n = min(16, batch) rows of the batch, in 4 rows of n / 4 images."""
  picture = np.asarray(Image.open(path))
  mesh = mesh_lib.make_mesh()
  batch = next(
    input_pipeline.train_batches(
      sources.get_source(config, {}),
      config,
      mesh_lib.batch_sharded(mesh),
      image_size=config.image_size,
    )(0)
  )
  crops = np.asarray(batch["image"])  # [B, 2, S, S, 3] uint8
  rng = jax.random.split(jax.random.PRNGKey(config.seed))[1]
  per_device = config.batch_size // jax.device_count()
  cell = max(64, config.image_size)
  pad, caption = pictures._PAD, pictures.LINE_HEIGHT  # "15: 2" fits a line of 64 px.
  n = min(16, config.batch_size)
  per_row = n // 4
  assert picture.shape == (4 * (cell + caption + pad) + pad, 2 * per_row * (cell + pad) + pad, 3)
  for i in (0, n // 3, n - 1):  # Batch 16: rows of devices 0, 2 and 7; batch 8: 0, 2 and 7.
    for v, view in enumerate(pretraining.views(config)):
      key = jax.random.split(common.view_key(rng, 0, i // per_device, v), per_device)[
        i % per_device
      ]
      x = np.asarray(augment.augment_image(crops[i, v], key, view))
      expected = Image.fromarray(np.round(np.clip(x, 0, 1) * 255).astype(np.uint8))
      expected = np.asarray(expected.resize((cell, cell), Image.BILINEAR))
      top = pad + (i // per_row) * (cell + caption + pad)
      left = pad + (2 * (i % per_row) + v) * (cell + pad)
      np.testing.assert_array_equal(picture[top : top + cell, left : left + cell], expected)


@pytest.fixture(scope="module")
def epoch_runs(tmp_path_factory):
  """(batch size -> (config, workdir, final state), the messages logged) of two runs of 2
  epochs of 32 images, at batch 8 (one image per device) and then 16, evaluated by kNN
  every epoch and checkpointed every epoch."""
  runs = {}
  with logged_messages() as messages:
    for batch_size in (8, 16):
      config = tiny_config()
      del config.evaluators["online_probe"]  # One evaluator shows it; compiling two is slow.
      config.train_split = "train[:32]"
      config.shuffle_buffer = 32
      config.batch_size = batch_size
      config.duration = "2 epochs"
      config.evaluators.knn.every = "1 epochs"
      config.checkpoint_every = "1 epochs"
      workdir = str(tmp_path_factory.mktemp(f"batch_{batch_size}"))
      state, _ = runner.run(pretrain, config, workdir)
      runs[batch_size] = (config, workdir, state)
  return runs, messages


@contextlib.contextmanager
def logged_messages():
  """The list of messages logged through absl while in it, at INFO and above.

  absl's logger is set to INFO meanwhile: its level follows absl's flags (WARNING while
  they are unparsed), which another test in this worker may have left unparsed.
  """
  messages = []
  handler = logging.Handler(logging.INFO)
  handler.emit = lambda record: messages.append(record.getMessage())
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.INFO)
  logger.addHandler(handler)
  try:
    yield messages
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_batch_of_8_pictures_its_8_images_and_trains(epoch_runs):
  config, workdir, state = epoch_runs[0][8]
  assert int(state.step) == 8
  check_views_picture(config, os.path.join(workdir, "augmented_views.png"))


def test_batch_size_override_keeps_evaluation_intervals_in_epochs(epoch_runs):
  runs, messages = epoch_runs
  steps_with_knn = {}
  for batch_size, (_, workdir, _) in runs.items():
    steps_with_knn[batch_size] = [r["step"] for r in read_metrics(workdir) if "knn_top1" in r]
    assert checkpointing.Checkpointer(os.path.join(workdir, "checkpoints")).all_steps() == [
      32 // batch_size,
      64 // batch_size,
    ]
  assert steps_with_knn == {8: [0, 4, 8], 16: [0, 2, 4]}
  # Each evaluation is announced before it runs (it can take tens of seconds).
  assert [l for l in messages if "evaluating" in l][-3:] == [
    f"Step {step}: evaluating knn ..." for step in (0, 2, 4)
  ]


def test_diverging_run_stops_with_its_last_healthy_checkpoint_intact(tmp_path):
  # Checkpoints more frequent than logs, keep 2: the NaN steps must never be
  # saved over the healthy ones.
  config = tiny_config()
  config.duration = "12 steps"
  config.checkpoint_every = "1 steps"
  config.log_every = "5 steps"
  config.keep_checkpoints = 2
  config.optimizer.base_lr = 1e30
  del config.evaluators["online_probe"]
  with pytest.raises(NonFiniteError) as error:
    runner.run(pretrain, config, str(tmp_path))
  directory = str(tmp_path / "checkpoints")
  latest = checkpointing.Checkpointer(directory).latest_step()
  assert f"step {latest} in {directory}, is intact" in str(error.value)
  assert latest is not None
  assert sorted(os.listdir(directory)) == sorted(
    str(s) for s in checkpointing.Checkpointer(directory).all_steps()
  )  # No half-written step.
  checkpoints_are_finite(directory)


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("temperature", 0.0, "config.temperature=0.0: must be > 0"),
    (
      "batch_size",
      12,
      "config.batch_size=12: must be a positive multiple of the number of devices (8)",
    ),
    ("model.name", "resnet7", "config.model.name='resnet7'"),
    ("method", "swav", "config.method='swav'"),
    ("data_source", "folder", "config.data_source='folder': must be one of ['tfds']"),
    ("dataset", "no_such_dataset", "config.dataset='no_such_dataset'"),
    ("train_split", "nope", "config.train_split='nope'"),
    ("duration", "10", "config.duration='10': must be a duration 'N steps' or 'N epochs'"),
    ("log_every", "0 steps", "config.log_every='0 steps'"),
    (
      "evaluators.knn.kind",
      "svm",
      "config.evaluators.knn.kind='svm': must be one of ['classifier', 'knn']",
    ),
    ("evaluators.knn.every", "0 epochs", "config.evaluators.knn.every='0 epochs'"),
    ("evaluators.knn.split", "test[:0]", "config.evaluators.knn.split='test[:0]'"),
    (
      "augment.view1.grayscale_prob",
      1.5,
      "config.augment.view1.grayscale_prob=1.5: must be in [0, 1]",
    ),
  ],
)
def test_bad_config_fails_before_compute_naming_the_field(tmp_path, field, value, message):
  config = tiny_config()
  *path, last = field.split(".")
  node = config
  for part in path:
    node = node[part]
  node[last] = value
  with pytest.raises(ConfigError) as error:
    runner.run(pretrain, config, str(tmp_path))
  assert message in str(error.value)
  assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_resume_refuses_every_changed_field_but_those_that_may_change(
  tmp_path, caplog, straight_run
):
  config, straight_workdir, straight = straight_run("simclr")  # Checkpoints of steps 3 and 4.
  shutil.copytree(straight_workdir, tmp_path, dirs_exist_ok=True)
  # A field the checkpoint's config lacks (set in the model config only) and a changed
  # one are both named, with both values; nothing is computed.
  changed = ml_collections.ConfigDict(config.to_dict())
  changed.model.width = 0.125
  changed.model.new_field = "x"
  with pytest.raises(ResumeError) as error:
    runner.run(pretrain, changed, str(tmp_path))
  assert error.value.differences == [
    ("model.new_field", ABSENT, "x"),
    ("model.width", 0.0625, 0.125),
  ]
  assert str(error.value).startswith(
    "config.model.new_field='x' (the checkpoint's: '<absent>'); config.model.width=0.125 "
    "(the checkpoint's: 0.0625): a resumed run must keep its checkpoint's config"
  )
  # Fields that may change on resume: the run goes on from step 3 to the same state. Step 4
  # loses its state item (a checkpoint partly deleted), and metrics.jsonl ends in a record
  # cut short: the run falls back to step 3, deletes step 4 and saves it again, and drops
  # the partial record.
  shutil.rmtree(tmp_path / "checkpoints" / "4" / "state")
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 5, "lo')
  changed = ml_collections.ConfigDict(config.to_dict())
  changed.log_every = "1 steps"
  changed.keep_checkpoints = 1
  changed.data_threads = 1
  changed.evaluators.knn.k = 3
  assert all(
    field in runner.MAY_CHANGE_ON_RESUME
    for field in ("log_every", "keep_checkpoints", "data_threads", "evaluators")
  )
  resumed, results = runner.run(pretrain, changed, str(tmp_path))
  assert int(resumed.step) == 4 and "knn_top1" in results
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), jax.device_get(straight))
  assert "Deleting checkpoint step 4 in" in caplog.text
  assert 'dropped line 6, \'{"step": 5, "lo\'' in caplog.text
  assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4]
  # Step 4 saved again; keep_checkpoints=1 removed step 3.
  assert checkpointing.Checkpointer(str(tmp_path / "checkpoints")).complete_steps() == [4]


def test_workdir_that_is_a_file_ends_in_one_line(tmp_path):
  workdir = tmp_path / "file"
  workdir.write_text("")
  with pytest.raises(JobError, match="it is a file"):
    runner.run(pretrain, tiny_config(), str(workdir))
  # The entry layer prints expected failures as one line and exits 1.
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "contrastive_jax.main",
      f"--config={CONFIG_DIR}/simclr_cifar10.py:runlocal",
      f"--workdir={workdir}",
      f"--config.data_dir={TFDS_DIR}",
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 1
  assert out.stderr.strip().splitlines()[-1] == (
    f"error: --workdir={workdir}: must be a directory (or not exist yet); it is a file"
  )
  assert "Traceback" not in out.stderr


def test_resumed_run_drops_metrics_of_steps_it_will_redo(tmp_path, caplog):
  with open(tmp_path / "metrics.jsonl", "w") as f:
    for step in range(6):
      f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
    f.write('{"step": 6, "loss": 1.')  # Cut short by a kill or a full disk.
  writer = metrics_lib.create_writer(str(tmp_path), resumed_step=3)
  writer.write_scalars(4, {"loss": 2.0})
  writer.close()
  assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [
    (0, 1.0),
    (1, 1.0),
    (2, 1.0),
    (3, 1.0),
    (4, 2.0),
  ]
  assert 'metrics.jsonl: dropped line 7, \'{"step": 6, "loss": 1.\': not a whole record' in (
    caplog.text
  )
  metrics_lib.create_writer(str(tmp_path), resumed_step=None).close()  # A fresh start.
  assert read_metrics(tmp_path) == []


def test_restore_falls_back_past_an_incomplete_checkpoint(tmp_path, caplog):
  directory = str(tmp_path / "checkpoints")
  ckpt = checkpointing.Checkpointer(directory)
  for step in (1, 2, 3):
    ckpt.save(step, {"w": np.full(3, step, np.float32)}, ml_collections.ConfigDict({"step": step}))
  ckpt.close()
  shutil.rmtree(tmp_path / "checkpoints" / "3" / "state")  # Partly deleted or corrupted.

  ckpt = checkpointing.Checkpointer(directory, read_only=True)
  assert ckpt.all_steps() == [1, 2, 3] and ckpt.complete_steps() == [1, 2]
  assert ckpt.latest_step() == 2
  assert caplog.text.count("Checkpoint step 3 in") == 1  # Once, however often asked.
  assert "is incomplete (its 'state' or 'config' item is missing" in caplog.text
  assert ckpt.saved_config().step == 2
  abstract = checkpointing.abstract_like(
    {"w": np.zeros(3, np.float32)}, mesh_lib.replicated(mesh_lib.make_mesh())
  )
  np.testing.assert_array_equal(ckpt.restore(abstract)["w"], [2, 2, 2])
  with pytest.raises(
    ConfigError,
    match=r"must be one of the saved steps \[1, 2\] \(incomplete, "
    r"so skipped: \[3\]\)",
  ):
    ckpt.restore(abstract, step=3)

  ckpt = checkpointing.Checkpointer(directory)  # A writer deletes it and may save it again.
  ckpt.discard_incomplete()
  assert ckpt.all_steps() == [1, 2]
  ckpt.save(3, {"w": np.full(3, 30, np.float32)}, ml_collections.ConfigDict({"step": 3}))
  ckpt.close()
  assert checkpointing.Checkpointer(directory, read_only=True).complete_steps() == [1, 2, 3]


def test_a_checkpoint_of_config_format_0_resumes_and_its_encoder_restores(tmp_path, straight_run):
  # Format 0 (no format_version) held the host crop in three flat fields: such a
  # checkpoint's saved config is read through config_files.upgrade_config everywhere.
  config, straight_workdir, _ = straight_run("simclr")
  workdir = str(tmp_path / "run")
  shutil.copytree(straight_workdir, workdir)
  paths = [
    os.path.join(d, f)
    for d, _, fs in os.walk(f"{workdir}/checkpoints")
    for f in fs
    if f == "metadata" and os.sep + "config" in d
  ]
  assert paths
  for path in paths:
    with open(path) as f:
      saved = json.load(f)
    crop = saved.pop("crop")
    del saved["format_version"]
    saved.update(
      crop_sampler=crop["sampler"], crop_area_min=crop["area_min"], crop_resize=crop["resize"]
    )
    with open(path, "w") as f:
      json.dump(saved, f)
  old = checkpointing.Checkpointer(f"{workdir}/checkpoints", read_only=True).saved_config()
  assert "crop_sampler" in old and "format_version" not in old
  runner.run(pretrain, config, workdir)  # The comparison with the upgraded config passes.
  probe = ml_collections.ConfigDict(
    dict(
      pretrain_workdir=workdir,
      pretrain_step=-1,
      random_init=False,
      model_name=None,
      pretrain_config=None,
    )
  )
  encoder = restore.restore_encoder(probe, mesh_lib.make_mesh())
  assert encoder.pretrained.crop.to_dict() == config.crop.to_dict()
  assert encoder.pretrained.format_version == config_files.FORMAT_VERSION

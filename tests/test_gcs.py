"""gs:// workdirs and data: a pretraining run stopped and resumed on gs://, its metrics,
TensorBoard events, checkpoints and saved config, a probe reading its encoder from gs://,
and one clear error for a gs:// path without credentials.

The storage is a local GCS emulator (tests/gcs_emulator.py), and every client the jobs
use on gs:// is pointed at it: TensorFlow's GCS filesystem (TFDS data_dir, TensorBoard
events, metrics.jsonl, Orbax's directories and small files through etils.epath) through
a TLS proxy, since it has no endpoint setting; TensorStore (Orbax's arrays) and
google-cloud-storage (Orbax's bucket query) directly. What no emulator shows: the real
service's consistency and permissions, hierarchical-namespace buckets (Orbax lists
those through google-cloud-storage), and a TPU VM's metadata-server credentials.
"""

import json
import os

import gcs_emulator
from google.auth.compute_engine import _metadata
from helpers import TFDS_DIR
from helpers import load_config
from helpers import sigterm_after_first_train_batch
from helpers import tiny_config
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow as tf

from contrastive_jax.core import checkpointing
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import JobError
from contrastive_jax.jobs import linear_probe
from contrastive_jax.jobs import pretrain
from contrastive_jax.methods import encoder_variables
from contrastive_jax.training import restore
from contrastive_jax.training import runner


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
  """gs://bucket on the emulator, holding the prepared cifar10 in tensorflow_datasets/."""
  emulator = gcs_emulator.start(str(tmp_path_factory.mktemp("gcs")), "bucket")
  try:
    source = os.path.join(TFDS_DIR, "cifar10", "3.0.2")
    for name in os.listdir(source):
      with open(os.path.join(source, name), "rb") as f:
        gcs_emulator.upload(emulator, f"tensorflow_datasets/cifar10/3.0.2/{name}", f.read())
    with pytest.MonkeyPatch.context() as m:
      for name, value in emulator.env.items():
        m.setenv(name, value)
      yield "gs://bucket"
  finally:
    emulator.stop()


def event_scalars(workdir, tag):
  """{step: value} of a TensorBoard scalar over all event files in workdir."""
  values = {}
  for path in tf.io.gfile.glob(f"{workdir}/events.out.tfevents.*"):
    for record in tf.data.TFRecordDataset(path):
      event = tf.compat.v1.Event.FromString(record.numpy())
      for value in event.summary.value:
        if value.tag == tag:
          values[event.step] = float(tf.make_ndarray(value.tensor))
  return values


def test_stopped_run_resumes_on_gs_and_the_probe_reads_it(bucket, monkeypatch):
  config = tiny_config()
  config.data_dir = f"{bucket}/tensorflow_datasets"
  config.evaluators = {}  # Their compilation is most of a tiny run's time; test_runner has them.
  workdir = f"{bucket}/simclr"
  with monkeypatch.context() as m:
    sigterm_after_first_train_batch(m)
    stopped, _ = runner.run(pretrain, config, workdir)
  assert int(stopped.step) == 2
  saved = ocp.StandardCheckpointer().restore(f"{workdir}/checkpoints/2/state")
  jax.tree.map(np.testing.assert_array_equal, saved["params"], jax.device_get(stopped.params))

  resumed, _ = runner.run(pretrain, config, workdir)
  assert int(resumed.step) == 4
  ckpt = checkpointing.Checkpointer(f"{workdir}/checkpoints", read_only=True)
  assert ckpt.all_steps() == [2, 4]
  assert ckpt.saved_config(4).to_dict() == json.loads(json.dumps(config.to_dict()))
  ckpt.close()

  with tf.io.gfile.GFile(f"{workdir}/metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == [1, 2, 3, 4]  # None lost or repeated.
  assert len(tf.io.gfile.glob(f"{workdir}/events.out.tfevents.*")) == 2  # One per run.
  assert event_scalars(workdir, "loss") == pytest.approx({r["step"]: r["loss"] for r in records})

  probe_config = load_config("linear_probe", "runlocal")
  probe_config.pretrain_workdir = workdir
  _, variables, pretrained, step, _ = restore.restore_encoder(probe_config, mesh_lib.make_mesh())
  assert step == 4 and pretrained.data_dir == config.data_dir
  jax.tree.map(
    np.testing.assert_array_equal,
    jax.device_get(variables),
    jax.device_get(encoder_variables(resumed)),
  )


@pytest.mark.parametrize("field", ["--workdir", "config.data_dir", "config.pretrain_workdir"])
def test_gs_path_without_credentials_is_one_clear_error(tmp_path, monkeypatch, field):
  for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # No gcloud credentials file there.
  # Not a GCE VM, whatever this machine is (google-auth would otherwise ask the metadata
  # server: 3 attempts, 3 s timeout each).
  monkeypatch.setattr(_metadata, "is_on_gce", lambda request: False)
  path = "gs://no-credentials/x"
  if field == "config.pretrain_workdir":
    job, config = linear_probe, load_config("linear_probe", "runlocal")
    config.pretrain_workdir, config.data_dir = path, TFDS_DIR
  else:
    job, config = pretrain, tiny_config()
    if field == "config.data_dir":
      config.data_dir = path
  workdir = path if field == "--workdir" else str(tmp_path / "run")
  with pytest.raises(JobError) as error:
    runner.run(job, config, workdir)
  message = str(error.value)
  assert message.startswith(f"{field}={path}: no Google Cloud credentials")
  assert "gcloud auth application-default login" in message and "\n" not in message

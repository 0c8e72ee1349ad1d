"""The export job: each format read back by its own runtime gives the project's h."""

import importlib.util
import json
import os

from helpers import TFDS_DIR
from helpers import load_config
from helpers import tiny_config
import jax
import numpy as np
import pytest
import tensorflow as tf

from contrastive_jax import models
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import tensor_files
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.data import input_pipeline
from contrastive_jax.jobs import embed
from contrastive_jax.jobs import export
from contrastive_jax.jobs import pretrain
from contrastive_jax.models import state_dicts
from contrastive_jax.training import restore
from contrastive_jax.training import runner

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A 1-step SimCLR run (ResNet-10 at width 0.0625, 32 px); returns its workdir."""
  workdir = str(tmp_path_factory.mktemp("pretrain"))
  config = tiny_config()
  config.duration = "1 steps"
  config.evaluators = {}
  runner.run(pretrain, config, workdir)
  return workdir


def export_config(pretrain_workdir, fmt):
  config = load_config("export")
  config.pretrain_workdir = pretrain_workdir
  config.format = fmt
  return config


@pytest.fixture(scope="module")
def source(pretrained):
  """The fixture run's encoder, restored as the export job restores it (restore.Encoder)."""
  return restore.restore_encoder(export_config(pretrained, "safetensors"), mesh_lib.make_mesh())


def _crops(source, images):
  """uint8 images centre-cropped as the evaluation of the checkpoint of `source` (a
  restore.Encoder) does."""
  config = source.pretrained
  return np.stack(
    [
      input_pipeline.center_crop(
        tf.constant(image), config.image_size, config.eval_crop_fraction, config.crop.resize
      ).numpy()
      for image in images
    ]
  )


def _project_h(source, images):
  """The project's h of uint8 images after the evaluation's centre crop.

  models.encode runs eagerly: each new batch size compiles its operations again (~2.5 s
  of CPU for the tiny ResNet), so the tests here use batches of 2 and 3 images only.
  """
  return np.asarray(models.encode(source.module, source.variables, _crops(source, images)))


def _relative(h, ref):
  return float(np.max(np.abs(np.asarray(h) - ref)) / np.max(np.abs(ref)))


def test_safetensors_export_reimports_bit_for_bit(pretrained, source, tmp_path):
  path = export.run(export_config(pretrained, "safetensors"), str(tmp_path / "out"))
  variables = state_dicts.from_state_dict(
    tensor_files.read(path), path, source.pretrained.model, 32
  )
  jax.tree.map(np.testing.assert_array_equal, variables, jax.device_get(source.variables))


def test_saved_model_serves_the_projects_h_on_images_of_any_size(pretrained, source, tmp_path):
  path = export.run(export_config(pretrained, "saved_model"), str(tmp_path / "out"))
  serve = tf.saved_model.load(path).signatures[export.SIGNATURE]
  for shape in [(3, 32, 32, 3), (2, 45, 38, 3)]:  # The export's size, and another.
    images = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    want = _project_h(source, images)
    assert _relative(serve(images=tf.constant(images))["h"].numpy(), want) < TOLERANCE, shape


def test_an_export_is_never_overwritten(pretrained, tmp_path):
  out = str(tmp_path / "out")
  export.run(export_config(pretrained, "safetensors"), out)
  with pytest.raises(JobError, match="already holds an export"):
    export.run(export_config(pretrained, "saved_model"), out)


def test_bad_export_formats_are_refused_before_anything_is_read(tmp_path):
  with pytest.raises(ConfigError, match="config.format='tflite': must be one of"):
    export.run(export_config(str(tmp_path), "tflite"), str(tmp_path / "out"))
  if importlib.util.find_spec("torch") is None:
    with pytest.raises(ConfigError, match=r"'pth' needs torch"):
      export.run(export_config(str(tmp_path), "pth"), str(tmp_path / "out"))
  assert not (tmp_path / "out" / export.META).exists()


@pytest.mark.parametrize("method", ["simclr", "mocov3"])
def test_pretraining_from_an_imported_file_starts_every_network_from_it(
  pretrained, source, tmp_path, method
):
  path = export.run(export_config(pretrained, "safetensors"), str(tmp_path / "out"))
  config = tiny_config(method)
  config.model.stage_projection = True  # The exported SimCLR ResNet's shortcuts.
  config.init_from = path
  _, imported = pretrain.imported_start(config)
  task = pretrain.build(config, mesh_lib.make_mesh(), None, str(tmp_path / "run"))
  state = jax.device_get(task.init())
  check = lambda tree: jax.tree.map(np.testing.assert_array_equal, tree, imported["params"])
  check(state.params["encoder"])
  jax.tree.map(np.testing.assert_array_equal, state.batch_stats["encoder"], imported["batch_stats"])
  if method == "mocov3":  # The momentum encoder too.
    check(state.extra["key_params"]["encoder"])
    jax.tree.map(
      np.testing.assert_array_equal,
      state.extra["key_batch_stats"]["encoder"],
      imported["batch_stats"],
    )
  if method != "simclr":  # The same model config as the exported run's: same features.
    return
  # Step 0's kNN monitor and the exporter see the same encoder: the kNN of the two is equal.
  images = np.random.default_rng(1).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
  np.testing.assert_array_equal(
    task.eval_model.features(task.eval_model.variables(state), images),
    models.encode(source.module, source.variables, images),
  )


def test_a_file_of_another_size_is_refused_before_pretraining(pretrained, tmp_path):
  path = export.run(export_config(pretrained, "safetensors"), str(tmp_path / "out"))
  config = tiny_config()
  config.model.width = 0.125
  config.init_from = path
  with pytest.raises(JobError, match="tensor 'conv1.weight' has shape"):
    runner.run(pretrain, config, str(tmp_path / "run"))
  assert not (tmp_path / "run" / "checkpoints").exists() or not list(
    (tmp_path / "run" / "checkpoints").iterdir()
  )


def _tiny_config_file(tmp_path):
  """A config file whose get_config is tiny_config() (the fixture's model)."""
  path = tmp_path / "tiny.py"
  path.write_text(
    f"import sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n"
    "from helpers import tiny_config\n\n\n"
    "def get_config(variant=''):\n  return tiny_config()\n"
  )
  return str(path)


def test_downstream_jobs_take_a_weights_file_as_their_pretrain_config_says(
  pretrained, source, tmp_path
):
  path = export.run(export_config(pretrained, "safetensors"), str(tmp_path / "out"))
  config = export_config(path, "safetensors")
  config.pretrain_config = _tiny_config_file(tmp_path)
  encoder = restore.restore_encoder(config, mesh_lib.make_mesh())
  jax.tree.map(
    np.testing.assert_array_equal,
    jax.device_get(encoder.variables),
    jax.device_get(source.variables),
  )
  assert (encoder.step, encoder.dim, encoder.pretrained.image_size) == (0, source.dim, 32)
  embed_config = load_config("embed")
  embed_config.update(
    pretrain_workdir=path,
    pretrain_config=config.pretrain_config,
    dataset="cifar10",
    data_dir=TFDS_DIR,
    split="test[:16]",
    batch_size=16,
  )
  h = embed.run(embed_config, str(tmp_path / "index"))
  assert h.shape == (16, source.dim)
  # Without pretrain_config: the export job's export.json beside the file says it.
  config.pretrain_config = None
  again = restore.restore_encoder(config, mesh_lib.make_mesh())
  jax.tree.map(
    np.testing.assert_array_equal, jax.device_get(again.variables), jax.device_get(source.variables)
  )
  assert again.pretrained.to_dict() == source.pretrained.to_dict()
  alone = tmp_path / "alone" / "encoder.safetensors"
  alone.parent.mkdir()
  alone.write_bytes(open(path, "rb").read())
  config.pretrain_workdir = str(alone)
  with pytest.raises(ConfigError, match="config.pretrain_config=None: must be the pretraining"):
    restore.restore_encoder(config, mesh_lib.make_mesh())
  config.pretrain_config = str(tmp_path / "tinny.py")
  with pytest.raises(JobError, match="no such file; did you mean"):
    restore.restore_encoder(config, mesh_lib.make_mesh())


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs the torch extra")
def test_pth_export_holds_the_safetensors_tensors(pretrained, tmp_path):
  pth = export.run(export_config(pretrained, "pth"), str(tmp_path / "pth"))
  safe = export.run(export_config(pretrained, "safetensors"), str(tmp_path / "safe"))
  read, want = tensor_files.read(pth), tensor_files.read(safe)
  assert sorted(read) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(read[name], value)


def test_saved_model_serves_the_projection_too_when_asked(pretrained, source, tmp_path):
  config = export_config(pretrained, "saved_model")
  config.projection = True
  path = export.run(config, str(tmp_path / "out"))
  images = np.random.default_rng(2).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
  h = _project_h(source, images)
  projector, variables = restore.restore_projector(config, source, mesh_lib.make_mesh())
  want = np.asarray(projector.apply(variables, h, train=False))
  served = tf.saved_model.load(path).signatures[export.SIGNATURE](images=tf.constant(images))
  assert _relative(served["h"].numpy(), h) < TOLERANCE
  assert _relative(served["z"].numpy(), want) < TOLERANCE
  config.format = "safetensors"
  with pytest.raises(ConfigError, match="config.projection=True: must be False for a state"):
    export.run(config, str(tmp_path / "out2"))


def test_onnx_export_gives_the_projects_h_and_z_under_onnx_runtime(pretrained, source, tmp_path):
  import onnx
  import onnxruntime

  config = export_config(pretrained, "onnx")
  config.projection = True
  path = export.run(config, str(tmp_path / "out"))
  images = np.random.default_rng(3).integers(0, 256, (3, 45, 38, 3), dtype=np.uint8)
  h = _project_h(source, images)
  projector, variables = restore.restore_projector(config, source, mesh_lib.make_mesh())
  z = np.asarray(projector.apply(variables, h, train=False))
  session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
  got_h, got_z = session.run(["h", "z"], {"images": _crops(source, images)})
  assert _relative(got_h, h) < TOLERANCE and _relative(got_z, z) < TOLERANCE
  metadata = {p.key: p.value for p in onnx.load(path).metadata_props}
  assert metadata["pretrain_step"] == str(source.step)
  assert json.loads(metadata["eval_crop"]) == {
    "size": 32,
    "fraction": source.pretrained.eval_crop_fraction,
    "resize": source.pretrained.crop.resize,
  }


def test_onnx_export_without_the_onnx_package_is_refused_in_one_line(tmp_path, monkeypatch):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else find_spec(name, *a)
  )
  with pytest.raises(ConfigError, match=r"'onnx' needs the onnx package \(pip install"):
    export.run(export_config(str(tmp_path), "onnx"), str(tmp_path / "out"))
  assert not (tmp_path / "out" / export.META).exists()


@pytest.mark.parametrize(
  "name, padding, stage_projection, warned",
  [
    ("resnet18", "torchvision", False, False),
    ("resnet50", "torchvision", True, False),  # Its first block widens anyway.
    ("resnet18", "tensorflow", False, True),
    ("resnet18", "torchvision", True, True),
    ("resnet10", "torchvision", False, True),  # torchvision builds no ResNet-10.
  ],
)
def test_a_state_dict_that_is_not_torchvisions_network_is_warned_of(
  name, padding, stage_projection, warned, caplog
):
  model_config = load_config("simclr_cifar10").model
  model_config.update(name=name, padding=padding, stage_projection=stage_projection)
  with caplog.at_level("WARNING"):
    export._warn_if_not_the_references_network(model_config)
  messages = [r.getMessage() for r in caplog.records if "not torchvision's" in r.getMessage()]
  assert len(messages) == int(warned)
  if warned:
    assert f"({name}, padding '{padding}'" in messages[0]

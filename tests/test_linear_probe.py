"""Linear probe: restores only the encoder of any method's checkpoint, keeps it frozen."""

import json
import os
import subprocess
import sys

from helpers import CONFIG_DIR
from helpers import TFDS_DIR
from helpers import checkpoints_are_finite
from helpers import load_config
from helpers import subprocess_env
from helpers import tiny_config
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from contrastive_jax import methods
from contrastive_jax.core import checkpointing
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.core.errors import NonFiniteError
from contrastive_jax.jobs import linear_probe
from contrastive_jax.jobs import pretrain
from contrastive_jax.methods import optim
from contrastive_jax.methods import pretraining
from contrastive_jax.training import probe_presets
from contrastive_jax.training import restore
from contrastive_jax.training import runner


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A 2-step SimCLR run on 8 devices; returns its workdir."""
  workdir = str(tmp_path_factory.mktemp("pretrain"))
  config = tiny_config()
  config.duration = "2 steps"
  config.checkpoint_every = "1 steps"
  config.evaluators = {}  # The probes read its checkpoints only; evaluating it would compile.
  runner.run(pretrain, config, workdir)
  return workdir


def pretraining_programs(saved_config, mesh):
  """pretraining.setup as the `pretrained` run's job called it (256 images in batches of 16,
  2 steps, CIFAR-10's 10 classes): that run's own init and train step, which this process
  traced and compiled for it (pretraining.setup keeps them), not a second compile."""
  return pretraining.setup(saved_config, mesh, 256 // 16, 2, num_classes=10)


def probe_config(pretrain_workdir, **overrides):
  config = load_config("linear_probe", "runlocal")
  config.pretrain_workdir = pretrain_workdir
  config.data_dir = TFDS_DIR
  config.train_split = "train[:64]"
  config.evaluators.linear_probe.split = "test[:40]"
  config.evaluators.linear_probe.batch_size = 16
  config.batch_size = 16
  config.duration = "3 steps"
  config.log_every = "1 steps"
  config.shuffle_buffer = 64
  config.data_threads = 1
  config.update(overrides)
  return config


def test_probe_trains_and_leaves_the_encoder_bit_identical(pretrained, tmp_path):
  mesh = mesh_lib.make_mesh()
  encoder = restore.restore_encoder(probe_config(pretrained), mesh)
  saved_config = encoder.pretrained
  assert encoder.step == 2 and saved_config.method == "simclr" and encoder.dim == 32
  before = jax.device_get(encoder.variables)
  # The partial restore read exactly what pretraining saved.
  ckpt = checkpointing.Checkpointer(os.path.join(pretrained, "checkpoints"), read_only=True)
  full = ckpt.restore(
    checkpointing.abstract_like(
      jax.eval_shape(pretraining_programs(saved_config, mesh).init),
      mesh_lib.replicated(mesh),
    )
  )
  jax.tree.map(
    np.testing.assert_array_equal, before["params"], jax.device_get(full.params["encoder"])
  )
  jax.tree.map(
    np.testing.assert_array_equal,
    before["batch_stats"],
    jax.device_get(full.batch_stats["encoder"]),
  )

  task = linear_probe.build(probe_config(pretrained), mesh, None, str(tmp_path))
  # 'auto' ran the SimCLR checkpoint's reference's probe: a plain linear layer.
  assert task.config.preset == "simclr" and not task.config.head.standardize
  state, result = runner.run(linear_probe, probe_config(pretrained), str(tmp_path))
  assert not state.batch_stats
  assert int(state.step) == 3
  enc_vars = task.eval_model.variables(state)[0]
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(enc_vars), before)
  with open(tmp_path / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == [1, 2, 3]
  assert 0 <= records[-1]["linear_probe_top1"] <= records[-1]["linear_probe_top5"] <= 1
  assert result == {k: records[-1][k] for k in ("linear_probe_top1", "linear_probe_top5")}
  # 40 test images: every fraction is a multiple of 1/40.
  assert round(result["linear_probe_top1"] * 40, 6) == round(result["linear_probe_top1"] * 40)
  # Resuming the finished probe reports the same numbers.
  assert runner.run(linear_probe, probe_config(pretrained), str(tmp_path))[1] == result
  # Resuming with another recipe is refused, not silently mixed.
  with pytest.raises(ConfigError, match=r"^config.batch_size=32 \(the checkpoint.s: 16\)"):
    runner.run(linear_probe, probe_config(pretrained, batch_size=32), str(tmp_path))
  # So is a probe into a pretraining workdir, and pretraining into a probe's.
  with pytest.raises(
    ConfigError,
    match="config.job='linear_probe': must be 'pretrain': another "
    "kind of job wrote the checkpoints in",
  ):
    runner.run(linear_probe, probe_config(pretrained), pretrained)
  with pytest.raises(
    ConfigError,
    match="config.job='pretrain': must be 'linear_probe': another "
    "kind of job wrote the checkpoints in",
  ):
    runner.run(pretrain, tiny_config(), str(tmp_path))


def test_probe_stops_on_a_non_finite_loss(pretrained, tmp_path):
  config = probe_config(pretrained, duration="20 steps", checkpoint_every="1 steps")
  # A weight-decay typo: each step multiplies the weights by about 1 - lr * wd = -6000,
  # so they overflow float32 after about 10 healthy, saved steps.
  config.optimizer.weight_decay = 1e6
  with pytest.raises(NonFiniteError, match="non-finite training at step") as error:
    runner.run(linear_probe, config, str(tmp_path))
  steps = checkpoints_are_finite(str(tmp_path / "checkpoints"))
  assert steps and f"step {steps[-1]} in " in str(error.value)


def test_restore_onto_another_device_count(pretrained):
  config = probe_config(pretrained)
  on8 = restore.restore_encoder(config, mesh_lib.make_mesh()).variables
  on1 = restore.restore_encoder(config, mesh_lib.make_mesh(jax.devices()[:1])).variables
  assert len(jax.tree.leaves(on1)[0].sharding.device_set) == 1
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(on8), jax.device_get(on1))


def test_random_init_baseline_is_the_pretraining_runs_initialisation(pretrained):
  restored = restore.restore_encoder(probe_config(pretrained), mesh_lib.make_mesh())
  trained, saved = restored.variables, restored.pretrained
  random = restore.restore_encoder(
    probe_config(pretrained, random_init=True), mesh_lib.make_mesh()
  ).variables
  init = jax.device_get(pretraining_programs(saved, mesh_lib.make_mesh()).init())
  jax.tree.map(
    np.testing.assert_array_equal, jax.device_get(random["params"]), init.params["encoder"]
  )
  assert not np.array_equal(
    jax.device_get(trained["params"]["stem_conv"]["kernel"]),
    jax.device_get(random["params"]["stem_conv"]["kernel"]),
  )


def test_bad_probe_inputs(pretrained, tmp_path):
  with pytest.raises(ConfigError, match="config.pretrain_workdir=.*looked in"):
    restore.restore_encoder(probe_config(str(tmp_path)), mesh_lib.make_mesh())
  with pytest.raises(
    ConfigError, match=r"config.pretrain_step=7: must be one of the saved steps \[1, 2\]"
  ):
    restore.restore_encoder(probe_config(pretrained, pretrain_step=7), mesh_lib.make_mesh())
  with pytest.raises(ConfigError, match="config.model_name='resnet50': must be 'resnet10'"):
    restore.restore_encoder(probe_config(pretrained, model_name="resnet50"), mesh_lib.make_mesh())
  config = probe_config(pretrained)
  config.evaluators.linear_probe.every = "0 steps"
  with pytest.raises(ConfigError, match="config.evaluators.linear_probe.every='0 steps'"):
    runner.run(linear_probe, config, str(tmp_path))


def test_checkpoints_of_another_tool_end_in_one_line_naming_pretrain_workdir(tmp_path):
  # An Orbax checkpoint without our 'config' item, and a bare numbered step folder.
  orbax_dir, numbered_dir = tmp_path / "orbax", tmp_path / "numbered"
  manager = ocp.CheckpointManager(str(orbax_dir / "checkpoints"), item_names=("state",))
  manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.zeros(2)})))
  manager.wait_until_finished()
  manager.close()
  (numbered_dir / "checkpoints" / "5").mkdir(parents=True)
  for workdir, step in ((orbax_dir, 3), (numbered_dir, 5)):
    with pytest.raises(
      ConfigError,
      match=(
        f"config.pretrain_workdir='{workdir}': must be a pretraining workdir of contrastive_jax; "
        f"{workdir}/checkpoints/{step} is not a checkpoint of contrastive_jax"
      ),
    ):
      restore.restore_encoder(probe_config(str(workdir)), mesh_lib.make_mesh())
  # A job's own workdir holding them: one line too, before anything is built.
  with pytest.raises(JobError, match=f"{numbered_dir}/checkpoints/5 is not a checkpoint"):
    runner.run(pretrain, tiny_config(), str(numbered_dir))
  # Through the entry point: one line on stderr, exit status 1.
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "contrastive_jax.main",
      f"--config={CONFIG_DIR}/linear_probe.py",
      f"--config.pretrain_workdir={orbax_dir}",
      f"--config.data_dir={TFDS_DIR}",
      f"--workdir={tmp_path / 'probe'}",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env=subprocess_env(),
  )
  assert out.returncode == 1 and "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1] == (
    f"error: config.pretrain_workdir='{orbax_dir}': must be a pretraining workdir of "
    f"contrastive_jax; {orbax_dir}/checkpoints/3 is not a checkpoint of contrastive_jax (it "
    "has the items ['state'], not the items 'state' and 'config'); nothing in it was read "
    "or changed"
  )
  # Neither was deleted (as an incomplete checkpoint of this project would be).
  assert os.listdir(orbax_dir / "checkpoints") == ["3"]
  assert os.listdir(numbered_dir / "checkpoints") == ["5"]


# Each reference's linear evaluation, from its own code (probe_presets.LINEAR_PROBE_PRESETS
# cites them): batch, duration, base lr (x B/256), Nesterov, weight decay, schedule,
# decay epochs (at the reference's duration), crop sampler, smallest crop area, head init,
# standardised features.
PROBE_REFERENCES = {
  "simclr": (512, "100 epochs", 0.1, True, 0.0, "cosine", (), "tensorflow", 0.08, "zeros", False),
  "moco": (
    256,
    "100 epochs",
    30.0,
    False,
    0.0,
    "step",
    (60, 80),
    "torchvision",
    0.08,
    "normal_0.01",
    False,
  ),
  "byol": (1024, "80 epochs", 0.2, True, 0.0, "cosine", (), "byol", 0.08, "lecun_normal", False),
  "dino": (
    1024,
    "100 epochs",
    0.001,
    False,
    0.0,
    "cosine",
    (),
    "torchvision",
    0.08,
    "normal_0.01",
    False,
  ),
  "mocov3": (
    1024,
    "90 epochs",
    0.1,
    False,
    0.0,
    "cosine",
    (),
    "torchvision",
    0.08,
    "normal_0.01",
    False,
  ),
  "standardised": (
    256,
    "100 epochs",
    0.1,
    False,
    0.0,
    "cosine",
    (),
    "torchvision",
    0.2,
    "zeros",
    True,
  ),
}
# LightlyTrain publishes no linear evaluation: distillation's preset is the standardised one.
PROBE_REFERENCES["distillation"] = PROBE_REFERENCES["standardised"]


def test_every_method_has_a_probe_preset_and_a_reference_here():
  missing = sorted(set(methods.METHODS) - set(probe_presets.LINEAR_PROBE_PRESETS))
  assert not missing, (
    f"methods {missing} have no linear-probe preset: preset 'auto' runs "
    "the one named as the checkpoint's method; add its reference's linear "
    "evaluation to probe_presets.LINEAR_PROBE_PRESETS"
  )
  assert set(PROBE_REFERENCES) == set(probe_presets.LINEAR_PROBE_PRESETS)


def test_probe_presets_resolve_to_their_references_recipes(pretrained):
  def resolved(**overrides):
    config = load_config("linear_probe")
    config.update(dict(pretrain_workdir=pretrained, data_dir=TFDS_DIR, **overrides))
    linear_probe.check_config(config, jax.device_count())
    return linear_probe.build(config, mesh_lib.make_mesh(), None, None).config

  def decay_epochs(c):
    fractions = c.optimizer.decay_fractions
    if fractions is None:
      return tuple(c.optimizer.decay_epochs)
    return tuple(round(f * int(c.duration.split()[0])) for f in fractions)

  for preset, expected in PROBE_REFERENCES.items():
    c = resolved(preset=preset)
    o = c.optimizer
    assert (
      c.batch_size,
      c.duration,
      o.base_lr,
      o.nesterov,
      o.weight_decay,
      o.schedule,
      decay_epochs(c),
      c.crop.sampler,
      c.crop.area_min,
      c.head.init,
      c.head.standardize,
    ) == expected, preset
    assert (c.preset, o.name, o.momentum, o.warmup_epochs) == (preset, "sgd", 0.9, 0)
  # Cut to runlocal's 1000 steps, MoCo's probe still decays x0.1 at 60% and 80% of its run.
  c = resolved(preset="moco", batch_size=256, duration="1000 steps")
  lr = optim.learning_rate_schedule(c.optimizer, 256, 195, 1000)
  np.testing.assert_allclose([lr(599), lr(600), lr(799), lr(800)], [30, 3, 3, 0.3], rtol=1e-6)
  # Decay epochs given win over the preset's fractions (one choice, not both).
  config = load_config("linear_probe")
  config.update(dict(pretrain_workdir=pretrained, data_dir=TFDS_DIR, preset="moco"))
  config.optimizer.decay_epochs = (30, 40)
  linear_probe.check_config(config, jax.device_count())
  o = probe_presets.fill_probe_preset(config, "moco").optimizer
  assert (tuple(o.decay_epochs), o.decay_fractions) == ((30, 40), None)
  # 'auto' runs the checkpoint's method's (SimCLR here); a value given wins over the preset's.
  c = resolved(batch_size=64)
  assert (c.preset, c.batch_size, c.duration) == ("simclr", 64, "100 epochs")
  bad = load_config("linear_probe")
  bad.preset = "simclr_v3"
  with pytest.raises(ConfigError, match="config.preset='simclr_v3': must be one of"):
    linear_probe.check_config(bad, 8)

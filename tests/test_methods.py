"""Every registered method against the method contract (methods/__init__.py); the
online probe and the training-health scalars; importing every module."""

import dataclasses
import inspect
import os
import socket
import subprocess
import sys

from helpers import TINY_TEACHER
from helpers import tiny_config
from helpers import tiny_teacher_file
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from contrastive_jax import methods
from contrastive_jax import models
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.methods import common
from contrastive_jax.methods import pretraining
from contrastive_jax.models import heads

# Method -> tiny config.
# MoCo v3 runs its ViT variant: its compile is a fraction of the ResNet's.
CONFIGS = {
  "simclr": "simclr",
  "moco": "moco_v2",
  "mocov3": "mocov3:runlocal_vit",
  "byol": "byol",
  "dino": "dino",
  # Distillation's v2 (v3 and v1 in tests/test_distillation.py), with a tiny teacher file.
  "distillation": "distill:runlocal,model=vit_tiny,loss=v2",
}

# The methods whose steps are also compared without the online probe. The probe is every
# method's alike (methods/common.build_train_step: its own gradient from outputs['h'] and
# the labels, its own update), so a ResNet's with BN statistics and DINO's, with its teacher
# and centre in the extra state, show that it changes no training; compiling a second step for
# every method would repeat them.
PROBE_COMPARED = ("simclr", "dino")

# The method contract's functions and their parameters (methods/__init__.py).
CONTRACT = {
  "check_config": ["config", "num_train_examples"],
  "build_model": ["config"],
  "init_state": ["config", "model", "tx", "init_rng", "rng"],
  "make_train_step": ["config", "model", "tx", "views", "mesh", "length", "probe"],
}


def _batches(config, n, seed=0):
  rng = np.random.default_rng(seed)
  size = config.image_size
  return [
    {
      "image": rng.integers(0, 256, (config.batch_size, 2, size, size, 3), np.uint8),
      "label": rng.integers(0, 10, config.batch_size).astype(np.int32),
    }
    for _ in range(n)
  ]


def _run(config, mesh, batches, num_classes):
  run = pretraining.setup(config, mesh, steps_per_epoch=16, num_steps=100, num_classes=num_classes)
  state = run.init()
  for batch in batches:
    state, metrics = run.train_step(state, jax.device_put(batch, mesh_lib.batch_sharded(mesh)))
  return jax.device_get(state), jax.device_get(metrics)


def test_every_method_has_a_config_here():
  assert set(CONFIGS) == set(methods.METHODS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_method_meets_the_contract_and_its_online_probe_leaves_the_encoder_unchanged(
  name, tmp_path
):
  method = methods.get_method(name)
  for fn, params in CONTRACT.items():
    assert list(inspect.signature(getattr(method, fn)).parameters) == params, fn
  config = tiny_config(*CONFIGS[name].split(":"))
  if name == "distillation":
    config.distill.teacher = tiny_teacher_file(tmp_path, config.image_size)
    config.distill.teacher_model = dict(TINY_TEACHER)
  if config.optimizer.name == "adamw":
    # SGD instead (the ViTs' recipes use AdamW): Adam's division by sqrt(v) turns gradients
    # that are float32 rounding noise into full steps, which the comparison with and
    # without the probe below could not tell from a change in the training.
    config.optimizer.name, config.optimizer.weight_decay_end = "sgd", None
  # The full learning rate from the first step, so that two steps move every parameter,
  # and no clipping (DINO's), which would hide a change in the gradients' size.
  config.optimizer.warmup_epochs = 0.0
  if config.optimizer.get("clip_per_tensor"):
    config.optimizer.clip_per_tensor = 0.0
  method.check_config(config, 50_000)
  model = method.build_model(config)
  assert isinstance(model, heads.ContrastiveModel)
  batches = _batches(config, 2)
  state, metrics = _run(config, mesh_lib.make_mesh(), batches, num_classes=10)
  assert isinstance(state, common.TrainState) and int(state.step) == 2
  # The encoder downstream jobs read is where the contract says.
  encoder = methods.encoder_variables(state)
  x = jnp.zeros((2, config.image_size, config.image_size, 3))
  h = jax.jit(lambda v, x: model.encoder.apply(v, x, train=False))(encoder, x)  # One compile.
  assert h.shape == (2, models.encoder_width(config.model)) and h.dtype == jnp.float32
  # The encoder its paper evaluates (optional_attributes' evaluated_encoder) is there too,
  # shaped like the student's.
  evaluated = methods.evaluated_encoder(name)(state)
  for part in ("params", "batch_stats"):
    assert jax.tree.structure(evaluated[part]) == jax.tree.structure(encoder[part]), part
  for key in (
    "loss",
    "grad_norm",
    "update_norm",
    "param_norm",
    "projection_std",
    "online_probe_loss",
    "online_probe_train_top1",
  ):
    assert metrics[key].shape == () and metrics[key].dtype == np.float32, key
    assert np.isfinite(metrics[key]), key
  # The norms are the ones of the trees they name.
  param_norm = np.sqrt(
    sum(np.sum(np.square(p.astype(np.float64))) for p in jax.tree.leaves(state.params))
  )
  np.testing.assert_allclose(metrics["param_norm"], param_norm, rtol=1e-5)

  if name not in PROBE_COMPARED:
    return
  # The same steps without the online probe: the encoder's training is the same, to
  # float32 rounding. XLA fuses the two programs differently, so leaves that the loss
  # barely depends on differ in their last bits; the tolerance is relative to each tree's
  # largest entry. A probe that changed the training (a gradient, a BN statistic, a
  # random draw) would change parameters by far more.
  without, metrics0 = _run(config, mesh_lib.make_mesh(), batches, num_classes=0)
  assert state.probe and not without.probe
  for tree, other in (
    (state.params, without.params),
    (state.batch_stats, without.batch_stats),
    (state.extra, without.extra),
  ):
    scale = max((float(np.max(np.abs(x), initial=0)) for x in jax.tree.leaves(other)), default=0)
    same = lambda a, b, scale=scale: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale)
    jax.tree.map(same, tree, other)
  np.testing.assert_allclose(metrics["loss"], metrics0["loss"], rtol=1e-6)
  # ... while the probe learned (its zero-initialised kernel moved).
  assert np.any(state.probe["params"]["kernel"] != 0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_optional_attributes_are_the_modules_or_the_declared_defaults(name):
  method, attributes = methods.get_method(name), methods.optional_attributes(name)
  for field in dataclasses.fields(methods.OptionalAttributes):
    value, attribute = getattr(attributes, field.name), field.metadata["attribute"]
    if hasattr(method, attribute):
      assert value is getattr(method, attribute), attribute
    else:
      assert value == field.default, attribute
  assert isinstance(attributes.local_crops, bool)
  # Two key paths into the TrainState, each to an encoder (the contract test checks
  # that a state at step 2 holds one there, shaped like the student's).
  assert len(attributes.evaluated_encoder) == 2
  for path in attributes.evaluated_encoder:
    assert all(isinstance(key, str) for key in path) and path[-1] == methods.ENCODER, path
  # The import hooks come as a pair: a run that reads the checkpoint also starts from it.
  hooks = (attributes.imported_state, attributes.with_imported)
  assert hooks == (None, None) or all(callable(hook) for hook in hooks)


def test_optional_attributes_defaults_and_dinos():
  # Hand-written: DINO trains on local crops, is evaluated by its teacher and continues its
  # reference's checkpoints; SimCLR has none of these and reads every default.
  dino = methods.optional_attributes("dino")
  assert dino.local_crops is True
  assert dino.evaluated_encoder == (
    ("extra", "teacher_params", "encoder"),
    ("extra", "teacher_batch_stats", "encoder"),
  )
  assert dino.imported_state is methods.dino.imported_state
  assert dino.with_imported is methods.dino.with_imported
  assert methods.optional_attributes("simclr") == methods.OptionalAttributes(
    local_crops=False,
    evaluated_encoder=(("params", "encoder"), ("batch_stats", "encoder")),
    imported_state=None,
    with_imported=None,
  )
  with pytest.raises(ConfigError, match="method"):
    methods.optional_attributes("simsiam")


def test_projection_std_on_8_devices_matches_numpy():
  rng = np.random.default_rng(0)
  z = rng.normal(size=(32, 6)).astype(np.float32)
  mesh = mesh_lib.make_mesh()
  fn = jax.jit(
    jax.shard_map(
      lambda z: common.projection_std(z, mesh_lib.DATA_AXIS),
      mesh=mesh,
      in_specs=jax.P(mesh_lib.DATA_AXIS),
      out_specs=jax.P(),
    )
  )
  unit = z / np.linalg.norm(z, axis=1, keepdims=True)
  np.testing.assert_allclose(
    fn(jax.device_put(z, mesh_lib.batch_sharded(mesh))), np.mean(np.std(unit, axis=0)), rtol=1e-5
  )
  collapsed = np.tile(z[:1], (32, 1))
  assert float(fn(jax.device_put(collapsed, mesh_lib.batch_sharded(mesh)))) < 1e-3


def test_every_module_imports_without_touching_a_device_then_distributed_initialises():
  package = os.path.join(os.path.dirname(__file__), "..", "contrastive_jax")
  names = sorted(
    "contrastive_jax." + os.path.relpath(os.path.join(d, f), package)[:-3].replace(os.sep, ".")
    for d, _, files in os.walk(package)
    for f in files
    if f.endswith(".py") and f != "__init__.py"
  )
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  code = "\n".join(
    [
      *(f"import {n}" for n in names),
      "import jax",
      f"jax.distributed.initialize('127.0.0.1:{port}', num_processes=1, process_id=0)",
      "print('OK', jax.process_count())",
    ]
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and "OK 1" in out.stdout, out.stderr[-3000:]
  assert "contrastive_jax.main" in names and "contrastive_jax.jobs.linear_probe" in names

"""DINO: loss, centre and gradients against numpy transcriptions of the reference
(facebookresearch/dino main_dino.py DINOLoss, utils.py cosine_scheduler and
clip_gradients), 8 devices against one, the schedules, the weight-normalised last
layer, the optimizer's DINO options, one train step's loss, centre, teacher EMA and
frozen last layer; multi-crop: the local crops' distribution against torchvision's,
the host pipeline's local views, the step over all views, its bad input."""

import argparse

import flax
from helpers import TFDS_DIR
from helpers import load_config
from helpers import sigterm_after_first_train_batch
from helpers import tiny_config
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from scipy import special
from scipy import stats
import tensorflow as tf
import tensorflow_datasets as tfds
from test_runner import read_metrics

from contrastive_jax import methods
from contrastive_jax import models
from contrastive_jax import recipes
from contrastive_jax.core import checkpointing
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import WeightsError
from contrastive_jax.data import crop_spec
from contrastive_jax.data import crops
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import sources
from contrastive_jax.jobs import pretrain
from contrastive_jax.methods import common
from contrastive_jax.methods import dino
from contrastive_jax.methods import optim
from contrastive_jax.methods import pretraining
from contrastive_jax.models import heads
from contrastive_jax.models import state_dicts
from contrastive_jax.training import restore
from contrastive_jax.training import runner


def _vit_config():
  """tiny_config of DINO's ViT runlocal with the reference's head (3 layers, no BN) and
  learned position embedding, which these tests transcribe; runlocal_resnet's tests cover
  the head with BN."""
  config = tiny_config("dino", "runlocal")
  config.dino.update(num_layers=3, use_bn_in_head=False)
  config.model.position_embedding = "learned"
  return config


def _small_head_config():
  """_vit_config with a small head, a teacher momentum of 0.5 (two steps move the teacher
  visibly) and the full learning rate from the first step: the one-step, kNN-monitor and
  checkpoint tests' run, one train step compiled for the three (pretraining.setup keeps the
  programs of a config it has built; SMALL_HEAD_RUN is what pretrain.build gives it)."""
  config = _vit_config()
  config.dino.update(out_dim=32, hidden_dim=16, bottleneck_dim=8, momentum_teacher=0.5)
  config.optimizer.warmup_epochs = 0.0
  return config


# (steps_per_epoch, num_steps, num_classes) of _small_head_config's run: 256 images at batch
# 16, 4 steps, CIFAR-10's classes.
SMALL_HEAD_RUN = (16, 4, 10)


# --- numpy transcriptions of the reference ------------------------------------------------


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def reference_loss(student_output, teacher_output, center, ncrops, student_temp, temp):
  """DINOLoss.forward in float64: student_output [ncrops * b, K] (views stacked as
  MultiCropWrapper concatenates them), teacher_output [2 * b, K], center [K]."""
  student_out = np.split(student_output / student_temp, ncrops)
  teacher_out = np.split(np.exp(_log_softmax((teacher_output - center) / temp)), 2)
  total_loss, n_loss_terms = 0.0, 0
  for iq, q in enumerate(teacher_out):
    for v in range(len(student_out)):
      if v == iq:
        continue
      total_loss += np.mean(np.sum(-q * _log_softmax(student_out[v]), axis=-1))
      n_loss_terms += 1
  return total_loss / n_loss_terms


def reference_center(center, teacher_output, momentum):
  """DINOLoss.update_center (one process: the all-reduce is the identity)."""
  batch_center = np.sum(teacher_output, axis=0) / len(teacher_output)
  return center * momentum + batch_center * (1 - momentum)


def reference_grad(student_output, teacher_output, center, ncrops, student_temp, temp):
  """d loss / d student_output from the paper's formula: for view v,
  sum over teacher views a != v of (softmax(s_v / tau_s) - P_t(a)) / (tau_s b |pairs|)."""
  b = len(teacher_output) // 2
  s = np.split(student_output, ncrops)
  q = np.split(np.exp(_log_softmax((teacher_output - center) / temp)), 2)
  n_pairs = 2 * (ncrops - 1)
  grads = []
  for v in range(ncrops):
    p = np.exp(_log_softmax(s[v] / student_temp))
    grads.append(sum(p - q[a] for a in range(2) if a != v) / (student_temp * b * n_pairs))
  return np.concatenate(grads)


def _case(ncrops, b=4, k=7, seed=0):
  rng = np.random.default_rng(seed)
  student = rng.normal(size=(ncrops * b, k)) * 3
  teacher = rng.normal(size=(2 * b, k)) * 3
  center = rng.normal(size=(k,))
  return student, teacher, center


def _jax_loss(student, teacher, center, ncrops, temp, axis_name=None):
  b = len(teacher) // 2
  return dino.dino_loss(
    jnp.asarray(student, jnp.float32).reshape(ncrops, b, -1),
    jnp.asarray(teacher, jnp.float32).reshape(2, b, -1),
    jnp.asarray(center, jnp.float32),
    0.1,
    temp,
    axis_name,
  )


@pytest.mark.parametrize("ncrops", [2, 4])
def test_loss_and_centre_equal_the_reference_and_its_pairing(ncrops):
  student, teacher, center = _case(ncrops)
  for temp in (0.04, 0.07):
    loss, entropy = _jax_loss(student, teacher, center, ncrops, temp)
    expected = reference_loss(student, teacher, center, ncrops, 0.1, temp)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    q = np.exp(_log_softmax((teacher - center) / temp))
    np.testing.assert_allclose(entropy, -np.mean(np.sum(q * np.log(q), -1)), atol=1e-6)
  # The pairing matters: with the same-view pairs too, the value differs.
  all_pairs = np.mean(
    [
      np.mean(np.sum(-qa * _log_softmax(sv / 0.1), -1))
      for qa in np.split(np.exp(_log_softmax((teacher - center) / 0.04)), 2)
      for sv in np.split(student, ncrops)
    ]
  )
  assert abs(all_pairs - reference_loss(student, teacher, center, ncrops, 0.1, 0.04)) > 1e-3
  b = len(teacher) // 2
  new = dino.update_center(
    jnp.asarray(center, jnp.float32), jnp.asarray(teacher, jnp.float32).reshape(2, b, -1), 0.9
  )
  np.testing.assert_allclose(new, reference_center(center, teacher, 0.9), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ncrops", [2, 4])
def test_gradient_equals_the_papers_formula_and_spares_the_teacher(ncrops):
  student, teacher, center = _case(ncrops, seed=1)
  grad_s, grad_t = jax.grad(lambda s, t: _jax_loss(s, t, center, ncrops, 0.04)[0], argnums=(0, 1))(
    jnp.asarray(student, jnp.float32), jnp.asarray(teacher, jnp.float32)
  )
  expected = reference_grad(student, teacher, center, ncrops, 0.1, 0.04)
  np.testing.assert_allclose(grad_s, expected, atol=1e-6)
  assert not np.any(grad_t)  # No gradient reaches the teacher.
  # ... and the formula is the reference's derivative (central differences in float64).
  eps, i, j = 1e-6, 3, 2
  bumped = [student.copy(), student.copy()]
  bumped[0][i, j] += eps
  bumped[1][i, j] -= eps
  numeric = (
    reference_loss(bumped[0], teacher, center, ncrops, 0.1, 0.04)
    - reference_loss(bumped[1], teacher, center, ncrops, 0.1, 0.04)
  ) / (2 * eps)
  np.testing.assert_allclose(expected[i, j], numeric, rtol=1e-5)


def test_eight_devices_equal_one_over_the_global_batch():
  ncrops, b = 3, 16  # 16 rows per view: 2 per device.
  student, teacher, center = _case(ncrops, b=b, seed=2)
  s = jnp.asarray(student, jnp.float32).reshape(ncrops, b, -1)
  t = jnp.asarray(teacher, jnp.float32).reshape(2, b, -1)
  c = jnp.asarray(center, jnp.float32)
  mesh = mesh_lib.make_mesh()
  axis = mesh_lib.DATA_AXIS

  def per_device(s, t):
    loss, entropy = dino.dino_loss(s, t, c, 0.1, 0.05, axis)
    return loss, entropy, dino.update_center(c, t, 0.9, axis)

  sharded = jax.jit(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=(jax.P(None, axis), jax.P(None, axis)), out_specs=jax.P()
    )
  )
  sharding = jax.NamedSharding(mesh, jax.P(None, axis))
  loss8, entropy8, center8 = sharded(jax.device_put(s, sharding), jax.device_put(t, sharding))
  loss1, entropy1 = dino.dino_loss(s, t, c, 0.1, 0.05)
  np.testing.assert_allclose(loss8, loss1, rtol=1e-6)
  np.testing.assert_allclose(entropy8, entropy1, rtol=1e-6)
  np.testing.assert_allclose(center8, dino.update_center(c, t, 0.9), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(loss1, reference_loss(student, teacher, center, 3, 0.1, 0.05), 1e-6)


# --- Schedules ------------------------------------------------------------------------------


def reference_cosine_scheduler(base, final, epochs, niter_per_ep, warmup_epochs=0):
  """utils.cosine_scheduler."""
  warmup = np.linspace(0, base, warmup_epochs * niter_per_ep) if warmup_epochs else np.array([])
  iters = np.arange(epochs * niter_per_ep - warmup_epochs * niter_per_ep)
  return np.concatenate(
    [warmup, final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))]
  )


def test_teacher_momentum_and_temperature_follow_the_reference_schedules():
  epochs, niter = 10, 7
  momentum = reference_cosine_scheduler(0.996, 1, epochs, niter)
  steps = np.arange(epochs * niter)
  ours = np.array([float(common.ema_momentum(0.996, k, epochs * niter, "cosine")) for k in steps])
  np.testing.assert_allclose(ours, momentum, atol=1e-7)
  assert ours[0] == pytest.approx(0.996) and ours[-1] < 1
  for warmup in (0, 1, 4):
    cfg = ml_collections.ConfigDict(
      dict(warmup_teacher_temp=0.04, teacher_temp=0.07, warmup_teacher_temp_epochs=warmup)
    )
    schedule = np.concatenate(
      (np.linspace(0.04, 0.07, warmup), np.ones(epochs - warmup) * 0.07)
    )  # DINOLoss.teacher_temp_schedule, indexed by epoch.
    temps = [float(dino.teacher_temperature(cfg, k, niter)) for k in steps]
    np.testing.assert_allclose(temps, schedule[steps // niter], rtol=1e-6)


def test_weight_decay_and_learning_rate_schedules_follow_the_reference():
  cfg = ml_collections.ConfigDict(
    recipes.optimizer("adamw", 0.0005, 0.04, weight_decay_end=0.4, final_lr=1e-6, warmup_epochs=2)
  )
  epochs, niter, batch = 10, 7, 512
  wd = optim.weight_decay_schedule(cfg, epochs * niter)
  steps = np.arange(epochs * niter)
  np.testing.assert_allclose(
    [float(wd(k)) for k in steps],
    reference_cosine_scheduler(0.04, 0.4, epochs, niter),
    rtol=1e-6,
  )
  lr = optim.learning_rate_schedule(cfg, batch, niter, epochs * niter)
  expected = reference_cosine_scheduler(0.0005 * batch / 256, 1e-6, epochs, niter, warmup_epochs=2)
  after = steps >= 2 * niter  # The cosine part equals; the warm-up ramps to the peak one
  np.testing.assert_allclose([float(lr(k)) for k in steps[after]], expected[after], rtol=1e-5)
  # step later (optax's linear_schedule reaches it at step W, np.linspace at W - 1).
  np.testing.assert_allclose(
    [float(lr(k)) for k in steps[~after]], steps[~after] * 0.001 / (2 * niter), rtol=1e-5
  )


# --- The weight-normalised last layer -------------------------------------------------------


def test_weight_normalised_last_layer():
  x = jax.random.normal(jax.random.PRNGKey(0), (5, 6))
  for norm_last_layer in (True, False):
    layer = heads.WeightNormDense(4, learn_scale=not norm_last_layer)
    params = layer.init(jax.random.PRNGKey(1), x)["params"]
    assert set(params) == ({"kernel"} if norm_last_layer else {"kernel", "g"})
    v = np.asarray(params["kernel"])
    assert np.abs(v).max() <= 1 / np.sqrt(6)  # nn.Linear's U(+-1/sqrt(fan_in)).
    # y = x (g v / ||v||), the norm of each output unit's column.
    np.testing.assert_allclose(
      layer.apply({"params": params}, x), x @ (v / np.linalg.norm(v, axis=0)), rtol=1e-5, atol=1e-6
    )
    # Scaling v changes nothing; its gradient is orthogonal to each column.
    scaled = dict(params, kernel=params["kernel"] * 7.0)
    np.testing.assert_allclose(
      layer.apply({"params": scaled}, x), layer.apply({"params": params}, x), rtol=1e-5, atol=1e-6
    )
    grad = jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, x) ** 3))(params)["kernel"]
    np.testing.assert_allclose(np.sum(grad * v, axis=0), 0, atol=1e-5)
    if not norm_last_layer:
      np.testing.assert_array_equal(params["g"], 1.0)
      g = jnp.arange(1.0, 5.0)
      np.testing.assert_allclose(
        layer.apply({"params": dict(params, g=g)}, x),
        layer.apply({"params": params}, x) * g,
        rtol=1e-5,
      )
  # In the head: the bottleneck is L2-normalised, the last layer named for the freeze.
  head = heads.DINOHead(16, hidden_dim=8, bottleneck_dim=4)
  params = head.init(jax.random.PRNGKey(2), x, train=False)["params"]
  assert sorted(params) == ["Dense_0", "Dense_1", "Dense_2", "last_layer"]
  with_bn = heads.DINOHead(16, hidden_dim=8, bottleneck_dim=4, use_bn=True)
  variables = with_bn.init(jax.random.PRNGKey(2), x, train=False)
  assert sorted(variables["batch_stats"]) == ["BatchNorm_0", "BatchNorm_1"]  # After each hidden.
  bottleneck = x
  for i in range(3):
    d = params[f"Dense_{i}"]
    bottleneck = bottleneck @ d["kernel"] + d["bias"]
    if i < 2:
      bottleneck = jax.nn.gelu(bottleneck, approximate=False)
  bottleneck = bottleneck / np.linalg.norm(bottleneck, axis=1, keepdims=True)
  v = params["last_layer"]["kernel"]
  np.testing.assert_allclose(
    head.apply({"params": params}, x, train=False),
    bottleneck @ (v / np.linalg.norm(v, axis=0)),
    rtol=1e-5,
    atol=1e-6,
  )


# --- The optimizer's DINO options -----------------------------------------------------------


def test_per_tensor_clipping_and_the_held_last_layer():
  rng = np.random.default_rng(3)
  params = {
    "projector": {
      "Dense_0": {"kernel": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)},
      "last_layer": {"kernel": jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)},
    }
  }
  grads = [
    jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * s, jnp.float32), params)
    for s in (10.0, 0.1, 5.0, 1.0)
  ]
  # utils.clip_gradients: each tensor on its own.
  clipped, _ = optim.clip_per_tensor(3.0).update(grads[0], optax.EmptyState())
  for got, g in zip(jax.tree.leaves(clipped), jax.tree.leaves(grads[0])):
    g = np.asarray(g)
    np.testing.assert_allclose(got, g * min(1, 3.0 / (np.linalg.norm(g) + 1e-6)), rtol=1e-6)
  small, _ = optim.clip_per_tensor(3.0).update(grads[1], optax.EmptyState())
  jax.tree.map(np.testing.assert_array_equal, small, grads[1])

  # Held for 2 steps: the last layer stays; then it steps as a fresh AdamW would at the
  # global step's lr and weight decay (torch's per-parameter state starts at its first
  # gradient), the other leaves as one AdamW all along.
  cfg = ml_collections.ConfigDict(
    recipes.optimizer("adamw", 1.0, 0.04, weight_decay_end=0.4, freeze_last_layer_epochs=1.0)
  )
  lrs = jnp.asarray([0.1, 0.2, 0.3, 0.4])
  schedule = lambda k: lrs[k]
  tx = optim.build_optimizer(cfg, schedule, steps_per_epoch=2, total_steps=4)
  state, p = tx.init(params), params
  history = []
  for g in grads:
    updates, state = tx.update(g, state, p)
    p = optax.apply_updates(p, updates)
    history.append(p)
  last = lambda tree: np.asarray(tree["projector"]["last_layer"]["kernel"])
  dense = lambda tree: np.asarray(tree["projector"]["Dense_0"]["kernel"])
  np.testing.assert_array_equal(last(history[1]), last(params))
  assert np.all(dense(history[0]) != dense(params))

  def adamw(w, gs, first_step):
    m, v = np.zeros_like(w), np.zeros_like(w)
    wd = optim.weight_decay_schedule(cfg, 4)
    for t, g in enumerate(gs, 1):
      k = first_step + t - 1
      m = 0.9 * m + 0.1 * g
      v = 0.999 * v + 0.001 * g * g
      update = (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
      w = w - float(lrs[k]) * (update + float(wd(k)) * w)
    return w

  # atol: optax's bias corrections are float32 (1 - 0.999 is 1.3e-5 off there).
  np.testing.assert_allclose(
    last(history[3]), adamw(last(params), [last(g) for g in grads[2:]], 2), atol=2e-5
  )
  np.testing.assert_allclose(
    dense(history[3]), adamw(dense(params), [dense(g) for g in grads], 0), atol=2e-5
  )
  # An Adam that had counted the held steps (zero gradients) would land elsewhere.
  zeros = [np.zeros_like(last(params))] * 2
  counted = adamw(last(params), zeros + [last(g) for g in grads[2:]], 0)
  assert np.abs(counted - last(history[3])).max() > 1e-2


# --- Config and one train step --------------------------------------------------------------


def test_config_pins_the_reference_command():
  config = load_config("dino_cifar10")
  assert config.dino.to_dict() == dict(
    out_dim=65536,
    hidden_dim=2048,
    bottleneck_dim=256,
    num_layers=3,
    use_bn_in_head=False,
    norm_last_layer=True,
    momentum_teacher=0.996,
    student_temp=0.1,
    warmup_teacher_temp=0.04,
    teacher_temp=0.04,
    warmup_teacher_temp_epochs=0,
    center_momentum=0.9,
    drop_path_rate=0.1,
  )
  o = config.optimizer
  assert (config.batch_size, config.duration) == (512, "100 epochs")
  assert (o.name, o.base_lr, o.lr_scaling, o.warmup_epochs, o.final_lr, o.momentum) == (
    "adamw",
    0.0005,
    "linear",
    10.0,
    1e-6,
    0.9,
  )
  assert (o.weight_decay, o.weight_decay_end, o.weight_decay_mask) == (0.04, 0.4, "kernels")
  assert (o.clip_per_tensor, o.freeze_last_layer_epochs) == (3.0, 1.0)
  assert config.crop.to_dict() == dict(sampler="torchvision", area_min=0.14, resize="pil_bicubic")
  v1, v2 = pretraining.views(config)
  assert (v1.blur_prob, v1.solarize_prob, v2.blur_prob, v2.solarize_prob) == (1.0, 0.0, 0.1, 0.2)
  assert (v1.brightness, v1.contrast, v1.saturation, v1.hue, v1.color_jitter_prob) == (
    0.4,
    0.4,
    0.2,
    0.1,
    0.8,
  )
  assert (config.evaluators.knn.k, config.evaluators.knn.temperature) == (20, 0.07)
  # --drop_path_rate reaches the reference's ViTs only (vits.__dict__[arch](..., drop_path_rate)).
  assert load_config("dino_cifar10", "model=resnet18").dino.drop_path_rate == 0.0
  resnet = load_config("dino_cifar10", "model=resnet18").optimizer
  assert (resnet.name, resnet.base_lr, resnet.weight_decay, resnet.momentum) == (
    "sgd",
    0.03,
    1e-4,
    0.9,
  )
  for variant in ("runlocal", "runlocal_resnet"):
    local = load_config("dino_cifar10", variant)
    dino.check_config(local, 50_000)
    optim.check_optimizer_config(local.optimizer)
  # The ViT runlocal's stated departures (its docstring; docs/results.md measures each).
  local = load_config("dino_cifar10", "runlocal")
  v1, v2 = pretraining.views(local)
  assert (local.model.position_embedding, local.optimizer.base_lr) == ("sincos", 0.001)
  assert (v1.blur_prob, v2.blur_prob, local.duration) == (0.0, 0.0, "1800 steps")
  bad = load_config("dino_cifar10")
  bad.dino.teacher_temp = 0.0
  with pytest.raises(ConfigError, match=r"^config.dino.teacher_temp=0.0: must be > 0"):
    dino.check_config(bad, 50_000)
  bad = load_config("dino_cifar10")
  bad.dino.drop_path_rate = 1.0
  with pytest.raises(ConfigError, match=r"^config.dino.drop_path_rate=1.0: must be a float in"):
    dino.check_config(bad, 50_000)
  bad = load_config("dino_cifar10", "model=resnet18")
  bad.dino.drop_path_rate = 0.1
  with pytest.raises(ConfigError, match=r"drop_path_rate=0.1: must be 0.0 for a resnet18: "):
    dino.check_config(bad, 50_000)


def test_stochastic_depth_drops_whole_samples_at_the_references_rates_and_spares_the_teacher():
  # drop_path: each sample's branch zeroed with probability p, else scaled by 1 / (1 - p).
  x = jnp.ones((20000, 2, 3))
  y = np.asarray(models.vit.drop_path(x, 0.3, jax.random.PRNGKey(0)))
  assert np.all(y == y[:, :1, :1]) and set(np.unique(y)) == {0.0, np.float32(1 / 0.7)}
  assert abs(np.mean(y[:, 0, 0] == 0) - 0.3) < 4 * np.sqrt(0.21 / 20000)
  # Block i's rate is drop_path_rate * i / (depth - 1): of 2 blocks at 0.9, block 0 never
  # drops and block 1 drops both branches of a sample with probability 0.81, which then
  # leaves the 1-block network's h exactly.
  vit = models.vit.ViT(16, 2, 2, 8, drop_path_rate=0.9)
  images = jnp.asarray(np.random.default_rng(0).uniform(size=(400, 16, 16, 3)), jnp.float32)
  params = vit.init(jax.random.PRNGKey(1), images[:1], train=False)["params"]
  h = np.asarray(vit.apply({"params": params}, images, True, rngs={"drop_path": jax.random.key(2)}))
  one_block = {k: v for k, v in params.items() if k != "block1"}
  h1 = np.asarray(vit.clone(depth=1).apply({"params": one_block}, images, False))
  same = np.all(np.abs(h - h1) < 1e-6, axis=1)
  assert abs(same.mean() - 0.81) < 4 * np.sqrt(0.81 * 0.19 / 400)
  # Not training: no drops, the network without stochastic depth.
  np.testing.assert_array_equal(
    vit.apply({"params": params}, images, False),
    vit.clone(drop_path_rate=0.0).apply({"params": params}, images, False),
  )
  # In DINO's step the student drops (its loss leaves the undropped one) and the teacher
  # does not: the centre is the mean of the undropped network's outputs (see
  # test_one_step_on_8_devices_loss_centre_teacher_ema_and_frozen_last_layer).
  config = _vit_config()
  config.dino.update(out_dim=32, hidden_dim=16, bottleneck_dim=8, drop_path_rate=0.5)
  config.model.depth = 2
  mesh = mesh_lib.make_mesh()
  run = pretraining.setup(config, mesh, steps_per_epoch=4, num_steps=10)
  state = run.init()
  before = jax.device_get(state)
  batch = {"image": np.random.default_rng(0).integers(0, 256, (16, 2, 32, 32, 3), np.uint8)}
  state, metrics = run.train_step(state, jax.device_put(batch, mesh_lib.batch_sharded(mesh)))
  x = np.concatenate([batch["image"][:, 0], batch["image"][:, 1]]).astype(np.float32) / 255
  teacher = run.model.clone(encoder=run.model.encoder.clone(drop_path_rate=0.0))
  _, out = teacher.apply({"params": before.params}, jnp.asarray(x), train=True)
  out = np.asarray(out, np.float64)
  np.testing.assert_allclose(
    jax.device_get(state.extra["center"]),
    reference_center(np.zeros(32), out, 0.9),
    rtol=1e-5,
    atol=1e-7,
  )
  undropped = reference_loss(out, out, np.zeros(32), 2, 0.1, 0.04)
  assert abs(float(metrics["loss"]) - undropped) > 1e-3


def test_one_step_on_8_devices_loss_centre_teacher_ema_and_frozen_last_layer():
  config = _small_head_config()  # A step with a learning rate above 0.
  mesh = mesh_lib.make_mesh()
  run = pretraining.setup(config, mesh, *SMALL_HEAD_RUN)
  state = run.init()
  before = jax.device_get(state)
  jax.tree.map(np.testing.assert_array_equal, before.extra["teacher_params"], before.params)
  rng = np.random.default_rng(0)
  batch = {
    "image": rng.integers(0, 256, (16, 2, 32, 32, 3), np.uint8),
    "label": rng.integers(0, 10, 16).astype(np.int32),  # For the online probe.
  }
  state, metrics = run.train_step(state, jax.device_put(batch, mesh_lib.batch_sharded(mesh)))
  after = jax.device_get(state)
  m = 0.5  # tau_0 of the cosine: the base momentum, config.dino.momentum_teacher.
  jax.tree.map(
    lambda t, s0, s1: np.testing.assert_allclose(t, m * s0 + (1 - m) * s1, rtol=1e-6, atol=1e-7),
    after.extra["teacher_params"],
    before.params,
    after.params,
  )
  np.testing.assert_array_equal(
    after.params["projector"]["last_layer"]["kernel"],
    before.params["projector"]["last_layer"]["kernel"],
  )
  assert np.any(
    after.params["encoder"]["norm"]["scale"] != before.params["encoder"]["norm"]["scale"]
  )
  # The step's loss and centre, on 8 devices, equal the reference's on the whole batch
  # in one piece: the tiny ViT has no BN and no colour augmentation, so each view is
  # its uint8 crop / 255, and at step 0 student and teacher are the same network.
  x = np.concatenate([batch["image"][:, 0], batch["image"][:, 1]]).astype(np.float32) / 255
  _, out = run.model.apply({"params": before.params}, jnp.asarray(x), train=True)
  out = np.asarray(out, np.float64)
  np.testing.assert_allclose(
    after.extra["center"], reference_center(np.zeros(32), out, 0.9), rtol=1e-5, atol=1e-7
  )
  np.testing.assert_allclose(
    metrics["loss"], reference_loss(out, out, np.zeros(32), 2, 0.1, 0.04), rtol=1e-5
  )
  assert float(metrics["teacher_temp"]) == pytest.approx(0.04)
  assert float(metrics["teacher_momentum"]) == pytest.approx(m)
  np.testing.assert_allclose(metrics["center_norm"], np.linalg.norm(after.extra["center"]), 1e-6)
  assert 0 < float(metrics["teacher_entropy"]) <= np.log(32) + 1e-5
  np.testing.assert_allclose(
    metrics["teacher_student_kl"], metrics["loss"] - metrics["teacher_entropy"], rtol=1e-6
  )


def test_knn_monitor_evaluates_the_teacher_and_the_online_probe_the_student(tmp_path):
  config = _small_head_config()  # Steps with a learning rate above 0.
  mesh = mesh_lib.make_mesh()
  task = pretrain.build(config, mesh, None, str(tmp_path))
  assert (task.steps_per_epoch, task.num_steps, task.num_classes) == SMALL_HEAD_RUN
  state = task.init()
  rng = np.random.default_rng(0)
  for _ in range(2):
    batch = {
      "image": rng.integers(0, 256, (16, 2, 32, 32, 3), np.uint8),
      "label": rng.integers(0, 10, 16).astype(np.int32),
    }
    state, _ = task.train_step(state, jax.device_put(batch, mesh_lib.batch_sharded(mesh)))
  state = jax.device_get(state)
  assert methods.optional_attributes("dino").evaluated_encoder == dino.EVALUATED_ENCODER
  assert methods.optional_attributes("byol").evaluated_encoder == methods.STUDENT_ENCODER
  encoder = dino.build_model(config).encoder
  images = rng.integers(0, 256, (8, 32, 32, 3), np.uint8)
  teacher = {"params": state.extra["teacher_params"]["encoder"], "batch_stats": {}}
  student = {"params": state.params["encoder"], "batch_stats": {}}
  variables = task.eval_model.variables(state)
  features = np.asarray(task.eval_model.features(variables, images))
  np.testing.assert_allclose(features, models.encode(encoder, teacher, images), rtol=1e-6)
  # After two steps the teacher (momentum 0.5) is apart from the student.
  assert np.abs(features - np.asarray(models.encode(encoder, student, images))).max() > 1e-4
  probe = pretraining.online_probe(config, 10).head
  np.testing.assert_allclose(
    task.eval_model.logits(variables, images),
    probe.apply({"params": state.probe["params"]}, models.encode(encoder, student, images)),
    rtol=1e-6,
    atol=1e-7,
  )


# --- Multi-crop -----------------------------------------------------------------------------


def torchvision_crop(h, w, scale, rng):
  """torchvision.transforms.RandomResizedCrop.get_params with scale (lo, hi), ratio (3/4, 4/3)."""
  for _ in range(10):
    target = h * w * rng.uniform(*scale)
    ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    cw, ch = int(round(np.sqrt(target * ratio))), int(round(np.sqrt(target / ratio)))
    if 0 < cw <= w and 0 < ch <= h:
      return ch, cw
  return h, w  # Square images: the fallback is the whole image.


def test_downstream_jobs_restore_the_teacher_of_a_dino_checkpoint(tmp_path):
  config = tiny_config("dino", "runlocal_resnet")
  config.dino.update(out_dim=32, hidden_dim=16, bottleneck_dim=8)
  state = jax.device_get(pretraining.setup(config, mesh_lib.make_mesh(), 10, 20, 10).init())
  # A teacher apart from the student (parameters and BN statistics), as after training.
  teacher = {
    "params": jax.tree.map(lambda x: x + 1.0, state.extra["teacher_params"]["encoder"]),
    "batch_stats": jax.tree.map(lambda x: x * 2.0, state.extra["teacher_batch_stats"]["encoder"]),
  }
  head = jax.tree.map(lambda x: x - 1.0, state.extra["teacher_params"]["projector"])
  extra = dict(state.extra)
  extra["teacher_params"] = dict(extra["teacher_params"], encoder=teacher["params"], projector=head)
  extra["teacher_batch_stats"] = dict(extra["teacher_batch_stats"], encoder=teacher["batch_stats"])
  ckpt = checkpointing.Checkpointer(str(tmp_path / "checkpoints"))
  ckpt.save(1, state.replace(extra=extra), config)
  ckpt.close()
  probe = load_config("linear_probe", "runlocal")
  probe.pretrain_workdir = str(tmp_path)
  encoder = restore.restore_encoder(probe, mesh_lib.make_mesh())
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(encoder.variables), teacher)
  # The export's projection head is the teacher's too, not the student's.
  _, projector = restore.restore_projector(probe, encoder, mesh_lib.make_mesh())
  jax.tree.map(np.testing.assert_array_equal, projector["params"], head)


def test_local_crops_keep_torchvisions_distribution_and_the_global_views():
  # Two-sample Kolmogorov-Smirnov on 3000 windows of a 96 x 96 image at DINO's local scale
  # (0.05, 0.4): the critical distance at alpha 1e-3 is 1.95 sqrt(2 / 3000) = 0.050; the
  # global scale's areas are far away.
  n, critical = 3000, 1.95 * np.sqrt(2 / 3000)
  rng = np.random.default_rng(0)
  reference = np.array([torchvision_crop(96, 96, (0.05, 0.4), rng) for _ in range(n)])
  draw = tf.function(
    lambda seeds: tf.map_fn(
      lambda s: tf.stack(crops.crop_window(96, 96, s, "torchvision", 0.05, 0.4)),
      seeds,
      fn_output_signature=tf.int32,
    )
  )
  windows = draw(tf.stack([tf.zeros([n], tf.int64), tf.range(n, dtype=tf.int64)], 1)).numpy()
  area = windows[:, 2] * windows[:, 3] / 96**2
  ref_area = reference[:, 0] * reference[:, 1] / 96**2
  assert stats.ks_2samp(area, ref_area).statistic < critical
  assert (
    stats.ks_2samp(windows[:, 3] / windows[:, 2], reference[:, 1] / reference[:, 0]).statistic
    < critical
  )
  assert area.max() < 0.45 and area.min() > 0.03
  global_ref = np.array([torchvision_crop(96, 96, (0.4, 1.0), rng) for _ in range(n)])
  assert stats.ks_2samp(area, global_ref[:, 0] * global_ref[:, 1] / 96**2).statistic > 0.5

  # The host pipeline: local views beside the global ones, which stay bitwise as without.
  config = ml_collections.ConfigDict(dict(data_source="tfds", dataset="cifar10", data_dir=TFDS_DIR))
  source = sources.get_source(config, {"train_split": "train"})
  args = dict(
    local_batch=4,
    image_size=32,
    crop=crop_spec.CropSpec("torchvision", 0.4, "pil_bicubic"),
    seed=3,
    start_step=1,
    cache=True,
    shuffle_buffer=16,
    threads=1,
  )
  plain = next(iter(tfds.as_numpy(input_pipeline.train_dataset(source, "train[:16]", **args))))
  local = crop_spec.LocalCrops(number=3, size=16, area_min=0.05, area_max=0.4)
  multi = next(
    iter(
      tfds.as_numpy(input_pipeline.train_dataset(source, "train[:16]", local_crops=local, **args))
    )
  )
  np.testing.assert_array_equal(multi["image"], plain["image"])
  np.testing.assert_array_equal(multi["label"], plain["label"])
  assert multi["local_image"].shape == (4, 3, 16, 16, 3) and multi["local_image"].dtype == np.uint8
  flat = multi["local_image"].reshape(12, -1)
  assert len({row.tobytes() for row in flat}) == 12  # Each local view its own draw.


def _multi_crop_config():
  """_vit_config with a small head and 2 local crops, on 48 images at batch 16 (3 steps an
  epoch) for 6 steps, the teacher temperature 0.04 in epoch 0 and 0.07 from epoch 1, no
  evaluators: the multi-crop step's and the multi-crop resume's run, one train step
  compiled for both (pretraining.setup keeps the programs of a config it has built;
  MULTI_CROP_RUN is what pretrain.build gives it)."""
  config = _vit_config()
  config.train_split = "train[:48]"
  config.duration = "6 steps"
  config.checkpoint_every = "3 steps"
  config.dino.update(out_dim=32, hidden_dim=16, bottleneck_dim=8)
  config.dino.update(teacher_temp=0.07, warmup_teacher_temp_epochs=2)  # 0.04, then 0.07.
  config.local_crops = dict(number=2, size=16, area_min=0.05, area_max=0.4)
  config.augment.local = dict(color_jitter_prob=0.0)  # Identity, as tiny_config's views.
  # No evaluators: the resume test compares the training state and its logged scalars, and
  # a resume's evaluators are tests/test_runner.py's; theirs would be most of its three
  # tiny runs' time.
  config.evaluators = {}
  return config


# (steps_per_epoch, num_steps, num_classes) of _multi_crop_config's run.
MULTI_CROP_RUN = (3, 6, 10)


def test_multi_crop_step_on_8_devices_equals_the_reference_over_all_views():
  config = _multi_crop_config()
  dino.check_config(config, 50_000)
  mesh = mesh_lib.make_mesh()
  run = pretraining.setup(config, mesh, *MULTI_CROP_RUN)
  state = run.init()
  params = jax.device_get(state).params
  rng = np.random.default_rng(1)
  batch = {
    "image": rng.integers(0, 256, (16, 2, 32, 32, 3), np.uint8),
    "label": rng.integers(0, 10, 16).astype(np.int32),  # For the online probe.
    "local_image": rng.integers(0, 256, (16, 2, 16, 16, 3), np.uint8),
  }
  state, metrics = run.train_step(state, jax.device_put(batch, mesh_lib.batch_sharded(mesh)))
  apply = lambda x: np.asarray(
    run.model.apply({"params": params}, jnp.asarray(x, jnp.float32) / 255, train=True)[1],
    np.float64,
  )
  teacher = apply(np.concatenate([batch["image"][:, v] for v in range(2)]))
  local = apply(np.concatenate([batch["local_image"][:, v] for v in range(2)]))
  student = np.concatenate([teacher, local])  # Student = teacher at step 0.
  assert float(metrics["teacher_temp"]) == pytest.approx(0.04)  # Epoch 0's.
  np.testing.assert_allclose(
    metrics["loss"], reference_loss(student, teacher, np.zeros(32), 4, 0.1, 0.04), rtol=1e-5
  )
  # The centre averages the teacher's global views only.
  np.testing.assert_allclose(
    jax.device_get(state).extra["center"],
    reference_center(np.zeros(32), teacher, 0.9),
    rtol=1e-5,
    atol=1e-7,
  )


def test_multi_crop_bad_input_is_one_line_before_any_compute():
  config = load_config("dino_cifar10", "runlocal,local_crops=4")
  dino.check_config(config, 50_000)
  config.local_crops.size = 12
  with pytest.raises(ConfigError, match=r"^config.local_crops.size=12: must be a multiple of "):
    dino.check_config(config, 50_000)
  config = load_config("dino_cifar10", "runlocal,local_crops=4")
  config.local_crops.area_min = 0.5
  with pytest.raises(ConfigError, match=r"^config.local_crops.area_min=0.5: must be in"):
    crop_spec.check_local_crops(config)
  simclr = load_config("simclr_cifar10", "runlocal")
  simclr.local_crops = dict(number=2, size=16, area_min=0.05, area_max=0.4)
  with pytest.raises(ConfigError, match=r"^config.local_crops=.*absent for method 'simclr'"):
    pretrain.check_config(simclr, 8)


def test_multi_crop_run_resumes_bit_for_bit_across_an_epoch_boundary(tmp_path, monkeypatch):
  # 48 images at batch 16: 3 steps an epoch. Stopped after step 2, the resumed run crosses
  # into epoch 1 at step 3, where the last layer's hold ends and the teacher temperature
  # steps up; its local views, teacher, centre and held optimizer state must match.
  config = _multi_crop_config()  # MULTI_CROP_RUN: the step test's train step.
  straight, _ = runner.run(pretrain, config, str(tmp_path / "straight"))
  with monkeypatch.context() as m:
    sigterm_after_first_train_batch(m)
    stopped, _ = runner.run(pretrain, config, str(tmp_path / "resumed"))
  assert int(stopped.step) == 2
  resumed, _ = runner.run(pretrain, config, str(tmp_path / "resumed"))
  assert int(resumed.step) == 6
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), jax.device_get(straight))
  records = read_metrics(tmp_path / "resumed")  # No evaluators: the train steps' alone.
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
  temps = [r.get("teacher_temp") for r in records]
  np.testing.assert_allclose(temps, [0.04] * 3 + [0.07] * 3, rtol=1e-6)


# --- continuing DINO's own checkpoints ----------------------------------------------------


def _reference_head(tensors, prefix, x, use_bn, eps=1e-5):
  """dino vision_transformer.py DINOHead.forward in eval mode, float64 numpy, from its
  state dict: mlp (Linear, [BN,] GELU, ..., Linear), L2 normalisation, then
  last_layer = weight_norm(Linear): weight_g * weight_v / ||weight_v|| (rows)."""
  mlp = prefix + "mlp."
  layers = sorted({int(k[len(mlp) :].split(".")[0]) for k in tensors if k.startswith(mlp)})
  for i in layers:
    name = f"{prefix}mlp.{i}."
    w = tensors[name + "weight"].astype(np.float64)
    if w.ndim == 2:  # Linear, then GELU unless it is the last.
      x = x @ w.T + tensors[name + "bias"]
      if i != layers[-1] and not use_bn:
        x = 0.5 * x * (1 + special.erf(x / np.sqrt(2)))
    else:  # BatchNorm1d with its running statistics, then GELU.
      x = (x - tensors[name + "running_mean"]) / np.sqrt(tensors[name + "running_var"] + eps)
      x = x * w + tensors[name + "bias"]
      x = 0.5 * x * (1 + special.erf(x / np.sqrt(2)))
  x = x / np.linalg.norm(x, axis=-1, keepdims=True)
  v = tensors[prefix + "last_layer.weight_v"].astype(np.float64)
  weight = tensors[prefix + "last_layer.weight_g"] * v / np.linalg.norm(v, axis=1, keepdims=True)
  return x @ weight.T


def _random_encoder(config, rng):
  """config.model's encoder variables drawn from rng: parameters normal(0, 0.1), BN
  means U(-0.2, 0.2) and variances U(0.5, 2)."""
  shapes = state_dicts.variable_shapes(config.model, 32)
  bounds = {"mean": (-0.2, 0.2), "var": (0.5, 2.0)}
  stats = flax.traverse_util.flatten_dict(shapes["batch_stats"])
  return {
    "params": jax.tree.map(
      lambda x: rng.normal(0, 0.1, x.shape).astype(np.float32), shapes["params"]
    ),
    "batch_stats": flax.traverse_util.unflatten_dict(
      {k: rng.uniform(*bounds[k[-1]], v.shape).astype(np.float32) for k, v in stats.items()}
    ),
  }


def _reference_checkpoint(config, rng):
  """A main_dino.py checkpoint for config's encoder and DINO head, in the reference's names
  (backbone: state_dicts.to_state_dict, tested against the stock models elsewhere; head:
  DINOHead's Sequential written out here), numpy: the student under 'module.', the teacher
  under 'module.' for a ResNet (DistributedDataParallel: it has BN) and bare for a ViT."""
  cfg, dim = config.dino, models.encoder_width(config.model)
  head, index, fan_in = {}, 0, dim
  widths = [cfg.hidden_dim] * (cfg.num_layers - 1) + [cfg.bottleneck_dim]
  for i, width in enumerate(widths):
    head[f"head.mlp.{index}.weight"] = rng.normal(0, 0.3, (width, fan_in)).astype(np.float32)
    head[f"head.mlp.{index}.bias"] = rng.normal(0, 0.1, width).astype(np.float32)
    if i < len(widths) - 1 and cfg.use_bn_in_head:
      bn = f"head.mlp.{index + 1}."
      head[bn + "weight"] = rng.uniform(0.5, 1.5, width).astype(np.float32)
      head[bn + "bias"] = rng.uniform(-0.2, 0.2, width).astype(np.float32)
      head[bn + "running_mean"] = rng.uniform(-0.2, 0.2, width).astype(np.float32)
      head[bn + "running_var"] = rng.uniform(0.5, 2, width).astype(np.float32)
      head[bn + "num_batches_tracked"] = np.zeros((), np.int64)
    index += 3 if cfg.use_bn_in_head else 2
    fan_in = width
  head["head.last_layer.weight_g"] = np.ones((cfg.out_dim, 1), np.float32)
  head["head.last_layer.weight_v"] = rng.normal(0, 1, (cfg.out_dim, fan_in)).astype(np.float32)
  networks = {}
  for name in ("student", "teacher"):
    wrapper = "" if name == "teacher" and "depth" in config.model else "module."
    encoder = state_dicts.to_state_dict(config.model, _random_encoder(config, rng), 32)
    networks[name] = {wrapper + "backbone." + k: v for k, v in encoder.items()}
    scale = np.float32(1.1 if name == "teacher" else 1.0)  # The teacher's head apart.
    networks[name].update(
      {
        wrapper + k: v * scale if "weight_g" not in k and v.dtype == np.float32 else v
        for k, v in head.items()
      }
    )
  center = rng.normal(size=(1, cfg.out_dim)).astype(np.float32)
  return dict(networks, dino_loss={"center": center})


@pytest.mark.parametrize("variant", ["runlocal_resnet", "runlocal"])
def test_a_dino_training_checkpoint_continues_its_student_teacher_and_centre(variant):
  # ResNet: a 2-layer head with BN, its teacher under 'module.'; ViT: the reference's (3
  # layers, a learned position embedding), its teacher bare.
  if variant == "runlocal":  # The one-step test's run: its train step, compiled once.
    config, length = _small_head_config(), SMALL_HEAD_RUN
  else:
    config, length = tiny_config("dino", variant), (10, 20, 10)
    config.dino.update(out_dim=32, hidden_dim=16, bottleneck_dim=8)
  checkpoint = _reference_checkpoint(config, np.random.default_rng(0))
  imported = dino.imported_state(checkpoint, "f.pth", config)
  mesh = mesh_lib.make_mesh()
  run = pretraining.setup(config, mesh, *length, (dino.with_imported, imported))
  state = jax.device_get(run.init())
  for name, params, network_stats in (
    ("student", state.params, state.batch_stats),
    ("teacher", state.extra["teacher_params"], state.extra["teacher_batch_stats"]),
  ):
    tensors = checkpoint[name]
    wrapper = next(p for p in ("module.", "") if p + "head.last_layer.weight_v" in tensors)
    # The encoder: exactly the file's backbone (the state dict round trip is bit for bit).
    backbone = state_dicts.to_state_dict(
      config.model,
      {"params": params["encoder"], "batch_stats": network_stats.get("encoder", {})},
      32,
    )
    for k, v in backbone.items():
      np.testing.assert_array_equal(v, tensors[wrapper + "backbone." + k], err_msg=k)
    # The head: its outputs those of the reference's DINOHead on the same features.
    x = np.random.default_rng(1).normal(size=(5, models.encoder_width(config.model)))
    variables = {"params": params["projector"]}
    if "projector" in network_stats:
      variables["batch_stats"] = network_stats["projector"]
    ours = run.model.projector.apply(variables, x.astype(np.float32), train=False)
    want = _reference_head(tensors, wrapper + "head.", x, config.dino.use_bn_in_head)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(state.extra["center"], checkpoint["dino_loss"]["center"][0])
  # The continued run trains from there.
  batch = {
    "image": np.random.default_rng(2).integers(0, 256, (16, 2, 32, 32, 3), dtype=np.uint8),
    "label": np.zeros(16, np.int32),
  }
  _, metrics = run.train_step(run.init(), jax.device_put(batch, mesh_lib.batch_sharded(mesh)))
  assert np.isfinite(float(metrics["loss"]))


def test_a_dino_checkpoint_of_another_head_is_refused_in_one_line():
  config = tiny_config("dino", "runlocal_resnet")
  config.dino.update(out_dim=32, hidden_dim=16, bottleneck_dim=8)
  checkpoint = _reference_checkpoint(config, np.random.default_rng(0))
  # Not DINO's training checkpoint (a backbone file): the encoder import's, not this.
  assert dino.imported_state({"": checkpoint["teacher"]}, "f.pth", config) is None
  other = config.copy_and_resolve_references()
  other.dino.hidden_dim = 24
  with pytest.raises(
    WeightsError,
    match=r"^f.pth \(student\): tensor module.head.mlp.0.weight has shape \[16, 32\] where "
    r"the run's head needs \[24, 32\]: config.dino \(out_dim 32, hidden_dim 24,",
  ):
    dino.imported_state(checkpoint, "f.pth", other)
  other = config.copy_and_resolve_references()
  other.dino.use_bn_in_head = False
  with pytest.raises(WeightsError, match=r"has no tensor 'module.head.mlp.2.weight' of the run's"):
    dino.imported_state(checkpoint, "f.pth", other)
  learned = dict(checkpoint, student=dict(checkpoint["student"]))
  learned["student"]["module.head.last_layer.weight_g"] = np.full((32, 1), 2.0, np.float32)
  with pytest.raises(WeightsError, match=r"weight_g is not 1 .*norm_last_layer=False$"):
    dino.imported_state(learned, "f.pth", config)
  # With norm_last_layer False the file's weight_g is the run's learned scale g.
  config.dino.norm_last_layer = False
  imported = dino.imported_state(learned, "f.pth", config)
  np.testing.assert_array_equal(imported["student"]["params"]["projector"]["last_layer"]["g"], 2.0)
  config.dino.out_dim = 64
  with pytest.raises(WeightsError, match=r"^f.pth \(student\): tensor module.head.last_layer"):
    dino.imported_state(checkpoint, "f.pth", config)
  config.dino.out_dim = 32
  with pytest.raises(WeightsError, match=r"^f.pth: dino_loss.center: none where"):
    dino.imported_state(dict(checkpoint, dino_loss={}), "f.pth", config)


def test_init_from_a_main_dino_pth_continues_it_and_a_backbone_file_starts_every_network(
  tmp_path,
):
  torch = pytest.importorskip("torch")
  config = tiny_config("dino", "runlocal_resnet")
  config.dino.update(out_dim=32, hidden_dim=16, bottleneck_dim=8)
  checkpoint = _reference_checkpoint(config, np.random.default_rng(0))
  saved = {
    k: {n: torch.from_numpy(np.asarray(v)) for n, v in d.items()} for k, d in checkpoint.items()
  }
  config.init_from = str(tmp_path / "checkpoint.pth")
  torch.save(dict(saved, epoch=3, args=argparse.Namespace(arch="resnet10")), config.init_from)
  replace, imported = pretrain.imported_start(config)
  assert replace is dino.with_imported
  want = dino.imported_state(checkpoint, config.init_from, config)
  jax.tree.map(np.testing.assert_array_equal, imported, want)
  # The teacher's backbone alone (DINO's published *_pretrain.pth layout): every network.
  torch.save(saved["teacher"], config.init_from)
  replace, imported = pretrain.imported_start(config)
  assert replace is methods.with_encoder
  teacher = want["teacher"]
  jax.tree.map(
    np.testing.assert_array_equal,
    imported,
    {"params": teacher["params"]["encoder"], "batch_stats": teacher["batch_stats"]["encoder"]},
  )

"""Distillation (methods/distillation.py): LightlyTrain's three losses against numpy
transcriptions of its formulas, value and gradient; the train step on 8 devices against 1;
exact resume across an epoch boundary; a teacher that nothing updates or saves; bad input."""

from helpers import TINY_DINOV3_TEACHER
from helpers import TINY_TEACHER
from helpers import sigterm_after_first_train_batch
from helpers import tiny_config
from helpers import tiny_distill_config
from helpers import tiny_teacher_file
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from contrastive_jax import models
from contrastive_jax import recipes
from contrastive_jax.core import checkpointing
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.jobs import pretrain
from contrastive_jax.methods import common
from contrastive_jax.methods import distillation
from contrastive_jax.methods import optim
from contrastive_jax.methods import pretraining
from contrastive_jax.training import restore
from contrastive_jax.training import runner

# --- the reference's formulas in numpy (float64) -------------------------------------------


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _kl_batchmean(student_logits, teacher_logits):
  """torch KLDivLoss(reduction='batchmean')(log_softmax(student), softmax(teacher)) of
  [N, C] logits, and its gradient with respect to the student's logits."""
  p, q = _softmax(teacher_logits), _softmax(student_logits)
  n = student_logits.shape[0]
  return np.sum(p * (np.log(p) - np.log(q))) / n, (q - p) / n


def reference_v1(s, t, queue, temp):
  """DistillationLoss.forward: value and d/d student."""
  loss, g = _kl_batchmean(s @ queue.T / temp, t @ queue.T / temp)
  return loss, g @ queue / temp


def reference_v2(s, t):
  """MSELoss: value and d/d student."""
  return np.mean((s - t) ** 2), 2 * (s - t) / s.size


def reference_v3_local(s, t, temp):
  """DistillationV3Loss's local term: value and d/d student ([B, M, D] each)."""
  b, m, _ = s.shape
  ss = np.einsum("bmd,bnd->bmn", s, s) / temp
  tt = np.einsum("bmd,bnd->bmn", t, t) / temp
  loss, g = _kl_batchmean(ss.reshape(b * m, m), tt.reshape(b * m, m))
  g = g.reshape(b, m, m)
  return loss, np.einsum("bmn,bnd->bmd", g + g.transpose(0, 2, 1), s) / temp


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


RNG = np.random.default_rng(0)
S, T, Q = (_unit(RNG.normal(size=shape)) for shape in ((8, 6), (8, 6), (20, 6)))
SL, TL = (_unit(RNG.normal(size=(8, 5, 6))) for _ in range(2))


def _check(fn, args, reference, axis_sharded=None):
  value, grad = jax.value_and_grad(fn)(*[jnp.asarray(a, jnp.float32) for a in args])
  ref_value, ref_grad = reference
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)


def test_v1_queue_kl_equals_the_references_value_and_gradient():
  # T 0.07 (the reference's) and 0.5: a sharp and a smooth distribution.
  for temp in (0.07, 0.5):
    _check(
      lambda s, t, q: distillation.queue_kl(s, t, q, temp), (S, T, Q), reference_v1(S, T, Q, temp)
    )


def test_v2_patch_mse_equals_the_references_value_and_gradient():
  _check(distillation.patch_mse, (SL, TL), reference_v2(SL, TL))


def test_v3_patch_similarity_kl_equals_the_references_value_and_gradient():
  _check(
    lambda s, t: distillation.patch_similarity_kl(s, t, 0.07),
    (SL, TL),
    reference_v3_local(SL, TL, 0.07),
  )


def test_losses_on_8_devices_equal_the_whole_batch_on_one():
  mesh = mesh_lib.make_mesh()
  axis = mesh_lib.DATA_AXIS

  def sharded(fn):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(jax.P(axis),) * 2, out_specs=jax.P()))
    put = lambda x: jax.device_put(np.asarray(x, np.float32), mesh_lib.batch_sharded(mesh))
    return lambda s, t: f(put(s), put(t))

  v1 = sharded(lambda s, t: distillation.queue_kl(s, t, jnp.asarray(Q, jnp.float32), 0.07, axis))
  v2 = sharded(lambda s, t: distillation.patch_mse(s, t, axis))
  v3 = sharded(lambda s, t: distillation.patch_similarity_kl(s, t, 0.07, axis))
  np.testing.assert_allclose(v1(S, T), reference_v1(S, T, Q, 0.07)[0], rtol=1e-5)
  np.testing.assert_allclose(v2(SL, TL), reference_v2(SL, TL)[0], rtol=1e-5)
  np.testing.assert_allclose(v3(SL, TL), reference_v3_local(SL, TL, 0.07)[0], rtol=1e-5)


def test_ring_buffer_mixup_and_resize_follow_the_reference():
  queue, ptr = jnp.zeros((5, 2)), jnp.zeros((), jnp.int32)
  keys = jnp.arange(6.0).reshape(3, 2)
  queue, ptr = distillation.enqueue(queue, ptr, keys)
  queue, ptr = distillation.enqueue(queue, ptr, keys + 10)
  # Rows 0-2 then 3, 4 and (wrapping) 0: the oldest key is the one overwritten.
  np.testing.assert_array_equal(queue[:, 0], [14, 2, 4, 10, 12])
  assert int(ptr) == 1
  # A batch at least as large as the queue: its first K keys (the reference's branch).
  full, ptr = distillation.enqueue(jnp.zeros((2, 2)), ptr, keys)
  np.testing.assert_array_equal(full, keys[:2]) and int(ptr) == 0
  # Mix-up: one l for the batch, each row mixed with one partner of a permutation.
  x = jnp.arange(8.0)[:, None, None, None] * jnp.ones((8, 2, 2, 3))
  mixed = np.asarray(distillation.mixup(x, jax.random.PRNGKey(3)))[:, 0, 0, 0]
  lam = float(jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(3), 0)))
  partners = (mixed - lam * np.arange(8)) / (1 - lam)
  np.testing.assert_allclose(np.sort(partners), np.arange(8), atol=1e-4)
  # torch's bilinear F.interpolate(align_corners=False) of a 2 x 2 map to 4 x 4: the rows
  # 0.25-steps between the corners, the edges clamped.
  m = jnp.asarray([[0.0, 1.0], [2.0, 3.0]])[None, :, :, None]
  out = np.asarray(distillation.resize_to_grid(m, (4, 4)))[0, :, :, 0]
  np.testing.assert_allclose(out[0], [0, 0.25, 0.75, 1], atol=1e-6)
  np.testing.assert_allclose(out[:, 0], [0, 0.5, 1.5, 2], atol=1e-6)


# --- the method ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("teacher")


def _batch(config, seed=0):
  rng = np.random.default_rng(seed)
  size = config.image_size
  return {
    "image": rng.integers(0, 256, (config.batch_size, 2, size, size, 3), np.uint8),
    "label": rng.integers(0, 10, config.batch_size).astype(np.int32),
  }


@pytest.fixture(scope="module")
def v3_config(teacher_dir):
  """tiny_distill_config's v3 with TINY_DINOV3_TEACHER's file (seed 7) as its teacher (patch
  16: a 2 x 2 grid at 32 px, the cheapest teacher forward); tests take a copy."""
  return tiny_distill_config(teacher_dir, "v3", TINY_DINOV3_TEACHER)


@pytest.fixture(scope="module")
def run_config(v3_config):
  """v3_config as the resume test runs it; tests take a copy. 48 images at batch 16: 3 steps
  an epoch; 4 steps; no evaluators (their compiles would double the resume test's time;
  runner's own tests run them); the full learning rate from the first step."""
  config = v3_config.copy_and_resolve_references()
  config.train_split = "train[:48]"
  config.duration = "4 steps"
  config.checkpoint_every = "4 steps"  # The stop's save and the last step's.
  config.evaluators = {}
  config.optimizer.warmup_epochs = 0.0
  return config


def _steps(config, mesh, batches):
  """The batches' steps of run_config's run, as pretrain.build sets it up (3 steps an epoch, 4
  steps, the online probe of CIFAR-10's 10 classes): on its 8-device mesh, the program that
  the resume test's runs then reuse (pretraining.setup keeps it)."""
  run = pretraining.setup(config, mesh, steps_per_epoch=3, num_steps=4, num_classes=10)
  state = run.init()
  for batch in batches:
    state, metrics = run.train_step(state, jax.device_put(batch, mesh_lib.batch_sharded(mesh)))
  return jax.device_get(state), jax.device_get(metrics)


def test_train_step_on_8_devices_equals_1_device_and_the_teacher_gets_no_update(run_config):
  # The tiny ViT config has no photometric augmentation, so the views do not depend on the
  # device a row is on; the mix-up and the queue are the global batch's. v3 runs v1's
  # global term and a local one; v2's step runs in tests/test_methods.py's contract test.
  # The teacher is a DINOv3-shaped file (patch 16: the student's 8 x 8 patch map resized to
  # its 2 x 2 grid).
  loss = "v3"
  config = run_config.copy_and_resolve_references()
  batches = [_batch(config, 0), _batch(config, 1)]
  # The config as pretrain.build passes it on: the teacher file's digest recorded.
  recorded = distillation.recorded_config(config, restore.checkpoint_encoder)
  eight, m8 = _steps(recorded, mesh_lib.make_mesh(), batches)
  one, m1 = _steps(recorded, mesh_lib.make_mesh(jax.devices()[:1]), batches)
  assert int(eight.step) == 2 and np.isfinite(m8["loss"])
  np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5)
  same = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
  jax.tree.map(same, eight.params, one.params)
  jax.tree.map(same, eight.extra, one.extra)
  # The teacher is in no part of the state: the student, its heads, the queue and its
  # pointer (v3) only; the file it came from is unchanged.
  assert set(eight.params) == {"encoder", "projector", distillation.LOCAL_PROJECTOR}
  assert set(eight.extra) == ({"queue", "queue_ptr"} if loss == "v3" else set())
  if loss == "v3":
    # Two global batches of 16 keys written into the queue of 32: every row, unit norm.
    np.testing.assert_allclose(np.linalg.norm(eight.extra["queue"], axis=1), 1.0, rtol=1e-5)
    assert {"global_loss", "local_loss"} <= set(m8)
  mesh = mesh_lib.make_mesh()
  teacher = distillation.load_teacher(config, mesh)
  # The teacher is an argument of the compiled step, not a constant of its program.
  model, tx = distillation.build_model(config), optax.identity()
  step = distillation.make_train_step(config, model, tx, pretraining.views(config), mesh, None)
  keys = jax.random.split(jax.random.PRNGKey(0))
  state = jax.eval_shape(lambda: distillation.init_state(config, model, tx, *keys))
  batch = jax.device_put(_batch(config), mesh_lib.batch_sharded(mesh))
  hlo = jax.jit(step).lower(state, batch, teacher).as_text()
  kernel = np.asarray(jax.device_get(teacher["params"]["patch_embed"]["kernel"]), np.float32)
  assert kernel.tobytes().hex().upper()[:64] not in hlo.upper()
  teacher = jax.device_get(teacher)
  x = jnp.asarray(_batch(config)["image"][:2, 0], jnp.float32) / 255
  module = distillation.teacher_encoder(config)
  assert module.dtype == jnp.bfloat16
  # Its outputs carry no gradient to its weights.
  grads = jax.jit(
    jax.grad(lambda v: sum(jnp.sum(o) for o in distillation.teacher_forward(module, v, x, 2)))
  )(teacher)
  assert all(not np.any(g) for g in jax.tree.leaves(grads))


def test_a_resnet_students_first_v1_step_loss_is_the_references_formula(teacher_dir):
  # One step of a tiny ResNet student (v1, 1 device, no photometric augmentation): its loss is
  # the numpy KL of the teacher's and the student's softmaxes over the queue at T 0.07, the
  # queue holding the batch's teacher embeddings (written before the loss) and zeros, on the
  # images mixed up as the reference's _mixup_data (l ~ U(0, 1), a permutation of the batch).
  config = tiny_config("distill", "runlocal,loss=v1")
  config.distill.teacher = tiny_teacher_file(teacher_dir, config.image_size)
  config.distill.teacher_model = dict(TINY_TEACHER)
  config.distill.queue_size = 32
  config.augment.view1 = dict(color_jitter_prob=0.0, grayscale_prob=0.0)
  config.optimizer.warmup_epochs = 0.0
  mesh = mesh_lib.make_mesh(jax.devices()[:1])
  run = pretraining.setup(config, mesh, steps_per_epoch=16, num_steps=100)
  state = run.init()
  batch = _batch(config)
  params, stats, rng = jax.device_get((state.params, state.batch_stats, state.rng))
  _, metrics = run.train_step(state, jax.device_put(batch, mesh_lib.batch_sharded(mesh)))
  # The mixed images, from the step's key as the reference draws l and the permutation.
  key = common.shuffle_key(rng, 0)
  lam = float(jax.random.uniform(jax.random.fold_in(key, 0)))
  perm = np.asarray(jax.random.permutation(jax.random.fold_in(key, 1), config.batch_size))
  x = batch["image"][:, 0].astype(np.float32) / 255
  x = lam * x + (1 - lam) * x[perm]
  teacher = distillation.load_teacher(config, mesh)
  module = distillation.teacher_encoder(config)
  t, _ = jax.jit(lambda v, x: distillation.teacher_forward(module, v, x, 1))(teacher, x)
  encoder = models.build_encoder(config.model)
  student = lambda p, bs, x: distillation.LinearHead(12).apply(
    {"params": p["projector"]},
    encoder.apply(
      {"params": p["encoder"], "batch_stats": bs["encoder"]}, x, train=True, mutable=["batch_stats"]
    )[0],
  )
  z = jax.jit(student)(params, stats, x)
  t, z = _unit(np.asarray(t, np.float64)), _unit(np.asarray(z, np.float64))
  queue = np.zeros((32, 12))
  queue[: config.batch_size] = t
  expected, _ = _kl_batchmean(z @ queue.T / 0.07, t @ queue.T / 0.07)
  np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=2e-5)


def test_a_dinov3_file_teaches_as_the_model_that_wrote_it(v3_config):
  # A DINOv3-shaped teacher (patch 16: a 2 x 2 grid at 32 px) read through the one
  # weights-in path (state_dicts.from_state_dict): its variables and its bfloat16 forward
  # are those of the model that wrote the file (the train step with it: the 8-device test).
  config = v3_config.copy_and_resolve_references()
  mesh = mesh_lib.make_mesh(jax.devices()[:1])
  loaded = jax.device_get(distillation.load_teacher(config, mesh))
  model = ml_collections.ConfigDict(TINY_DINOV3_TEACHER)
  x = jnp.asarray(_batch(config)["image"][:4, 0], jnp.float32) / 255
  written = models.build_encoder(model).init(jax.random.PRNGKey(7), x[:1], train=False)
  jax.tree.map(np.testing.assert_array_equal, loaded["params"], written["params"])
  module = distillation.teacher_encoder(config)
  forward = jax.jit(lambda v: distillation.teacher_forward(module, v, x, 2))
  jax.tree.map(np.testing.assert_array_equal, forward(loaded), forward(written))
  h, patches = forward(loaded)
  assert h.shape == (4, 12) and patches.shape[:3] == (4, 2, 2)
  # The image-size check uses the teacher's patch, 16.
  config.image_size = 40
  with pytest.raises(ConfigError, match="image_size=40: .* teacher's patch size 16"):
    distillation.check_config(config, 256)


def test_resumes_bit_for_bit_across_an_epoch_boundary_without_the_teacher_in_checkpoints(
  tmp_path, run_config, monkeypatch
):
  # 48 images at batch 16: 3 steps an epoch; stopped after step 2, resumed across the
  # epoch boundary to step 4 (the fewest steps that cross it after a stop mid-epoch).
  config = run_config.copy_and_resolve_references()
  straight, _ = runner.run(pretrain, config, str(tmp_path / "straight"))
  with monkeypatch.context() as m:
    sigterm_after_first_train_batch(m)
    stopped, _ = runner.run(pretrain, config, str(tmp_path / "resumed"))
  assert int(stopped.step) == 2
  resumed, _ = runner.run(pretrain, config, str(tmp_path / "resumed"))
  assert int(resumed.step) == 4
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), jax.device_get(straight))
  ckpt = checkpointing.Checkpointer(str(tmp_path / "resumed" / "checkpoints"), read_only=True)
  try:
    saved = ckpt.saved_config()
  finally:
    ckpt.close()
  # The teacher file's digest was recorded; its weights are in no checkpoint (the saved
  # state is the TrainState, which has none of them).
  assert saved.distill.teacher_sha256 == distillation.file_sha256(config.distill.teacher)
  # A workdir of this package as the teacher: its latest step, model and evaluated encoder
  # recorded, the encoder restored from the checkpoint.
  as_teacher = config.copy_and_resolve_references()
  as_teacher.distill.teacher = str(tmp_path / "straight")
  del as_teacher.distill["teacher_model"]
  as_teacher.distill.teacher_model = None
  recorded = distillation.recorded_config(as_teacher, restore.checkpoint_encoder)
  assert recorded.distill.teacher_step == 4
  teacher_model = recorded.distill.teacher_model
  assert [teacher_model[k] for k in ("name", "width", "depth", "patch_size")] == [
    config.model[k] for k in ("name", "width", "depth", "patch_size")
  ]
  variables = distillation.load_teacher(recorded, mesh_lib.make_mesh())
  jax.tree.map(
    np.testing.assert_array_equal,
    jax.device_get(variables["params"]),
    jax.device_get(straight.params["encoder"]),
  )
  with pytest.raises(ConfigError, match="distill.teacher_sha256"):
    changed = config.copy_and_resolve_references()
    changed.distill.teacher_sha256 = "0" * 64
    distillation.recorded_config(changed, restore.checkpoint_encoder)


def test_bad_input_is_one_line_before_any_compute(teacher_dir, v3_config):
  config = v3_config.copy_and_resolve_references()
  missing = config.copy_and_resolve_references()
  missing.distill.teacher = str(teacher_dir / "nothing.safetensors")
  with pytest.raises(ConfigError, match="distill.teacher=.*nothing.safetensors.*existing"):
    distillation.check_config(missing, 256)
  no_workdir = config.copy_and_resolve_references()
  no_workdir.distill.teacher = str(teacher_dir / "no_such_run")
  with pytest.raises(ConfigError, match="pretraining or fine-tuning workdir"):
    distillation.check_config(no_workdir, 256)
  # A patch-14 teacher and 32 px images: the two cannot share the input.
  patch14 = config.copy_and_resolve_references()
  patch14.distill.teacher_model = ml_collections.ConfigDict(dict(TINY_TEACHER, patch_size=14))
  with pytest.raises(ConfigError, match="image_size=32: .* teacher's patch size 14 .* student's 4"):
    distillation.check_config(patch14, 256)
  for field, value, match in (
    ("loss", "v4", "one of"),
    ("queue_size", 256, r"\[1, 256\)"),
    ("temperature", 0.0, "> 0"),
  ):
    bad = config.copy_and_resolve_references()
    bad.distill[field] = value
    with pytest.raises(ConfigError, match=f"distill.{field}.*{match}"):
      distillation.check_config(bad, 256)
  assert distillation.reference_queue_size(50_000) == 8192
  assert distillation.reference_queue_size(300) == 128


def test_optimisers_are_the_references_and_clip_the_global_norm():
  # lr x sqrt(B / 1536) as base_lr x sqrt(B): at the reference batch, the reference's rate.
  for loss, vit, name, lr, wd in (
    ("v1", False, "lars", 1.8, 1e-6),
    ("v2", False, "lars", 9.0, 1e-6),
    ("v3", False, "adamw", 5e-4, 1e-6),
    ("v3", True, "adamw", 5e-4, 0.04),
  ):
    cfg = ml_collections.ConfigDict(recipes.distillation_optimizer(loss, vit, 100))
    assert (cfg.name, cfg.weight_decay, cfg.warmup_epochs) == (name, wd, 10.0)
    assert optim.peak_learning_rate(cfg, 1536) == pytest.approx(lr)
  assert recipes.distillation_optimizer("v3", True, 20)["warmup_epochs"] == 2.0
  # torch.nn.utils.clip_grad_norm_(max_norm=1): gradients of global norm 5 scaled to norm 1,
  # of norm 0.5 left alone (plain SGD at lr 1 shows the gradient it steps with).
  cfg = ml_collections.ConfigDict(
    recipes.optimizer(
      "sgd", 1.0, 0.0, momentum=0.0, warmup_epochs=0, weight_decay_mask="all", clip_global_norm=1.0
    )
  )
  tx = optim.build_optimizer(cfg, lambda step: 1.0)
  params = {"a": jnp.zeros(3), "b": jnp.zeros(4)}
  for scale, expected in ((1.0, 0.2), (0.1, 1.0)):
    grads = {"a": jnp.asarray([3.0, 0, 0]) * scale, "b": jnp.asarray([4.0, 0, 0, 0]) * scale}
    updates, _ = tx.update(grads, tx.init(params), params)
    jax.tree.map(
      lambda u, g: np.testing.assert_allclose(-u, g * expected, rtol=1e-6), updates, grads
    )

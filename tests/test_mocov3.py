"""MoCo v3 and the ViT encoders: the loss against the paper's pseudo-code, 8 devices vs 1,
the position embedding, ViT shapes, the AdamW mask, bad input, and the linear probe of a
ViT checkpoint."""

import math

from helpers import TFDS_DIR
from helpers import load_config
from helpers import tiny_config
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from test_simclr import numeric_grad

from contrastive_jax import models
from contrastive_jax import recipes
from contrastive_jax.core import checkpointing
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.jobs import linear_probe
from contrastive_jax.jobs import pretrain
from contrastive_jax.methods import common
from contrastive_jax.methods import mocov3
from contrastive_jax.methods import optim
from contrastive_jax.methods import pretraining
from contrastive_jax.models import vit
from contrastive_jax.training import restore
from contrastive_jax.training import runner


def algorithm1_loss(q1, q2, k1, k2, t):
  """MoCo v3 Algorithm 1, in numpy: ctr(q1, k2) + ctr(q2, k1) with
  ctr(q, k) = CrossEntropyLoss(q k^T / t, labels = arange(N)) * 2t, q and k normalised."""

  def ctr(q, k):
    q = q / np.linalg.norm(q, axis=1, keepdims=True)
    k = k / np.linalg.norm(k, axis=1, keepdims=True)
    logits = q @ k.T / t
    log_softmax = logits - np.log(np.sum(np.exp(logits), axis=1, keepdims=True))
    return -np.mean(np.diag(log_softmax)) * 2 * t

  return ctr(q1, k2) + ctr(q2, k1)


@pytest.mark.parametrize("t", [0.2, 1.0])
def test_loss_and_gradient_match_algorithm_1(t):
  rng = np.random.default_rng(0)
  q1, q2, k1, k2 = rng.normal(size=(4, 6, 5))
  loss = lambda a: (
    mocov3.contrastive_loss(a, jnp.asarray(k2), t)[0]
    + mocov3.contrastive_loss(jnp.asarray(q2), jnp.asarray(k1), t)[0]
  )
  np.testing.assert_allclose(loss(jnp.asarray(q1)), algorithm1_loss(q1, q2, k1, k2, t), rtol=1e-5)
  grad = jax.grad(loss)(jnp.asarray(q1, jnp.float32))
  np.testing.assert_allclose(
    grad, numeric_grad(lambda a: algorithm1_loss(a, q2, k1, k2, t), q1), atol=1e-5
  )
  # top1: row i is right when key i is the most similar; identical queries and keys: all.
  _, top1 = mocov3.contrastive_loss(jnp.asarray(k2), jnp.asarray(k2), t)
  assert float(top1) == 1.0


def test_sharded_loss_and_gradients_equal_single_device():
  mesh = mesh_lib.make_mesh()
  rng = np.random.default_rng(1)
  w, u = (jnp.asarray(a, jnp.float32) for a in rng.normal(size=(2, 5, 4)))
  x1, x2 = (jnp.asarray(a, jnp.float32) for a in rng.normal(size=(2, 16, 5)))

  def loss_of(w, x1, x2, axis_name):
    k1, k2 = jax.lax.stop_gradient((jnp.tanh(x1 @ u), jnp.tanh(x2 @ u)))
    return (
      mocov3.contrastive_loss(jnp.tanh(x1 @ w), k2, 0.2, axis_name)[0]
      + mocov3.contrastive_loss(jnp.tanh(x2 @ w), k1, 0.2, axis_name)[0]
    )

  single, single_grad = jax.value_and_grad(loss_of)(w, x1, x2, None)
  sharded_fn = jax.jit(
    jax.shard_map(
      jax.value_and_grad(lambda w, a, b: loss_of(w, a, b, mesh_lib.DATA_AXIS)),
      mesh=mesh,
      in_specs=(jax.P(), jax.P(mesh_lib.DATA_AXIS), jax.P(mesh_lib.DATA_AXIS)),
      out_specs=jax.P(),
    )
  )
  sharded, sharded_grad = sharded_fn(
    jax.device_put(w, mesh_lib.replicated(mesh)),
    jax.device_put(x1, mesh_lib.batch_sharded(mesh)),
    jax.device_put(x2, mesh_lib.batch_sharded(mesh)),
  )
  np.testing.assert_allclose(sharded, single, rtol=1e-6)
  np.testing.assert_allclose(sharded_grad, single_grad, rtol=1e-5, atol=1e-7)


def tiny_vit_config():
  return tiny_config("mocov3", "runlocal_vit")


def test_train_steps_on_8_devices_equal_1_device_and_the_momentum_encoder_is_an_ema():
  config = tiny_vit_config()
  # SGD, not AdamW: the projector's BN cancels any shift of h, so the final LayerNorm's
  # bias gets a gradient of rounding noise only, which Adam's normalisation makes a
  # full-size step of a sign that differs between 8 devices and 1.
  config.optimizer = recipes.optimizer("sgd", 0.1, 1e-4, warmup_epochs=0)
  # tiny_config's ViT views are crops only: no augmentation key depends on the device.
  images = np.random.default_rng(0).integers(0, 256, (2, 16, 2, 32, 32, 3), np.uint8)

  def run(mesh):
    r = pretraining.setup(config, mesh, steps_per_epoch=10, num_steps=100)
    state, states, losses = r.init(), [], []
    for batch in images:
      states.append(jax.device_get(state))
      state, metrics = r.train_step(
        state, {"image": jax.device_put(batch, mesh_lib.batch_sharded(mesh))}
      )
      losses.append(float(metrics["loss"]))
    return states + [jax.device_get(state)], losses, float(metrics["key_momentum"])

  states8, losses8, momentum = run(mesh_lib.make_mesh())
  states1, losses1, _ = run(mesh_lib.make_mesh(jax.devices()[:1]))
  np.testing.assert_allclose(losses8, losses1, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(states8[-1]), jax.tree.leaves(states1[-1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # Step 0 starts from a copy; step k's EMA uses m_k and the query network before step k.
  s0, s1, s2 = states8
  jax.tree.map(
    np.testing.assert_array_equal, s0.extra["key_params"]["encoder"], s0.params["encoder"]
  )
  m1 = 1 - (1 - 0.99) * (math.cos(math.pi / 100) + 1) / 2
  assert momentum == pytest.approx(m1, rel=1e-6)
  jax.tree.map(
    lambda k, k1, q1: np.testing.assert_allclose(k, m1 * k1 + (1 - m1) * q1, rtol=1e-5, atol=1e-7),
    s2.extra["key_params"],
    s1.extra["key_params"],
    mocov3._momentum_part(s1.params),
  )
  # The frozen patch projection never moved; everything else trained.
  frozen = s2.params["encoder"]["frozen_patch_embed"]
  jax.tree.map(np.testing.assert_array_equal, frozen, s0.params["encoder"]["frozen_patch_embed"])
  assert not np.array_equal(s2.params["encoder"]["cls_token"], s0.params["encoder"]["cls_token"])
  assert "encoder" not in s2.batch_stats and "encoder" not in s2.extra["key_batch_stats"]


def test_position_embedding_matches_its_formula():
  grid, dim = 3, 8
  emb = vit.sincos_position_embedding(grid, dim)
  assert emb.shape == (grid * grid, dim) and emb.dtype == np.float32
  omega = 1.0 / 10000 ** (np.arange(2) / 2)  # dim / 4 = 2 frequencies: 1 and 1/100.
  for patch in range(grid * grid):
    r, c = divmod(patch, grid)  # Row-major patches, as the convolution's output.
    expected = [
      np.sin(r * omega[0]),
      np.sin(r * omega[1]),
      np.cos(r * omega[0]),
      np.cos(r * omega[1]),
      np.sin(c * omega[0]),
      np.sin(c * omega[1]),
      np.cos(c * omega[0]),
      np.cos(c * omega[1]),
    ]
    np.testing.assert_allclose(emb[patch], expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
  "name,width,params",
  [
    ("vit_tiny", 192, None),
    ("vit_small", 384, None),
    # timm's vit_base_patch16_224 has 86,567,656 parameters: minus its 1000-class head
    # (769,000) and its position embedding (151,296), a constant here.
    ("vit_base", 768, 85_647_360),
  ],
)
def test_vit_output_shapes_for_each_size(name, width, params):
  cfg = ml_collections.ConfigDict(recipes.vit_model(name, 16, "bfloat16", True))
  encoder = models.build_encoder(cfg)
  x = jax.ShapeDtypeStruct((2, 224, 224, 3), jnp.float32)
  variables = jax.eval_shape(lambda x: encoder.init(jax.random.PRNGKey(0), x, train=False), x)
  assert set(variables) == {"params"}  # No BN: no batch_stats.
  h = jax.eval_shape(lambda v, x: encoder.apply(v, x, train=False), variables, x)
  assert h.shape == (2, width) == (2, models.encoder_width(cfg)) and h.dtype == jnp.float32
  leaves = jax.tree.leaves(variables["params"])
  assert all(leaf.dtype == jnp.float32 for leaf in leaves)  # bf16 compute, f32 parameters.
  assert len(variables["params"]) == 1 + 1 + 12 + 1  # patch projection, cls token, blocks, norm.
  if params:
    assert sum(math.prod(leaf.shape) for leaf in leaves) == params


def test_adamw_decays_kernels_only_and_leaves_the_frozen_projection_alone():
  cfg = ml_collections.ConfigDict(recipes.vit_model("vit_tiny", 8, "float32", True))
  cfg.update(width=0.125, depth=1)
  encoder = models.build_encoder(cfg)
  # Jitted: one program, not one per op run eagerly.
  params, _ = jax.jit(lambda key: common.init_variables(encoder, key, 16))(jax.random.PRNGKey(0))
  mask = {
    "/".join(k.key for k in path): v
    for path, v in jax.tree_util.tree_leaves_with_path(optim.decay_mask(params, "kernels"))
  }
  assert {k for k, v in mask.items() if v} == {
    "frozen_patch_embed/kernel",
    "block0/attn/qkv/kernel",
    "block0/attn/proj/kernel",
    "block0/fc1/kernel",
    "block0/fc2/kernel",
  }
  assert not mask["cls_token"] and not mask["norm/scale"] and not mask["block0/norm1/bias"]
  lr, wd = 0.1, 0.5
  opt = recipes.optimizer("adamw", 1.0, wd)
  tx = optim.build_optimizer(ml_collections.ConfigDict(opt), lambda step: lr, freeze=True)
  # Zero gradients: Adam's step is 0, so only the decoupled decay moves w: w (1 - lr wd).
  grads = jax.tree.map(jnp.zeros_like, params)
  grads["frozen_patch_embed"] = jax.tree.map(jnp.ones_like, grads["frozen_patch_embed"])
  step = jax.jit(lambda g, p: optax.apply_updates(p, tx.update(g, tx.init(p), p)[0]))
  new = step(grads, params)
  for path, leaf in jax.tree_util.tree_leaves_with_path(new):
    name = "/".join(k.key for k in path)
    old = params
    for k in path:
      old = old[k.key]
    decayed = mask[name] and not name.startswith("frozen_")
    np.testing.assert_allclose(
      leaf, old * (1 - lr * wd) if decayed else old, rtol=1e-6, err_msg=name
    )


def test_bad_input_raises_one_config_error_naming_the_field():
  def error(config, check):
    with pytest.raises(ConfigError) as info:
      check(config)
    return str(info.value)

  check = lambda c: pretrain.check_config(c, 8)
  method_check = lambda c: mocov3.check_config(c, 50_000)
  config = tiny_vit_config()
  config.model.patch_size = 5
  assert error(config, check).startswith(
    "config.model.patch_size=5: must be an integer > 0 that divides image_size (32)"
  )
  config = tiny_vit_config()
  config.model.name = "vit_huge"
  assert error(config, check).startswith("config.model.name='vit_huge': must be one of")
  config = tiny_config("mocov3")
  config.moco.queue_size = 4096
  assert error(config, method_check).startswith("config.moco.queue_size=4096: must be absent")
  config = tiny_config("mocov3")
  config.temperature = 0.0
  assert error(config, method_check) == "config.temperature=0.0: must be > 0"


def test_linear_probe_of_a_vit_checkpoint(tmp_path):
  # A step-0 checkpoint of a MoCo v3 ViT run, written as the runner writes it: its
  # batch_stats hold the heads' BN statistics but nothing of the encoder.
  config = tiny_vit_config()
  pretrain_dir = str(tmp_path / "pretrain")
  state = pretraining.setup(config, mesh_lib.make_mesh(), 16, 4, num_classes=10).init()
  assert "encoder" not in state.batch_stats
  ckpt = checkpointing.Checkpointer(f"{pretrain_dir}/checkpoints")
  ckpt.save(0, state, config)
  ckpt.wait()
  ckpt.close()
  probe = load_config("linear_probe", "runlocal")
  probe.update(
    dict(
      pretrain_workdir=pretrain_dir,
      data_dir=TFDS_DIR,
      train_split="train[:64]",
      batch_size=16,
      duration="1 steps",
      log_every="1 steps",
      shuffle_buffer=64,
      data_threads=1,
    )
  )
  probe.evaluators.linear_probe.update(split="test[:32]", batch_size=16)
  encoder = restore.restore_encoder(probe, mesh_lib.make_mesh())
  assert encoder.variables["batch_stats"] == {} and encoder.dim == 12
  jax.tree.map(
    np.testing.assert_array_equal,
    jax.device_get(encoder.variables["params"]),
    jax.device_get(state.params["encoder"]),
  )
  _, results = runner.run(linear_probe, probe, str(tmp_path / "probe"))
  assert 0 <= results["linear_probe_top1"] <= 1

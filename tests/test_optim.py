"""LARS masks on a real ResNet parameter tree; schedule values."""

from absl import flags
from helpers import CONFIG_DIR
import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_flags
import numpy as np
import optax
import pytest

from contrastive_jax import models
from contrastive_jax import recipes
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.methods import common
from contrastive_jax.methods import optim
from contrastive_jax.models import heads


def _resnet_params():
  model = heads.ContrastiveModel(
    encoder=models.build_encoder(
      ml_collections.ConfigDict(
        dict(
          name="resnet18",
          width=0.125,
          stem="cifar",
          dtype="float32",
          zero_init_residual=True,
          conv_init="he_normal",
          padding="legacy",
          stage_projection=False,
          input_mean=(0.0, 0.0, 0.0),
          input_std=(1.0, 1.0, 1.0),
        )
      )
    ),
    projector=models.build_mlp(
      ml_collections.ConfigDict(
        dict(hidden_dims=(16,), out_dim=8, use_bn=True, init="lecun_normal")
      ),
      "float32",
    ),
  )
  params, _ = common.init_variables(model, jax.random.PRNGKey(0), 8)
  return params


def _opt_config(**kw):
  return ml_collections.ConfigDict(
    recipes.optimizer(
      "lars",
      base_lr=1.0,
      weight_decay=0.1,
      **{"warmup_epochs": 1, "lr_before_momentum": True, **kw},
    )
  )


def test_decay_mask_leaves_out_biases_and_bn_parameters():
  params = _resnet_params()
  flat = {
    jax.tree_util.keystr(p): v
    for p, v in jax.tree_util.tree_leaves_with_path(optim.decay_mask(params, "kernels"))
  }
  kernels = [k for k in flat if k.endswith("['kernel']")]
  excluded = [k for k in flat if k.endswith("['bias']") or k.endswith("['scale']")]
  assert len(kernels) + len(excluded) == len(flat)
  assert all(flat[k] for k in kernels) and not any(flat[k] for k in excluded)
  assert any("BatchNorm" in k or "bn" in k for k in excluded)
  # ResNet-18: stem + 16 block convs + 3 shortcut convs; projector: 2 dense.
  assert len(kernels) == 20 + 2


def test_lars_does_not_decay_or_trust_scale_bn_and_biases():
  params = _resnet_params()
  tx = optim.build_optimizer(_opt_config(), lambda step: 1.0)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = tx.update(grads, tx.init(params), params)
  for path, u in jax.tree_util.tree_leaves_with_path(updates):
    name = path[-1].key
    if name in ("bias", "scale"):
      # Plain SGD step: -lr * grad, no weight decay, no trust ratio.
      np.testing.assert_allclose(u, -1.0, rtol=1e-6, err_msg=jax.tree_util.keystr(path))
  kernel = params["encoder"]["stem_conv"]["kernel"]
  u = updates["encoder"]["stem_conv"]["kernel"]
  g = 1.0 + 0.1 * kernel  # Weight decay added before the trust ratio.
  trust = 0.001 * jnp.linalg.norm(kernel) / jnp.linalg.norm(g)
  np.testing.assert_allclose(u, -trust * g, rtol=1e-5)


def test_schedule_warmup_then_cosine_and_lr_scaling():
  cfg = _opt_config()
  assert optim.peak_learning_rate(cfg, 512) == 2.0
  cfg.lr_scaling = "sqrt"
  np.testing.assert_allclose(optim.peak_learning_rate(cfg, 4096), 64.0)
  cfg.lr_scaling = "linear"
  sched = optim.learning_rate_schedule(cfg, 256, steps_per_epoch=10, total_steps=110)
  np.testing.assert_allclose(
    [sched(0), sched(5), sched(10), sched(60), sched(110)], [0.0, 0.5, 1.0, 0.5, 0.0], atol=1e-6
  )


def test_step_schedule_decays_at_the_given_epochs():
  cfg = _opt_config(schedule="step", decay_epochs=(3, 4), warmup_epochs=1)
  sched = optim.learning_rate_schedule(cfg, 256, steps_per_epoch=10, total_steps=50)
  np.testing.assert_allclose(
    [sched(5), sched(10), sched(29), sched(30), sched(39), sched(40)],
    [0.5, 1.0, 1.0, 0.1, 0.1, 0.01],
    rtol=1e-6,
  )


def test_schedules_without_warmup_start_at_their_peak_and_log_nothing(caplog):
  # Cosine from step 0 over 100 steps: lr(t) = 0.5 (1 + cos(pi t / 100)) x peak (1.0).
  for schedule, points, want in [
    ("cosine", [0, 25, 50, 100], [1.0, 0.5 * (1 + np.cos(np.pi / 4)), 0.5, 0.0]),
    ("step", [0, 29, 30, 40], [1.0, 1.0, 0.1, 0.01]),
  ]:
    cfg = _opt_config(schedule=schedule, decay_epochs=(3, 4), warmup_epochs=0)
    with caplog.at_level("INFO"), caplog.at_level("INFO", logger="absl"):
      sched = optim.learning_rate_schedule(cfg, 256, steps_per_epoch=10, total_steps=100)
    np.testing.assert_allclose([sched(t) for t in points], want, rtol=1e-6, atol=1e-7)
  assert "transition_steps" not in caplog.text  # optax's line for a ramp of 0 steps.


def test_nesterov_sgd_steps():
  # Constant gradient 1, lr 1, momentum 0.9: v_t = 0.9 v_{t-1} + g; the Nesterov
  # step is -(g + 0.9 v_t): -1.9, then -2.71 (plain momentum: -1, then -1.9).
  cfg = ml_collections.ConfigDict(
    recipes.optimizer("sgd", base_lr=1.0, weight_decay=0.0, nesterov=True)
  )
  tx = optim.build_optimizer(cfg, lambda step: 1.0)
  params = {"kernel": jnp.zeros(3)}
  state = tx.init(params)
  steps = []
  for _ in range(2):
    updates, state = tx.update({"kernel": jnp.ones(3)}, state, params)
    steps.append(updates["kernel"])
  np.testing.assert_allclose(steps, [[-1.9] * 3, [-2.71] * 3], rtol=1e-6)


def test_half_an_epoch_of_warmup_parses_and_warms_up_for_half_an_epoch():
  argv = [
    "main",
    f"--config={CONFIG_DIR}/simclr_cifar10.py",
    "--config.optimizer.warmup_epochs=0.5",
  ]
  flag_values = flags.FlagValues()
  config = config_flags.DEFINE_config_file("config", flag_values=flag_values, sys_argv=argv)
  flag_values(argv)
  cfg = config.value.optimizer
  assert cfg.warmup_epochs == 0.5
  sched = optim.learning_rate_schedule(cfg, 512, steps_per_epoch=98, total_steps=980)
  # Peak 1.0 x 512 / 256 = 2, reached at step 49 after a linear rise.
  np.testing.assert_allclose(
    [sched(0), sched(24), sched(49), sched(50)],
    [0.0, 2.0 * 24 / 49, 2.0, 2.0 * (1 + np.cos(np.pi / 931)) / 2],
    rtol=1e-6,
  )


def test_whole_warmup_epochs_give_the_same_steps_as_integers_did():
  for epochs in (0, 1, 10, 40):
    for steps_per_epoch in (1, 97, 390):
      cfg = _opt_config(warmup_epochs=epochs)
      assert isinstance(cfg.warmup_epochs, float)
      sched = optim.learning_rate_schedule(cfg, 256, steps_per_epoch, total_steps=100_000)
      warmup = epochs * steps_per_epoch
      assert sched(warmup) == 1.0 and (warmup == 0 or sched(warmup - 1) < 1.0)


def _reference_lr(t, peak, warmup, decays, factor=0.1):
  """The warm-up then step schedule written out: a linear rise over `warmup` steps, then
  peak x factor^(the decay steps <= t)."""
  if t < warmup:
    return peak * t / warmup
  return peak * factor ** sum(t >= d for d in decays)


def test_fraction_schedules_keep_their_shape_at_every_step_budget():
  cfg = _opt_config(
    schedule="step", warmup_epochs=0, warmup_fraction=0.1, decay_fractions=(0.6, 0.8)
  )
  optim.check_optimizer_config(cfg)
  for total in (50, 1000):  # steps_per_epoch no longer matters: 7 or 390.
    for steps_per_epoch in (7, 390):
      sched = optim.learning_rate_schedule(cfg, 256, steps_per_epoch, total_steps=total)
      points = [0, total // 20, total // 10, total * 6 // 10 - 1, total * 6 // 10, total - 1]
      want = [
        _reference_lr(t, 1.0, total // 10, (total * 6 // 10, total * 8 // 10)) for t in points
      ]
      np.testing.assert_allclose([sched(t) for t in points], want, rtol=1e-6, atol=1e-7)
  # Cosine after a warm-up of a fifth of the run: half the peak half-way through the rest.
  cfg = _opt_config(warmup_epochs=0, warmup_fraction=0.2, decay_fractions=())
  sched = optim.learning_rate_schedule(cfg, 256, steps_per_epoch=3, total_steps=500)
  np.testing.assert_allclose([sched(50), sched(100), sched(300), sched(500)], [0.5, 1, 0.5, 0])


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(warmup_fraction=1.0), r"config.optimizer.warmup_fraction=1.0: must be in \[0, 1\)"),
    (dict(warmup_fraction=0.1, warmup_epochs=2), "config.optimizer.warmup_epochs=2.0: must be 0"),
    (dict(decay_fractions=(0.8, 0.6)), r"config.optimizer.decay_fractions=\(0.8, 0.6\)"),
    (dict(warmup_fraction=0.5, decay_fractions=(0.4,)), r"in \(warmup_fraction \(0.5\), 1\)"),
    (dict(decay_fractions=(0.5,), decay_epochs=(3,)), r"decay_epochs=\(3.0,\): must be \(\)"),
  ],
)
def test_bad_fractions_are_named(fields, message):
  cfg = _opt_config(**{"warmup_epochs": 0, **fields})
  with pytest.raises(ConfigError, match=message):
    optim.check_optimizer_config(cfg)


@pytest.mark.parametrize(
  "name, fields",
  [
    ("sgd", dict(nesterov=True, weight_decay=0.1)),
    ("lars", dict(weight_decay=0.1, lr_before_momentum=True)),
    ("adamw", dict(weight_decay=0.1)),
  ],
)
def test_scaled_learning_rates_are_per_leaf_rates(name, fields):
  # Each leaf with multiplier m steps as the same optimizer at lr x m does.
  cfg = ml_collections.ConfigDict(recipes.optimizer(name, base_lr=1.0, **fields))
  rng = np.random.default_rng(0)
  params = {"a": {"kernel": jnp.asarray(rng.normal(size=(3, 2)))}, "b": {"bias": jnp.ones(4)}}
  multipliers = {"a": 0.25, "b": 3.0}
  scaled = optim.scale_learning_rates(
    optim.build_optimizer(cfg, lambda t: 0.1),
    lambda p: {k: jax.tree.map(lambda _: multipliers[k], p[k]) for k in p},
  )
  state = scaled.init(params)
  plain = {k: optim.build_optimizer(cfg, lambda t, m=m: 0.1 * m) for k, m in multipliers.items()}
  states = {k: plain[k].init(params[k]) for k in params}
  for _ in range(3):
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params)
    updates, state = scaled.update(grads, state, params)
    for k in params:
      want, states[k] = plain[k].update(grads[k], states[k], params[k])
      for u, w in zip(jax.tree.leaves(updates[k]), jax.tree.leaves(want)):
        np.testing.assert_allclose(u, w, rtol=1e-5, atol=1e-8)
    params = optax.apply_updates(params, updates)

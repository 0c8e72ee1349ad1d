"""BYOL (Grill et al. 2020, arXiv 2006.07733): online network vs EMA target.

The online network (encoder, projector, predictor) predicts the target
network's projection of the other view; the target network (encoder,
projector) is an EMA of the online one with a cosine-ramped rate and is never
differentiated. Its parameters and BN statistics live in state.extra. As in
the reference (deepmind-research byol_experiment.py), each view goes through
its own forward pass, so BN statistics are per view, global (cross-device)
over that view's batch, and the running statistics are updated twice per
step, view 1 first (common.apply_per_view); the target network is initialised with its own key, not
as a copy of the online one.
"""

import jax
import jax.numpy as jnp

from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.methods import common

_TARGET_PARTS = ("encoder", "projector")


def regression_loss(p, z):
  """Mean over rows of 2 - 2 cos(p, z) (BYOL Eq. 2), float32 scalar, in [0, 4].

  p: [b, D] online predictions; z: [b, D] target projections. Gradients flow
  into both; the caller stops them on z.
  """
  p = p.astype(jnp.float32)
  z = z.astype(jnp.float32)
  p = common.l2_normalize(p)
  z = common.l2_normalize(z)
  return jnp.mean(2.0 - 2.0 * jnp.sum(p * z, axis=1))


def byol_loss(p1, p2, z1, z2, axis_name=None):
  """Symmetrised BYOL loss L + L~ (BYOL Sec. 3.1), float32 scalar in [0, 8].

  p1, p2: online predictions of view 1 and view 2 [b, D]; z1, z2: target
  projections of view 1 and view 2 [b, D] (stop-gradient applied here). View
  1's prediction regresses view 2's target projection and vice versa. Inside
  shard_map, axis_name averages over the global batch.
  """
  z1, z2 = jax.lax.stop_gradient(z1), jax.lax.stop_gradient(z2)
  loss = regression_loss(p1, z2) + regression_loss(p2, z1)
  if axis_name is not None:
    loss = jax.lax.pmean(loss, axis_name)
  return loss


def check_config(config, num_train_examples: int):
  """Raises ConfigError for BYOL fields that cannot run. BYOL's only constraint on
  num_train_examples, B <= N, is the runner's (runner.steps_per_epoch)."""
  if not 0.0 <= config.byol.tau_base <= 1.0:
    raise ConfigError("byol.tau_base", config.byol.tau_base, "in [0, 1]")
  common.check_heads_with_predictor(config, "the prediction regresses the target projection")


# The online network.
build_model = common.build_model_with_predictor


def _target_part(tree):
  return {name: tree[name] for name in _TARGET_PARTS}


def target_key(init_rng):
  """The key the target network is initialised with (init_rng is the online network's)."""
  return jax.random.fold_in(init_rng, 1)


def init_state(config, model, tx, init_rng, rng) -> common.TrainState:
  """Step 0: the online network from init_rng, the target network from its own key.

  The reference initialises them independently (rng_online, rng_target in
  _make_initial_state), noting that a copy made no difference it could see.
  """
  params, batch_stats = common.init_variables(model, init_rng, config.image_size)
  target_params, target_stats = common.init_variables(
    model, target_key(init_rng), config.image_size
  )
  extra = {
    "target_params": _target_part(target_params),
    "target_batch_stats": _target_part(target_stats),
  }
  return common.TrainState.create(
    params=params,
    tx=tx,
    rng=rng,
    batch_stats=batch_stats,
    extra=extra,
  )


def make_train_step(config, model, tx, views, mesh, length: common.RunLength, probe=None):
  """Returns train_step(state, batch) -> (state, metrics), to be jitted.

  The target EMA uses tau_k of the step k just taken (common.ema_momentum,
  'cosine' over length.num_steps) and the online parameters after the update.
  """
  target_model = model.clone(predictor=None)

  def per_device(state, images):
    x1, x2 = common.augmented_views(images, state.rng, state.step, views)
    extra = state.extra
    (_, z1), (_, z2), target_stats = common.apply_per_view(
      target_model, extra["target_params"], extra["target_batch_stats"], x1, x2
    )

    def loss_fn(params):
      (h1, online_z1, p1), (_, _, p2), stats = common.apply_per_view(
        model, params, state.batch_stats, x1, x2
      )
      return byol_loss(p1, p2, z1, z2, mesh_lib.DATA_AXIS), (stats, {"h": h1, "z": online_z1})

    (loss, (stats, outputs)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_extra = dict(extra, target_batch_stats=target_stats)
    return grads, stats, new_extra, {"loss": loss}, outputs

  def update_target(state):
    tau = common.ema_momentum(config.byol.tau_base, state.step - 1, length.num_steps, "cosine")
    target = common.ema_update(state.extra["target_params"], _target_part(state.params), tau)
    return state.replace(extra=dict(state.extra, target_params=target))

  return common.build_train_step(per_device, tx, mesh, after_update=update_target, probe=probe)

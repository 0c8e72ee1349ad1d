"""The train state pytree and the pieces every method's train step shares.

Methods keep their loss and state update together in their own module; this
one holds what is the same for several of them: the state's common fields,
the run's length, the PRNG streams, the two augmented views, the optimizer update, the health
scalars, the online probe, the train step builder, the EMA, L2 normalisation
and the gather over the global batch.
"""

from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import optax

from contrastive_jax import models
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.mesh import DATA_AXIS
from contrastive_jax.data import augment
from contrastive_jax.models import heads


@flax.struct.dataclass
class TrainState:
  """Everything a run needs to continue: one pytree, replicated on the mesh.

  Attributes:
    step: int32 scalar, optimizer steps taken.
    params: trainable parameters (float32).
    batch_stats: BatchNorm running statistics.
    opt_state: optax state.
    rng: uint32 [2], the run's base PRNG key; the key of step s is
      fold_in(rng, s), so every random draw is a function of seed and step.
    extra: method-specific state (MoCo's key encoder and queue, BYOL's target
      network), a dict; empty for SimCLR.
    probe: the online probe's {'params', 'opt_state'}, or {} without one.
  """

  step: jax.Array
  params: Any
  batch_stats: Any
  opt_state: Any
  rng: jax.Array
  extra: Any = flax.struct.field(default_factory=dict)
  probe: Any = flax.struct.field(default_factory=dict)

  @classmethod
  def create(cls, *, params, tx, rng, batch_stats=None, extra=None, probe=None) -> "TrainState":
    """The state at step 0: the optimizer state from tx.init(params), step 0.

    Args:
      params: trainable parameters (float32 pytree).
      tx: the optax GradientTransformation whose state starts here.
      rng: uint32 [2], the run's base PRNG key.
      batch_stats: BatchNorm running statistics ({} for a model without BN).
      extra: method-specific state ({} when None).
      probe: the online probe's {'params', 'opt_state'} ({} when None).
    """
    return cls(
      step=jnp.zeros((), jnp.int32),
      params=params,
      batch_stats={} if batch_stats is None else batch_stats,
      opt_state=tx.init(params),
      rng=rng,
      extra={} if extra is None else extra,
      probe={} if probe is None else probe,
    )


class RunLength(NamedTuple):
  """How long a pretraining run is, for the schedules a method's train step follows.

  Attributes:
    num_steps: optimizer steps of the whole run (the EMA momentum ramps of MoCo, MoCo v3,
      BYOL and DINO end there).
    steps_per_epoch: optimizer steps of one pass over the train split (DINO's teacher
      temperature warms up in epochs).
  """

  num_steps: int
  steps_per_epoch: int


def init_variables(model, rng, image_size: int):
  """Initialises a Flax model on a [2, S, S, 3] float32 dummy batch.

  Returns (params, batch_stats); batch_stats is {} for a model without BN.
  """
  variables = model.init(rng, jnp.zeros((2, image_size, image_size, 3), jnp.float32), train=False)
  return variables["params"], variables.get("batch_stats", {})


def apply_per_view(network, params, batch_stats, x1, x2):
  """Train-mode outputs of view 1 and view 2, each its own forward pass.

  BN statistics are thus per view (BYOL's and MoCo v3's references encode
  the views separately); the running statistics are updated twice, view 1's
  first. Returns (outputs of x1, outputs of x2, the new batch_stats).
  """
  out1, updates = network.apply(
    {"params": params, "batch_stats": batch_stats}, x1, train=True, mutable=["batch_stats"]
  )
  out2, updates = network.apply(
    {"params": params, "batch_stats": updates["batch_stats"]},
    x2,
    train=True,
    mutable=["batch_stats"],
  )
  return out1, out2, updates["batch_stats"]


def augmented_views(images, rng, step, views):
  """Augments both views of a per-device batch, inside shard_map.

  Args:
    images: uint8 [b, 2, H, W, 3], the host's two crops of each image.
    rng, step: the state's base key and step.
    views: (ViewAugment, ViewAugment), the settings of view 1 and view 2.
  Returns:
    (x1, x2), float32 [b, H, W, 3] each; keys differ per device, view, example.
  """
  device = jax.lax.axis_index(DATA_AXIS)
  return tuple(
    augment.augment_batch(images[:, v], view_key(rng, step, device, v), views[v]) for v in range(2)
  )


def augmented_local_views(images, rng, step, view):
  """Augments multi-crop's local views of a per-device batch, inside shard_map.

  images: uint8 [b, N, s, s, 3]; view: their ViewAugment. Returns float32
  [N, b, s, s, 3]; local view i draws with view_key's view index 2 + i, so its
  keys differ from the global views' and from each other's.
  """
  device = jax.lax.axis_index(DATA_AXIS)
  return jnp.stack(
    [
      augment.augment_batch(images[:, i], view_key(rng, step, device, 2 + i), view)
      for i in range(images.shape[1])
    ]
  )


# Independent random streams of a step: fold_in(fold_in(rng, step), stream).
_VIEW_STREAM, _SHUFFLE_STREAM, _DROP_PATH_STREAM = 0, 1, 2


def view_key(rng, step, device_index, view_index):
  """The PRNG key of one view on one device at one step.

  A pure function of (rng, step, device, view), so that a resumed run draws the
  same augmentations and no two devices or views share a key.
  """
  key = jax.random.fold_in(jax.random.fold_in(rng, step), _VIEW_STREAM)
  return jax.random.fold_in(jax.random.fold_in(key, device_index), view_index)


def drop_path_key(rng, step, pass_index):
  """The PRNG key of a network's stochastic depth in one forward pass of a step, inside
  shard_map: a pure function of (rng, step, device, pass), so that a resumed run drops the
  same branches and each device draws its own samples' drops."""
  key = jax.random.fold_in(jax.random.fold_in(rng, step), _DROP_PATH_STREAM)
  device = jax.lax.axis_index(DATA_AXIS)
  return jax.random.fold_in(jax.random.fold_in(key, device), pass_index)


def shuffle_key(rng, step):
  """The PRNG key of a step's batch permutation (MoCo's shuffle BN), same on every device."""
  return jax.random.fold_in(jax.random.fold_in(rng, step), _SHUFFLE_STREAM)


def apply_gradients(state: TrainState, grads, tx: optax.GradientTransformation, **changes):
  """One optimizer update; `changes` replace other state fields (batch_stats, extra).

  Returns (new state, health) where health holds the float32 global L2 norms
  'grad_norm', 'update_norm' and 'param_norm' (of the new parameters; it is
  non-finite as soon as any parameter is, which the runner checks before
  every save).
  """
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  health = {
    "grad_norm": optax.tree.norm(grads),
    "update_norm": optax.tree.norm(updates),
    "param_norm": optax.tree.norm(params),
  }
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state, **changes), health


def projection_std(z, axis_name):
  """Mean over dimensions of the per-dimension std of L2-normalised z over the global batch.

  The collapse signal of SimSiam (Chen and He 2021, Sec. 4.1): about
  1/sqrt(d) for a healthy d-dim projection, near 0 once the outputs collapse
  to one vector. z: this device's float [b, d] rows inside shard_map.
  Returns a float32 scalar, the same on every device.
  """
  z = jax.lax.stop_gradient(z.astype(jnp.float32))
  z = l2_normalize(z)
  mean = jax.lax.pmean(jnp.mean(z, axis=0), axis_name)
  var = jax.lax.pmean(jnp.mean(jnp.square(z - mean), axis=0), axis_name)
  return jnp.mean(jnp.sqrt(var))


class OnlineProbe(NamedTuple):
  """A linear classifier on stop_gradient(h) of view 1, trained inside the train step.

  The online evaluation of SimCLR (Chen et al. 2020, Appendix B.6) and BYOL
  (Grill et al. 2020, Appendix C.1), with its own optimizer `tx` and the
  train batch's labels; no gradient reaches the encoder, so the encoder's
  training is the same with and without it. head: a Flax module mapping
  float32 [b, D] to [b, num_classes] logits.
  """

  head: Any
  tx: optax.GradientTransformation

  def init(self, rng, feature_dim: int) -> dict:
    """{'params', 'opt_state'} of a head on D = feature_dim features."""
    params = self.head.init(rng, jnp.zeros((1, feature_dim), jnp.float32))["params"]
    return {"params": params, "opt_state": self.tx.init(params)}

  def grads(self, params, h, labels, axis_name):
    """Gradients of the mean cross-entropy over the global batch, inside shard_map.

    h: this device's float [b, D] representations (stop_gradient applied
    here); labels: int32 [b]. Returns (grads like params, {'online_probe_loss',
    'online_probe_train_top1'} float32 scalars), the same on every device.
    """
    h = jax.lax.stop_gradient(h.astype(jnp.float32))

    def loss_fn(p):
      logits = self.head.apply({"params": p}, h)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      top1 = jnp.mean(jnp.argmax(logits, -1) == labels)
      return jax.lax.pmean(loss, axis_name), jax.lax.pmean(top1, axis_name)

    (loss, top1), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return grads, {"online_probe_loss": loss, "online_probe_train_top1": top1}

  def update(self, probe_state, grads) -> dict:
    """One step of tx on {'params', 'opt_state'}; returns the new pair."""
    updates, opt_state = self.tx.update(grads, probe_state["opt_state"], probe_state["params"])
    return {"params": optax.apply_updates(probe_state["params"], updates), "opt_state": opt_state}


def build_train_step(
  per_device,
  tx,
  mesh,
  after_update=None,
  probe: OnlineProbe = None,
  local_views: bool = False,
  frozen: bool = False,
):
  """A method's train_step(state, batch) -> (state, metrics), to be jitted.

  Args:
    per_device: (state, images) -> (grads, batch_stats, extra, metrics,
      outputs), run inside shard_map on every device with the state
      replicated and images = this device's rows of batch['image'] (uint8
      [b, 2, H, W, 3]); with local_views, (state, images, local_images), the
      latter this device's rows of batch['local_image'] (uint8 [b, N, s, s, 3],
      multi-crop's local views). Its grads, batch_stats, extra and metrics must be the
      same on every device (psum/pmean inside); outputs holds this device's
      train-mode 'h' [b, D] and projection 'z' [b, d] of view 1.
    tx: the optimizer applied to the gradients, outside shard_map.
    after_update: optional state -> state run after the optimizer update
      (BYOL's target EMA, which uses the updated online parameters).
    probe: an OnlineProbe trained on outputs['h'] and batch['label'], or None.
    frozen: whether per_device also reads variables that nothing updates (distillation's
      teacher, methods.OptionalAttributes.frozen_variables): train_step then takes them as
      a third argument, replicated on the mesh, and passes them to per_device as its last
      argument (through shard_map as an input: a jitted function's argument, so that they
      are parameters of the executable, not constants of its program).
  Returns:
    train_step whose metrics add 'projection_std' (see projection_std), the
    norms of apply_gradients and, with a probe, 'online_probe_loss' and
    'online_probe_train_top1' to the method's.
  """

  num_images = 2 if local_views else 1

  held = 1 if frozen else 0

  def sharded_part(state, *arrays):
    arrays, fixed = arrays[held:], arrays[:held]
    grads, batch_stats, extra, metrics, outputs = per_device(state, *arrays[:num_images], *fixed)
    labels = arrays[num_images] if probe is not None else None
    metrics = dict(metrics, projection_std=projection_std(outputs["z"], DATA_AXIS))
    probe_grads = None
    if probe is not None:
      probe_grads, probe_metrics = probe.grads(
        state.probe["params"], outputs["h"], labels, DATA_AXIS
      )
      metrics.update(probe_metrics)
    return grads, batch_stats, extra, metrics, probe_grads

  # Labels are an input only with a probe: the methods themselves never see them.
  inputs = ("image", "local_image")[:num_images] + (() if probe is None else ("label",))
  sharded = jax.shard_map(
    sharded_part,
    mesh=mesh,
    in_specs=(jax.P(),) * (1 + held) + (jax.P(DATA_AXIS),) * len(inputs),
    out_specs=jax.P(),
  )

  def train_step(state, batch, *fixed):
    grads, batch_stats, extra, metrics, probe_grads = sharded(
      state, *fixed, *(batch[name] for name in inputs)
    )
    state, health = apply_gradients(state, grads, tx, batch_stats=batch_stats, extra=extra)
    if after_update is not None:
      state = after_update(state)
    if probe is not None:
      state = state.replace(probe=probe.update(state.probe, probe_grads))
    return state, {**metrics, **health}

  return train_step


MOMENTUM_SCHEDULES = ("constant", "cosine")


def ema_momentum(base: float, step, total_steps: int, schedule: str):
  """EMA momentum at optimizer step k: constant, or cosine-ramped to 1.

  'cosine' is BYOL's schedule (Grill et al. 2020, Sec. 3.2):
    tau_k = 1 - (1 - base) * (cos(pi k / K) + 1) / 2,
  so tau_0 = base and tau_K = 1. MoCo may use it too (m 0.99 -> 1).
  Returns a float32 scalar.
  """
  if schedule == "constant":
    return jnp.float32(base)
  progress = jnp.minimum(step, total_steps) / total_steps
  return 1.0 - (1.0 - base) * (jnp.cos(jnp.pi * progress) + 1.0) / 2.0


def ema_update(target, online, momentum):
  """target <- momentum * target + (1 - momentum) * online, on every leaf.

  MoCo's key encoder (He et al. 2019, Eq. 2) and BYOL's target network
  (Grill et al. 2020, Eq. 1). No gradient flows through it.
  """
  return jax.tree.map(
    lambda t, o: momentum * t + (1.0 - momentum) * jax.lax.stop_gradient(o), target, online
  )


def l2_normalize(x):
  """Rows of x [..., D] scaled to unit L2 norm (all-zero rows stay zero), in x's dtype."""
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def gather_global(x, axis_name):
  """Inside shard_map: (every device's rows of x concatenated in device order [B, ...],
  the index of this device's first row in them). With axis_name None: (x, 0)."""
  if axis_name is None:
    return x, 0
  return (jax.lax.all_gather(x, axis_name, tiled=True), jax.lax.axis_index(axis_name) * x.shape[0])


def build_model_with_predictor(config) -> heads.ContrastiveModel:
  """Encoder, projection head and predictor, every BN global over the data axis.

  BYOL's online network (Grill et al. 2020, Sec. 3.1) and MoCo v3's query
  network (Chen et al. 2021, Algorithm 1) have this shape.
  """
  return heads.ContrastiveModel(
    encoder=models.build_encoder(config.model, bn_axis_name=DATA_AXIS),
    projector=models.build_mlp(config.projector, config.model.dtype, DATA_AXIS),
    predictor=models.build_mlp(config.predictor, config.model.dtype, DATA_AXIS),
  )


def check_heads_with_predictor(config, why: str):
  """Raises ConfigError for a projector or predictor config that cannot be built, or a
  predictor whose output size is not the projector's (`why` says what needs them equal)."""
  models.check_mlp_config(config.projector, "projector")
  models.check_mlp_config(config.predictor, "predictor")
  if config.predictor.out_dim != config.projector.out_dim:
    raise ConfigError(
      "predictor.out_dim",
      config.predictor.out_dim,
      f"projector.out_dim ({config.projector.out_dim}): {why}",
    )

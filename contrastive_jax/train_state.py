"""The train state pytree and the pieces every method's train step shares.

Methods keep their loss and state update together in contrastive_jax/methods/;
this module holds what is the same for all of them: the state's common
fields, the device mesh, the two augmented views, and the optimizer update.
"""
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from contrastive_jax import augment

DATA_AXIS = "data"


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
  """
  step: jax.Array
  params: Any
  batch_stats: Any
  opt_state: Any
  rng: jax.Array
  extra: Any = flax.struct.field(default_factory=dict)


def make_mesh(devices=None) -> jax.sharding.Mesh:
  """A 1-D mesh, axis DATA_AXIS, over `devices` (default: every device of every process)."""
  devices = jax.devices() if devices is None else devices
  return jax.make_mesh((len(devices),), (DATA_AXIS,), devices=devices)


def init_variables(model, rng, image_size: int):
  """Initialises a Flax model on a [2, S, S, 3] float32 dummy batch.

  Returns (params, batch_stats).
  """
  variables = model.init(rng, jnp.zeros((2, image_size, image_size, 3), jnp.float32), train=False)
  return variables["params"], variables["batch_stats"]


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
  return tuple(augment.augment_batch(images[:, v], view_key(rng, step, device, v), views[v])
               for v in range(2))


# Independent random streams of a step: fold_in(fold_in(rng, step), stream).
_VIEW_STREAM, _SHUFFLE_STREAM = 0, 1


def view_key(rng, step, device_index, view_index):
  """The PRNG key of one view on one device at one step.

  A pure function of (rng, step, device, view), so that a resumed run draws the
  same augmentations and no two devices or views share a key.
  """
  key = jax.random.fold_in(jax.random.fold_in(rng, step), _VIEW_STREAM)
  return jax.random.fold_in(jax.random.fold_in(key, device_index), view_index)


def shuffle_key(rng, step):
  """The PRNG key of a step's batch permutation (MoCo's shuffle BN), same on every device."""
  return jax.random.fold_in(jax.random.fold_in(rng, step), _SHUFFLE_STREAM)


def apply_gradients(state: TrainState, grads, tx: optax.GradientTransformation, **changes):
  """One optimizer update; `changes` replace other state fields (batch_stats, extra)."""
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                       opt_state=opt_state, **changes)


def build_train_step(per_device, tx, mesh, after_update=None):
  """A method's train_step(state, batch) -> (state, metrics), to be jitted.

  Args:
    per_device: (state, images) -> (grads, batch_stats, extra, metrics), run
      inside shard_map on every device with the state replicated and
      images = this device's rows of batch['image'] (uint8 [b, 2, H, W, 3]).
      Its outputs must be the same on every device (psum/pmean inside).
    tx: the optimizer applied to the gradients, outside shard_map.
    after_update: optional state -> state run after the optimizer update
      (BYOL's target EMA, which uses the updated online parameters).
  """
  sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(jax.P(), jax.P(DATA_AXIS)),
                          out_specs=jax.P())

  def train_step(state, batch):
    grads, batch_stats, extra, metrics = sharded(state, batch["image"])
    state = apply_gradients(state, grads, tx, batch_stats=batch_stats, extra=extra)
    if after_update is not None:
      state = after_update(state)
    return state, metrics

  return train_step


def replicated(mesh):
  """The sharding of a value held whole on every device."""
  return jax.sharding.NamedSharding(mesh, jax.P())


def batch_sharded(mesh):
  """The sharding of a batch split along axis 0 over the data axis."""
  return jax.sharding.NamedSharding(mesh, jax.P(DATA_AXIS))


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
  return jax.tree.map(lambda t, o: momentum * t + (1.0 - momentum) * jax.lax.stop_gradient(o),
                      target, online)

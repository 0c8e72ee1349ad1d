"""MoCo v1/v2 (He et al. 2019, arXiv 1911.05722; Chen et al. 2020, arXiv 2003.04297).

A query encoder trained by gradient and a momentum (key) encoder, an EMA of it;
a queue of K L2-normalised keys of past global batches serves as negatives.
The key encoder, its BN statistics, the queue and the queue pointer live in
state.extra and are updated functionally each step (the state is donated, so
the queue is written in place). Shuffle BN: the key encoder's inputs are
permuted across the global batch before its forward pass and put back after,
so a key's BN statistics come from other samples than its query's.

BN is per BN group of moco.bn_group_size images, as the reference's per-GPU
BN (facebookresearch/moco: 8 GPUs x 32 images, so 32; its CIFAR-10 demo's
SplitBatchNorm: 8 splits of 64). How groups map to devices: row i of the
global batch (in device order) belongs to group i mod G, G = batch /
bn_group_size, so each of the D devices holds bn_group_size / D rows of every
group, and a group's statistics are averaged over the devices (BN with
axis_name inside a vmap over the G groups). The groups are thus the same
function of the global row whatever D divides bn_group_size (1 device gives
the same result as 8), and a group may span devices, which per-GPU BN cannot.
Queries are grouped in batch order (a fixed partition, as the reference's
per-GPU batches), keys in shuffled order (a random one). The running
statistics are the mean over groups (the reference keeps GPU 0's, copied to
the others by DistributedDataParallel).
"""

import jax
import jax.numpy as jnp

from contrastive_jax import models
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.methods import common
from contrastive_jax.models import heads


def info_nce(q, k, queue, temperature: float, axis_name=None):
  """InfoNCE loss with a queue of negatives (MoCo Eq. 1; Oord et al. 2018).

  logits [b, 1 + K] = [q.k+, q.queue^T] / t, label 0 for every row.

  Args:
    q: [b, D] queries (this device's rows); k: [b, D] their positive keys;
      both L2-normalised here, any float dtype.
    queue: [K, D] L2-normalised negative keys.
    temperature: t > 0.
    axis_name: mesh axis to average over, or None (inputs are the whole batch).
  Returns:
    (loss, top1): float32 scalars averaged over the global batch, the same on
    every device; top1 is the fraction of rows whose largest logit is the positive.
  """
  q = common.l2_normalize(q.astype(jnp.float32))
  k = common.l2_normalize(k.astype(jnp.float32))
  l_pos = jnp.sum(q * k, axis=1, keepdims=True)
  l_neg = jnp.matmul(q, queue.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
  logits = jnp.concatenate([l_pos, l_neg], axis=1) / temperature
  global_b = q.shape[0] * (1 if axis_name is None else jax.lax.axis_size(axis_name))
  loss = jnp.sum(jax.nn.logsumexp(logits, axis=1) - logits[:, 0]) / global_b
  top1 = jnp.sum(jnp.argmax(logits, axis=1) == 0) / global_b
  if axis_name is not None:
    loss, top1 = jax.lax.psum((loss, top1), axis_name)
  return loss, top1


def enqueue(queue, ptr, keys):
  """Ring-buffer write of keys [B, D] at ptr; returns (queue, (ptr + B) mod K).

  Requires K % B == 0 (checked in check_config): dynamic_update_slice clamps
  an out-of-range start and would silently overwrite the newest keys.
  """
  queue = jax.lax.dynamic_update_slice(queue, keys.astype(queue.dtype), (ptr, 0))
  return queue, (ptr + keys.shape[0]) % queue.shape[0]


def check_config(config, num_train_examples: int):
  """Raises ConfigError for MoCo fields that cannot run."""
  moco = config.moco
  if not config.temperature > 0:
    raise ConfigError("temperature", config.temperature, "> 0")
  if not 0.0 <= moco.momentum <= 1.0:
    raise ConfigError("moco.momentum", moco.momentum, "in [0, 1]")
  if moco.momentum_schedule not in common.MOMENTUM_SCHEDULES:
    raise ConfigError(
      "moco.momentum_schedule", moco.momentum_schedule, f"one of {list(common.MOMENTUM_SCHEDULES)}"
    )
  if moco.queue_size <= 0 or moco.queue_size % config.batch_size:
    raise ConfigError(
      "moco.queue_size",
      moco.queue_size,
      f"a positive multiple of batch_size ({config.batch_size}): each step "
      "writes one global batch of keys into the ring buffer",
    )
  if moco.queue_size > num_train_examples:
    raise ConfigError(
      "moco.queue_size",
      moco.queue_size,
      f"at most the train split's size ({num_train_examples}), or images "
      "meet their own keys as negatives",
    )
  size, devices = moco.bn_group_size, jax.device_count()
  if size < 2 or size % devices or config.batch_size % size or config.batch_size // size < 2:
    raise ConfigError(
      "moco.bn_group_size",
      size,
      f">= 2 images, a multiple of the device count ({devices}) that divides "
      f"batch_size ({config.batch_size}) into >= 2 groups (with one group "
      "shuffle BN does nothing)",
    )
  models.check_mlp_config(config.projector, "projector")


def build_model(config) -> heads.ContrastiveModel:
  """Encoder + head (v1: projector.hidden_dims = (); v2: MLP); BN statistics are averaged
  over the data axis, within each BN group of grouped_apply's vmap."""
  return heads.ContrastiveModel(
    encoder=models.build_encoder(config.model, bn_axis_name=mesh_lib.DATA_AXIS),
    projector=models.build_mlp(config.projector, config.model.dtype, mesh_lib.DATA_AXIS),
  )


def init_state(config, model, tx, init_rng, rng) -> common.TrainState:
  """Step 0: key encoder = query encoder; queue of random unit vectors; pointer 0."""
  params, batch_stats = common.init_variables(model, init_rng, config.image_size)
  queue = jax.random.normal(
    jax.random.fold_in(init_rng, 1), (config.moco.queue_size, config.projector.out_dim), jnp.float32
  )
  extra = {
    "key_params": params,
    "key_batch_stats": batch_stats,
    "queue": common.l2_normalize(queue),
    "queue_ptr": jnp.zeros((), jnp.int32),
  }
  return common.TrainState.create(
    params=params,
    tx=tx,
    rng=rng,
    batch_stats=batch_stats,
    extra=extra,
  )


def grouped_apply(model, params, batch_stats, x, groups: int):
  """Inside shard_map: train-mode forward with separate BN statistics per BN group.

  x: this device's [b, ...] rows; row r belongs to group r mod groups (with
  b a multiple of groups, that is global row i to group i mod groups). The
  model's BN averages over the data axis, so each group's statistics cover
  its rows on every device. Returns (h [b, C], z [b, D], new batch_stats, the
  mean over groups, the same on every device); h and z float32.
  """

  def one_group(xg):
    (h, z), updates = model.apply(
      {"params": params, "batch_stats": batch_stats}, xg, train=True, mutable=["batch_stats"]
    )
    return h, z, updates["batch_stats"]

  h, z, stats = jax.vmap(one_group, in_axes=1, out_axes=(1, 1, 0))(
    x.reshape(-1, groups, *x.shape[1:])
  )
  stats = jax.tree.map(lambda s: jnp.mean(s, axis=0), stats)
  return h.reshape(-1, h.shape[-1]), z.reshape(-1, z.shape[-1]), stats


def shuffle_rows(x, perm):
  """Inside shard_map: this device's rows of the global batch permuted by perm.

  x: this device's [b, ...] rows; perm: [B] permutation of the global batch,
  the same on every device. Device d gets global rows perm[d*b:(d+1)*b].
  """
  b = x.shape[0]
  rows = jax.lax.dynamic_slice_in_dim(perm, jax.lax.axis_index(mesh_lib.DATA_AXIS) * b, b)
  return jax.lax.all_gather(x, mesh_lib.DATA_AXIS, tiled=True)[rows]


def unshuffle_rows(y, perm):
  """Inverse of shuffle_rows: gathers every device's [b, ...] rows, returns [B, ...] in batch order.

  The result is typed invariant across devices (the same everywhere), so it
  can update the replicated queue.
  """
  gathered = jax.lax.all_gather(y, mesh_lib.DATA_AXIS, tiled=True, to="invarying")
  return gathered[jnp.argsort(perm)]


def make_train_step(config, model, tx, views, mesh, length: common.RunLength, probe=None):
  """Returns train_step(state, batch) -> (state, metrics), to be jitted.

  Per step: EMA of the key encoder from the current query encoder (MoCo
  Algorithm 1), keys under stop-gradient with shuffle BN, InfoNCE against the
  queue, then the global batch of keys is enqueued; the momentum follows
  moco.momentum_schedule over length.num_steps.
  """
  moco = config.moco
  groups = config.batch_size // moco.bn_group_size

  def per_device(state, images):
    x_q, x_k = common.augmented_views(images, state.rng, state.step, views)
    extra = state.extra
    momentum = common.ema_momentum(
      moco.momentum, state.step, length.num_steps, moco.momentum_schedule
    )
    key_params = common.ema_update(extra["key_params"], state.params, momentum)
    b = x_k.shape[0]
    perm = jax.random.permutation(
      common.shuffle_key(state.rng, state.step), b * jax.lax.axis_size(mesh_lib.DATA_AXIS)
    )
    # Shuffle BN: encode the keys in BN groups of other samples than their queries'.
    _, k_shuffled, key_stats = grouped_apply(
      model, key_params, extra["key_batch_stats"], shuffle_rows(x_k, perm), groups
    )
    k_all = jax.lax.stop_gradient(unshuffle_rows(common.l2_normalize(k_shuffled), perm))
    k = jax.lax.dynamic_slice_in_dim(k_all, jax.lax.axis_index(mesh_lib.DATA_AXIS) * b, b)

    def loss_fn(params):
      h, q, stats = grouped_apply(model, params, state.batch_stats, x_q, groups)
      loss, top1 = info_nce(q, k, extra["queue"], config.temperature, mesh_lib.DATA_AXIS)
      return loss, (stats, top1, {"h": h, "z": q})

    (loss, (stats, top1, outputs)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    queue, ptr = enqueue(extra["queue"], extra["queue_ptr"], k_all)
    new_extra = {
      "key_params": key_params,
      "key_batch_stats": key_stats,
      "queue": queue,
      "queue_ptr": ptr,
    }
    return (
      grads,
      stats,
      new_extra,
      {"loss": loss, "contrastive_top1": top1, "key_momentum": momentum},
      outputs,
    )

  return common.build_train_step(per_device, tx, mesh, probe=probe)

"""MoCo v3 (Chen, Xie and He 2021, arXiv 2104.02057; facebookresearch/moco-v3).

The query network is the encoder, a projection MLP and a prediction MLP; the
momentum network is the encoder and projection MLP, an EMA of the query
network's with a momentum ramped from moco.momentum to 1 by a cosine
(common.ema_momentum 'cosine'; main_moco.py --moco-m-cos), updated before the keys
are computed, as the reference does (builder.py forward). It and its BN
statistics live in state.extra; at step 0 it is a copy of the query network.
There is no queue: each view's queries are contrasted with the momentum keys of
the other view over the all-gathered global batch (Algorithm 1 of the paper),
the loss symmetrised and scaled by 2t (ctr(q1, k2) + ctr(q2, k1)).

Each view goes through its own forward pass (common.apply_per_view), so BN
statistics are per view; all BN is global (cross-device), as the reference
converts every BN to SyncBatchNorm. The MLP heads are configs
(projector, predictor): the reference's are Linear (no bias), BN, ReLU layers
of 4096 units; the projector ends with a Linear to 256 and a BN without affine
parameters (final_bn with final_bn_scale False), 3 layers for a ViT and 2 for
a ResNet; the predictor has 2 layers and ends with the bare Linear
(final_bias False) for a ResNet, with the Linear and a BN without affine
parameters for a ViT (builder.py: MoCo_ViT keeps _build_mlp's last_bn=True,
MoCo_ResNet passes False).
"""

import jax
import jax.numpy as jnp

from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.methods import common

_MOMENTUM_PARTS = ("encoder", "projector")
_MOCO_FIELDS = ("momentum", "momentum_schedule")


def contrastive_loss(q, k, temperature: float, axis_name=None):
  """InfoNCE of queries against the keys of the global batch, scaled by 2t (MoCo v3 Alg. 1).

  For query i of the global batch of B, with keys k_1..k_B,
    l_i = -log( exp(q_i.k_i / t) / sum_j exp(q_i.k_j / t) ),
  q and k L2-normalised; the loss is 2t times the mean of l_i, as the
  reference's ctr (CrossEntropyLoss * 2 * T), which keeps the gradient's scale
  about the same for every t. Inside shard_map with axis_name set, this
  device's b queries are compared with the all-gathered keys of every device,
  the positive's column offset by the device's position (common.gather_global).

  Args:
    q: [b, D] queries of this device's images; k: [b, D] their keys (the
      caller stops their gradient); any float dtype, computed in float32.
    temperature: t > 0.
    axis_name: mesh axis to gather over, or None (the inputs are the whole batch).
  Returns:
    (loss, top1): float32 scalars, the same on every device; top1 is the
    fraction of queries whose most similar key is their positive.
  """
  q = common.l2_normalize(q.astype(jnp.float32))
  k = common.l2_normalize(k.astype(jnp.float32))
  keys, offset = common.gather_global(k, axis_name)
  global_b = keys.shape[0]
  logits = jnp.matmul(q, keys.T, precision=jax.lax.Precision.HIGHEST) / temperature
  labels = offset + jnp.arange(q.shape[0])
  pos = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
  loss = 2 * temperature * jnp.sum(jax.nn.logsumexp(logits, axis=1) - pos) / global_b
  top1 = jnp.sum(jnp.argmax(logits, axis=1) == labels) / global_b
  if axis_name is not None:
    loss, top1 = jax.lax.psum((loss, top1), axis_name)
  return loss, top1


def check_config(config, num_train_examples: int):
  """Raises ConfigError for MoCo v3 fields that cannot run. Its only constraint on
  num_train_examples, B <= N, is the runner's (runner.steps_per_epoch)."""
  if not config.temperature > 0:
    raise ConfigError("temperature", config.temperature, "> 0")
  for field in config.moco:
    if field not in _MOCO_FIELDS:
      raise ConfigError(
        f"moco.{field}",
        config.moco[field],
        "absent for MoCo v3, which has no queue (the negatives are the other "
        "keys of the global batch) and global BN; its moco fields are "
        f"{list(_MOCO_FIELDS)}",
      )
  if not 0.0 <= config.moco.momentum <= 1.0:
    raise ConfigError("moco.momentum", config.moco.momentum, "in [0, 1]")
  if config.moco.momentum_schedule not in common.MOMENTUM_SCHEDULES:
    raise ConfigError(
      "moco.momentum_schedule",
      config.moco.momentum_schedule,
      f"one of {list(common.MOMENTUM_SCHEDULES)}",
    )
  common.check_heads_with_predictor(config, "queries and keys are compared")


# The query network: encoder, projector and predictor, all BN global over the data axis.
build_model = common.build_model_with_predictor


def _momentum_part(tree):
  """The encoder's and projector's entries of a params or batch_stats tree (a ViT
  encoder has no batch_stats entry)."""
  return {name: tree[name] for name in _MOMENTUM_PARTS if name in tree}


def init_state(config, model, tx, init_rng, rng) -> common.TrainState:
  """Step 0: the momentum network is a copy of the query network's encoder and projector
  (builder.py copies the parameters)."""
  params, batch_stats = common.init_variables(model, init_rng, config.image_size)
  extra = {"key_params": _momentum_part(params), "key_batch_stats": _momentum_part(batch_stats)}
  return common.TrainState.create(
    params=params,
    tx=tx,
    rng=rng,
    batch_stats=batch_stats,
    extra=extra,
  )


def make_train_step(config, model, tx, views, mesh, length: common.RunLength, probe=None):
  """Returns train_step(state, batch) -> (state, metrics), to be jitted.

  Per step k: momentum m_k (common.ema_momentum over length.num_steps), the momentum
  network's EMA from the current query network, keys of both views under
  stop-gradient, then the symmetrised contrastive_loss. Metrics add 'loss',
  'contrastive_top1' (the mean over both directions) and 'key_momentum'.
  """
  key_model = model.clone(predictor=None)

  def per_device(state, images):
    x1, x2 = common.augmented_views(images, state.rng, state.step, views)
    extra = state.extra
    momentum = common.ema_momentum(
      config.moco.momentum, state.step, length.num_steps, config.moco.momentum_schedule
    )
    key_params = common.ema_update(extra["key_params"], _momentum_part(state.params), momentum)
    (_, k1), (_, k2), key_stats = common.apply_per_view(
      key_model, key_params, extra["key_batch_stats"], x1, x2
    )
    k1, k2 = jax.lax.stop_gradient((k1, k2))

    def loss_fn(params):
      (h1, z1, q1), (_, _, q2), stats = common.apply_per_view(
        model, params, state.batch_stats, x1, x2
      )
      loss12, top1_12 = contrastive_loss(q1, k2, config.temperature, mesh_lib.DATA_AXIS)
      loss21, top1_21 = contrastive_loss(q2, k1, config.temperature, mesh_lib.DATA_AXIS)
      return loss12 + loss21, (stats, (top1_12 + top1_21) / 2, {"h": h1, "z": z1})

    (loss, (stats, top1, outputs)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_extra = {"key_params": key_params, "key_batch_stats": key_stats}
    return (
      grads,
      stats,
      new_extra,
      {"loss": loss, "contrastive_top1": top1, "key_momentum": momentum},
      outputs,
    )

  return common.build_train_step(per_device, tx, mesh, probe=probe)

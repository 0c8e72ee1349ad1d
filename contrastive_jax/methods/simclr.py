"""SimCLR (Chen et al. 2020, arXiv 2002.05709): NT-Xent over the global batch.

Both views go through one forward pass of the encoder and projection head with
global (cross-device) BatchNorm, as the reference concatenates them; each
device's anchors are compared with the all-gathered embeddings of every device,
so the negatives are the whole global batch. The projection head's last layer
is a Dense without bias followed by a BN without offset (projector.final_bn,
the reference's model_util.projection_head).
"""

import jax
import jax.numpy as jnp

from contrastive_jax import models
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.methods import common
from contrastive_jax.models import heads


def nt_xent(z1, z2, temperature: float, axis_name=None):
  """NT-Xent loss and contrastive top-1 accuracy (SimCLR Eq. 1).

  For anchor i with positive j among the 2B views of the global batch,
    l(i, j) = -log( exp(sim(z_i, z_j)/t) / sum_{k != i} exp(sim(z_i, z_k)/t) ),
  sim the cosine similarity; the k = i term is masked out of the denominator.
  The loss is the mean of l over the B view-1 anchors plus the mean over the
  B view-2 anchors, as the reference's objective.add_contrastive_loss returns
  loss_a + loss_b: twice the mean over all 2B anchors. The scale matters under
  LARS, whose trust ratio leaves out biases and BN parameters: their steps are
  proportional to it.

  Call it inside shard_map with axis_name set: this device's rows are compared
  with the all-gathered rows of every device, the positive's column offset by
  the device's position. With axis_name None the inputs are the whole batch.

  Args:
    z1, z2: [b, d] projections of view 1 and view 2 of this device's b images
      (row r of z1 and row r of z2 are the same image); any float dtype.
    temperature: t > 0.
    axis_name: mesh axis to gather over, or None.
  Returns:
    (loss, top1): float32 scalars, the same on every device. top1 is the
    fraction of the 2B anchors whose most similar other view is their positive.
  """
  z1 = z1.astype(jnp.float32)
  z2 = z2.astype(jnp.float32)
  z1 = common.l2_normalize(z1)
  z2 = common.l2_normalize(z2)
  b = z1.shape[0]
  all1, offset = common.gather_global(z1, axis_name)
  all2, _ = common.gather_global(z2, axis_name)
  global_b = all1.shape[0]
  anchors = jnp.concatenate([z1, z2])  # [2b, d]
  candidates = jnp.concatenate([all1, all2])  # [2B, d]
  # HIGHEST keeps the similarities in true float32 on TPU/GPU (their default
  # float32 matmul rounds inputs to bfloat16).
  logits = jnp.matmul(anchors, candidates.T, precision=jax.lax.Precision.HIGHEST) / temperature
  rows = jnp.arange(b)
  self_col = jnp.concatenate([offset + rows, global_b + offset + rows])
  pos_col = jnp.concatenate([global_b + offset + rows, offset + rows])
  cols = jnp.arange(2 * global_b)
  logits = jnp.where(cols[None, :] == self_col[:, None], -jnp.inf, logits)
  pos_logit = jnp.take_along_axis(logits, pos_col[:, None], axis=1)[:, 0]
  loss = jnp.sum(jax.nn.logsumexp(logits, axis=1) - pos_logit) / global_b
  top1 = jnp.sum(jnp.argmax(logits, axis=1) == pos_col) / (2 * global_b)
  if axis_name is not None:
    loss, top1 = jax.lax.psum((loss, top1), axis_name)
  return loss, top1


def check_config(config, num_train_examples: int):
  """Raises ConfigError for SimCLR fields that cannot run. SimCLR's only constraint on
  num_train_examples, B <= N, is the runner's (runner.steps_per_epoch)."""
  if not config.temperature > 0:
    raise ConfigError("temperature", config.temperature, "> 0")
  models.check_mlp_config(config.projector, "projector")


def build_model(config) -> heads.ContrastiveModel:
  """Encoder + projection head, both with global BN over the data axis."""
  return heads.ContrastiveModel(
    encoder=models.build_encoder(config.model, bn_axis_name=mesh_lib.DATA_AXIS),
    projector=models.build_mlp(config.projector, config.model.dtype, mesh_lib.DATA_AXIS),
  )


def init_state(config, model, tx, init_rng, rng) -> common.TrainState:
  """The state at step 0: parameters drawn with init_rng; rng is the base key."""
  params, batch_stats = common.init_variables(model, init_rng, config.image_size)
  return common.TrainState.create(
    params=params,
    tx=tx,
    rng=rng,
    batch_stats=batch_stats,
  )


def make_train_step(config, model, tx, views, mesh, length: common.RunLength, probe=None):
  """Returns train_step(state, batch) -> (state, metrics), to be jitted.

  batch['image'] is uint8 [B, 2, H, W, 3] sharded over the data axis; metrics
  add float32 scalars 'loss' and 'contrastive_top1' to common.build_train_step's.
  The step does not depend on the run's length: SimCLR has no schedule besides the
  optimizer's.
  """

  def per_device(state, images):
    x1, x2 = common.augmented_views(images, state.rng, state.step, views)

    def loss_fn(params):
      (h, z), updates = model.apply(
        {"params": params, "batch_stats": state.batch_stats},
        jnp.concatenate([x1, x2]),
        train=True,
        mutable=["batch_stats"],
      )
      z1, z2 = jnp.split(z, 2)
      loss, top1 = nt_xent(z1, z2, config.temperature, mesh_lib.DATA_AXIS)
      return loss, (updates["batch_stats"], top1, {"h": h[: len(x1)], "z": z1})

    (loss, (new_stats, top1, outputs)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.params
    )
    return grads, new_stats, state.extra, {"loss": loss, "contrastive_top1": top1}, outputs

  return common.build_train_step(per_device, tx, mesh, probe=probe)

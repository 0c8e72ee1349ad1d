"""DINO (Caron et al. 2021, arXiv 2104.14294; facebookresearch/dino main_dino.py).

Self-distillation without labels: a student network (encoder and heads.DINOHead)
learns to match the output distribution of a teacher network of the same
architecture, an EMA of the student with a momentum ramped from
dino.momentum_teacher to 1 by a cosine (common.ema_momentum 'cosine', the
reference's momentum_schedule), taken after the optimizer step and never
differentiated. The teacher starts as a copy of the student (the reference's
load_state_dict); its parameters and BN statistics live in state.extra with
the centre c [out_dim], an EMA (dino.center_momentum) of the teacher's mean
output over the global batch (DINOLoss.update_center).

The loss (Sec. 3.1, Eq. 2-3; DINOLoss.forward): for each global view a, the
teacher's centred and sharpened distribution P_t(a) = softmax((g_t(a) - c) / tau_t)
against the student's log-distribution log P_s(v) = log_softmax(g_s(v) / tau_s)
of every other view v != a, the cross-entropy averaged over the batch, then
over those pairs. The student temperature tau_s is dino.student_temp; tau_t
follows teacher_temperature (a linear warm-up by epochs, then constant).

Views: the two global views of the method contract (batch 'image' [B, 2, S, S,
3]) and, with config.local_crops (multi-crop), N local views of s pixels (batch
'local_image' [B, N, s, s, 3], augmented with config.augment.local). The teacher
sees the global views only, the student all of them. As the reference's
MultiCropWrapper, the views of one size go through each network in one forward
pass (the rows of view 1, then of view 2, ...), so BN statistics are over all
views of one size of the global batch (every BN global over the data axis, as
the reference's SyncBatchNorm). (The reference runs its head once on the
features of all sizes together; here each size's pass runs the head too, which
differs only for a head with BN, off by default.) A ViT sees the local views on
their own grid of patches: its learned position embedding interpolated to it as
the reference's interpolate_pos_encoding (models/vit.py), or the sin-cos table
of that grid.

Stochastic depth (dino.drop_path_rate, the reference's --drop_path_rate 0.1): a ViT
student's residual branches are dropped per sample in training (models/vit.py
drop_path, block i at rate * i / (depth - 1)), with keys of common.drop_path_key; the
teacher never drops, as the reference builds it without.

Health scalars (the paper's Sec. 5.3 and Fig. 7 analysis of collapse):
'teacher_entropy', the mean entropy of P_t (log out_dim at uniform collapse, 0
at one-hot collapse); 'teacher_student_kl', the mean KL(P_t || P_s) over the
loss's pairs (near 0 at either collapse); 'center_norm', ||c|| after the update.
"""

from absl import logging
import jax
import jax.numpy as jnp

from contrastive_jax import models
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import WeightsError
from contrastive_jax.data import augment
from contrastive_jax.methods import common
from contrastive_jax.models import heads
from contrastive_jax.models import state_dicts

_DINO_FIELDS = (
  "out_dim",
  "hidden_dim",
  "bottleneck_dim",
  "num_layers",
  "use_bn_in_head",
  "norm_last_layer",
  "momentum_teacher",
  "student_temp",
  "warmup_teacher_temp",
  "teacher_temp",
  "warmup_teacher_temp_epochs",
  "center_momentum",
  "drop_path_rate",
)
# Multi-crop's local views are this method's: the pretraining job refuses them for others.
LOCAL_CROPS = True
# Above this teacher temperature the reference reports unstable training (main_dino.py,
# --teacher_temp's help: "anything above 0.07 is unstable").
STABLE_TEACHER_TEMP = 0.07


def dino_loss(student_out, teacher_out, center, student_temp, teacher_temp, axis_name=None):
  """DINO's cross-entropy between teacher and student views (DINOLoss.forward).

  With P_t(a) = softmax((teacher_out[a] - center) / teacher_temp) (no gradient) and
  log P_s(v) = log_softmax(student_out[v] / student_temp), the loss is
    1/|pairs| sum_{a < G, v < V, v != a} mean_rows( -sum_k P_t(a)_k log P_s(v)_k ),
  the views a of the teacher being the first G of the student's (the global views).
  Inside shard_map with axis_name set, the row means are over the global batch.

  Args:
    student_out: float [V, b, K] student logits, V views (V >= 2).
    teacher_out: float [G, b, K] teacher logits of the first G views (G <= V).
    center: float32 [K], the centre c.
    student_temp, teacher_temp: temperatures > 0 (teacher_temp may be a traced scalar).
    axis_name: mesh axis to average over, or None.
  Returns:
    (loss, teacher_entropy): float32 scalars; teacher_entropy is the mean over
    the global batch and the G teacher views of H(P_t(a)) (each view a is in
    V - 1 pairs, so it is also the mean over the pairs, and loss - teacher_entropy
    is the pairs' mean KL(P_t || P_s)).
  """
  teacher_out = jax.lax.stop_gradient(teacher_out.astype(jnp.float32))
  log_q = jax.nn.log_softmax((teacher_out - center) / teacher_temp, axis=-1)
  q = jnp.exp(log_q)
  log_p = jax.nn.log_softmax(student_out.astype(jnp.float32) / student_temp, axis=-1)
  num_global, num_views = teacher_out.shape[0], student_out.shape[0]
  # cross[a, v] = mean over rows of -sum_k q[a] log_p[v].
  cross = -jnp.einsum("abk,vbk->av", q, log_p, precision=jax.lax.Precision.HIGHEST)
  cross = cross / q.shape[1]
  pairs = (
    jnp.ones((num_global, num_views)).at[jnp.arange(num_global), jnp.arange(num_global)].set(0)
  )
  loss = jnp.sum(cross * pairs) / jnp.sum(pairs)
  entropy = -jnp.mean(jnp.sum(q * log_q, axis=-1))
  if axis_name is not None:
    loss, entropy = jax.lax.pmean((loss, entropy), axis_name)
  return loss, entropy


def update_center(center, teacher_out, momentum: float, axis_name=None):
  """c <- m c + (1 - m) mean(teacher_out) (DINO Eq. 4; DINOLoss.update_center).

  The mean is over every row of every view of the global batch (the reference
  all-reduces the sum of its teacher outputs, both global views, and divides by
  their number). center: float32 [K]; teacher_out: float [G, b, K]; returns
  float32 [K], the same on every device.
  """
  teacher_out = jax.lax.stop_gradient(teacher_out.astype(jnp.float32))
  batch_center = jnp.mean(teacher_out, axis=(0, 1))
  if axis_name is not None:
    batch_center = jax.lax.pmean(batch_center, axis_name)
  return center * momentum + batch_center * (1.0 - momentum)


def teacher_temperature(cfg, step, steps_per_epoch: int):
  """tau_t at optimizer step `step` (DINOLoss.teacher_temp_schedule indexed by epoch).

  For epoch e = step // steps_per_epoch and W = warmup_teacher_temp_epochs:
  np.linspace(warmup_teacher_temp, teacher_temp, W)[e] while e < W, then
  teacher_temp. Returns a float32 scalar.
  """
  start, end, warmup = cfg.warmup_teacher_temp, cfg.teacher_temp, cfg.warmup_teacher_temp_epochs
  epoch = step // steps_per_epoch
  if warmup == 0:
    return jnp.float32(end)
  ramp = start + (end - start) * epoch / max(warmup - 1, 1)
  return jnp.where(epoch < warmup, ramp, end).astype(jnp.float32)


def check_config(config, num_train_examples: int):
  """Raises ConfigError for DINO fields that cannot run; logs one warning line for a
  teacher temperature above STABLE_TEACHER_TEMP (allowed, as the reference allows it).
  DINO's only constraint on num_train_examples, B <= N, is the runner's
  (runner.steps_per_epoch)."""
  for field in config.dino:
    if field not in _DINO_FIELDS:
      raise ConfigError(
        f"dino.{field}", config.dino[field], f"absent: DINO's fields are {list(_DINO_FIELDS)}"
      )
  cfg = config.dino
  for field in ("out_dim", "hidden_dim", "bottleneck_dim", "num_layers"):
    if not isinstance(cfg[field], int) or cfg[field] <= 0:
      raise ConfigError(f"dino.{field}", cfg[field], "an integer > 0")
  for field in ("student_temp", "warmup_teacher_temp", "teacher_temp"):
    if not cfg[field] > 0:
      raise ConfigError(f"dino.{field}", cfg[field], "> 0")
  for field in ("use_bn_in_head", "norm_last_layer"):
    if not isinstance(cfg[field], bool):
      raise ConfigError(f"dino.{field}", cfg[field], "True or False")
  for field in ("momentum_teacher", "center_momentum"):
    if not 0.0 <= cfg[field] <= 1.0:
      raise ConfigError(f"dino.{field}", cfg[field], "in [0, 1]")
  if not isinstance(cfg.drop_path_rate, float) or not 0.0 <= cfg.drop_path_rate < 1.0:
    raise ConfigError("dino.drop_path_rate", cfg.drop_path_rate, "a float in [0, 1)")
  if cfg.drop_path_rate and models.family(config.model) != "vit":
    raise ConfigError(
      "dino.drop_path_rate",
      cfg.drop_path_rate,
      f"0.0 for a {config.model.name}: stochastic depth drops a ViT's residual branches",
    )
  if not isinstance(cfg.warmup_teacher_temp_epochs, int) or cfg.warmup_teacher_temp_epochs < 0:
    raise ConfigError(
      "dino.warmup_teacher_temp_epochs", cfg.warmup_teacher_temp_epochs, "an integer >= 0"
    )
  local = config.get("local_crops")
  if local is not None:
    if "local" not in config.augment:
      raise ConfigError("augment.local", None, "the local views' augmentation (local_crops)")
    patch = config.model.get("patch_size")
    if patch and local.size % patch:
      raise ConfigError("local_crops.size", local.size, f"a multiple of model.patch_size ({patch})")
  if max(cfg.teacher_temp, cfg.warmup_teacher_temp) > STABLE_TEACHER_TEMP:
    logging.warning(
      "config.dino.teacher_temp=%s: above %s, where the DINO reference reports unstable "
      "training (main_dino.py --teacher_temp)",
      max(cfg.teacher_temp, cfg.warmup_teacher_temp),
      STABLE_TEACHER_TEMP,
    )


def build_model(config) -> heads.ContrastiveModel:
  """The student: the encoder and heads.DINOHead (config.dino), every BN global; a ViT
  with stochastic depth dino.drop_path_rate (its apply in training then needs a
  'drop_path' rng)."""
  return _network(config, config.dino.drop_path_rate)


def _network(config, drop_path_rate: float) -> heads.ContrastiveModel:
  encoder = models.build_encoder(config.model, bn_axis_name=mesh_lib.DATA_AXIS)
  if drop_path_rate:
    encoder = encoder.clone(drop_path_rate=drop_path_rate)
  return heads.ContrastiveModel(encoder=encoder, projector=_head(config))


def _head(config) -> heads.DINOHead:
  cfg = config.dino
  return heads.DINOHead(
    cfg.out_dim,
    hidden_dim=cfg.hidden_dim,
    bottleneck_dim=cfg.bottleneck_dim,
    num_layers=cfg.num_layers,
    use_bn=cfg.use_bn_in_head,
    norm_last_layer=cfg.norm_last_layer,
    dtype=models.common.DTYPES[config.model.dtype],
    bn_axis_name=mesh_lib.DATA_AXIS,
  )


def init_state(config, model, tx, init_rng, rng) -> common.TrainState:
  """Step 0: the teacher a copy of the student, the centre zeros [out_dim]."""
  params, batch_stats = common.init_variables(model, init_rng, config.image_size)
  extra = {
    "teacher_params": params,
    "teacher_batch_stats": batch_stats,
    "center": jnp.zeros((config.dino.out_dim,), jnp.float32),
  }
  return common.TrainState.create(
    params=params,
    tx=tx,
    rng=rng,
    batch_stats=batch_stats,
    extra=extra,
  )


def imported_state(entries, path: str, config):
  """What a run continued from DINO's own checkpoint starts from, or None for a file
  that is not one.

  entries: tensor_files.read_entries of the file. A main_dino.py checkpoint holds
  'student' and 'teacher' (MultiCropWrapper state dicts: backbone and DINO head) and
  'dino_loss' (the centre, [1, out_dim]); the run then starts its student and teacher,
  encoders and heads, from them, and its centre from the file's (with_imported). Its
  optimizer state, epoch and schedules are not read: the run's own start afresh.

  Returns:
    None (no 'student' and 'teacher' entries), or {'student', 'teacher'}: each
    {'params', 'batch_stats'} of {'encoder', 'projector'}, and 'center' float32
    [out_dim], numpy.
  Raises:
    WeightsError: a network that does not fit config.model and config.dino
      (state_dicts.dino_network_from_state_dict), no centre or one of another size.
  """
  if "student" not in entries or "teacher" not in entries:
    return None
  head = _head(config)
  networks = {
    name: state_dicts.dino_network_from_state_dict(
      entries[name], f"{path} ({name})", config.model, head, config.image_size
    )
    for name in ("student", "teacher")
  }
  center = entries.get("dino_loss", {}).get("center")
  if center is None or center.size != config.dino.out_dim:
    shape = "none" if center is None else f"shape {list(center.shape)}"
    raise WeightsError(
      path, f"dino_loss.center: {shape} where config.dino.out_dim needs [1, {config.dino.out_dim}]"
    )
  return dict(networks, center=center.reshape(-1).astype("float32"))


def with_imported(state, imported):
  """state with its student, teacher and centre those of imported_state.

  Raises:
    ValueError: imported not shaped like the state.
  """
  student, teacher = imported["student"], imported["teacher"]
  extra = dict(
    state.extra,
    teacher_params=teacher["params"],
    teacher_batch_stats=teacher["batch_stats"],
    center=imported["center"],
  )
  new = state.replace(params=student["params"], batch_stats=student["batch_stats"], extra=extra)
  if jax.tree.structure(new) != jax.tree.structure(state):
    raise ValueError("the imported networks are not shaped like the state's")
  return new


# The teacher's encoder: what the DINO paper evaluates (Sec. 4; eval_knn.py's and
# eval_linear.py's default --checkpoint_key teacher). The contract: methods.OptionalAttributes.
EVALUATED_ENCODER = (
  ("extra", "teacher_params", "encoder"),
  ("extra", "teacher_batch_stats", "encoder"),
)


def make_train_step(config, model, tx, views, mesh, length: common.RunLength, probe=None):
  """Returns train_step(state, batch) -> (state, metrics), to be jitted.

  Per step k: the teacher's outputs of both views (train mode, its own BN
  statistics), the student's, the loss at tau_t of k's epoch (length.steps_per_epoch
  optimizer steps an epoch), the centre's update with the teacher's outputs,
  the optimizer step, then the teacher's EMA with momentum m_k
  (common.ema_momentum 'cosine' over length.num_steps) from the updated student.
  Metrics add 'loss', the health scalars of the module docstring,
  'teacher_temp' and 'teacher_momentum'.
  """
  cfg = config.dino
  axis = mesh_lib.DATA_AXIS
  multi_crop = config.get("local_crops") is not None
  local_view = (
    augment.ViewAugment.from_config(config.augment.local, "augment.local") if multi_crop else None
  )

  # The reference's teacher has no stochastic depth (built without --drop_path_rate).
  teacher_model = _network(config, 0.0)

  def forward(network, network_params, batch_stats, x, drop_path_key=None):
    (h, out), updates = network.apply(
      {"params": network_params, "batch_stats": batch_stats},
      x,
      train=True,
      mutable=["batch_stats"],
      rngs=None if drop_path_key is None else {"drop_path": drop_path_key},
    )
    return h, out, updates["batch_stats"]

  def per_device(state, images, local_images=None):
    x1, x2 = common.augmented_views(images, state.rng, state.step, views)
    b = x1.shape[0]
    x = jnp.concatenate([x1, x2])
    if multi_crop:
      local = common.augmented_local_views(local_images, state.rng, state.step, local_view)
      local = local.reshape((-1,) + local.shape[2:])  # [N b, s, s, 3], view-major.
    extra = state.extra
    _, teacher_out, teacher_stats = forward(
      teacher_model, extra["teacher_params"], extra["teacher_batch_stats"], x
    )
    teacher_out = jax.lax.stop_gradient(teacher_out).reshape(2, b, -1)
    temp = teacher_temperature(cfg, state.step, length.steps_per_epoch)

    drop_keys = [
      common.drop_path_key(state.rng, state.step, i) if cfg.drop_path_rate else None
      for i in range(2)
    ]

    def loss_fn(params):
      h, student_out, stats = forward(model, params, state.batch_stats, x, drop_keys[0])
      if multi_crop:
        _, local_out, stats = forward(model, params, stats, local, drop_keys[1])
        student_out = jnp.concatenate([student_out, local_out])
      student_out = student_out.reshape(-1, b, student_out.shape[-1])
      loss, entropy = dino_loss(
        student_out, teacher_out, extra["center"], cfg.student_temp, temp, axis
      )
      return loss, (stats, entropy, {"h": h[:b], "z": student_out[0]})

    (loss, (stats, entropy, outputs)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.params
    )
    center = update_center(extra["center"], teacher_out, cfg.center_momentum, axis)
    new_extra = dict(extra, teacher_batch_stats=teacher_stats, center=center)
    metrics = {
      "loss": loss,
      "teacher_entropy": entropy,
      "teacher_student_kl": loss - entropy,
      "center_norm": jnp.linalg.norm(center),
      "teacher_temp": temp,
      "teacher_momentum": common.ema_momentum(
        cfg.momentum_teacher, state.step, length.num_steps, "cosine"
      ),
    }
    return grads, stats, new_extra, metrics, outputs

  def update_teacher(state):
    momentum = common.ema_momentum(cfg.momentum_teacher, state.step - 1, length.num_steps, "cosine")
    teacher = common.ema_update(state.extra["teacher_params"], state.params, momentum)
    return state.replace(extra=dict(state.extra, teacher_params=teacher))

  return common.build_train_step(
    per_device, tx, mesh, after_update=update_teacher, probe=probe, local_views=multi_crop
  )

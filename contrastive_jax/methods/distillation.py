"""Distillation from a frozen teacher: LightlyTrain's distillation v1, v2 and v3.

The losses as lightly-ai/lightly-train defines them (src/lightly_train/_methods/
distillation*/: distillation_loss.py, distillationv2_loss.py, distillationv3_loss.py, and
the methods' training steps beside them), with one image view mixed up with a permutation
of its batch (each method's _mixup_data: x <- l x + (1 - l) x[perm], l ~ U(0, 1) once per
step):

  v1 'v1': queue_kl. The teacher's global embedding t and the student's projected one s,
      both L2-normalised, are compared with a queue Q of the teacher's embeddings of the
      latest images (the current batch written in before the loss): KL(softmax(t Q^T / T) ||
      softmax(s Q^T / T)), T = 0.07, summed over the queue and averaged over the images
      (torch's KLDivLoss(reduction='batchmean')).
  v2 'v2': patch_mse. The teacher's patch tokens of its last n blocks (n 2, each through
      the final norm as DINOv2's get_intermediate_layers, concatenated along channels) and
      the student's spatial features through a linear projection, resized bilinearly to
      the teacher's grid: their mean squared difference over every element (MSELoss).
  v3 'v3': v1's global term plus local_weight x patch_similarity_kl: per image, the
      teacher's and the student's L2-normalised patch features give patch-to-patch
      similarity maps [M, M]; the KL between their softmaxes at T_local = 0.07, summed
      over each row and averaged over the B x M rows.

The teacher (models.build_encoder of its model config, computing in bfloat16 with float32
weights) runs inside the same jitted step and shard_map as the student, under
stop_gradient: its variables are read once by pretraining.setup (load_teacher: a weights
file through models/state_dicts.py, as the downstream jobs read one, the evaluated
encoder of a pretraining workdir of this package, or the fine-tuned encoder of a
fine-tuning workdir) and replicated on the mesh. They are an
argument of the jitted step and an input of its shard_map (common.build_train_step's
frozen), so that the executable takes them as parameters: a closed-over array would be a
constant of the program, the whole teacher in its HLO.
They are not part of the TrainState, so no checkpoint holds them; the run records what it
read (config.distill.teacher_sha256 of a weights file, teacher_step of a workdir's
checkpoint) when it starts (recorded_config), and a resumed run whose file changed stops
with the resume check's line naming that field. Why re-read rather than save once: a
ViT-L teacher is 1.2 GB, which a copy in every workdir would double, while a changed file
is caught by its digest before any compute.

Where this departs from the reference, and why:
  - The queue holds the global batch's embeddings (all-gathered in device order) and the
    mix-up permutes the global batch, not each GPU's own (the reference's DDP keeps a queue
    per GPU and mixes within it): so that the step is the same function of the global batch
    on any number of devices. It is a ring buffer (the oldest keys overwritten), where
    the reference shifts the queue; the loss sums over the queue, so the order of its
    rows does not change it.
  - The host pipeline's two crops arrive; only the first is used (augmented with view 1's
    settings).
  - A ResNet student's BN statistics are the global batch's (the reference's DDP: each
    GPU's), for the same reason.

The student is any encoder of the registry; its spatial features are a ViT's patch tokens
(after its final norm) or a ResNet's last block's output map. The projection heads are
linear with a normal(0.02) kernel (the reference's trunc_normal_(std=0.02), whose cut at
+-2 in absolute value is 100 standard deviations: a normal); their bias PyTorch's nn.Linear
default (v1, v3) or zero (v2's head).
"""

import hashlib
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.scipy.special import xlogy

from contrastive_jax import models
from contrastive_jax.core import checkpointing
from contrastive_jax.core import files
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import tensor_files
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.data import augment
from contrastive_jax.methods import common
from contrastive_jax.models import heads
from contrastive_jax.models import resnet
from contrastive_jax.models import state_dicts
from contrastive_jax.models import vit
from contrastive_jax.models.common import DTYPES

LOSSES = ("v1", "v2", "v3")
LOCAL_PROJECTOR = "local_projector"

# The reference's queue size for a train split of n images (DistillationArgs.resolve_auto,
# about half of the smallest and a quarter of the largest split of each bucket): the size of
# the first (limit, size) with n < limit, as its _scaling.get_bucket_value reads them.
QUEUE_BUCKETS = (
  (50, 16),
  (100, 32),
  (250, 64),
  (500, 128),
  (1_000, 256),
  (2_000, 512),
  (4_000, 1024),
  (10_000, 2048),
  (20_000, 4096),
  (float("inf"), 8192),
)


def reference_queue_size(num_train_examples: int) -> int:
  """The reference's default queue size for a train split of num_train_examples images."""
  return next(size for limit, size in QUEUE_BUCKETS if num_train_examples < limit)


# ---------------------------------------------------------------------------------------
# Losses (float32; inputs of any float dtype).


def _kl_rows(teacher_logits, student_logits):
  """sum over the last axis of KL(softmax(teacher) || softmax(student)), float32 [...]:
  torch's KLDivLoss(log_softmax(student), softmax(teacher)) before its reduction (0 log 0
  = 0)."""
  p = jax.nn.softmax(teacher_logits, axis=-1)
  return jnp.sum(xlogy(p, p) - p * jax.nn.log_softmax(student_logits, axis=-1), axis=-1)


def _global_count(n: int, axis_name):
  return n * (1 if axis_name is None else jax.lax.axis_size(axis_name))


def queue_kl(student, teacher, queue, temperature: float, axis_name=None):
  """Distillation v1's loss, v3's global term (distillation_loss.py DistillationLoss).

  Args:
    student, teacher: [b, D] L2-normalised embeddings of this device's images.
    queue: [K, D] L2-normalised teacher embeddings (the current global batch's among them).
    temperature: T > 0.
    axis_name: the mesh axis of the global batch, or None.
  Returns:
    float32 scalar: sum_k p_t (log p_t - log p_s) averaged over the global batch, p = the
    softmax of the similarities to the queue over T; the same on every device.
  """
  queue = queue.astype(jnp.float32)
  hi = jax.lax.Precision.HIGHEST
  s = jnp.matmul(student.astype(jnp.float32), queue.T, precision=hi) / temperature
  t = jnp.matmul(teacher.astype(jnp.float32), queue.T, precision=hi) / temperature
  loss = jnp.sum(_kl_rows(t, s)) / _global_count(student.shape[0], axis_name)
  return loss if axis_name is None else jax.lax.psum(loss, axis_name)


def patch_mse(student, teacher, axis_name=None):
  """Distillation v2's loss (distillationv2_loss.py: MSELoss), float32 scalar.

  student, teacher: [b, M, D] patch features of this device's images on the teacher's grid;
  the mean of the squared differences over the global batch's B x M x D elements.
  """
  d = student.astype(jnp.float32) - teacher.astype(jnp.float32)
  loss = jnp.sum(jnp.square(d)) / _global_count(d.size, axis_name)
  return loss if axis_name is None else jax.lax.psum(loss, axis_name)


def patch_similarity_kl(student, teacher, temperature: float, axis_name=None):
  """Distillation v3's local term (distillationv3_loss.py), float32 scalar.

  student, teacher: [b, M, D] L2-normalised patch features on the teacher's grid. Per image
  the [M, M] patch-to-patch similarities over T; the KL of each row's softmaxes (teacher ||
  student), summed over the row, averaged over the global batch's B x M rows
  (KLDivLoss 'batchmean' of the [B M, M] flattened maps).
  """
  hi = jax.lax.Precision.HIGHEST
  s, t = student.astype(jnp.float32), teacher.astype(jnp.float32)
  s = jnp.einsum("bmd,bnd->bmn", s, s, precision=hi) / temperature
  t = jnp.einsum("bmd,bnd->bmn", t, t, precision=hi) / temperature
  loss = jnp.sum(_kl_rows(t, s)) / _global_count(s.shape[0] * s.shape[1], axis_name)
  return loss if axis_name is None else jax.lax.psum(loss, axis_name)


def enqueue(queue, ptr, keys):
  """Ring-buffer write of the global batch's keys [B, D]; returns (queue, pointer).

  B < K: rows ptr, ..., ptr + B - 1 (mod K) take the keys, the pointer moves by B. B >= K:
  the queue is the first K keys (the reference's _update_queue), the pointer 0.
  """
  b, k = keys.shape[0], queue.shape[0]
  if b >= k:
    return keys[:k].astype(queue.dtype), jnp.zeros((), jnp.int32)
  rows = (ptr + jnp.arange(b)) % k
  return queue.at[rows].set(keys.astype(queue.dtype)), (ptr + b) % k


def mixup(x, key, axis_name=None):
  """The reference's _mixup_data over the global batch: l x + (1 - l) x[perm].

  x: this device's [b, ...] float images inside shard_map (or the whole batch with
  axis_name None); key: the same on every device. l ~ U(0, 1) and perm, a permutation
  of the global batch, are drawn from it. Returns this device's b mixed rows.
  """
  lam = jax.random.uniform(jax.random.fold_in(key, 0))
  everyone, first = common.gather_global(x, axis_name)
  perm = jax.random.permutation(jax.random.fold_in(key, 1), everyone.shape[0])
  partners = everyone[jax.lax.dynamic_slice_in_dim(perm, first, x.shape[0])]
  return lam * x + (1.0 - lam) * partners


def resize_to_grid(x, grid):
  """Bilinear resize of [b, h, w, D] to [b, grid[0], grid[1], D] without antialiasing:
  torch's F.interpolate(mode='bilinear', align_corners=False), as the reference resizes the
  student's map (half-pixel centres, two taps per axis, also when shrinking)."""
  if tuple(x.shape[1:3]) == tuple(grid):
    return x
  return jax.image.resize(
    x, (x.shape[0], *grid, x.shape[-1]), method="bilinear", antialias=False
  ).astype(x.dtype)


# ---------------------------------------------------------------------------------------
# Networks: spatial features of the registry's encoders, the heads.


def _last_block_name(encoder) -> str:
  """The Flax name of a ResNet's last residual block (auto-named by class and order)."""
  block_type, stage_sizes = encoder.depth_spec
  cls = resnet.BasicBlock if block_type == "basic" else resnet.BottleneckBlock
  return f"{cls.__name__}_{sum(stage_sizes) - 1}"


def _capture(encoder, blocks: int):
  """capture_intermediates filter: a ResNet's last block, or a ViT's last `blocks` blocks."""
  if isinstance(encoder, vit.ViT):
    names = {f"block{i}" for i in range(encoder.depth - blocks, encoder.depth)}
  else:
    names = {_last_block_name(encoder)}
  return lambda module, method: method == "__call__" and module.name in names


def _vit_grid(tokens, encoder):
  """[N, n, D] patch tokens (row-major) as [N, g, g, D]."""
  g = int(round(tokens.shape[1] ** 0.5))
  return tokens.reshape(tokens.shape[0], g, g, tokens.shape[-1])


def spatial_features(encoder, intermediates, encoder_params, blocks: int = 1):
  """The encoder's spatial features [N, h, w, C'] float32 from an apply's intermediates.

  intermediates: the encoder's collection of an apply with mutable 'intermediates' and
  capture_intermediates=_capture(encoder, blocks). A ViT: its patch tokens, each of the last
  `blocks` blocks' outputs through the final LayerNorm (DINOv2's get_intermediate_layers,
  norm=True; blocks 1: the tokens the ViT sows), registers and class token left out,
  concatenated along channels (C' = blocks x D). A ResNet: its last block's output (blocks
  must be 1).
  """
  if not isinstance(encoder, vit.ViT):
    return intermediates[_last_block_name(encoder)]["__call__"][0].astype(jnp.float32)
  if blocks == 1:
    return _vit_grid(intermediates["tokens"][0][:, 1:], encoder)
  norm = nn.LayerNorm(epsilon=vit.LN_EPSILON, dtype=encoder.dtype)
  maps = []
  for i in range(encoder.depth - blocks, encoder.depth):
    x = intermediates[f"block{i}"]["__call__"][0]
    x = norm.apply({"params": encoder_params["norm"]}, x).astype(jnp.float32)
    maps.append(_vit_grid(x[:, 1 + encoder.registers :], encoder))
  return jnp.concatenate(maps, axis=-1)


class LinearHead(nn.Module):
  """A linear projection [..., C] -> [..., out_dim] float32: kernel normal(0.02); bias
  PyTorch's nn.Linear default (U(+-1/sqrt(C))) or zero (torch_bias False)."""

  out_dim: int
  torch_bias: bool = True
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    fan_in = x.shape[-1]
    bound = 1.0 / fan_in**0.5
    bias_init = (
      (lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound))
      if self.torch_bias
      else nn.initializers.zeros
    )
    y = nn.Dense(
      self.out_dim, dtype=self.dtype, kernel_init=nn.initializers.normal(0.02), bias_init=bias_init
    )(x)
    return y.astype(jnp.float32)


def teacher_width(config) -> int:
  """D_t, the width of the teacher's embedding (its encoder's h)."""
  return models.encoder_width(config.distill.teacher_model)


def local_width(config) -> int:
  """The channels of the teacher's spatial features: n x D_t for v2, D_t for v3, 0 for v1."""
  d = config.distill
  return {"v1": 0, "v2": d.teacher_blocks * teacher_width(config), "v3": teacher_width(config)}[
    d.loss
  ]


def local_projector(config):
  """The student's local head (v2, v3), or None (v1)."""
  width = local_width(config)
  if not width:
    return None
  dtype = DTYPES[config.model.dtype]
  return LinearHead(width, torch_bias=config.distill.loss != "v2", dtype=dtype)


# ---------------------------------------------------------------------------------------
# The teacher.


def is_workdir_teacher(path: str) -> bool:
  """Whether the teacher path is a pretraining or fine-tuning workdir (else a weights file)."""
  return not tensor_files.is_weights_file(path)


def file_sha256(path: str) -> str:
  """The hexadecimal SHA-256 of a file's bytes."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 24), b""):
      digest.update(chunk)
  return digest.hexdigest()


def _checkpoint_dir(path: str) -> str:
  return f"{files.resolve_dir(path)}/checkpoints"


def recorded_config(config, checkpoint_encoder):
  """config with what the run reads of its teacher recorded in config.distill (a copy):
  a weights file's teacher_sha256; a pretraining workdir's teacher_step (the latest where
  -1), teacher_model and teacher_paths: the model and the key paths of the encoder that
  checkpoint_encoder('distill.teacher', path, saved config) reads from a checkpoint of a
  pretraining workdir (the encoder its method evaluates) or a fine-tuning workdir (its
  fine-tuned encoder, as the model it started from). A resumed run records again
  and the runner's resume check names any field that changed (a file rewritten in place).

  Raises:
    ConfigError: see check_teacher and checkpoint_encoder; a teacher_sha256 set by hand
      that is not the file's.
  """
  check_teacher(config)
  config = config.copy_and_resolve_references()
  d = config.distill
  if not is_workdir_teacher(d.teacher):
    digest = file_sha256(d.teacher)
    if d.teacher_sha256 and d.teacher_sha256 != digest:
      raise ConfigError(
        "distill.teacher_sha256",
        d.teacher_sha256,
        f"the SHA-256 of distill.teacher={d.teacher} ({digest}), or '' to record it",
      )
    d.teacher_sha256 = digest
    return config
  ckpt = checkpointing.Checkpointer(_checkpoint_dir(d.teacher), read_only=True)
  try:
    step = ckpt.resolve_step(None if d.teacher_step < 0 else d.teacher_step, "distill.teacher_step")
    saved = ckpt.saved_config(step)
  finally:
    ckpt.close()
  pretrained, paths = checkpoint_encoder("distill.teacher", d.teacher, saved)
  d.teacher_step = step
  d.teacher_model = pretrained.model.to_dict()
  d.teacher_paths = [list(path) for path in paths]
  check_shared_input(config)
  return config


def check_teacher(config):
  """Raises ConfigError for a teacher that does not exist, or a weights file without the
  teacher_model that says what it holds."""
  d = config.distill
  path = d.get("teacher") or ""
  if is_workdir_teacher(path):
    if not path or not os.path.isdir(_checkpoint_dir(path)):
      raise ConfigError(
        "distill.teacher",
        path,
        "an existing weights file (.safetensors, .pth) or a pretraining or fine-tuning "
        f"workdir with checkpoints (looked for {_checkpoint_dir(path) if path else 'a path'})",
      )
  else:
    if not os.path.isfile(path):
      raise ConfigError("distill.teacher", path, "an existing weights file: there is none")
    if not d.get("teacher_model"):
      raise ConfigError(
        "distill.teacher_model",
        d.get("teacher_model"),
        "the model config of the weights file (e.g. recipes.foundation_model)",
      )


def check_shared_input(config):
  """Raises ConfigError for a teacher that cannot take the student's images: a ViT teacher
  whose patch does not divide config.image_size (both see the same images)."""
  teacher = config.distill.teacher_model
  patch = teacher.get("patch_size") if "depth" in teacher else None
  if patch and config.image_size % patch:
    student = config.model.get("patch_size") if "depth" in config.model else None
    theirs = f", the student's {student}" if student else ""
    raise ConfigError(
      "image_size",
      config.image_size,
      f"a multiple of the teacher's patch size {patch} (distill.teacher_model "
      f"{teacher.name}){theirs}: student and teacher see the same images",
    )
  models.check_model_config(teacher, config.image_size)


def teacher_encoder(config):
  """The teacher's encoder module, computing in bfloat16."""
  model = dict(config.distill.teacher_model, dtype="bfloat16")
  return models.build_encoder(type(config.distill.teacher_model)(model))


def load_teacher(config, mesh) -> dict:
  """The teacher's {'params', 'batch_stats'} (float32), replicated on the mesh.

  A weights file: state_dicts.from_state_dict as config.distill.teacher_model. A workdir:
  the recorded encoder of its recorded checkpoint step (recorded_config), a partial restore.

  Raises:
    ConfigError: see check_teacher. WeightsError: a file that does not fit the model.
  """
  check_teacher(config)
  d = config.distill
  if not is_workdir_teacher(d.teacher):
    variables = state_dicts.from_state_dict(
      tensor_files.read(d.teacher), d.teacher, d.teacher_model, config.image_size
    )
    return jax.device_put(variables, mesh_lib.replicated(mesh))
  module = teacher_encoder(config)
  x = jnp.zeros((1, config.image_size, config.image_size, 3), jnp.float32)
  shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), x, train=False))
  wanted = {}
  for kind, path in zip(("params", "batch_stats"), d.teacher_paths):
    if kind in shapes:
      node = wanted
      for key in path[:-1]:
        node = node.setdefault(key, {})
      node[path[-1]] = shapes[kind]
  ckpt = checkpointing.Checkpointer(_checkpoint_dir(d.teacher), read_only=True)
  try:
    restored = ckpt.restore_partial(
      checkpointing.abstract_like(wanted, mesh_lib.replicated(mesh)), d.teacher_step
    )
  finally:
    ckpt.close()
  found = []
  for path in d.teacher_paths:
    node = restored
    for key in path:
      node = node.get(key, {})
    found.append(node)
  return {"params": found[0], "batch_stats": found[1]}


# The teacher's variables, read once by pretraining.setup and passed to every step
# (methods.OptionalAttributes.frozen_variables).
frozen_variables = load_teacher


# ---------------------------------------------------------------------------------------
# The method contract.


def check_config(config, num_train_examples: int):
  """Raises ConfigError for distill fields that cannot run (before any compute)."""
  d = config.distill
  if d.loss not in LOSSES:
    raise ConfigError("distill.loss", d.loss, f"one of {list(LOSSES)}")
  check_teacher(config)
  if not d.get("teacher_model"):
    raise ConfigError(
      "distill.teacher_model",
      d.get("teacher_model"),
      "the teacher's model config (recorded from its workdir when the run starts)",
    )
  check_shared_input(config)
  for field in ("temperature", "temperature_local"):
    if not d[field] > 0:
      raise ConfigError(f"distill.{field}", d[field], "> 0")
  if d.local_weight < 0:
    raise ConfigError("distill.local_weight", d.local_weight, ">= 0")
  if d.loss in ("v1", "v3") and not 0 < d.queue_size < num_train_examples:
    raise ConfigError(
      "distill.queue_size",
      d.queue_size,
      f"in [1, {num_train_examples}): fewer than the train split's images (the reference's "
      f"size for {num_train_examples} images is {reference_queue_size(num_train_examples)})",
    )
  teacher = d.teacher_model
  depth = teacher.get("depth") if "patch_size" in teacher else 1
  if d.loss == "v2" and not 1 <= d.teacher_blocks <= (depth or 1):
    raise ConfigError(
      "distill.teacher_blocks",
      d.teacher_blocks,
      f"in [1, {depth}]: the teacher's blocks ({teacher.name}; a ResNet gives its last only)",
    )


def build_model(config) -> heads.ContrastiveModel:
  """The student: its encoder (BN over the data axis) and the linear global head to the
  teacher's width (v1, v3; v2 trains it too but its loss does not read it: the online
  probe's and projection_std's z)."""
  dtype = DTYPES[config.model.dtype]
  return heads.ContrastiveModel(
    encoder=models.build_encoder(config.model, bn_axis_name=mesh_lib.DATA_AXIS),
    projector=LinearHead(teacher_width(config), dtype=dtype),
  )


def init_state(config, model, tx, init_rng, rng) -> common.TrainState:
  """Step 0: the student and its heads; the queue of zeros (the reference's buffer) and
  its pointer 0. The teacher is not in the state (see the module docstring)."""
  params, batch_stats = common.init_variables(model, init_rng, config.image_size)
  local = local_projector(config)
  if local is not None:
    # A ViT's patch tokens and a ResNet's last map have the encoder's width, as its h.
    features = jnp.zeros((1, models.encoder_width(config.model)), jnp.float32)
    key = jax.random.fold_in(init_rng, 1)
    params = dict(params, **{LOCAL_PROJECTOR: local.init(key, features)["params"]})
  extra = {}
  if config.distill.loss in ("v1", "v3"):
    extra = {
      "queue": jnp.zeros((config.distill.queue_size, teacher_width(config)), jnp.float32),
      "queue_ptr": jnp.zeros((), jnp.int32),
    }
  return common.TrainState.create(
    params=params, tx=tx, rng=rng, batch_stats=batch_stats, extra=extra
  )


def student_forward(model, params, batch_stats, x):
  """Train-mode student: (h, z [b, D_t], spatial features [b, h, w, C], new batch_stats)."""
  encoder = model.encoder
  variables = {"params": {k: params[k] for k in ("encoder", "projector")}}
  if batch_stats:
    variables["batch_stats"] = batch_stats
  (h, z), out = model.apply(
    variables,
    x,
    train=True,
    mutable=["batch_stats", "intermediates"],
    capture_intermediates=_capture(encoder, 1),
  )
  features = spatial_features(encoder, out["intermediates"]["encoder"], params["encoder"])
  return h, z, features, out.get("batch_stats", {})


def teacher_forward(encoder, variables, x, blocks: int):
  """Eval-mode teacher under stop_gradient: (h float32 [b, D_t], spatial features)."""
  h, out = encoder.apply(
    variables,
    x,
    train=False,
    mutable=["intermediates"],
    capture_intermediates=_capture(encoder, blocks),
  )
  features = spatial_features(encoder, out["intermediates"], variables["params"], blocks)
  return jax.lax.stop_gradient(h.astype(jnp.float32)), jax.lax.stop_gradient(features)


def make_train_step(config, model, tx, views, mesh, length: common.RunLength, probe=None):
  """Returns

  train_step(state, batch, teacher_variables) -> (state, metrics), to be jitted: the
  teacher's variables (frozen_variables) are its third argument, which pretraining.setup
  passes (methods.OptionalAttributes.frozen_variables).

  Per step, on each device's rows: view 1's augmentation of the first crop, the mix-up over
  the global batch, the teacher's forward (bfloat16, stop_gradient), the queue written with
  the global batch's teacher embeddings (v1, v3) and then the loss. length is not used (no
  schedule of the method's own).
  """
  del length
  d = config.distill
  teacher = teacher_encoder(config)
  blocks = d.teacher_blocks if d.loss == "v2" else 1
  local = local_projector(config)
  view = views[0]

  def per_device(state, images, teacher_variables):
    device = jax.lax.axis_index(mesh_lib.DATA_AXIS)
    x = augment.augment_batch(images[:, 0], common.view_key(state.rng, state.step, device, 0), view)
    x = mixup(x, common.shuffle_key(state.rng, state.step), mesh_lib.DATA_AXIS)
    t_global, t_local = teacher_forward(teacher, teacher_variables, x, blocks)
    grid = t_local.shape[1:3]
    t_local = t_local.reshape(t_local.shape[0], -1, t_local.shape[-1])
    t_global = common.l2_normalize(t_global)
    extra = state.extra
    if d.loss in ("v1", "v3"):
      keys = jax.lax.all_gather(t_global, mesh_lib.DATA_AXIS, tiled=True, to="invarying")
      queue, ptr = enqueue(extra["queue"], extra["queue_ptr"], keys)
      extra = {"queue": queue, "queue_ptr": ptr}

    def loss_fn(params):
      h, z, s_local, stats = student_forward(model, params, state.batch_stats, x)
      metrics = {}
      loss = jnp.zeros((), jnp.float32)
      if local is not None:
        s_local = local.apply({"params": params[LOCAL_PROJECTOR]}, s_local)
        s_local = resize_to_grid(s_local, grid)
        s_local = s_local.reshape(s_local.shape[0], -1, s_local.shape[-1])
      if d.loss == "v2":
        loss = patch_mse(s_local, t_local, mesh_lib.DATA_AXIS)
      else:
        loss = queue_kl(
          common.l2_normalize(z), t_global, extra["queue"], d.temperature, mesh_lib.DATA_AXIS
        )
        if d.loss == "v3":
          local_loss = patch_similarity_kl(
            common.l2_normalize(s_local),
            common.l2_normalize(t_local),
            d.temperature_local,
            mesh_lib.DATA_AXIS,
          )
          metrics = {"global_loss": loss, "local_loss": local_loss}
          loss = loss + d.local_weight * local_loss
      return loss, (stats, metrics, {"h": h, "z": z})

    (loss, (stats, metrics, outputs)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.params
    )
    return grads, stats, extra, dict(metrics, loss=loss), outputs

  return common.build_train_step(per_device, tx, mesh, probe=probe, frozen=True)

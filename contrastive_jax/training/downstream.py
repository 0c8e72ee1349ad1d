"""What the jobs on a pretrained encoder share: the linear probe and fine-tuning.

Both start from an encoder restored by restore.py (a pretraining checkpoint, its
run's initialisation or a weights file), train a classifier on one random
crop-and-flip per labelled image with cross-entropy, and are evaluated at the
pretraining run's image size and eval crop. They differ only in what trains
(the probe: a head on frozen h; fine-tuning: encoder and head) and in their
presets: build_task is the rest. The label-efficiency protocols (protocols.py)
train the same heads with the same steps from the same states (make_probe_step,
probe_state, finetune_head, finetune_state, make_finetune_step).
"""

import functools
import re
from typing import Callable, NamedTuple

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from contrastive_jax import models
from contrastive_jax.core import durations
from contrastive_jax.core import files
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.data import crop_spec
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import sources
from contrastive_jax.methods import ENCODER
from contrastive_jax.methods import common
from contrastive_jax.methods import encoder_variables
from contrastive_jax.methods import optim
from contrastive_jax.training import evaluators
from contrastive_jax.training import restore
from contrastive_jax.training import runner


def check_config(config, num_devices: int):
  """Raises ConfigError for the shared fields that cannot run (before any compute)."""
  runner.check_config(config, num_devices)
  crop_spec.check_config(config)
  optim.check_optimizer_config(config.optimizer)


def labelled_source(config, job: str):
  """The data source of config.train_split, checked with the config's evaluators.

  Raises:
    ConfigError: see sources.get_source and evaluators.check_config; an
      unlabeled dataset (`job`, e.g. 'the linear probe', trains on labels).
  """
  source = sources.get_source(config, {"train_split": config.train_split})
  if source.num_classes is None:
    raise ConfigError("dataset", config.dataset, f"a labelled dataset: {job} trains on labels")
  evaluators.check_config(config.evaluators, source, jax.device_count())
  return source


def eval_datasets(source, config, encoder: restore.Encoder):
  """The evaluators' datasets (input_pipeline.eval_datasets) with the encoder's eval crop."""
  return input_pipeline.eval_datasets(
    source,
    eval_crop=input_pipeline.EvalCrop.of(encoder.pretrained),
    threads=config.data_threads,
    cache=config.cache,
  )


def train_batches(data, config, mesh, encoder: restore.Encoder) -> Callable:
  """input_pipeline.train_batches of `data` with config's crop and batch: one view per image,
  at the encoder's pretraining image size, batches sharded over the mesh."""
  return input_pipeline.train_batches(
    data,
    config,
    mesh_lib.batch_sharded(mesh),
    image_size=encoder.pretrained.image_size,
    num_views=1,
  )


def make_classifier_step(inputs: Callable, forward: Callable, tx):
  """Jitted (state, batch, *frozen) -> (state, metrics), state donated: one cross-entropy step.

  inputs(images, *frozen) -> x: what the trained part reads, computed outside the gradient
  (images uint8 [B, S, S, 3]; frozen: what does not train, e.g. the probe's encoder variables).
  forward(params, batch_stats, x) -> (logits float32 [B, C], the updated batch_stats).
  batch: {'image': uint8 [B, 1, S, S, 3] (one crop per image), 'label': int32 [B]}.
  metrics: float32 'loss' (mean softmax cross-entropy), 'train_top1' and
  common.apply_gradients' norms.
  """

  def train_step(state, batch, *frozen):
    x = inputs(batch["image"][:, 0], *frozen)

    def loss_fn(params):
      logits, stats = forward(params, state.batch_stats, x)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
      return loss, (stats, logits)

    (loss, (stats, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    top1 = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    state, health = common.apply_gradients(state, grads, tx, batch_stats=stats)
    return state, {"loss": loss, "train_top1": top1, **health}

  return jax.jit(train_step, donate_argnums=0)


class Trainer(NamedTuple):
  """What a downstream job trains, as its make_trainer(schedule) builds it for build_task.

  init: () -> common.TrainState at step 0, jitted with its outputs replicated.
  train_step: (state, batch) -> (state, metrics).
  eval_model: the evaluators' view of it (evaluators.EvalModel; dataset None: build_task
    gives the evaluation datasets).
  """

  init: Callable
  train_step: Callable
  eval_model: evaluators.EvalModel


def build_task(
  config,
  mesh,
  *,
  source,
  train_data,
  encoder: restore.Encoder,
  make_trainer: Callable,
  verb: str,
  detail: str = "",
) -> runner.Task:
  """The runner.Task of a downstream job; resolves config's pretraining checkpoint in place.

  Args:
    config: the job's config, resolved (copy_and_resolve_references); its pretrain_step and
      pretrain_workdir are set to the encoder's, so that a resume names the same checkpoint
      however it was spelled.
    mesh: the device mesh.
    source: the labelled data source (labelled_source), whose evaluation splits and classes
      the evaluators use.
    train_data: what trains: source, or a labelled subset of it.
    encoder: the restored encoder.
    make_trainer: (learning-rate schedule) -> Trainer.
    verb, detail: the log line's, e.g. 'Probing' and ' with the linear-probe preset ...'.
  """
  config.pretrain_step = encoder.step
  config.pretrain_workdir = files.resolve_dir(config.pretrain_workdir)
  steps_per_epoch = runner.steps_per_epoch(train_data, config)
  num_steps = durations.to_steps(config.duration, "duration", steps_per_epoch)
  schedule = optim.learning_rate_schedule(
    config.optimizer, config.batch_size, steps_per_epoch, num_steps
  )
  trainer = make_trainer(schedule)
  logging.info(
    "%s %s encoder (%s, step %d of %s)%s.",
    verb,
    "a randomly initialised" if config.random_init else "the pretrained",
    encoder.pretrained.method,
    config.pretrain_step,
    config.pretrain_workdir,
    detail,
  )
  return runner.Task(
    config=config,
    init=trainer.init,
    train_step=trainer.train_step,
    train_batches=train_batches(train_data, config, mesh, encoder),
    num_steps=num_steps,
    steps_per_epoch=steps_per_epoch,
    global_batch=config.batch_size,
    schedule=schedule,
    eval_model=trainer.eval_model._replace(dataset=eval_datasets(source, config, encoder)),
    num_classes=source.num_classes,
  )


# name -> (kernel init, bias init) of the linear layer.
HEAD_INITS = {
  "zeros": (nn.initializers.zeros, nn.initializers.zeros),
  "normal_0.01": (nn.initializers.normal(0.01), nn.initializers.zeros),
  "lecun_normal": (nn.initializers.lecun_normal(), nn.initializers.zeros),
}


class LinearHead(nn.Module):
  """[N, D] float32 features -> [N, num_classes] logits: a Dense, after an affine-free BN
  with standardize (the 'standardised' preset); dense_init a HEAD_INITS name."""

  num_classes: int
  standardize: bool = True
  dense_init: str = "zeros"

  @nn.compact
  def __call__(self, h, train: bool):
    if self.standardize:
      h = nn.BatchNorm(
        use_running_average=not train, use_scale=False, use_bias=False, momentum=0.9, epsilon=1e-6
      )(h)
    kernel_init, bias_init = HEAD_INITS[self.dense_init]
    return nn.Dense(self.num_classes, kernel_init=kernel_init, bias_init=bias_init)(h)


def make_probe_step(head: LinearHead, tx, encoder=None):
  """Jitted (state, batch[, encoder variables]) -> (state, metrics), state donated: the head
  trained on frozen h (make_classifier_step); state.params and state.batch_stats are the head's.

  With `encoder` (a models encoder module), batch['image'] holds uint8 crops and the step
  takes the encoder's variables: h = models.encode in eval mode, outside the gradient
  (stop_gradient), the encoder never updated. Without, batch['image'] holds h itself,
  float32 [B, 1, D] (features computed once, as the label-efficiency probe trains).
  """
  if encoder is None:
    inputs = lambda h: h
  else:

    def inputs(images, enc_vars):
      return jax.lax.stop_gradient(models.encode(encoder, enc_vars, images))

  def forward(params, batch_stats, h):
    logits, updates = head.apply(
      {"params": params, "batch_stats": batch_stats}, h, train=True, mutable=["batch_stats"]
    )
    return logits, updates.get("batch_stats", {})

  return make_classifier_step(inputs, forward, tx)


def probe_state(head: LinearHead, tx, dim: int, seed: int) -> common.TrainState:
  """The probe's state at step 0: head initialised from PRNGKey(seed) on h of width dim."""
  variables = head.init(jax.random.PRNGKey(seed), jnp.zeros((1, dim)), train=False)
  return common.TrainState.create(
    params=variables["params"],
    tx=tx,
    rng=jax.random.PRNGKey(seed),
    batch_stats=variables.get("batch_stats", {}),
  )


def finetune_head(num_classes: int) -> nn.Module:
  """Fine-tuning's head: a zero-initialised linear layer on h (SimCLR's, Appendix B.5)."""
  return nn.Dense(num_classes, kernel_init=nn.initializers.zeros)


def finetune_state(tx, enc_vars, head_params, seed: int) -> common.TrainState:
  """Fine-tuning's state at step 0: params {'encoder': enc_vars['params'], 'head':
  head_params}, batch_stats {'encoder': enc_vars['batch_stats']}, rng PRNGKey(seed)."""
  return common.TrainState.create(
    params={ENCODER: enc_vars["params"], "head": head_params},
    tx=tx,
    rng=jax.random.PRNGKey(seed),
    batch_stats={ENCODER: enc_vars["batch_stats"]},
  )


def finetune_logits(encoder, head) -> Callable:
  """(variables of a finetune_state, uint8 images [B, S, S, 3]) -> float32 logits [B, C]:
  the fine-tuned encoder in eval mode (its running statistics), then the head."""

  def logits(variables, images):
    h = models.encode(encoder, encoder_variables(variables), images)
    return head.apply({"params": variables["params"]["head"]}, h)

  return logits


def check_multipliers(config, prefix: str):
  """Raises ConfigError for a backbone_lr_multiplier not > 0 or a layer_decay not in (0, 1]
  (fields of config, named with prefix, e.g. 'finetune.')."""
  if not config.backbone_lr_multiplier > 0:
    raise ConfigError(
      f"{prefix}backbone_lr_multiplier", config.backbone_lr_multiplier, "> 0 (1: the head's rate)"
    )
  if not 0 < config.layer_decay <= 1:
    raise ConfigError(f"{prefix}layer_decay", config.layer_decay, "in (0, 1] (1: no decay)")


def build_finetune_optimizer(config, schedule, encoder: restore.Encoder):
  """optim.build_optimizer of config.optimizer, with the per-leaf rates of
  learning_rate_multipliers when backbone_lr_multiplier or layer_decay is not 1 (only
  then: the wrapper changes the optimizer state's structure, as freeze does). A random
  patch projection (the encoder's model config) stays frozen, as it was pretrained."""
  freeze = encoder.pretrained.model.get("random_patch_projection", False)
  tx = optim.build_optimizer(config.optimizer, schedule, freeze=freeze)
  if config.backbone_lr_multiplier == 1 and config.layer_decay == 1:
    return tx
  return optim.scale_learning_rates(
    tx,
    functools.partial(
      learning_rate_multipliers,
      backbone=config.backbone_lr_multiplier,
      layer_decay=config.layer_decay,
    ),
  )


def make_finetune_step(encoder, head, tx):
  """Jitted (state, batch) -> (state, metrics), state donated; encoder and head both train.

  make_classifier_step with state.params = {'encoder', 'head'},
  state.batch_stats = {'encoder'}: BN in train mode over the global batch,
  running statistics updated.
  """

  def inputs(images):
    return images.astype(jnp.float32) / 255.0  # Scaled as models.encode does.

  def forward(params, batch_stats, images):
    h, updates = encoder.apply(
      {"params": params[ENCODER], "batch_stats": batch_stats[ENCODER]},
      images,
      train=True,
      mutable=["batch_stats"],
    )
    logits = head.apply({"params": params["head"]}, h)
    return logits, {ENCODER: updates.get("batch_stats", {})}  # {}: a ViT has no BN.

  return make_classifier_step(inputs, forward, tx)


# A residual block's or transformer block's module name (ResNet's BasicBlock_k or
# BottleneckBlock_k, ViT's block{k}); k is its position, 0 first.
_BLOCK = re.compile(r"(?:BasicBlock_|BottleneckBlock_|block)(\d+)")


def learning_rate_multipliers(params, backbone: float, layer_decay: float):
  """The learning-rate multiplier of each leaf of params = {'encoder', 'head'} (floats).

  The head's leaves: 1. An encoder leaf at depth d of L blocks: backbone x
  layer_decay^(L + 1 - d), d = 0 before the first block (a ResNet's stem, a
  ViT's patch embedding and class token), k + 1 in block k, L + 1 after the
  last (a ViT's final LayerNorm, the projection head's layers of
  heads.EncoderWithHeadLayers): layer-wise learning-rate decay as BEiT's
  fine-tuning assigns it (Bao et al. 2022, Sec. 3 and its layer ids), times a
  lower rate for the whole pretrained backbone. 1 and 1 leave every rate as it is.
  """

  def block(path):
    found = [_BLOCK.fullmatch(str(getattr(k, "key", ""))) for k in path]
    return next((int(m.group(1)) for m in found if m), None)

  blocks = [block(path) for path, _ in jax.tree_util.tree_leaves_with_path(params[ENCODER])]
  num_blocks = max((b for b in blocks if b is not None), default=-1) + 1

  def depth(path):
    k = block(path)
    if k is not None:
      return k + 1
    names = [str(getattr(key, "key", "")) for key in path]
    if names[0] == "projector":  # EncoderWithHeadLayers' head layers: after the last block.
      return num_blocks + 1
    top = names[1] if names[0] == "encoder" else names[0]  # Its encoder, or a bare one.
    # Before the first block: the modules whose names precede it (stem_*, patch_embed, cls_token).
    return num_blocks + 1 if top == "norm" else 0

  encoder = jax.tree_util.tree_map_with_path(
    lambda path, _: backbone * layer_decay ** (num_blocks + 1 - depth(path)), params[ENCODER]
  )
  return {ENCODER: encoder, "head": jax.tree.map(lambda _: 1.0, params["head"])}

"""Optimizers (LARS, LARC, SGD with momentum, AdamW) and the warm-up + cosine schedule.

Where the references differ, config fields say whose variant to run:
weight_decay_mask 'kernels' leaves biases, BN and LayerNorm parameters and a
ViT's class token out of weight decay and of LARS's trust ratio (SimCLR, BYOL,
solo-learn, MoCo v3's LARS), 'all' decays every parameter (torch.optim.SGD's
weight_decay: MoCo; torch.optim.AdamW as MoCo v3's main_moco.py calls it);
lr_before_momentum scales each step by the learning rate before it enters the
momentum (SimCLR's LARS
and optax.lars) instead of scaling the momentum (BYOL's LARS, PyTorch's and
TensorFlow's momentum SGD); nesterov as in those optimizers.

DINO's recipe (facebookresearch/dino main_dino.py, utils.py) adds four optional
fields, absent (off) in the other configs: final_lr, the cosine's end
(cosine_scheduler's min_lr); weight_decay_end, a cosine schedule of the weight
decay from weight_decay to it (its wd_schedule); clip_per_tensor, each
gradient tensor's L2 norm clipped on its own (utils.clip_gradients); and
freeze_last_layer_epochs, the epochs during which a module named 'last_layer'
(heads.DINOHead's) is held still (utils.cancel_gradients_last_layer).
LightlyTrain's distillation adds clip_global_norm, the gradients' global L2 norm clipped
(its configure_gradient_clipping: torch.nn.utils.clip_grad_norm_ at 1.0).
"""

import math

import jax
import jax.numpy as jnp
import optax

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.models import vit

LR_SCALINGS = ("linear", "sqrt")
SCHEDULES = ("cosine", "step")
OPTIMIZERS = ("lars", "larc", "sgd", "adamw")
DECAY_MASKS = ("kernels", "all")


def check_optimizer_config(cfg):
  """Raises ConfigError naming the field for an optimizer config that cannot run."""
  if cfg.name not in OPTIMIZERS:
    raise ConfigError("optimizer.name", cfg.name, f"one of {list(OPTIMIZERS)}")
  if cfg.weight_decay_mask not in DECAY_MASKS:
    raise ConfigError(
      "optimizer.weight_decay_mask", cfg.weight_decay_mask, f"one of {list(DECAY_MASKS)}"
    )
  if cfg.lr_scaling not in LR_SCALINGS:
    raise ConfigError("optimizer.lr_scaling", cfg.lr_scaling, f"one of {list(LR_SCALINGS)}")
  if not cfg.base_lr > 0:
    raise ConfigError("optimizer.base_lr", cfg.base_lr, "> 0")
  if cfg.weight_decay < 0:
    raise ConfigError("optimizer.weight_decay", cfg.weight_decay, ">= 0")
  if not 0 <= cfg.momentum < 1:
    raise ConfigError("optimizer.momentum", cfg.momentum, "in [0, 1)")
  if cfg.schedule not in SCHEDULES:
    raise ConfigError("optimizer.schedule", cfg.schedule, f"one of {list(SCHEDULES)}")
  if not 0 < cfg.decay_factor <= 1:
    raise ConfigError("optimizer.decay_factor", cfg.decay_factor, "in (0, 1]")
  if cfg.warmup_epochs < 0:
    raise ConfigError("optimizer.warmup_epochs", cfg.warmup_epochs, ">= 0")
  if cfg.get("final_lr", 0.0) < 0:
    raise ConfigError("optimizer.final_lr", cfg.final_lr, ">= 0")
  if cfg.get("weight_decay_end") is not None and cfg.weight_decay_end < 0:
    raise ConfigError("optimizer.weight_decay_end", cfg.weight_decay_end, ">= 0, or None")
  if cfg.get("weight_decay_end") is not None and cfg.name != "adamw":
    raise ConfigError(
      "optimizer.weight_decay_end",
      cfg.weight_decay_end,
      f"None for optimizer.name={cfg.name!r} (a weight-decay schedule is AdamW's only)",
    )
  if cfg.get("clip_per_tensor", 0.0) < 0:
    raise ConfigError("optimizer.clip_per_tensor", cfg.clip_per_tensor, ">= 0 (0: no clipping)")
  if cfg.get("clip_global_norm", 0.0) < 0:
    raise ConfigError("optimizer.clip_global_norm", cfg.clip_global_norm, ">= 0 (0: no clipping)")
  if cfg.get("freeze_last_layer_epochs", 0.0) < 0:
    raise ConfigError("optimizer.freeze_last_layer_epochs", cfg.freeze_last_layer_epochs, ">= 0")
  epochs = list(cfg.decay_epochs)
  if epochs != sorted(set(epochs)) or (epochs and epochs[0] <= cfg.warmup_epochs):
    raise ConfigError(
      "optimizer.decay_epochs",
      tuple(epochs),
      f"strictly increasing epochs after warmup_epochs ({cfg.warmup_epochs})",
    )
  _check_fractions(cfg)


def _check_fractions(cfg):
  """The optional warmup_fraction and decay_fractions (learning_rate_schedule): fractions of
  the run that replace warmup_epochs and decay_epochs, which must then be 0 and ()."""
  warmup = cfg.get("warmup_fraction")
  if warmup is not None:
    if not 0 <= warmup < 1:
      raise ConfigError("optimizer.warmup_fraction", warmup, "in [0, 1): a fraction of the run")
    if cfg.warmup_epochs:
      raise ConfigError(
        "optimizer.warmup_epochs",
        cfg.warmup_epochs,
        f"0 with warmup_fraction set ({warmup}): the warm-up is one or the other",
      )
  fractions = cfg.get("decay_fractions")
  if fractions is not None:
    fractions = list(fractions)
    if fractions != sorted(set(fractions)) or any(not (warmup or 0) < f < 1 for f in fractions):
      raise ConfigError(
        "optimizer.decay_fractions",
        tuple(fractions),
        f"strictly increasing fractions of the run in (warmup_fraction ({warmup or 0}), 1)",
      )
    if list(cfg.decay_epochs):
      raise ConfigError(
        "optimizer.decay_epochs",
        tuple(cfg.decay_epochs),
        "() with decay_fractions set: the decays are at one or the other",
      )


def peak_learning_rate(cfg, global_batch: int) -> float:
  """base_lr * B / 256 ('linear') or base_lr * sqrt(B) ('sqrt'); SimCLR Appendix B.1."""
  if cfg.lr_scaling == "linear":
    return cfg.base_lr * global_batch / 256
  return cfg.base_lr * math.sqrt(global_batch)


def learning_rate_schedule(cfg, global_batch: int, steps_per_epoch: int, total_steps: int):
  """Linear warm-up from 0 over warmup_epochs, then cosine decay to final_lr (0 when
  absent) at total_steps ('cosine'), or a constant lr times decay_factor at each of
  decay_epochs ('step', MoCo v1's schedule).

  A config with the optional fields warmup_fraction (float) and decay_fractions
  (floats) set places the warm-up's end and the step decays at those fractions
  of total_steps instead (rounded down to a step; e.g. MoCo's decays at epochs
  60 and 80 of 100 are decay_fractions (0.6, 0.8)), so that a recipe cut to
  another step budget keeps its shape.

  Returns an optax schedule: step (int) -> learning rate (float32).
  """
  peak = peak_learning_rate(cfg, global_batch)
  warmup_fraction, decay_fractions = cfg.get("warmup_fraction"), cfg.get("decay_fractions")
  if warmup_fraction is None:
    warmup = min(int(round(cfg.warmup_epochs * steps_per_epoch)), total_steps)
  else:
    warmup = int(warmup_fraction * total_steps)
  if decay_fractions is None:
    decays = [int(e * steps_per_epoch) for e in cfg.decay_epochs]
  else:
    decays = [int(f * total_steps) for f in decay_fractions]
  if cfg.schedule == "step":
    # join_schedules counts the second schedule's steps from the boundary.
    decay = optax.piecewise_constant_schedule(
      peak, {step - warmup: cfg.decay_factor for step in decays}
    )
  else:
    alpha = cfg.get("final_lr", 0.0) / peak
    decay = optax.cosine_decay_schedule(peak, max(total_steps - warmup, 1), alpha=alpha)
  if not warmup:  # No warm-up: the decay from step 0 (optax logs a line for a 0-step ramp).
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def decay_mask(params, which: str):
  """True for the leaves that get weight decay (and, under LARS, the trust ratio).

  'kernels': biases, BatchNorm and LayerNorm parameters (leaves named 'bias'
  or 'scale') and a ViT's class token are left out, as in SimCLR (Appendix
  B.1; its LARS excludes 'batch_normalization' and 'bias'), BYOL (Sec. 3.3;
  exclude_bias_and_norm) and MoCo v3's LARS (moco-v3 optimizer.py: parameters
  with one dimension), so only conv and dense kernels are True. (A ViT's
  position embedding is a constant, not a parameter.) 'all': every leaf, as
  torch.optim.SGD's weight_decay in MoCo's main_moco.py.
  """

  def keep(path, _):
    return which == "all" or path[-1].key not in ("bias", "scale", "cls_token")

  return jax.tree_util.tree_map_with_path(keep, params)


def scale_by_clipped_trust_ratio(
  schedule, trust_coefficient: float, weight_decay: float, mask, eps: float = 1e-8
) -> optax.GradientTransformation:
  """LARC's clipped trust ratio with weight decay, as solo-learn's LARS (clip_lars_lr=True).

  For a leaf w with gradient g where mask is True and both norms are > 0:
    r = min(eta ||w|| / (||g|| + wd ||w|| + eps) / lr_k, 1),  update (g + wd w) r,
  lr_k = schedule(k) the step's learning rate; other leaves pass g unchanged
  (no decay, no ratio). Momentum and the learning rate follow (build_optimizer).
  """

  def init(params):
    del params
    return optax.ScaleByScheduleState(count=jnp.zeros((), jnp.int32))

  def update(grads, state, params):
    lr = schedule(state.count)

    def one(g, w, masked):
      if not masked:
        return g
      w_norm, g_norm = jnp.linalg.norm(w), jnp.linalg.norm(g)
      ratio = trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + eps)
      ratio = jnp.minimum(ratio / lr, 1.0)
      scaled = (g + weight_decay * w) * ratio
      return jnp.where((w_norm > 0) & (g_norm > 0), scaled, g)

    updates = jax.tree.map(one, grads, params, mask(params))
    return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

  return optax.GradientTransformation(init, update)


LAST_LAYER = "last_layer"  # heads.DINOHead's weight-normalised layer.


def frozen_labels(params):
  """'frozen' for the leaves under a module whose name starts with vit.FROZEN_PREFIX
  (a ViT's random patch projection), 'train' for the others."""

  def label(path, _):
    frozen = any(str(getattr(k, "key", "")).startswith(vit.FROZEN_PREFIX) for k in path)
    return "frozen" if frozen else "train"

  return jax.tree_util.tree_map_with_path(label, params)


def _labels(params, freeze: bool, hold: bool):
  """frozen_labels (with freeze), and 'held' for the leaves under a LAST_LAYER module
  (with hold)."""
  frozen = frozen_labels(params) if freeze else jax.tree.map(lambda _: "train", params)

  def label(path, frozen_label):
    held = hold and any(getattr(k, "key", None) == LAST_LAYER for k in path)
    return "held" if held and frozen_label == "train" else frozen_label

  return jax.tree_util.tree_map_with_path(label, frozen)


def weight_decay_schedule(cfg, total_steps: int):
  """The weight decay at step k: cfg.weight_decay, or with weight_decay_end set, DINO's
  cosine (utils.cosine_scheduler without warm-up, as main_dino.py's wd_schedule):
    wd_k = end + (start - end) (1 + cos(pi k / K)) / 2,  K = total_steps.
  Returns step -> float32."""
  start, end = cfg.weight_decay, cfg.get("weight_decay_end")
  if end is None:
    return lambda step: jnp.float32(start)
  return lambda step: end + 0.5 * (start - end) * (1 + jnp.cos(jnp.pi * step / total_steps))


def clip_per_tensor(max_norm: float) -> optax.GradientTransformation:
  """Each gradient tensor g scaled by min(1, max_norm / (||g|| + 1e-6)) on its own (DINO's
  utils.clip_gradients: torch.nn.utils.clip_grad_norm_ per parameter, not over all)."""

  def update(grads, state, params=None):
    del params

    def one(g):
      coef = max_norm / (jnp.linalg.norm(g) + 1e-6)
      return jnp.where(coef < 1, g * coef, g)

    return jax.tree.map(one, grads), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def add_scheduled_decayed_weights(schedule, mask) -> optax.GradientTransformation:
  """updates + schedule(k) * params on the leaves of mask, k counting the steps
  (optax.add_decayed_weights with a weight decay that changes per step)."""

  def init(params):
    del params
    return optax.ScaleByScheduleState(count=jnp.zeros((), jnp.int32))

  def update(updates, state, params):
    wd = schedule(state.count)
    updates = jax.tree.map(lambda u, p, m: u + wd * p if m else u, updates, params, mask(params))
    return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

  return optax.GradientTransformation(init, update)


def build_optimizer(
  cfg, schedule, freeze: bool = False, steps_per_epoch: int = 0, total_steps: int = 0
) -> optax.GradientTransformation:
  """LARS (You et al. 2017), LARC, SGD with momentum or AdamW (see the module docstring).

  lars: weight decay, then the trust ratio trust_coefficient ||w|| / ||update||
  (SimCLR and BYOL: 0.001), both on the leaves of decay_mask; sgd: weight decay
  added to the gradient (torch.optim.SGD, tf's L2 loss); larc:
  scale_by_clipped_trust_ratio. Then momentum (Nesterov or not) and the
  learning rate, in the order lr_before_momentum says. adamw: optax.adamw
  (Loshchilov and Hutter 2019; decoupled decay w <- w - lr wd w on the leaves
  of decay_mask, as torch.optim.AdamW), b1 = momentum, b2 = 0.999 and eps 1e-8
  (PyTorch's defaults, which MoCo v3 keeps); nesterov, lr_before_momentum and
  trust_coefficient are unused; with weight_decay_end the decay follows
  weight_decay_schedule. clip_per_tensor > 0 clips each gradient tensor first;
  clip_global_norm > 0 clips the gradients' global L2 norm.

  freeze: the leaves frozen_labels marks get a zero update (no step, no
  decay), as PyTorch leaves a parameter with requires_grad False alone (MoCo
  v3's stop-grad patch projection). It changes the optimizer state's
  structure, so it is set only for models with frozen leaves.

  freeze_last_layer_epochs > 0: for its first round(epochs x steps_per_epoch)
  steps the leaves under a LAST_LAYER module get a zero update and their own
  copy of the optimizer keeps its state (no decay, no moment, no count), as
  torch's optimizers skip a parameter whose gradient DINO set to None; from
  then on that copy steps with the schedules at the global step, its Adam
  count starting at 0 as torch's per-parameter state does.

  total_steps: the run's steps, needed by weight_decay_end.

  Raises:
    ValueError: weight_decay_end without total_steps, freeze_last_layer_epochs
      without steps_per_epoch.
  """
  hold_steps = 0
  if cfg.get("freeze_last_layer_epochs", 0.0) > 0:
    if steps_per_epoch <= 0:
      raise ValueError("freeze_last_layer_epochs needs steps_per_epoch")
    hold_steps = int(round(cfg.freeze_last_layer_epochs * steps_per_epoch))
  if cfg.get("weight_decay_end") is not None and total_steps <= 0:
    raise ValueError("weight_decay_end needs total_steps")
  tx = _optimizer(cfg, schedule, total_steps)
  if not freeze and not hold_steps:
    return tx
  transforms = {"train": tx, "frozen": optax.set_to_zero()}
  if hold_steps:
    shifted = _optimizer(cfg, lambda step: schedule(step + hold_steps), total_steps, hold_steps)
    transforms["held"] = optax.transforms.conditionally_mask(
      shifted, lambda count: count >= hold_steps
    )
  return optax.multi_transform(transforms, lambda params: _labels(params, freeze, hold_steps > 0))


def _optimizer(cfg, schedule, total_steps: int = 0, offset: int = 0):
  """The optimizer of cfg; its weight-decay schedule starts at step `offset`."""
  mask = lambda params: decay_mask(params, cfg.weight_decay_mask)
  steps = [clip_per_tensor(cfg.clip_per_tensor)] if cfg.get("clip_per_tensor", 0.0) > 0 else []
  if cfg.get("clip_global_norm", 0.0) > 0:
    # torch.nn.utils.clip_grad_norm_ over all parameters (LightlyTrain's methods: 1.0).
    steps.append(optax.clip_by_global_norm(cfg.clip_global_norm))
  if cfg.name == "adamw":
    if cfg.get("weight_decay_end") is None and not steps:
      return optax.adamw(
        schedule, b1=cfg.momentum, b2=0.999, eps=1e-8, weight_decay=cfg.weight_decay, mask=mask
      )
    wd = weight_decay_schedule(cfg, total_steps)
    return optax.chain(
      *steps,
      optax.scale_by_adam(b1=cfg.momentum, b2=0.999, eps=1e-8),
      add_scheduled_decayed_weights(lambda step: wd(step + offset), mask),
      optax.scale_by_learning_rate(schedule),
    )
  if cfg.name == "larc":
    steps.append(
      scale_by_clipped_trust_ratio(schedule, cfg.trust_coefficient, cfg.weight_decay, mask)
    )
  else:
    steps.append(optax.add_decayed_weights(cfg.weight_decay, mask=mask))
    if cfg.name == "lars":
      steps.append(
        optax.masked(optax.scale_by_trust_ratio(trust_coefficient=cfg.trust_coefficient), mask)
      )
  momentum = optax.trace(decay=cfg.momentum, nesterov=cfg.nesterov)
  lr = optax.scale_by_learning_rate(schedule)
  steps += [lr, momentum] if cfg.lr_before_momentum else [momentum, lr]
  return optax.chain(*steps)


def scale_learning_rates(tx, multipliers) -> optax.GradientTransformation:
  """tx with each leaf's update multiplied by multipliers(params)'s leaf (a float per leaf).

  Every optimizer here makes an update linear in its learning rate (momentum,
  weight decay, LARS's trust ratio and Adam's normalised step all come before
  it), so this is the per-leaf learning rate lr x multiplier: a lower backbone
  rate, or layer-wise learning-rate decay (Clark et al. 2020, ELECTRA; Bao et
  al. 2022, BEiT), when fine-tuning.
  """

  def scale(updates, params):
    return jax.tree.map(lambda u, m: u * m, updates, multipliers(params))

  return optax.chain(tx, optax.stateless(scale))

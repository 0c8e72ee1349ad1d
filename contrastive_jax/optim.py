"""Optimizers (LARS, SGD with momentum) and the warm-up + cosine schedule."""
import math

import jax
import optax

from contrastive_jax.errors import ConfigError

LR_SCALINGS = ("linear", "sqrt")
SCHEDULES = ("cosine", "step")
OPTIMIZERS = ("lars", "sgd")


def check_optimizer_config(cfg):
  """Raises ConfigError naming the field for an optimizer config that cannot run."""
  if cfg.name not in OPTIMIZERS:
    raise ConfigError("optimizer.name", cfg.name, f"one of {list(OPTIMIZERS)}")
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
  epochs = list(cfg.decay_epochs)
  if epochs != sorted(set(epochs)) or (epochs and epochs[0] <= cfg.warmup_epochs):
    raise ConfigError("optimizer.decay_epochs", tuple(epochs),
                      f"strictly increasing epochs after warmup_epochs ({cfg.warmup_epochs})")


def peak_learning_rate(cfg, global_batch: int) -> float:
  """base_lr * B / 256 ('linear') or base_lr * sqrt(B) ('sqrt'); SimCLR Appendix B.1."""
  if cfg.lr_scaling == "linear":
    return cfg.base_lr * global_batch / 256
  return cfg.base_lr * math.sqrt(global_batch)


def learning_rate_schedule(cfg, global_batch: int, steps_per_epoch: int, total_steps: int):
  """Linear warm-up from 0 over warmup_epochs, then cosine decay to 0 at total_steps
  ('cosine'), or a constant lr times decay_factor at each of decay_epochs ('step',
  MoCo v1's schedule).

  Returns an optax schedule: step (int) -> learning rate (float32).
  """
  peak = peak_learning_rate(cfg, global_batch)
  warmup = min(int(round(cfg.warmup_epochs * steps_per_epoch)), total_steps)
  if cfg.schedule == "step":
    # join_schedules counts the second schedule's steps from the boundary.
    decay = optax.piecewise_constant_schedule(
        peak, {int(e * steps_per_epoch) - warmup: cfg.decay_factor for e in cfg.decay_epochs})
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=0.0)


def decay_mask(params):
  """True for weights that get weight decay and LARS trust-ratio scaling.

  Biases and BatchNorm parameters (leaves named 'bias' or 'scale') are left out,
  as in SimCLR (Appendix B.1) and BYOL (Sec. 3.3): only conv and dense kernels
  are True. optax.lars applies both to every leaf unless given this mask.
  """
  def keep(path, _):
    return path[-1].key not in ("bias", "scale")
  return jax.tree_util.tree_map_with_path(keep, params)


def build_optimizer(cfg, schedule) -> optax.GradientTransformation:
  """LARS (You et al. 2017) or SGD with momentum, decay masked by decay_mask.

  LARS: trust coefficient cfg.trust_coefficient (SimCLR: 0.001), momentum 0.9.
  SGD: L2 weight decay added to the gradient (torch.optim.SGD style, as in MoCo).
  Nesterov momentum with the optional field cfg.nesterov = True (SimCLR's
  fine-tuning). Optional rather than a default of config_lib.optimizer: the
  optimizer is an identity field, and a new key would make every checkpoint
  saved before it refuse to resume.
  """
  nesterov = cfg.get("nesterov", False)
  if cfg.name == "lars":
    return optax.lars(schedule, weight_decay=cfg.weight_decay, weight_decay_mask=decay_mask,
                      trust_coefficient=cfg.trust_coefficient, trust_ratio_mask=decay_mask,
                      momentum=cfg.momentum, nesterov=nesterov)
  return optax.chain(optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
                     optax.sgd(schedule, momentum=cfg.momentum, nesterov=nesterov))

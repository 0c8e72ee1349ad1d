"""The linear-probe presets: each reference's own linear evaluation (configs/linear_probe.py,
config.preset), and filling a probe config's unset fields from one."""

import ml_collections

from contrastive_jax import recipes

# Linear-probe presets (configs/linear_probe.py): each reference's own linear
# evaluation, with the figures it gives for CIFAR-10 where it has them. Every
# preset keeps the encoder frozen in eval mode, as all three references do
# (SimCLR's model_fn: "Finetune just supervised (linear) head will not update
# BN stats"), and trains on random crops and flips without color changes.
_STANDARDISED = dict(
  batch_size=256,
  duration="100 epochs",
  crop=recipes.crop("torchvision", 0.2, "pil_bilinear"),
  head=dict(standardize=True, init="zeros"),
  optimizer=recipes.optimizer("sgd", 0.1, 0.0, warmup_epochs=0),
)

LINEAR_PROBE_PRESETS = {
  # SimCLR README, CIFAR-10 fine-tuning of the linear head (run.py
  # --train_mode=finetune --fine_tune_after_block=4): momentum optimizer
  # (tf.train.MomentumOptimizer, Nesterov), lr 0.1 x B/256, no weight decay
  # (1e-6 on ImageNet), batch 512, 100 epochs (90 on ImageNet), cosine, no
  # warm-up, logits layer zero-initialised.
  "simclr": dict(
    batch_size=512,
    duration="100 epochs",
    crop=recipes.crop("tensorflow", 0.08, "tf_bicubic"),
    head=dict(standardize=False, init="zeros"),
    optimizer=recipes.optimizer(
      "sgd", 0.1, 0.0, nesterov=True, warmup_epochs=0, weight_decay_mask="all"
    ),
  ),
  # MoCo main_lincls.py (and its CIFAR-10 demo's advice: lr 30, wd 0, 100
  # epochs): SGD momentum 0.9, lr 30 at batch 256, no weight decay, lr x0.1
  # at epochs 60 and 80, RandomResizedCrop(scale 0.08-1) and flip, fc weights
  # normal(0, 0.01), bias 0. The decays as fractions of the run (0.6, 0.8): the
  # same epochs at its 100, and a shorter run (runlocal's) decays too.
  "moco": dict(
    batch_size=256,
    duration="100 epochs",
    crop=recipes.crop("torchvision", 0.08, "pil_bilinear"),
    head=dict(standardize=False, init="normal_0.01"),
    optimizer=recipes.optimizer(
      "sgd",
      30.0,
      0.0,
      warmup_epochs=0,
      schedule="step",
      decay_fractions=(0.6, 0.8),
      weight_decay_mask="all",
    ),
  ),
  # BYOL configs/eval.py and eval_experiment.py: SGD with Nesterov momentum
  # 0.9, base lr 0.2 x B/256, cosine, no warm-up, no weight decay, 80
  # epochs, batch 1024 (the paper's), BYOL's own crop and a flip, hk.Linear's
  # default initialisation.
  "byol": dict(
    batch_size=1024,
    duration="80 epochs",
    crop=recipes.crop("byol", 0.08, "tf_bicubic"),
    head=dict(standardize=False, init="lecun_normal"),
    optimizer=recipes.optimizer(
      "sgd", 0.2, 0.0, nesterov=True, warmup_epochs=0, weight_decay_mask="all"
    ),
  ),
  # MoCo v3 main_lincls.py: SGD momentum 0.9, lr 0.1 x B/256 (its default, the
  # ResNet-50 command; CONFIG.md's ViT commands pass --lr=3), no weight decay,
  # batch 1024, 90 epochs, half-cycle cosine without warm-up, RandomResizedCrop
  # (scale 0.08-1) and flip, fc weights normal(0, 0.01), bias 0.
  "mocov3": dict(
    batch_size=1024,
    duration="90 epochs",
    crop=recipes.crop("torchvision", 0.08, "pil_bilinear"),
    head=dict(standardize=False, init="normal_0.01"),
    optimizer=recipes.optimizer("sgd", 0.1, 0.0, warmup_epochs=0, weight_decay_mask="all"),
  ),
  # DINO eval_linear.py as its README runs it (8 GPUs x --batch_size_per_gpu 128): SGD
  # momentum 0.9, lr 0.001 x B/256, no weight decay, batch 1024, 100 epochs, cosine to 0
  # without warm-up (CosineAnnealingLR), RandomResizedCrop(224) (scale 0.08-1, bilinear)
  # and flip, fc weights normal(0, 0.01), bias 0. (Its ViTs' probe reads the class tokens
  # of the last 4 blocks; this preset reads h, the last one.)
  "dino": dict(
    batch_size=1024,
    duration="100 epochs",
    crop=recipes.crop("torchvision", 0.08, "pil_bilinear"),
    head=dict(standardize=False, init="normal_0.01"),
    optimizer=recipes.optimizer("sgd", 0.001, 0.0, warmup_epochs=0, weight_decay_mask="all"),
  ),
  # This project's own probe, no reference's: h standardised by an
  # affine-free BN (a fixed per-feature affine map, so the classifier stays
  # linear), so that one learning rate fits every encoder, a random one too;
  # SGD momentum 0.9, lr 0.1 x B/256, cosine, no weight decay, crop 0.2-1.
  "standardised": _STANDARDISED,
  # Distillation: LightlyTrain publishes no linear evaluation of its own (its students are
  # evaluated by the user's task); this project's standardised probe, whose one learning
  # rate fits whatever student.
  "distillation": _STANDARDISED,
}


def fill_probe_preset(config, name: str) -> ml_collections.ConfigDict:
  """A copy of a probe config whose unset (None) preset fields take preset `name`'s values.

  The preset fields are batch_size, duration, crop.*, head.* and optimizer.*;
  a value set in the config (e.g. by a --config flag or a config argument such
  as runlocal) wins over the preset's.
  """
  config = config.copy_and_resolve_references()
  preset = LINEAR_PROBE_PRESETS[name]
  flat = {
    "batch_size": preset["batch_size"],
    "duration": preset["duration"],
    **{f"crop.{k}": v for k, v in preset["crop"].items()},
    **{f"head.{k}": v for k, v in preset["head"].items()},
    **{f"optimizer.{k}": v for k, v in preset["optimizer"].items()},
  }
  # A preset's step decays as fractions of the run give way to decay epochs the config set
  # (the two are one choice: methods/optim.py refuses both).
  if config.optimizer.get("decay_epochs") is not None:
    flat.pop("optimizer.decay_fractions", None)
  for path, value in flat.items():
    *parents, leaf = path.split(".")
    node = config
    for parent in parents:
      node = node[parent]
    if node[leaf] is None:
      node[leaf] = value
  return config

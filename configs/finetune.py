"""Fine-tuning a pretrained encoder on few CIFAR-10 labels (config.job='finetune').

  python -m contrastive_jax.main --config=configs/finetune.py \
      --config.pretrain_workdir=DIR --config.label_fraction=0.01 --workdir=FINETUNE_DIR

Set --config.pretrain_workdir=DIR (the pretraining job's --workdir); add
--config.random_init=True for the baseline (the same encoder at its
initialisation). The encoder's architecture and image size come from the
checkpoint's own config. label_fraction: 0.01, 0.1 or 1.0 of each class's
train images (label_seed picks them; every run with the same two trains on
the same images).

Recipe: SimCLR's fine-tuning on 1% and 10% of the labels (Chen et al. 2020,
Appendix B.5): SGD with Nesterov momentum 0.9, lr 0.05 x B/256, no warm-up,
cosine decay, no weight decay, SimCLR's random crop (TensorFlow's
bounding-box sampler, area 0.08 to 1, bicubic; data/crops.py) and flip only,
60 epochs for 1% of the labels and 30 for 10% (--config.duration='30
epochs'); BN in train mode. The batch is 64 here (SimCLR: 4096 on 12.8k
ImageNet images), so that an epoch of 1% (500 images) is several steps.

Options beyond SimCLR's recipe: backbone_lr_multiplier (a lower rate for the
pretrained encoder than for the head, e.g. 0.1) and layer_decay (layer-wise
learning-rate decay as BEiT's fine-tuning, e.g. 0.75: each block's rate that of
the block after it times layer_decay); 1 and 1 (the defaults) train every layer
at one rate. projector_layers (e.g. 1) keeps that many of the projection head's
hidden layers (Dense -> BN -> ReLU) between h and the linear head, as SimCLR v2
fine-tunes from its 3-layer head's first layer (Chen et al. 2020b, Sec. 2); 0
(the default) fine-tunes from h. On the `runlocal` encoders these defaults validated
best, or as well (docs/label_efficiency.md, "Fine-tuning's options").

Argument `runlocal` (--config=configs/finetune.py:runlocal): the same recipe with
fewer evaluations and more frequent logs and checkpoints, for the 2-core CPU: 1% of
CIFAR-10 (500 images, 60 epochs = 420 steps) takes 1 to 3 minutes there, 10% (30
epochs = 2340 steps) about 5.
"""

import ml_collections

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(runlocal=False)


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS)
  config = recipes.data_fields(ml_collections.ConfigDict())
  config.job = "finetune"
  config.format_version = config_files.FORMAT_VERSION
  recipes.pretrained_encoder_fields(config)
  config.label_fraction = 0.01
  config.label_seed = 0
  config.crop = recipes.crop("tensorflow", 0.08, "tf_bicubic")  # SimCLR's crop, as in B.5.
  config.batch_size = 64
  config.duration = "60 epochs"
  config.optimizer = recipes.optimizer(
    "sgd", base_lr=0.05, weight_decay=0.0, warmup_epochs=0, nesterov=True
  )
  # The encoder's rates: backbone_lr_multiplier x layer_decay^(blocks after it + 1)
  # (training/downstream.learning_rate_multipliers); 1 and 1: the head's rate, SimCLR's recipe.
  config.backbone_lr_multiplier = 1.0
  config.layer_decay = 1.0
  # Hidden layers of the projection head kept under the linear head: 0 fine-tunes from h
  # (SimCLR v1's B.5), 1 from the head's first layer (SimCLR v2, Chen et al. 2020b, Sec. 2).
  config.projector_layers = 0
  config.log_every = "100 steps"
  config.checkpoint_every = "1000 steps"
  config.keep_checkpoints = 2
  config.evaluators = dict(
    finetune=dict(kind="classifier", every="10 epochs", split="test", batch_size=1000)
  )
  if args.runlocal:
    config.log_every = "20 steps"
    config.checkpoint_every = "200 steps"
    config.evaluators.finetune.every = "20 epochs"  # Each pass over the test split costs ~10 s.
  return config

"""What pretraining buys at each label count, on CIFAR-10 (config.job='label_efficiency').

  python -m contrastive_jax.main --config=configs/label_efficiency.py \
      --config.pretrain_workdir=DIR --workdir=CURVE_DIR

Set --config.pretrain_workdir=DIR (the pretraining job's --workdir). For each
init of `inits` ('pretrained': its checkpoint; 'random': its encoder at
initialisation; any other name: the weights file `weights` gives that name, read
as the model `weights_config` gives it, e.g. public supervised or DINOv2 weights),
each label count of
`labels` (integers, or fractions of train_split), each of `seeds` seeds and each
protocol of `protocols`, a class-balanced subset of the train split is drawn,
validation_fraction of it held out for the protocol's choices, and the chosen
model scores the test split (jobs/label_efficiency.py). The first init's gain
over the others, with a 95% interval paired by seed, is in summary.json.

Several weights files, each an init of its own name (pretrain_workdir may be left
unset when no init is 'pretrained' or 'random'):

  --config.inits=pretrained,dinov2_s,dinov2_b,random \
  --config.weights='dinov2_s=/w/dinov2_vits14_pretrain.pth;dinov2_b=/w/dinov2_vitb14_pretrain.pth' \
  --config.weights_config='dinov2_s=configs/dinov2.py:model=vit_small_patch14_dinov2;dinov2_b=configs/dinov2.py:model=vit_base_patch14_dinov2'

A file the export job wrote needs no weights_config entry. The one-file form of
older configs, --config.inits=pretrained,weights --config.weights=FILE
--config.weights_config=configs/X.py, still names its init 'weights'.

Protocols: weighted kNN of the frozen h (temperature 0.07 as Wu et al. 2018;
k of knn.k chosen by validation); a linear probe on the frozen h (this
project's standardised probe: affine-free BN, then a zero-initialised linear
layer; Nesterov SGD lr 0.1 x B/256, cosine, no weight decay); fine-tuning the
whole encoder and a linear head with SimCLR's semi-supervised recipe
(configs/finetune.py: Nesterov SGD lr 0.05 x B/256, cosine, no weight decay,
SimCLR's crop and flip, batch 64, 60 epochs); and, if listed ('lp_ft', not by
default), LP-FT (Kumar et al. 2022): that fine-tuning from a linear probe's head (the
probe without its standardising BN). Probe and fine-tune keep the epoch, of those
evaluated every eval_every epochs, of best validation top-1; with an lr_grid of several
multipliers of their base rate (e.g. linear_probe.lr_grid='0.3,1,3'), each rate is
fitted and validation picks the rate and the epoch. Their warm-up and step
decays are fractions of their run (optimizer.warmup_fraction, decay_fractions);
fine-tuning can train the encoder at a lower rate than the head
(finetune.backbone_lr_multiplier, e.g. 0.1) and decay it layer by layer
(finetune.layer_decay, e.g. 0.75, as BEiT).

Argument `runlocal` (--config=configs/label_efficiency.py:runlocal): labels 100,
500 and 1000, 3 seeds, the probe for 50 epochs and fine-tuning for 20, each
validated every 5, for the 2-core CPU. With --config.labels=100,500,1000,5000 it
ran in 25 minutes on a loaded 2-core VM (docs/label_efficiency.md).
"""

import ml_collections
from ml_collections import config_dict

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(runlocal=False)
# The probe's and fine-tuning's warm-up and step decays, in fractions of their run's steps
# (methods/optim.learning_rate_schedule): a count's schedule keeps its shape whatever its steps.
FRACTIONS = dict(warmup_fraction=0.0, decay_fractions=())


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS)
  config = recipes.data_fields(ml_collections.ConfigDict())
  config.job = "label_efficiency"
  config.format_version = config_files.FORMAT_VERSION
  recipes.pretrained_encoder_fields(config)
  config.test_split = "test"
  config.labels = "100,500,1000,5000"  # Counts, or fractions of train_split (e.g. '0.01,0.1').
  config.seeds = 3
  config.validation_fraction = 0.2  # Of each class's share of a subset, at least one image.
  config.inits = "pretrained,random"  # The first init's gain over each other one is reported.
  # 'NAME=FILE;NAME=FILE...': the weights file of each init of inits but pretrained and random.
  config.weights = config_dict.placeholder(str)
  config.weights_config = config_dict.placeholder(str)  # 'NAME=configs/X.py[:ARG];...'.
  config.protocols = "knn,linear_probe,finetune"
  config.auroc = True
  config.curve_metric = "top1"  # curve.png's: 'top1', 'balanced_accuracy' or 'auroc'.
  config.eval_batch_size = 1000
  config.knn = dict(k="10,20,50", temperature=0.07)
  # lr_grid: multipliers of optimizer.base_lr, each fitted; validation picks one ('1': none).
  config.linear_probe = dict(
    epochs=100,
    eval_every=10,
    batch_size=256,
    lr_grid="1",
    optimizer=recipes.optimizer(
      "sgd", base_lr=0.1, weight_decay=0.0, warmup_epochs=0, nesterov=True, **FRACTIONS
    ),
  )
  config.finetune = dict(
    epochs=60,
    eval_every=10,
    batch_size=64,
    lr_grid="1",
    crop=recipes.crop("tensorflow", 0.08, "tf_bicubic"),
    optimizer=recipes.optimizer(
      "sgd", base_lr=0.05, weight_decay=0.0, warmup_epochs=0, nesterov=True, **FRACTIONS
    ),
    backbone_lr_multiplier=1.0,  # The encoder's rate / the head's.
    layer_decay=1.0,  # Layer-wise decay (training/downstream.learning_rate_multipliers).
    projector_layers=0,  # Head layers fine-tuned from (1: SimCLR v2's); 0: from h.
  )
  config.evaluators = {}  # The job scores its cells itself (validation, then test).
  if args.runlocal:
    config.labels = "100,500,1000"
    config.linear_probe.epochs = 50
    config.linear_probe.eval_every = 5
    config.finetune.epochs = 20
    config.finetune.eval_every = 5
  return config

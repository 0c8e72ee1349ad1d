"""Linear probe of a pretrained encoder on CIFAR-10 (config.job='linear_probe').

  python -m contrastive_jax.main --config=configs/linear_probe.py \
      --config.pretrain_workdir=DIR --workdir=PROBE_DIR

Set --config.pretrain_workdir=DIR (the pretraining job's --workdir). The
encoder's architecture and image size come from the checkpoint's own config;
it stays frozen in eval mode. config.preset chooses the recipe
(probe_presets.LINEAR_PROBE_PRESETS): 'auto' (the default) runs the linear
evaluation of the reference of the checkpoint's method ('simclr': SimCLR
README's, Nesterov SGD lr 0.1 x B/256, batch 512, 100 epochs, cosine; 'moco':
main_lincls.py's, SGD lr 30, batch 256, 100 epochs, x0.1 at 60% and 80% of the run;
'byol': BYOL's, Nesterov SGD lr 0.2 x B/256, batch 1024, 80 epochs, cosine;
each with its reference's crop and head initialisation, no weight decay);
'standardised' runs this project's own probe (h standardised by an affine-free
BN, SGD lr 0.1 x B/256, batch 256, 100 epochs, crop 0.2-1), whichever the
method. The preset fills the fields left None here (batch_size, duration,
crop.*, head.*, optimizer.*); a value given with --config wins. The probe
logs the preset it ran and saves it, resolved, as config.preset with its
checkpoints. Top-1 and top-5 on the whole test split at the end (and every
10 epochs).

Argument `runlocal` (--config=configs/linear_probe.py:runlocal): 1000 steps at batch
256 (about 5 epochs) of the preset's recipe, sized for a 2-core CPU; every preset's
schedule keeps its shape (cosine to the run's end; MoCo's decays at 60% and 80% of it).

The presets and their sources: docs/jobs.md (Linear probe), docs/recipes.md.
"""

import ml_collections
from ml_collections import config_dict

from contrastive_jax import config_files
from contrastive_jax import recipes

ARGS = dict(runlocal=False)


def get_config(arg: str = ""):
  args = config_files.parse_args(arg, ARGS)
  config = recipes.data_fields(ml_collections.ConfigDict())
  config.job = "linear_probe"
  config.format_version = config_files.FORMAT_VERSION
  recipes.pretrained_encoder_fields(config)
  config.preset = "auto"
  # None: the preset's value.
  config.batch_size = config_dict.placeholder(int)
  config.duration = config_dict.placeholder(str)
  config.crop = dict(
    sampler=config_dict.placeholder(str),
    area_min=config_dict.placeholder(float),
    resize=config_dict.placeholder(str),
  )
  config.head = dict(standardize=config_dict.placeholder(bool), init=config_dict.placeholder(str))
  config.optimizer = {
    key: config_dict.placeholder(type(value))
    for key, value in recipes.optimizer("sgd", 0.1, 0.0).items()
  }
  config.optimizer.decay_fractions = config_dict.placeholder(tuple)  # MoCo's preset's.
  config.log_every = "100 steps"
  config.checkpoint_every = "1000 steps"
  config.keep_checkpoints = 2
  config.evaluators = dict(
    linear_probe=dict(kind="classifier", every="10 epochs", split="test", batch_size=1000)
  )
  if args.runlocal:
    config.batch_size = 256
    config.duration = "1000 steps"
    config.log_every = "50 steps"
    config.checkpoint_every = "250 steps"
  return config

"""Linear probe of a pretrained encoder on CIFAR-10 (python -m contrastive_jax.linear_probe).

Set --config.pretrain_workdir=DIR (the pretraining job's --workdir). The
encoder's architecture and image size come from the checkpoint's own config.
Recipe: 100 epochs, batch 256, SGD momentum 0.9, lr 0.1 x B/256 with cosine
decay, no weight decay, crop (0.2, 1) and flip.

Variant `runlocal`: 1000 steps (~5 epochs), sized for a 2-core CPU.
"""
import ml_collections
from ml_collections import config_dict

from contrastive_jax import config_lib


def get_config(variant: str = ""):
  config = ml_collections.ConfigDict()
  config.pretrain_workdir = config_dict.placeholder(str)
  config.pretrain_step = -1  # -1: the latest checkpoint.
  config.random_init = False  # True: probe the pretraining run's encoder at initialisation (baseline).
  config.model_name = config_dict.placeholder(str)  # If set, the checkpoint's model must match.
  config.seed = 0
  config.dataset = "cifar10"
  config.data_dir = config_dict.placeholder(str)
  config.train_split = "train"
  config.eval_split = "test"
  config.crop_area_min = 0.2
  config.cache = True
  config.shuffle_buffer = 50_000
  config.data_threads = 2
  config.batch_size = 256
  config.eval_batch_size = 1000
  config.num_epochs = 100
  config.total_steps = -1  # > 0 overrides num_epochs.
  config.optimizer = config_lib.optimizer("sgd", base_lr=0.1, weight_decay=0.0, warmup_epochs=0)
  config.log_every_steps = 100
  config.checkpoint_every_steps = 1000
  if variant == "runlocal":
    config.total_steps = 1000
    config.log_every_steps = 50
    config.checkpoint_every_steps = 250
  elif variant:
    raise ValueError(f"Unknown variant {variant!r} of linear_probe; known: 'runlocal'.")
  return config

"""Linear probe of a pretrained encoder on CIFAR-10 (config.job='linear_probe').

  python -m contrastive_jax.main --config=configs/linear_probe.py \
      --config.pretrain_workdir=DIR --workdir=PROBE_DIR

Set --config.pretrain_workdir=DIR (the pretraining job's --workdir). The
encoder's architecture and image size come from the checkpoint's own config.
Recipe: 100 epochs, batch 256, SGD momentum 0.9, lr 0.1 x B/256 with cosine
decay, no weight decay, crop (0.2, 1) and flip; top-1 and top-5 on the whole
test split at the end (and every 10 epochs).

Variant `runlocal`: 1000 steps (~5 epochs), sized for a 2-core CPU.
"""
import ml_collections

from contrastive_jax import config_lib


def get_config(variant: str = ""):
  config = config_lib.data_fields(ml_collections.ConfigDict())
  config.job = "linear_probe"
  config_lib.pretrained_encoder_fields(config)
  config.crop_area_min = 0.2
  config.batch_size = 256
  config.duration = "100 epochs"
  config.optimizer = config_lib.optimizer("sgd", base_lr=0.1, weight_decay=0.0, warmup_epochs=0)
  config.log_every = "100 steps"
  config.checkpoint_every = "1000 steps"
  config.keep_checkpoints = 2
  config.evaluators = dict(linear_probe=dict(kind="classifier", every="10 epochs", split="test",
                                             batch_size=1000))
  if variant == "runlocal":
    config.duration = "1000 steps"
    config.log_every = "50 steps"
    config.checkpoint_every = "250 steps"
  elif variant:
    raise ValueError(f"Unknown variant {variant!r} of linear_probe; known: 'runlocal'.")
  return config

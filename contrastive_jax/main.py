"""Pretraining job: python -m contrastive_jax.main --config=configs/X.py --workdir=DIR.

Every config field can be overridden on the command line, e.g.
--config.batch_size=512 or --config=configs/simclr_cifar10.py:runlocal.
A workdir that holds a checkpoint resumes from it.
"""
import sys

import jax
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from contrastive_jax import metrics
from contrastive_jax import train
from contrastive_jax.errors import ConfigError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:variant]).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() first (multi-host TPU pods).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  metrics.quiet_library_logs()
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  logging.info("JAX process %d of %d, %d local devices of %d.", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  try:
    train.train(_CONFIG.value, _WORKDIR.value)
  except ConfigError as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main)

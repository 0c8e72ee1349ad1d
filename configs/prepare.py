"""Prepares a folder of image files as a TFDS dataset (config.job='prepare').

  python -m contrastive_jax.main --config=configs/prepare.py --workdir=/tmp/tfds \
      --config.src=/photos --config.name=photos

The workdir is the TFDS data directory: the dataset is written to
WORKDIR/NAME/1.0.0/, and jobs read it with --config.dataset=NAME
--config.data_dir=WORKDIR. Runs on Apache Beam (pip install -e '.[beam]');
docs/images.md has the layout rules, the report and the Beam options.
"""

import ml_collections
from ml_collections import config_dict

from contrastive_jax import config_files

ARGS = {}


def get_config(arg: str = ""):
  config_files.parse_args(arg, ARGS)
  config = ml_collections.ConfigDict()
  config.job = "prepare"
  config.src = config_dict.placeholder(str)  # Folder of image files (any depth), local or gs://.
  config.name = config_dict.placeholder(str)  # Dataset name: lowercase letters, digits and '_'.
  config.image_size = 256  # Stored shorter side in pixels (never upscaled); 0: every own size.
  config.format = "jpeg"  # Storage encoding: 'jpeg' (quality 95) or 'png' (lossless).
  config.max_pixels = 100_000_000  # Files whose header claims more are skipped, not decoded.
  config.holdout_fraction = 0.1  # Of each class, held out as test when src has no val/test.
  config.seed = 0  # Of the held-out choice.
  config.overwrite = False  # True: replace a dataset of this name from other files or options.
  config.beam = ml_collections.ConfigDict(
    dict(
      runner="DirectRunner",  # This machine; or e.g. 'DataflowRunner'.
      direct_num_workers=0,  # DirectRunner's worker processes; 0: one per core; 1: in-process.
      options="",  # More Beam pipeline options, as on a command line ('--project=P ...').
    )
  )
  return config

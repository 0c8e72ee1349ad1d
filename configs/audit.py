"""Duplicate and leakage audit of embed job outputs (config.job='audit').

  python -m contrastive_jax.main --config=configs/audit.py --workdir=AUDIT_DIR \
      --config.index_workdir=TRAIN_EMBED_DIR --config.against=TEST_EMBED_DIR,VAL_EMBED_DIR

index_workdir: the reference (train split, or a folder), embedded with the embed job;
its pairs of rows scoring at least threshold are duplicates. against: other splits'
embed outputs (comma-separated, may be empty), made with the same checkpoint; each of
their rows that scores at least threshold with a reference row is a leak.

threshold: the cosine similarity from which a pair is reported. The default 0.999 is
calibrated on a 20,000-photo corpus with the SimCLR CIFAR-10 runlocal encoder (32 px,
D = 128; docs/search.md): re-encoded, resized copies scored 0.9996 to 1, two different
photos at most 0.998. An encoder's scores have their own scale: calibrate it again for
another encoder (benchmarks/audit.py).
k: neighbours searched per row (self excluded); a row whose k-th neighbour still
scores at least threshold is counted in summary.json (it may have more pairs).
search: 'auto' searches the reference's ANN index when it has one (not 'flat'),
'exact' always exactly.
"""

import ml_collections
from ml_collections import config_dict

from contrastive_jax import config_files

ARGS = {}


def get_config(arg: str = ""):
  config_files.parse_args(arg, ARGS)
  config = ml_collections.ConfigDict()
  config.job = "audit"
  config.index_workdir = config_dict.placeholder(str)  # The reference's embed --workdir.
  config.against = ""  # Other splits' embed workdirs, comma-separated.
  config.threshold = 0.999  # Cosine similarity; calibrated in docs/search.md.
  config.k = 10
  config.search = "auto"  # Or 'exact'.
  config.chunk_size = 65536  # Reference rows scored per device step (exact search).
  config.picture_pairs = 16  # Top pairs drawn in pairs.png.
  config.cell = 96  # Pixels per image in pairs.png.
  return config

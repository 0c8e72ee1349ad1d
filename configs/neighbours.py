"""Search by image in an embed job's index (config.job='neighbours').

  python -m contrastive_jax.main --config=configs/neighbours.py --workdir=DIR \
      --config.index_workdir=EMBED_DIR --config.queries=/photos/new/a.jpg,/photos/new/b.jpg
  python -m contrastive_jax.main --config=configs/neighbours.py --workdir=DIR \
      --config.index_workdir=EMBED_DIR --config.query_rows=0,50,100

Queries (comma-separated): image files or names of the index's rows
(index.jsonl), and row numbers of the index in query_rows.
"""
import ml_collections
from ml_collections import config_dict

from contrastive_jax import recipes

VARIANTS = ()


def get_config(variant: str = ""):
  recipes.check_variant(variant, VARIANTS)
  config = ml_collections.ConfigDict()
  config.job = "neighbours"
  config.index_workdir = config_dict.placeholder(str)  # The embed job's --workdir.
  config.queries = ""
  config.query_rows = ""
  config.k = 8
  config.chunk_size = 65536  # Index rows scored per device step.
  config.cell = 96  # Pixels per image in neighbours.png.
  config.max_pixels = 100_000_000  # Query files whose header claims more are not decoded.
  return config

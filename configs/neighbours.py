"""Search by image in an embed job's index (config.job='neighbours').

  python -m contrastive_jax.main --config=configs/neighbours.py --workdir=DIR \
      --config.index_workdir=EMBED_DIR --config.queries=/photos/new/a.jpg,/photos/new/b.jpg
  python -m contrastive_jax.main --config=configs/neighbours.py --workdir=DIR \
      --config.index_workdir=EMBED_DIR --config.query_rows=0,50,100

Queries: image files or names of the index's rows (the name column of its metadata/
shards), comma-separated in queries or one per line in the text file queries_file
(for names that have a comma: each line is taken as it is, blank lines skipped), and
row numbers of the index in query_rows. Rows come first, then queries, then queries_file.

search: 'auto' searches the index's ANN index (ann.json) when it has one and
exactly otherwise; 'exact' always exactly.

docs/images.md (Search by image), docs/search.md (the ANN index).
"""

import ml_collections
from ml_collections import config_dict

from contrastive_jax import config_files

ARGS = {}


def get_config(arg: str = ""):
  config_files.parse_args(arg, ARGS)
  config = ml_collections.ConfigDict()
  config.job = "neighbours"
  config.index_workdir = config_dict.placeholder(str)  # The embed job's --workdir.
  config.queries = ""
  config.queries_file = ""  # A text file of queries, one per line.
  config.query_rows = ""
  config.k = 8
  config.search = "auto"  # Or 'exact'.
  config.chunk_size = 65536  # Index rows scored per device step (exact search).
  config.cell = 96  # Pixels per image in neighbours.png.
  config.max_pixels = 100_000_000  # Query files whose header claims more are not decoded.
  return config

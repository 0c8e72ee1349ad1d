"""A 2-D map of an embed job's index: UMAP or t-SNE, PNGs and TensorBoard's projector
(config.job='map').

  python -m contrastive_jax.main --config=configs/map.py --workdir=DIR \
      --config.index_workdir=EMBED_DIR
  python -m contrastive_jax.main --config=configs/map.py --workdir=DIR \
      --config.index_workdir=EMBED_DIR --config.method=tsne --config.max_points=5000

Needs the map extra: pip install 'contrastive_jax[map]'. UMAP is the default: on
this project's 2-core machine it mapped 10,000 points of D = 128 several times
faster than t-SNE (docs/images.md).
"""

import ml_collections
from ml_collections import config_dict

from contrastive_jax import config_files

ARGS = {}


def get_config(arg: str = ""):
  config_files.parse_args(arg, ARGS)
  config = ml_collections.ConfigDict()
  config.job = "map"
  config.index_workdir = config_dict.placeholder(str)  # The embed job's --workdir.
  config.method = "umap"  # Or 'tsne'.
  config.max_points = 10_000  # Rows mapped: a sample seeded by seed when the index has more.
  config.seed = 0  # The sample, PCA, the projection and k-means.
  config.pca_dims = 50  # PCA to this many dimensions first (0: none).
  config.umap = ml_collections.ConfigDict({"n_neighbors": 15, "min_dist": 0.1})  # umap-learn's.
  config.tsne = ml_collections.ConfigDict({"perplexity": 30.0})  # scikit-learn's default.
  config.threads = 1  # For t-SNE, k-means and PCA; 0: a thread per core (slow on a busy machine).
  config.clusters = 10  # k-means clusters that colour an unlabelled index.
  config.size = 1024  # Side in pixels of the plot in map.png and thumbnails.png.
  config.thumbnail = 32  # Side in pixels of a thumbnail (thumbnails.png, the projector's sprite).
  return config

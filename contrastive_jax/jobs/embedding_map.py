"""The map job (config.job='map'): a 2-D map of an embed job's index.

  python -m contrastive_jax.main --config=configs/map.py --workdir=DIR \
      --config.index_workdir=EMBED_DIR

A seeded sample of at most config.max_points rows of the index (all of them
if fewer) is projected to 2-D by UMAP (McInnes, Healy and Melville 2018,
umap-learn) or t-SNE (van der Maaten and Hinton 2008, scikit-learn's
Barnes-Hut TSNE), after a PCA to config.pca_dims dimensions (scikit-learn).
Points are coloured by class when the index is labelled, else by a k-means
clustering (scikit-learn, config.clusters clusters) of the sampled embeddings.
Writes to the workdir (process 0; every file atomically, map.json last):

  map.png         the points as dots coloured by class (or cluster), with a
                  legend; the title says what was projected and how.
  thumbnails.png  the same layout with thumbnails of images at their places:
                  one per square of config.thumbnail pixels (the point closest
                  to its centre), framed in its class's colour, each
                  centre-cropped as the encoder saw it.
  map.csv         row (of the index), name, label (empty if unlabelled),
                  cluster (empty if labelled), x, y: one line per point.
  map.json        index_workdir, method, its parameters, pca_dims (or null),
                  seed, sample_size, index_rows, coloured_by, clusters,
                  projection_seconds. Its presence marks a complete map.
  projector_config.pbtxt, projector_embeddings.tsv, projector_metadata.tsv,
  projector_sprite.png
                  TensorBoard's projector: the sampled embeddings (float32
                  [n, D], the index's own), their name and class (or cluster)
                  and a sprite of their thumbnails: `tensorboard --logdir DIR`
                  shows them in the Projector tab (which projects them itself).
  TensorBoard     map.png and thumbnails.png, images 'map' and 'thumbnails' at
                  step 0.

UMAP and t-SNE come with the `map` extra (pip install 'contrastive_jax[map]');
they are imported only when the job runs. Not a training loop, so not run by
runner.run.
"""

import contextlib
import csv
import importlib
import importlib.util
import io
import json
import math
import sys
import time

from absl import logging
from clu import metric_writers
from google.protobuf import text_format
import jax
import numpy as np
from PIL import Image
from tensorboard.plugins import projector
from tensorboard.plugins.projector import metadata as projector_metadata
import tensorflow as tf

from contrastive_jax.core import files
from contrastive_jax.core import pictures
from contrastive_jax.core import scatter
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.search import index as index_lib

METHODS = ("umap", "tsne")
_NAMES = {"umap": "UMAP", "tsne": "t-SNE"}  # As map.png's title names them.
MAP, THUMBNAILS, TABLE, META = "map.png", "thumbnails.png", "map.csv", "map.json"
PROJECTOR_TENSORS = "projector_embeddings.tsv"
PROJECTOR_METADATA = "projector_metadata.tsv"
PROJECTOR_SPRITE = "projector_sprite.png"
PROJECTOR_CONFIG = (
  projector_metadata.PROJECTOR_FILENAME
)  # Where the projector looks for its config.
MAX_POINTS = 100_000  # Beyond this a CPU projects for hours and the projector's browser tab stalls.
MAX_SIZE = 8192  # The largest plot side: map.png is then 200 MB of pixels in memory.
SPRITE_SIDE = 8192  # TensorBoard's projector reads sprites of at most 8192 x 8192 pixels.
INSTALL = "pip install 'contrastive_jax[map]'"
_READ_CHUNK = 1000  # Images read and cropped at a time: memory stays small for large photos.
# The packages each method needs: (import name, PyPI name). PCA and k-means are scikit-learn's.
_PACKAGES = {
  "umap": [("sklearn", "scikit-learn"), ("umap", "umap-learn")],
  "tsne": [("sklearn", "scikit-learn")],
}


def check_config(config):
  """Raises ConfigError for fields that cannot run, before the index is read."""
  if config.method not in METHODS:
    raise ConfigError("method", config.method, f"one of {list(METHODS)}")
  if not 2 <= config.max_points <= MAX_POINTS:
    raise ConfigError(
      "max_points",
      config.max_points,
      f"an integer in [2, {MAX_POINTS}] (beyond it a CPU projects for hours and "
      "the projector's browser tab stalls)",
    )
  for field, value, low in (
    ("seed", config.seed, 0),
    ("pca_dims", config.pca_dims, 0),
    ("threads", config.threads, 0),
    ("clusters", config.clusters, 2),
    ("umap.n_neighbors", config.umap.n_neighbors, 2),
  ):
    if value < low:
      raise ConfigError(field, value, f"an integer >= {low}")
  if config.umap.min_dist < 0:
    raise ConfigError("umap.min_dist", config.umap.min_dist, "a distance >= 0")
  if config.tsne.perplexity <= 0:
    raise ConfigError("tsne.perplexity", config.tsne.perplexity, "a number > 0")
  if not 128 <= config.size <= MAX_SIZE:
    raise ConfigError("size", config.size, f"a side in pixels in [128, {MAX_SIZE}]")
  if not 8 <= config.thumbnail <= config.size // 4:
    raise ConfigError(
      "thumbnail", config.thumbnail, f"a side in pixels in [8, size / 4 = {config.size // 4}]"
    )
  for module, package in _PACKAGES[config.method]:
    if importlib.util.find_spec(module) is None:
      raise ConfigError(
        "method",
        config.method,
        f"a method whose library is installed: {config.method!r} needs {package} ({INSTALL})",
      )
  if not config.index_workdir or not index_lib.is_index(files.resolve_dir(config.index_workdir)):
    raise ConfigError(
      "index_workdir",
      config.index_workdir,
      f"the workdir of a finished embed job (holding {index_lib.META} and the shards it lists)",
    )


def check_sample(config, size: int, labelled: bool):
  """Raises ConfigError when size points are too few for the method's parameters.

  t-SNE calibrates each point's Gaussian on its 3 x perplexity nearest
  points (scikit-learn's TSNE), UMAP builds its graph from n_neighbors
  nearest; k-means needs a point per cluster.
  """
  if config.method == "tsne" and size <= 3 * config.tsne.perplexity:
    raise ConfigError(
      "tsne.perplexity",
      config.tsne.perplexity,
      f"less than a third of the points mapped ({size}: the index's rows, at most max_points)",
    )
  if config.method == "umap" and size <= config.umap.n_neighbors:
    raise ConfigError(
      "umap.n_neighbors",
      config.umap.n_neighbors,
      f"less than the number of points mapped ({size}: the index's rows, at most max_points)",
    )
  if not labelled and config.clusters > size:
    raise ConfigError(
      "clusters",
      config.clusters,
      f"at most the number of points mapped ({size}), the index being unlabelled",
    )


def sample_rows(num_rows: int, max_points: int, seed: int) -> np.ndarray:
  """The index rows to map, int64 [min(num_rows, max_points)], ascending: all of them, or a
  uniform sample without replacement drawn by numpy's default_rng(seed)."""
  if num_rows <= max_points:
    return np.arange(num_rows)
  return np.sort(np.random.default_rng(seed).choice(num_rows, max_points, replace=False))


def parameters(config) -> dict:
  """The method's parameters as map.json records them (config.umap or config.tsne, plus what is
  fixed here)."""
  if config.method == "umap":
    return {
      "n_neighbors": config.umap.n_neighbors,
      "min_dist": config.umap.min_dist,
      "metric": "euclidean",
      "init": "spectral",
    }
  return {
    "perplexity": config.tsne.perplexity,
    "metric": "euclidean",
    "init": "pca",
    "learning_rate": "auto",
  }


def project(x: np.ndarray, config):
  """The 2-D map of x by config.method: (float32 [N, 2], the PCA's dimensions or None).

  The rows are L2-normalised, so Euclidean distance orders pairs as cosine
  similarity does. A PCA to config.pca_dims dimensions comes first when that
  is fewer than x has (0: none): it keeps the directions the points vary
  most in and makes both methods' nearest-neighbour searches, whose cost
  grows with the dimension, cheaper. Deterministic for config.seed
  on one machine and library version (UMAP then runs on one thread).

  Args:
    x: float32 [N, D], N large enough for the method (check_sample).
  Raises:
    ConfigError: the method's package is not installed.
  """
  x = np.asarray(x, np.float32)
  pca_dims = None
  if 0 < config.pca_dims < min(x.shape):
    decomposition = _import("sklearn.decomposition", config)
    pca_dims = config.pca_dims
    x = decomposition.PCA(pca_dims, random_state=config.seed).fit_transform(x)
  if config.method == "umap":
    # n_jobs=1: a seeded UMAP runs on one thread anyway, and says so in a warning otherwise.
    reducer = _import("umap", config).UMAP(
      n_components=2,
      n_neighbors=config.umap.n_neighbors,
      min_dist=config.umap.min_dist,
      metric="euclidean",
      init="spectral",
      random_state=config.seed,
      n_jobs=1,
    )
  else:
    reducer = _import("sklearn.manifold", config).TSNE(
      n_components=2,
      perplexity=config.tsne.perplexity,
      init="pca",
      learning_rate="auto",
      random_state=config.seed,
    )
  return np.asarray(reducer.fit_transform(x), np.float32), pca_dims


def clusters(x: np.ndarray, config) -> np.ndarray:
  """k-means (scikit-learn, k-means++ seeded by config.seed) of x's rows: int [N] in
  [0, config.clusters)."""
  cluster = _import("sklearn.cluster", config)
  # 4 seeded starts, the best kept: one start can merge two clusters and split another.
  return cluster.KMeans(config.clusters, n_init=4, random_state=config.seed).fit_predict(
    np.asarray(x, np.float32)
  )


def thread_limit(config):
  """A context in which OpenMP and BLAS (scikit-learn's t-SNE, k-means, PCA) run on at most
  config.threads threads (threadpoolctl); 0 leaves their default, a thread per core.

  On a machine busy with other work, OpenMP's threads wait for each other:
  t-SNE of 300 points took 37 s with 2 threads and 0.9 s with 1 on this
  project's 2-core machine under a load of 10 (2026-12-01). A seeded UMAP
  runs on one thread whatever this says.
  """
  if not config.threads:
    return contextlib.nullcontext()
  return _import("threadpoolctl", config).threadpool_limits(limits=config.threads)


def _keep_triton_out():
  """Makes `import triton` raise ImportError in this process once TensorFlow is loaded.

  TensorFlow's 2.20 and 2.21 wheels load their statically linked LLVM into the global
  symbol table (RTLD_GLOBAL); Triton's libtriton, loaded after it, binds to that LLVM and
  crashes the interpreter with SIGSEGV (tensorflow/tensorflow#124205). umap's package
  imports torch and torchvision where they are installed (for its parametric UMAP, which
  this job does not use), and torchvision probes for Triton. An ImportError makes torch
  take Triton as absent; a later import of it in this process would crash anyway.
  """
  if "tensorflow" in sys.modules and "triton" not in sys.modules:
    if importlib.util.find_spec("triton") is not None:
      sys.modules["triton"] = None


def _import(module: str, config):
  """module, imported now; ConfigError naming config.method and the extra if it is missing."""
  if module == "umap":
    _keep_triton_out()
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ConfigError(
      "method", config.method, f"a method whose library is installed: {e} ({INSTALL})"
    ) from None


def _refuse_existing_map(workdir: str):
  """Raises JobError if workdir holds a complete map (one is never overwritten)."""
  if tf.io.gfile.exists(f"{workdir}/{META}"):
    raise JobError(
      f"--workdir={workdir}: already holds a map ({META}, {MAP}); use a new workdir or delete them"
    )


def run(config, workdir: str):
  """Maps a sample of config.index_workdir's rows to 2-D; writes the map to workdir.

  Returns what map.json holds on process 0, None on the others. Holds the
  workdir's lock (files.workdir_lock) once the config is checked.

  Raises:
    ConfigError: before any compute: see check_config and check_sample.
    JobError: a workdir that is a file, that already holds a map or that
      another job is running in; an image of the index that cannot be read
      again (ImageError; then nothing is written).
  """
  workdir = files.prepare_workdir(workdir)
  _refuse_existing_map(workdir)
  check_config(config)
  index_workdir = files.resolve_dir(config.index_workdir)
  index = index_lib.load_index(index_workdir)
  labelled = index.class_names is not None
  rows = sample_rows(len(index.rows), config.max_points, config.seed)
  check_sample(config, len(rows), labelled)
  with files.workdir_lock(workdir):
    _refuse_existing_map(workdir)  # Again: a job that held the lock may have written one.
    if jax.process_index() != 0:  # One process maps: the work is on the host, not the devices.
      return None
    return _map_and_write(config, workdir, index_workdir, index, rows)


def _thumbnails(index: index_lib.Index, rows, cell: int) -> list:
  """uint8 [cell, cell, 3] per row: its image read again and centre-cropped as the encoder saw it
  (the neighbours job's reading and crop), _READ_CHUNK rows at a time."""
  side = index.eval_crop.shorter_side(max(cell, index.eval_crop.size))
  out = []
  for start in range(0, len(rows), _READ_CHUNK):
    part = [int(r) for r in rows[start : start + _READ_CHUNK]]
    read = index_lib.read_images(index, part, side)
    out += [index_lib.center_crop(index, read[r], cell) for r in part]
  return out


def _map_and_write(config, workdir: str, index_workdir: str, index: index_lib.Index, rows):
  """run's work on process 0 once the workdir is locked; returns what map.json holds."""
  labelled = index.class_names is not None
  # Read first: an image that is gone stops the job before the projection's minutes.
  logging.info("Reading %d images of %s.", len(rows), index_workdir)
  images = _thumbnails(index, rows, config.thumbnail)
  x = np.asarray(index.embeddings[rows], np.float32)
  logging.info(
    "Projecting %d of %d rows (D = %d) with %s.",
    len(rows),
    len(index.rows),
    x.shape[1],
    config.method,
  )
  with thread_limit(config):
    start = time.perf_counter()
    xy, pca_dims = project(x, config)
    seconds = time.perf_counter() - start
    if labelled:
      names, coloured_by = list(index.class_names), "class"
      # Rows added from a folder without class folders have no label: one more group.
      groups = np.asarray([index.rows[r].get("label", len(names)) for r in rows])
      if (groups == len(names)).any():
        names.append("(no label)")
    else:
      groups = clusters(x, config)
      names = [f"cluster {i}" for i in range(config.clusters)]
      coloured_by = "k-means cluster"

  tf.io.gfile.makedirs(workdir)
  title = f"{_NAMES[config.method]} of {len(rows)} of {len(index.rows)} rows, coloured by " + (
    "class" if labelled else f"k-means cluster (k={config.clusters}; no labels)"
  )
  picture = scatter.scatter(xy, groups, names, size=config.size, title=title, seed=config.seed)
  pictures.write_png(f"{workdir}/{MAP}", picture)
  view = scatter.thumbnails(
    xy, dict(enumerate(images)), groups, names, size=config.size, cell=config.thumbnail, title=title
  )
  pictures.write_png(f"{workdir}/{THUMBNAILS}", view)
  _write_table(f"{workdir}/{TABLE}", index, rows, groups, labelled, xy)
  _write_projector(workdir, index, rows, x, [names[g] for g in groups], images)
  writer = metric_writers.create_default_writer(workdir, asynchronous=False)
  writer.write_images(0, {"map": picture[None], "thumbnails": view[None]})
  writer.close()
  meta = {
    "index_workdir": index_workdir,
    "method": config.method,
    "parameters": parameters(config),
    "pca_dims": pca_dims,
    "seed": config.seed,
    "sample_size": len(rows),
    "index_rows": len(index.rows),
    "coloured_by": coloured_by,
    "clusters": None if labelled else config.clusters,
    "projection_seconds": round(seconds, 3),
  }
  files.write_atomic(f"{workdir}/{META}", json.dumps(meta, indent=1).encode())
  logging.info(
    "Wrote the map of %d points to %s (projection: %.1f s).", len(rows), workdir, seconds
  )
  return meta


def _write_table(path: str, index: index_lib.Index, rows, groups, labelled: bool, xy):
  """map.csv: a header, then row, name, label, cluster, x, y per point (csv's quoting; x and y
  to 9 digits, which give back their float32 values)."""
  buffer = io.StringIO()
  table = csv.writer(buffer, lineterminator="\n")
  table.writerow(["row", "name", "label", "cluster", "x", "y"])
  for row, group, (x, y) in zip(rows, groups, xy):
    label, cluster = (index.rows[row].get("label", ""), "") if labelled else ("", int(group))
    table.writerow([int(row), index.rows[row]["name"], label, cluster, f"{x:.9g}", f"{y:.9g}"])
  files.write_atomic(path, buffer.getvalue())


def _tsv_field(text: str) -> str:
  """text as one field of the projector's TSV: its tabs and line breaks become spaces."""
  return " ".join(str(text).replace("\t", " ").splitlines())


def _write_projector(workdir: str, index: index_lib.Index, rows, x, classes, images):
  """The projector's files and its projector_config.pbtxt (tensorboard.plugins.projector's
  ProjectorConfig), paths relative to the workdir as the projector resolves them.

  The sprite's thumbnails shrink when config.thumbnail of them per row would
  make it wider than SPRITE_SIDE.
  """
  buffer = io.BytesIO()
  np.savetxt(buffer, x, fmt="%.8g", delimiter="\t")
  files.write_atomic(f"{workdir}/{PROJECTOR_TENSORS}", buffer.getvalue())
  lines = ["name\tclass"] + [
    f"{_tsv_field(index.rows[r]['name'])}\t{_tsv_field(c)}" for r, c in zip(rows, classes)
  ]
  files.write_atomic(f"{workdir}/{PROJECTOR_METADATA}", "\n".join(lines) + "\n")
  cell = min(images[0].shape[0], SPRITE_SIDE // math.ceil(math.sqrt(len(images))))
  if cell != images[0].shape[0]:
    images = [np.asarray(Image.fromarray(i).resize((cell, cell), Image.BILINEAR)) for i in images]
  pictures.write_png(f"{workdir}/{PROJECTOR_SPRITE}", scatter.sprite(images))
  config = projector.ProjectorConfig()
  embedding = config.embeddings.add()
  embedding.tensor_name = "embeddings"
  embedding.tensor_path = PROJECTOR_TENSORS
  embedding.tensor_shape.extend(x.shape)
  embedding.metadata_path = PROJECTOR_METADATA
  embedding.sprite.image_path = PROJECTOR_SPRITE
  embedding.sprite.single_image_dim.extend([cell, cell])
  files.write_atomic(f"{workdir}/{PROJECTOR_CONFIG}", text_format.MessageToString(config))

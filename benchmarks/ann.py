"""Measures the ANN indexes against exact search in one run; prints a table.

  python benchmarks/ann.py                       # 1,000,000 random unit vectors, D = 128
  python benchmarks/ann.py --rows=100000 --threads=2
  python benchmarks/ann.py --index_workdir=/tmp/photos_index   # an embed job's embeddings

For each index: build time, size on disk (FAISS's serialized index, ScaNN's
saved folder), recall@k against exact search (the share of the exact k
nearest it returns, over all queries), queries/s, and queries/s as a multiple
of exact search's measured in the same run. Exact search is FAISS's
IndexFlatIP searching all queries in one batch (BLAS); each index searches
the same batch. Every search runs after one untimed warm-up search. Random
unit vectors are the hardest case for an ANN index (no clusters, every
direction equally likely); embeddings of images are far easier.

The rows marked 'default' are what the embed job builds for --rows rows
(jobs/ann.py's choose with no overrides). ScaNN is measured when its
pybind module loads (scann 1.4.2's `import scann` loads TensorFlow ops built
against another TensorFlow than this project's, so only its pybind searcher
is used, without its package's __init__).
"""
import importlib.util
import os
import sys
import tempfile
import time
import types

# Time the package this script sits in, not another installed copy of it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ml_collections  # pylint: disable=g-import-not-at-top
import numpy as np
from absl import app
from absl import flags

from contrastive_jax import recipes
from contrastive_jax.jobs import ann as ann_lib
from contrastive_jax.jobs import index as index_lib

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "embed.py")
_ROWS = flags.DEFINE_integer("rows", 1_000_000, "Random unit vectors in the index.")
_DIM = flags.DEFINE_integer("dim", 128, "Their dimension.")
_QUERIES = flags.DEFINE_integer("queries", 1000, "Queries (random unit vectors, or index rows "
                                "with --index_workdir).")
_K = flags.DEFINE_integer("k", 10, "Neighbours per query (recall@k).")
_THREADS = flags.DEFINE_integer("threads", 2, "FAISS (OpenMP) threads.")
_INDEX_WORKDIR = flags.DEFINE_string("index_workdir", None, "An embed job's workdir: its "
                                     "embeddings instead of random vectors.")
_TYPES = flags.DEFINE_string("types", "ivfpq,ivf", "FAISS index types measured besides the "
                             "default (jobs/ann.py: hnsw, ivf, ivfpq); HNSW takes the longest "
                             "to build.")
_EF_SEARCH = flags.DEFINE_string("ef_search", "64,128,512",
                                 "HNSW efSearch values measured besides the default.")
_NPROBE_FRACTIONS = flags.DEFINE_string("nprobe_fractions", "0.0625,0.125,0.5",
                                        "IVF nprobe values, as fractions of nlist, measured "
                                        "besides the default.")
_SCANN = flags.DEFINE_bool("scann", True, "Measure ScaNN too, when it loads.")


def unit_rows(rng, n: int, d: int) -> np.ndarray:
  """float32 [n, d] rows uniform on the unit sphere (normalised Gaussians)."""
  x = rng.standard_normal((n, d), dtype=np.float32)
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  return x


def recall(found: np.ndarray, exact: np.ndarray) -> float:
  """The share of each query's exact k rows (int [Q, k]) among its found ones, averaged."""
  return float(np.mean([len(set(f) & set(e)) / len(e) for f, e in zip(found, exact)]))


def timed_search(search, queries):
  """(rows [Q, k], seconds) of search(queries), after one untimed warm-up on a few queries."""
  search(queries[:16])
  start = time.perf_counter()
  rows = search(queries)
  return rows, time.perf_counter() - start


def load_scann():
  """ScaNN's pybind searcher module (scann_ops_pybind), or None with why."""
  spec = importlib.util.find_spec("scann")
  if spec is None:
    return None, "not installed"
  if "scann" not in sys.modules:  # Skip scann/__init__.py, which loads its TensorFlow ops.
    package = types.ModuleType("scann")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["scann"] = package
  try:
    from scann.scann_ops.py import scann_ops_pybind  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return None, str(e)
  return scann_ops_pybind, None


def folder_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)


def main(_):
  faiss = ann_lib.faiss_module("ann.type", "auto", "'none'")
  faiss.omp_set_num_threads(_THREADS.value)
  rng = np.random.default_rng(0)
  if _INDEX_WORKDIR.value:
    saved = index_lib.load_index(_INDEX_WORKDIR.value)
    bank = np.ascontiguousarray(np.asarray(saved.embeddings), np.float32)
    queries = bank[np.sort(rng.choice(len(bank), min(_QUERIES.value, len(bank)), replace=False))]
    what = f"{_INDEX_WORKDIR.value}'s embeddings"
  else:
    bank, queries = unit_rows(rng, _ROWS.value, _DIM.value), unit_rows(rng, _QUERIES.value,
                                                                       _DIM.value)
    what = "random unit vectors"
  n, d, k = len(bank), bank.shape[1], _K.value
  print(f"{n} x {d} {what}, {len(queries)} queries, k={k}, {_THREADS.value} FAISS threads, "
        f"faiss {faiss.__version__}, load average at start {os.getloadavg()[0]:.1f}")
  table = []

  def row(name, build_s, size, found, seconds):
    table.append((name, build_s, size, recall(found, exact_rows), len(queries) / seconds,
                  exact_s / seconds))
    print("  measured:", table[-1], flush=True)

  start = time.perf_counter()
  flat = faiss.IndexFlatIP(d)
  flat.add(bank)
  flat_build = time.perf_counter() - start
  exact_rows, exact_s = timed_search(lambda q: flat.search(q, k)[1], queries)
  row("exact: faiss IndexFlatIP", flat_build, n * d * 4, exact_rows, exact_s)

  auto = recipes.load_config_file(CONFIG, "CONFIG").ann  # The embed job's defaults.
  default = ann_lib.choose(n, d, auto)
  specs = [default] if default["type"] != "flat" else []
  specs += [spec for spec in (ann_lib.choose(n, d, ml_collections.ConfigDict(dict(auto, type=t)))
                              for t in _TYPES.value.split(",") if t)
            if spec["factory"] != default["factory"]]
  for spec in specs:
    start = time.perf_counter()
    built = ann_lib.build(bank, spec, threads=_THREADS.value)
    build_s = time.perf_counter() - start
    size = len(faiss.serialize_index(built))
    if spec["type"] == "hnsw":
      values = sorted({spec["params"]["efSearch"], *map(int, _EF_SEARCH.value.split(","))})
    else:
      nlist = spec["params"]["nlist"]
      values = sorted({spec["params"]["nprobe"], *(max(1, round(nlist * float(f)))
                                                   for f in _NPROBE_FRACTIONS.value.split(","))})
    for value in values:
      if spec["type"] == "hnsw":
        built.hnsw.efSearch = value
        name = f"{spec['factory']} efC={spec['params']['efConstruction']} efSearch={value}"
        is_default = spec is default and value == spec["params"]["efSearch"]
      else:
        faiss.extract_index_ivf(built).nprobe = value
        name = f"{spec['factory']} nprobe={value}" + (
            f" k_factor={spec['params']['k_factor']}" if spec["type"] == "ivfpq" else "")
        is_default = spec is default and value == spec["params"]["nprobe"]
      found, seconds = timed_search(lambda q, b=built: b.search(q, k)[1], queries)
      row(name + (" (default)" if is_default else ""), build_s, size, found, seconds)
    del built

  scann, why = load_scann() if _SCANN.value else (None, "--noscann")
  if scann is None:
    print(f"ScaNN not measured: {why}")
  else:
    leaves = int(2 ** round(np.log2(np.sqrt(n))))
    start = time.perf_counter()
    searcher = scann.builder(bank, k, "dot_product").tree(
        num_leaves=leaves, num_leaves_to_search=leaves // 10,
        training_sample_size=min(n, 250_000)).score_ah(
            2, anisotropic_quantization_threshold=0.2).reorder(200).build()
    build_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
      searcher.serialize(folder)
      size = folder_bytes(folder)
    for fraction in (16, 8, 4, 2):
      for reorder in (100, 1000):
        found, seconds = timed_search(lambda q, f=fraction, r=reorder: searcher.search_batched(
            q, leaves_to_search=leaves // f, pre_reorder_num_neighbors=r)[0], queries)
        row(f"ScaNN tree {leaves} leaves, search {leaves // fraction}, AH 2, reorder {reorder}",
            build_s, size, found, seconds)

  print(f"\nload average at end {os.getloadavg()[0]:.1f}\n")
  print("| index | build (s) | size (MB) | recall@%d | queries/s | x exact |" % k)
  print("|---|---|---|---|---|---|")
  for name, build_s, size, rec, qps, ratio in table:
    print(f"| {name} | {build_s:.1f} | {size / 1e6:.0f} | {rec:.3f} | {qps:.0f} | {ratio:.1f} |")


if __name__ == "__main__":
  app.run(main)

"""Measures the ANN indexes against exact search in one run; prints a table.

  python benchmarks/ann.py                       # 1,000,000 random unit vectors, D = 128
  python benchmarks/ann.py --rows=100000 --threads=2
  python benchmarks/ann.py --index_workdir=/tmp/photos_index   # an embed job's embeddings
  python benchmarks/ann.py --views_file=/tmp/cifar10_views.npz  # benchmarks/view_embeddings.py's

For each index: build time, size on disk (FAISS's serialized index, ScaNN's
saved folder), recall@k against exact search (the share of the exact k
nearest it returns, over all queries), queries/s, and queries/s as a multiple
of exact search's measured in the same run. Exact search is FAISS's
IndexFlatIP searching all queries in one batch (BLAS); each index searches
the same batch. The project's own exact search (exact.top_k_cosine, which
the neighbours and audit jobs use) is measured beside it on the same batch,
with whether its rows are FAISS's. Every search runs after one untimed warm-up search. Random
unit vectors are the hardest case for an ANN index (no clusters, every
direction equally likely); embeddings of images are far easier.

The rows marked 'default' are what the embed job builds for --rows rows
(jobs/ann.py's choose with configs/embed.py's ann fields, its nprobe
calibrated to their recall on the rows themselves; the build time includes
the calibration). The default type is measured at each nprobe fraction and
k_factor asked for. ScaNN is measured when its
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

from contrastive_jax.core import runtime

if __name__ == "__main__":
  runtime.setup()  # Every process setting first, before the imports below (core/runtime.py).

from absl import app
from absl import flags
import ml_collections  # pylint: disable=g-import-not-at-top
import numpy as np

from contrastive_jax import config_files
from contrastive_jax.search import ann as ann_lib
from contrastive_jax.search import exact
from contrastive_jax.search import index as index_lib

CONFIG = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "embed.py"
)
FLAGS = flags.FLAGS
EXACT_CHUNK = 65_536  # configs/neighbours.py's chunk_size.


def define_flags():
  """Registers the command-line flags (not at import, so that tests can import this file)."""
  flags.DEFINE_integer("rows", 1_000_000, "Random unit vectors in the index.")
  flags.DEFINE_integer("dim", 128, "Their dimension.")
  flags.DEFINE_integer(
    "queries",
    1000,
    "Queries: random unit vectors, index rows held out of the indexes (--index_workdir) "
    "or views of images none of whose views are in them (--views_file).",
  )
  flags.DEFINE_integer("k", 10, "Neighbours per query (recall@k).")
  flags.DEFINE_integer("threads", 2, "FAISS (OpenMP) threads.")
  flags.DEFINE_string(
    "index_workdir", None, "An embed job's workdir: its embeddings instead of random vectors."
  )
  flags.DEFINE_string(
    "views_file",
    None,
    "benchmarks/view_embeddings.py's npz instead: the queries one view each of --queries "
    "images none of whose views are in the indexes.",
  )
  flags.DEFINE_string(
    "types",
    "ivf",
    "FAISS index types measured besides the default "
    "(jobs/ann.py: hnsw, ivf, ivfpq); HNSW takes the longest to build.",
  )
  flags.DEFINE_string(
    "ef_search", "64,128,512", "HNSW efSearch values measured besides the default."
  )
  flags.DEFINE_string(
    "nprobe_fractions",
    "0.0625,0.125,0.25,0.5",
    "IVF nprobe values, as fractions of nlist, measured besides the default.",
  )
  flags.DEFINE_string("k_factors", "10", "IVFPQ k_factor values measured besides the default.")
  flags.DEFINE_bool("scann", True, "Measure ScaNN too, when it loads.")
  flags.DEFINE_string(
    "max_memory",
    "",
    "A memory budget (config.ann.max_memory, e.g. '40MB'): instead of the types above, "
    "measure the indexes 'auto' chooses from within it (ann.candidates that fit, the "
    "chosen one first, up to --budget_indexes of them), re-ranked as the jobs search them.",
  )
  flags.DEFINE_integer("budget_indexes", 3, "Indexes measured within --max_memory.")
  flags.DEFINE_integer(
    "pca", 0, "With --max_memory: also measure IVF-SQ8 after a PCA to this many dimensions."
  )
  flags.DEFINE_integer(
    "clusters",
    0,
    "With random rows: draw them around this many random centres (0: uniform on the sphere).",
  )


def unit_rows(rng, n: int, d: int) -> np.ndarray:
  """float32 [n, d] rows uniform on the unit sphere (normalised Gaussians)."""
  x = rng.standard_normal((n, d), dtype=np.float32)
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  return x


def new_images_views(rng, rows: np.ndarray, image: np.ndarray, num: int) -> tuple:
  """(bank, queries): the rows [N, D] (views of images: image int [N] names each row's)
  of all but `num` images drawn by rng (at most half of them), and the first row of each
  of those, in the order of their image numbers: queries [num, D] as new products'
  photos, none of whose views the bank holds."""
  images = np.unique(image)
  new = rng.choice(images, min(num, len(images) // 2), replace=False)
  held_out = np.isin(image, new)
  _, first = np.unique(image[held_out], return_index=True)
  return rows[~held_out], rows[held_out][first]


def clustered_rows(rng, n: int, d: int, clusters: int, spread: float = 0.25) -> np.ndarray:
  """float32 [n, d] unit rows: a random centre of `clusters` each, plus spread x a random
  unit vector, normalised. Synthetic structure, not photos' neighbourhoods."""
  centres = unit_rows(rng, clusters, d)
  x = centres[rng.integers(clusters, size=n)] + spread * unit_rows(rng, n, d)
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  return x


def measure_budget(
  bank, queries, *, k: int, threads: int, max_memory: str, indexes: int, pca: int = 0
):
  """Within a memory budget: [(index, estimated bytes, FAISS bytes, nprobe, calibrated recall,
  recall@k, queries/s, queries/s over exact's)], exact search (FAISS IndexFlatIP) first, then
  the index 'auto' chooses within max_memory and the smaller candidates that fit (ann.candidates),
  at most `indexes`, each built, calibrated and searched as the jobs do (re-ranked with bank);
  then, with pca > 0, 'ivfsq8' after a PCA to pca dimensions, where it fits.
  """
  faiss = ann_lib.faiss_module("ann.type", "auto", "'none'")
  faiss.omp_set_num_threads(threads)
  n, d = bank.shape
  flat = faiss.IndexFlatIP(d)
  flat.add(bank)
  exact_rows, exact_s = timed_search(lambda q: flat.search(q, k)[1], queries)
  table = [
    ("exact: faiss IndexFlatIP", n * d * 4, n * d * 4, None, 1.0, 1.0, len(queries) / exact_s, 1.0)
  ]
  config = config_files.load_config_file(CONFIG, "CONFIG").ann
  config = ml_collections.ConfigDict(dict(config, max_memory=max_memory, threads=threads))
  budget = ann_lib.max_memory(config)
  chosen = ann_lib.choose(n, d, config)
  specs = [s for s in ann_lib.candidates(n, d, config) if ann_lib.estimate_bytes(s, n, d) <= budget]
  specs = specs[:indexes]
  if pca:
    projected = ml_collections.ConfigDict(dict(config, type="ivfsq8", pca=pca, max_memory=""))
    specs += [ann_lib.choose(n, d, projected)]
  for spec in specs:
    if ann_lib.estimate_bytes(spec, n, d) > budget:
      continue
    spec = dict(spec, memory={"budget": budget, "estimate": ann_lib.estimate_bytes(spec, n, d)})
    built, spec = ann_lib.build(bank, spec, threads=threads)
    rerank = ann_lib.reranker(spec, bank)
    found, seconds = timed_search(
      lambda q, b=built, r=rerank: ann_lib.search(b, q, k, r)[1], queries
    )
    mark = " (chosen)" if spec["factory"] == chosen["factory"] else ""
    table.append(
      (
        spec["factory"] + mark,
        spec["memory"]["estimate"],
        len(faiss.serialize_index(built)),
        spec["params"].get("nprobe"),
        (spec["calibration"] or {}).get("recall", 1.0),
        recall(found, exact_rows),
        len(queries) / seconds,
        exact_s / seconds,
      )
    )
    print("  measured:", table[-1], flush=True)
    del built
  return table


def report_budget(table: list, k: int) -> str:
  """measure_budget's table in markdown."""
  lines = [
    f"| index | estimated (MB) | FAISS file (MB) | nprobe | calibrated | recall@{k} | queries/s "
    "| x exact |",
    "|---|---|---|---|---|---|---|---|",
  ]
  lines += [
    f"| {name} | {estimate / 1e6:.2f} | {size / 1e6:.2f} | {nprobe or ''} | {calibrated:.3f} "
    f"| {rec:.3f} | {qps:.0f} | {ratio:.1f} |"
    for name, estimate, size, nprobe, calibrated, rec, qps, ratio in table
  ]
  return "\n".join(lines)


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


def _ints(values: str) -> list:
  return [int(v) for v in values.split(",") if v]


def _settings(spec: dict, *, ef_search: list, nprobe_fractions: list, k_factors: list) -> list:
  """[(params, name)]: the search-time settings measured on a built index of spec, its own first."""
  params = spec["params"]
  if spec["type"] == "hnsw":
    options = [dict(params, efSearch=e) for e in [params["efSearch"], *ef_search]]
  elif spec["type"] in ("ivf", "ivfpq"):
    nprobes = [params["nprobe"], *(max(1, round(params["nlist"] * f)) for f in nprobe_fractions)]
    factors = [params["k_factor"], *k_factors] if spec["type"] == "ivfpq" else [None]
    options = [
      dict(params, nprobe=p, **({"k_factor": f} if f else {})) for p in nprobes for f in factors
    ]
  else:
    options = [params]
  unique = []
  for option in options:
    if option not in unique:
      unique.append(option)
  return [
    (
      option,
      " ".join(f"{key}={value}" for key, value in option.items() if key not in ("M", "nlist")),
    )
    for option in unique
  ]


def measure(
  bank: np.ndarray,
  queries: np.ndarray,
  *,
  k: int,
  threads: int,
  types: list,
  ef_search: list,
  nprobe_fractions: list,
  k_factors: list,
  scann: bool,
) -> list:
  """Measures exact search, the embed job's default index for bank and `types`, and ScaNN.

  Args:
    bank: float32 [N, D] unit rows; queries: float32 [Q, D] unit rows.
    k: neighbours per query.
    threads: FAISS's OpenMP threads.
    types: FAISS index types (jobs/ann.py) measured besides the default.
    ef_search, nprobe_fractions, k_factors: search settings measured besides
      each index's defaults.
    scann: whether to measure ScaNN (when it loads).
  Returns:
    [(name, build seconds, bytes, recall@k, queries/s, queries/s over exact's)],
    exact search first.
  """
  faiss = ann_lib.faiss_module("ann.type", "auto", "'none'")
  faiss.omp_set_num_threads(threads)
  n, d = bank.shape
  table = []

  def row(name, build_s, size, found, seconds):
    table.append(
      (name, build_s, size, recall(found, exact_rows), len(queries) / seconds, exact_s / seconds)
    )
    print("  measured:", table[-1], flush=True)

  start = time.perf_counter()
  flat = faiss.IndexFlatIP(d)
  flat.add(bank)
  flat_build = time.perf_counter() - start
  exact_rows, exact_s = timed_search(lambda q: flat.search(q, k)[1], queries)
  row("exact: faiss IndexFlatIP", flat_build, n * d * 4, exact_rows, exact_s)
  # The project's own exact search (exact.top_k_cosine, as the jobs' config.chunk_size).
  # Compiled untimed for all the queries' blocks (the warm-up's 16 are another shape).
  exact.top_k_cosine(queries, bank, k, chunk_size=EXACT_CHUNK)
  own_rows, own_s = timed_search(
    lambda q: exact.top_k_cosine(q, bank, k, chunk_size=EXACT_CHUNK)[1], queries
  )
  row("exact: contrastive_jax top_k_cosine", 0.0, n * d * 4, own_rows, own_s)
  print(f"  top_k_cosine rows identical to IndexFlatIP's: {np.array_equal(own_rows, exact_rows)}")

  auto = config_files.load_config_file(CONFIG, "CONFIG").ann  # The embed job's defaults.
  default = ann_lib.choose(n, d, auto)
  specs = [default] if default["type"] != "flat" else []
  specs += [
    spec
    for spec in (ann_lib.choose(n, d, ml_collections.ConfigDict(dict(auto, type=t))) for t in types)
    if spec["factory"] != default["factory"]
  ]
  for number, spec in enumerate(specs):
    start = time.perf_counter()
    built, spec = ann_lib.build(bank, spec, threads=threads)  # Calibrated, as the embed job's.
    build_s = time.perf_counter() - start
    size = len(faiss.serialize_index(built))
    for params, name in _settings(
      spec, ef_search=ef_search, nprobe_fractions=nprobe_fractions, k_factors=k_factors
    ):
      ann_lib.set_search_params(faiss, built, dict(spec, params=params))
      # As the jobs search (ann.search: at least the calibration's k, the best k kept).
      found, seconds = timed_search(lambda q, b=built: ann_lib.search(b, q, k)[1], queries)
      own = params == spec["params"]
      mark = (
        " (default)"
        if number == 0 and default["type"] != "flat" and own
        else " (calibrated)"
        if own and spec["calibration"]
        else ""
      )
      row(f"{spec['factory']} {name}{mark}", build_s, size, found, seconds)
    del built

  module, why = load_scann() if scann else (None, "--noscann")
  if module is None:
    print(f"ScaNN not measured: {why}")
    return table
  leaves = int(2 ** round(np.log2(np.sqrt(n))))
  start = time.perf_counter()
  searcher = (
    module.builder(bank, k, "dot_product")
    .tree(
      num_leaves=leaves,
      num_leaves_to_search=max(1, leaves // 10),
      training_sample_size=min(n, 250_000),
    )
    .score_ah(2, anisotropic_quantization_threshold=0.2)
    .reorder(200)
    .build()
  )
  build_s = time.perf_counter() - start
  with tempfile.TemporaryDirectory() as folder:
    searcher.serialize(folder)
    size = folder_bytes(folder)
  for fraction in (16, 8, 4, 2):
    for reorder in (100, 1000):
      searched = max(1, leaves // fraction)
      found, seconds = timed_search(
        lambda q, s=searched, r=reorder: searcher.search_batched(
          q, leaves_to_search=s, pre_reorder_num_neighbors=r
        )[0],
        queries,
      )
      row(
        f"ScaNN tree {leaves} leaves, search {searched}, AH 2, reorder {reorder}",
        build_s,
        size,
        found,
        seconds,
      )
  return table


def report(table: list, k: int) -> str:
  """measure's table in markdown."""
  lines = [
    f"| index | build (s) | size (MB) | recall@{k} | queries/s | x exact |",
    "|---|---|---|---|---|---|",
  ]
  lines += [
    f"| {name} | {build_s:.1f} | {size / 1e6:.0f} | {rec:.3f} | {qps:.0f} | {ratio:.1f} |"
    for name, build_s, size, rec, qps, ratio in table
  ]
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  rng = np.random.default_rng(0)
  if FLAGS.index_workdir:
    saved = index_lib.load_index(FLAGS.index_workdir)
    rows = np.ascontiguousarray(np.asarray(saved.embeddings), np.float32)
    # Held out: queries that the indexes do not hold, as a new photo is (an HNSW graph
    # links each row it holds to its neighbours, so its own rows are found more easily).
    held_out = np.zeros(len(rows), bool)
    held_out[rng.choice(len(rows), min(FLAGS.queries, len(rows) // 2), replace=False)] = True
    bank, queries = rows[~held_out], rows[held_out]
    what = f"{FLAGS.index_workdir}'s embeddings (the queries {len(queries)} others of them)"
  elif FLAGS.views_file:
    with np.load(FLAGS.views_file) as saved:
      bank, queries = new_images_views(rng, saved["embeddings"], saved["image"], FLAGS.queries)
    what = f"views of images ({FLAGS.views_file}; the queries a view each of {len(queries)} others)"
  elif FLAGS.clusters:
    rows = clustered_rows(rng, FLAGS.rows + FLAGS.queries, FLAGS.dim, FLAGS.clusters)
    bank, queries = rows[: FLAGS.rows], rows[FLAGS.rows :]
    what = f"random unit vectors around {FLAGS.clusters} random centres (spread 0.25)"
  else:
    bank = unit_rows(rng, FLAGS.rows, FLAGS.dim)
    queries = unit_rows(rng, FLAGS.queries, FLAGS.dim)
    what = "random unit vectors"
  print(
    f"{len(bank)} x {bank.shape[1]} {what}, {len(queries)} queries, k={FLAGS.k}, "
    f"{FLAGS.threads} FAISS threads, load average at start {os.getloadavg()[0]:.1f}"
  )
  if FLAGS.max_memory:
    table = measure_budget(
      bank,
      queries,
      k=FLAGS.k,
      threads=FLAGS.threads,
      max_memory=FLAGS.max_memory,
      indexes=FLAGS.budget_indexes,
      pca=FLAGS.pca,
    )
    print(f"\nload average at end {os.getloadavg()[0]:.1f}\n")
    print(f"Within --max_memory={FLAGS.max_memory} (raw vectors: {bank.nbytes / 1e6:.1f} MB):")
    print(report_budget(table, FLAGS.k))
    return
  table = measure(
    bank,
    queries,
    k=FLAGS.k,
    threads=FLAGS.threads,
    types=[t for t in FLAGS.types.split(",") if t],
    ef_search=_ints(FLAGS.ef_search),
    nprobe_fractions=[float(f) for f in FLAGS.nprobe_fractions.split(",") if f],
    k_factors=_ints(FLAGS.k_factors),
    scann=FLAGS.scann,
  )
  print(f"\nload average at end {os.getloadavg()[0]:.1f}\n")
  print(report(table, FLAGS.k))


if __name__ == "__main__":
  define_flags()
  app.run(main)

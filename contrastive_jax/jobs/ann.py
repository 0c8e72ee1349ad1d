"""The approximate-nearest-neighbour (ANN) index of an embed job's output, built with FAISS.

Two files beside the embeddings (index.py), so that a search service can load
the index with FAISS alone, without this package:

  ann.G.faiss  the FAISS index in FAISS's own format (faiss.read_index), G
               the index's generation (0, then one more per add); row i of
               the embeddings is FAISS id i. Inner product metric: the rows
               are unit vectors, so scores are cosine similarities.
  ann.json     what it is: {"format_version", "library": "faiss",
               "library_version", "file", "bytes", "type" ('flat', 'hnsw',
               'ivf' or 'ivfpq'), "factory" (faiss.index_factory's string),
               "params" (build and search parameters), "metric", "rows",
               "dim", "embed_run" (embed.json's run_id)}.

The type comes from the row count by default (choose): an exact flat index
below EXACT_BELOW rows, 'ivfpq' from there: an inverted file whose lists hold
4-bit product-quantization codes of 2 dimensions each, scanned with SIMD
lookups (FAISS's "fast scan"), the best k_factor x k re-ranked exactly with
the stored vectors. Chosen by benchmarks/ann.py's measurements
(docs/search.md): on random unit vectors, the hardest case, it gave more
recall per query time than FAISS's HNSW and IVF-Flat and than ScaNN, and
built faster than HNSW (42 s against 131 s for 200,000 rows). FAISS is an
extra (pip install 'contrastive_jax[search]'), imported only when an index
is built or read.

Sources: Malkov & Yashunin 2018, "Efficient and robust approximate nearest
neighbor search using Hierarchical Navigable Small World graphs" (HNSW, M,
efConstruction, efSearch); Jegou et al. 2011, "Product quantization for
nearest neighbor search" (the inverted file, nlist, nprobe, product
quantization, re-ranking); André et al. 2017, "Accelerated nearest neighbor
search with quick ADC" (4-bit codes scanned with SIMD lookups); Guo et al.
2020, "Accelerating large-scale inference with anisotropic vector
quantization" (ScaNN, 2 dimensions per 4-bit code); the FAISS documentation
(github.com/facebookresearch/faiss/wiki: index_factory strings, HNSW and IVF
parameters, fast-scan PQ).
"""
import importlib.util
import json
import logging

import numpy as np
import tensorflow as tf

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.core import files

FORMAT_VERSION = 1
META = "ann.json"
TYPES = ("auto", "none", "flat", "hnsw", "ivf", "ivfpq")
# Below this many rows the exact flat index is chosen: exact search took 23 to
# 26 ms per query per 1,000,000 rows here (batched; it grows with the rows), so
# about 2 ms below 100,000 rows, not worth the recall an ANN index gives up
# (0.87 at 16 times the speed on random vectors; docs/search.md).
EXACT_BELOW = 100_000
# HNSW (not chosen by 'auto'): M 32 and FAISS's own efConstruction 40; efSearch 256
# found 0.93 of the 10 nearest of 30,000 random unit vectors, at about exact
# search's speed (docs/search.md): a graph needs structure in the data to skip rows.
HNSW_M, HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH = 32, 40, 256
# nprobe = nlist / 2 and k_factor 20 unless given: on 1,000,000 random unit
# vectors, recall@10 0.87 at 16 times exact search's queries/s (k_factor 10:
# 0.81 at 10 to 20 times, two runs; recall 0.95 needed 3/4 of the lists and
# k_factor 40, at 10 times; docs/search.md).
IVF_NPROBE_FRACTION = 1 / 2
IVFPQ_K_FACTOR = 20
_ADD_CHUNK = 65_536  # Rows handed to FAISS at a time: a memory-mapped part is read piecewise.


def faiss_module(field: str, value, instead: str):
  """FAISS, imported here so that the base install (without it) imports every module.

  Raises:
    ConfigError: FAISS is not installed, naming the field that needs it and
      the value (`instead`) that does without.
  """
  # FAISS's loader logs, at INFO, each SIMD build it tries and fails to import
  # (with a ModuleNotFoundError each) before the one it loads: noise in a job's log.
  logging.getLogger("faiss.loader").setLevel(logging.WARNING)
  try:
    import faiss  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError(field, value, f"{instead} unless FAISS is installed: pip install "
                      f"'contrastive_jax[search]' ({e})") from None
  return faiss


def check_config(ann, *, adding: bool = False):
  """Raises ConfigError for config.ann fields that cannot build an index: FAISS missing too,
  for a type named or for an add (its index may hold one); 'auto' on a new index does
  without (has_faiss)."""
  if ann.type not in TYPES:
    raise ConfigError("ann.type", ann.type, f"one of {TYPES}")
  if ann.type not in ("none", "auto") or (adding and ann.type == "auto"):
    faiss_module("ann.type", ann.type, "'none'")
  for field in ("hnsw_m", "ef_construction", "ef_search", "nlist", "nprobe", "k_factor"):
    if ann[field] < 0:
      raise ConfigError(f"ann.{field}", ann[field], "an integer >= 0 (0: chosen from the rows)")
  if ann.threads < 0:
    raise ConfigError("ann.threads", ann.threads, "an integer >= 0 (0: every core)")


def has_faiss() -> bool:
  """Whether FAISS is installed (the search extra)."""
  return importlib.util.find_spec("faiss") is not None


def choose(num_rows: int, dim: int, ann) -> dict:
  """The index type and parameters for num_rows rows of dimension dim: config.ann's, or chosen.

  Returns {"type", "factory", "params"}, or None for ann.type 'none'.
  'auto' is 'flat' below EXACT_BELOW rows and 'ivfpq' from there; a
  parameter of 0 takes its default (IVF: nlist sqrt(N) rounded to a power of
  two, nprobe nlist / 2; 'ivfpq': dim / 2 codes of 4 bits, k_factor 20, the
  candidates re-ranked exactly per neighbour asked for).
  """
  kind = ann.type
  if kind == "none":
    return None
  if kind == "auto":
    kind = "flat" if num_rows < EXACT_BELOW else "ivfpq"
  if kind == "flat":
    return {"type": "flat", "factory": "Flat", "params": {}}
  if kind == "hnsw":
    m = ann.hnsw_m or HNSW_M
    params = {"M": m, "efConstruction": ann.ef_construction or HNSW_EF_CONSTRUCTION,
              "efSearch": ann.ef_search or HNSW_EF_SEARCH}
    return {"type": "hnsw", "factory": f"HNSW{m},Flat", "params": params}
  # sqrt(N) lists: k-means of 4 sqrt(N) (FAISS's guideline) took minutes at 1,000,000 rows here.
  nlist = ann.nlist or int(2 ** round(np.log2(np.sqrt(max(num_rows, 1)))))
  nlist = min(nlist, max(num_rows, 1))  # k-means needs at least one row per list.
  nprobe = min(ann.nprobe or max(1, round(nlist * IVF_NPROBE_FRACTION)), nlist)
  if kind == "ivf":
    return {"type": "ivf", "factory": f"IVF{nlist},Flat", "params": {"nlist": nlist,
                                                                       "nprobe": nprobe}}
  codes = dim // 2 if dim % 2 == 0 else dim  # 2 dimensions per 4-bit code (1 if dim is odd).
  return {"type": "ivfpq", "factory": f"IVF{nlist},PQ{codes}x4fs,RFlat",
          "params": {"nlist": nlist, "nprobe": nprobe,
                     "k_factor": ann.k_factor or IVFPQ_K_FACTOR}}


def set_search_params(faiss, index, spec: dict):
  """Sets the spec's search-time parameters (efSearch, nprobe, k_factor) on a FAISS index."""
  if spec["type"] == "hnsw":
    faiss.downcast_index(index).hnsw.efSearch = spec["params"]["efSearch"]
  if spec["type"] in ("ivf", "ivfpq"):
    faiss.extract_index_ivf(index).nprobe = spec["params"]["nprobe"]
  if spec["type"] == "ivfpq":
    faiss.downcast_index(index).k_factor = spec["params"]["k_factor"]


def build(embeddings, spec: dict, *, threads: int = 0):
  """A FAISS index of spec (choose) holding every row of embeddings, id i for row i.

  Args:
    embeddings: float32 [N, D] unit rows; any array-like with len, shape and
      slices (a memory-mapped .npy, index.Parts).
    spec: {"type", "factory", "params"} from choose.
    threads: FAISS's OpenMP threads (0: every core).
  Returns:
    The faiss.Index, its search parameters set. An IVF index trains its
    k-means (and product quantizer) on at most 64 rows per list or 65,536
    rows, whichever is more, drawn with a fixed seed.
  """
  faiss = faiss_module("ann.type", spec["type"], "'none'")
  if threads:
    faiss.omp_set_num_threads(threads)
  dim = embeddings.shape[1]
  index = faiss.index_factory(dim, spec["factory"], faiss.METRIC_INNER_PRODUCT)
  if spec["type"] == "hnsw":
    faiss.downcast_index(index).hnsw.efConstruction = spec["params"]["efConstruction"]
  if spec["type"] in ("ivf", "ivfpq"):
    count = min(len(embeddings), max(64 * spec["params"]["nlist"], 65_536))
    sample = np.sort(np.random.default_rng(0).choice(len(embeddings), count, replace=False))
    index.train(np.ascontiguousarray(embeddings[sample], np.float32))
  add(index, embeddings, 0)
  set_search_params(faiss, index, spec)
  return index


def add(index, embeddings, start: int):
  """Adds rows start.. of embeddings (float32 [N, D]) to a FAISS index, in chunks."""
  for begin in range(start, len(embeddings), _ADD_CHUNK):
    index.add(np.ascontiguousarray(embeddings[begin:begin + _ADD_CHUNK], np.float32))


def write(workdir: str, index, spec: dict, *, generation: int, embed_run: str) -> dict:
  """Writes the FAISS index to WORKDIR/ann.GENERATION.faiss atomically; returns its description.

  The description is what ann.json holds (the module docstring); the caller
  writes it (index.py writes embed.json, then ann.json).
  """
  faiss = faiss_module("ann.type", spec["type"], "'none'")
  name = f"ann.{generation}.faiss"
  content = faiss.serialize_index(index).tobytes()
  files.write_atomic(f"{workdir}/{name}", content)
  return {"format_version": FORMAT_VERSION, "library": "faiss",
          "library_version": faiss.__version__, "file": name, "bytes": len(content),
          "type": spec["type"], "factory": spec["factory"], "params": spec["params"],
          "metric": "inner_product", "rows": int(index.ntotal), "dim": int(index.d),
          "embed_run": embed_run}


def write_meta(workdir: str, description: dict):
  """Writes ann.json (atomically)."""
  files.write_atomic(f"{workdir}/{META}", json.dumps(description, indent=1).encode())


def check(description: dict, *, rows: int, dim: int, embed_run: str, where: str):
  """Raises JobError if an ANN description does not fit its index, naming what differs.

  Args:
    description: embed.json's "ann" (ann.json's content).
    rows, dim, embed_run: embed.json's row count, dimension and run_id.
    where: the index folder as the user gave it, for the message.
  """
  version = description.get("format_version")
  if version != FORMAT_VERSION:
    raise JobError(f"{where}: the ANN index's format_version={version!r}: must be "
                   f"{FORMAT_VERSION} (written by another version of contrastive_jax; embed "
                   "again, or build it with --config.ann.type)")
  for key, want in (("embed_run", embed_run), ("dim", dim), ("rows", rows)):
    if description.get(key) != want:
      raise JobError(f"{where}: the ANN index {description.get('file')} has {key}="
                     f"{description.get(key)!r}: must be the embeddings' ({want!r}); it was "
                     "built from another embed run or dimension")


def load(workdir: str, description: dict, *, where: str):
  """The FAISS index description names in workdir, its search parameters set.

  Raises:
    ConfigError: FAISS is not installed.
    JobError: the file is missing, truncated (fewer bytes than described) or
      not a FAISS index.
  """
  faiss = faiss_module("search", "auto", "'exact'")
  path = f"{workdir}/{description['file']}"
  if not tf.io.gfile.exists(path):
    raise JobError(f"{where}: the ANN index {description['file']} is missing; it must be "
                   f"the file {META} describes")
  size = tf.io.gfile.stat(path).length
  if size != description["bytes"]:
    raise JobError(f"{where}: the ANN index {description['file']} has {size} bytes: must have "
                   f"{description['bytes']} ({META}); it is truncated or was replaced")
  with tf.io.gfile.GFile(path, "rb") as f:
    content = np.frombuffer(f.read(), np.uint8)
  try:
    index = faiss.deserialize_index(content)
  except RuntimeError as e:
    raise JobError(f"{where}: the ANN index {description['file']} must be a FAISS index "
                   f"({str(e).splitlines()[-1]})") from None
  set_search_params(faiss, index, description)
  return index


def search(index, queries: np.ndarray, k: int):
  """(scores float32 [Q, k], rows int64 [Q, k]) of the k best rows per query, best first.

  queries: float32 [Q, D] unit vectors. An approximate index may find fewer
  than k rows for a query (IVF with few lists probed); the missing ones are
  row -1 with score -inf, last.
  """
  scores, rows = index.search(np.ascontiguousarray(queries, np.float32), k)
  return np.where(rows < 0, -np.inf, scores).astype(np.float32), rows

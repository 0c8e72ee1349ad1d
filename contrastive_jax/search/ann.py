"""The approximate-nearest-neighbour (ANN) index of an embed job's output, built with FAISS.

Two files beside the embeddings (index.py), so that a search service can load
the index with FAISS alone, without this package:

  ann.G.faiss  the FAISS index in FAISS's own format (faiss.read_index), G
               the index's generation (0, then one more per add); row i of
               the embeddings is FAISS id i. Inner product metric: the rows
               are unit vectors, so scores are cosine similarities.
  ann.json     what it is: {"format_version", "library": "faiss",
               "library_version", "file", "bytes", "crc32" (zlib's CRC-32
               of the file's bytes; an ann.json without it is checked by its
               size only), "type" (TYPES but 'auto' and 'none'),
               "factory" (faiss.index_factory's string), "params" (build
               and search parameters), "calibration" (how the search
               parameter was chosen, or null), "memory" (within a budget:
               {"budget", "estimate"} in bytes), "score" (recall@10 and
               speed: score; not for 'flat'), "metric", "rows", "dim",
               "embed_run" (embed.json's run_id)}.

The type comes from the row count by default (choose): an exact flat index
below EXACT_BELOW rows, 'ivf' (IVF-Flat: k-means lists of the vectors
themselves) from there. The other types are built when named: 'ivfpq', an
inverted file whose lists hold 4-bit product-quantization codes of 2
dimensions each, scanned with SIMD lookups (FAISS's "fast scan"), the best
k_factor x k re-ranked exactly with the stored vectors; 'hnsw'. Chosen by
benchmarks/ann.py's measurements on image embeddings (docs/search.md): from
50,000 to 100,000 rows IVF-Flat gave IVF-PQ's recall at 1.6 to 1.7 times its
speed, and at 1,000,000 rows recall@10 0.96 at 27 times exact search's speed,
where IVF-PQ's re-ranking reached at most 0.92. IVF-PQ is for data without
clusters: on 1,000,000 random unit vectors it was 11 times as fast as IVF-Flat
(which was slower than exact search there), and faster than HNSW and ScaNN.

How many lists a query probes (nprobe) decides both recall and speed, and
the right value depends on the data far more than on its size: random
vectors need half the lists for recall@10 0.95, clustered image embeddings a
few percent. So unless it is given, it is calibrated when the index is built
and after each add (calibrate): the smallest nprobe at which the index finds
ann.recall of the 10 nearest other rows of a fixed sample of its own rows,
found by bisection against exact search. A row stands for a new query here
(the lists and codes of the other rows do not depend on it): on 20,000 rows,
random or clustered, new queries found 0.897 and 0.926 where the rows found
0.900 and 0.933; where most rows have near-copies in the index (20 views of each
image, 1,000,000 rows), new images found 0.943 where the rows found 0.95, since a
row's near-copies are easy to find. Not so in an HNSW graph, where each row is linked to its
neighbours when it is added (0.95 on the rows, 0.85 on new queries): its
efSearch is not calibrated.

Within a memory budget (config.ann.max_memory: choose_within), 'auto' takes
the first of candidates whose estimated bytes (estimate_bytes: codes, ids,
centroids, the quantizers' tables) fit: today's choice, then IVF lists of
SQ8 codes ('ivfsq8', D bytes a row), then of 8-bit PQ codes ('ivfpq8', D / 2,
D / 4, ... bytes). Those two keep no vector: the best k_factor x k candidates
by their codes are re-ranked exactly with the rows read from the shards,
memory-mapped (Rerank), so the index's memory is its codes. nprobe is
calibrated as above, with the re-ranking; a budget whose index cannot reach
ann.recall is refused, saying the recall it reaches. The index is trained on
a sample and filled shard by shard (add); each built index is scored on rows
held out of the calibration (score: recall@10, queries/s), as autofaiss's
score_index reports an index.

FAISS is an extra (pip install 'contrastive_jax[search]'), imported only
when an index is built or read.

Sources: Malkov & Yashunin 2018, "Efficient and robust approximate nearest
neighbor search using Hierarchical Navigable Small World graphs" (HNSW, M,
efConstruction, efSearch); Jegou et al. 2011, "Product quantization for
nearest neighbor search" (the inverted file, nlist, nprobe, product
quantization, re-ranking); André et al. 2017, "Accelerated nearest neighbor
search with quick ADC" (4-bit codes scanned with SIMD lookups); Guo et al.
2020, "Accelerating large-scale inference with anisotropic vector
quantization" (ScaNN, 2 dimensions per 4-bit code); the FAISS documentation
(github.com/facebookresearch/faiss/wiki: index_factory strings, HNSW and IVF
parameters, fast-scan PQ, scalar quantizers); autofaiss (github.com/criteo/autofaiss:
a memory budget, max_index_memory_usage; score_index's recall and search speed).
"""

import json
import logging
import time
from typing import NamedTuple, Optional
import zlib

import numpy as np
import tensorflow as tf

from contrastive_jax.core import files
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError

FORMAT_VERSION = 1
META = "ann.json"
TYPES = ("auto", "none", "flat", "hnsw", "ivf", "ivfpq", "ivfsq8", "ivfpq8")
# The types whose candidates are re-ranked with the rows read from the shards on disk
# (memory-mapped), not with vectors the index keeps: what fits a memory budget below
# the raw vectors (choose_within).
RERANKED = ("ivfsq8", "ivfpq8")
# 'auto' within a budget tries OPQ before a PQ code whose sub-vectors have at least this
# many dimensions: there it raised recall (D = 128: 16 bytes, +0.03 at nprobe 16); with
# finer codes (32 bytes) it gained 0.001 for 15 times the build (docs/search.md).
OPQ_MIN_SUBDIM = 8
# Candidates re-ranked per neighbour by a RERANKED type (k_factor 0).
RERANK_K_FACTOR = 10
# config.ann.max_memory's units (decimal and binary), case-insensitive.
MEMORY_UNITS = {
  "B": 1,
  "KB": 10**3,
  "MB": 10**6,
  "GB": 10**9,
  "TB": 10**12,
  "KiB": 2**10,
  "MiB": 2**20,
  "GiB": 2**30,
  "TiB": 2**40,
}
# The score (score): recall@SCORE_K of up to SCORE_QUERIES rows held out of the
# calibration's sample, each searched alone (as autofaiss's score_index times them).
SCORE_K, SCORE_QUERIES = 10, 500
_RERANK_BYTES = 1 << 26  # Candidate rows gathered at a time for re-ranking (64 MB).
# Below this many rows the exact flat index is chosen: exact search took 1.5 ms
# per query per 1,000,000 rows here (batched; it grows with the rows), so at
# most about 0.15 ms below 100,000 rows, where the indexes measured were at most
# about 6 times faster (docs/search.md): not worth the recall they give up.
EXACT_BELOW = 100_000
# From EXACT_BELOW rows 'auto' is 'ivf'. Measured (2 cores; docs/search.md), nprobe
# calibrated to recall@10 0.95 on the index's rows, queries held out: 50,000 SimCLR
# runlocal CIFAR-10 embeddings (2026-12-03, b71c4a5): IVF-Flat 0.958 at 3.5 times
# exact search's queries/s, IVF-PQ 0.958 at 2.1 times; a 100,000-photo corpus: 6.0
# against 3.7 times; 1,000,000 embeddings of 20 views of each of 50,000 CIFAR-10
# images, the queries views of 10,000 others (2026-12-06, 406d998): IVF-Flat 0.943
# at 31 times (0.960 at 27 times probing 12 lists rather than the calibrated 10),
# IVF-PQ 0.78 calibrated and at most 0.92 with twice its re-ranking: ranked by 4-bit
# codes, its candidates miss a new image's neighbours among many rows of nearly their
# score. Memory does not decide it: the 'ivfpq' index keeps every vector for its
# re-ranking (RFlat), so it is larger than IVF-Flat's (556 MB against 522 MB there).
# On 1,000,000 random unit vectors IVF-PQ was 2.2 times exact, IVF-Flat 0.2.
# HNSW (not chosen by 'auto'): M 32 and FAISS's own efConstruction 40; efSearch 256
# found 0.93 of the 10 nearest of 30,000 random unit vectors, at about exact
# search's speed (docs/search.md): a graph needs structure in the data to skip rows.
HNSW_M, HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH = 32, 40, 256
# IVF-PQ re-ranks the best k_factor x k candidates exactly. On 1,000,000 random
# unit vectors, with nprobe calibrated to recall 0.95: k_factor 20 needed 3,711
# of 4,096 lists (2.2 times exact search's speed), 50 and 100 about 2,200 (3.2
# and 3.5 times; one run, docs/search.md); 50 costs less where few lists are
# probed, as on image embeddings.
IVFPQ_K_FACTOR = 50
# FAISS's k-means wants at least 39 training rows per list; a default nlist is
# capped to keep that many.
MIN_ROWS_PER_LIST = 39
# The calibration (calibrate): recall@CALIBRATION_K on up to CALIBRATION_QUERIES
# rows of the index, drawn with a fixed seed. A found row counts when its score is
# within TIE_TOLERANCE of the k-th exact one (identical rows tie; FAISS and numpy
# round float32 dot products differently). When the target is out of reach,
# nprobe is the smallest within SHORTFALL_TOLERANCE of the recall of every list.
CALIBRATION_K, CALIBRATION_QUERIES = 10, 1000
TIE_TOLERANCE, SHORTFALL_TOLERANCE = 1e-6, 0.005
_ADD_CHUNK = 65_536  # Rows handed to FAISS at a time: a memory-mapped part is read piecewise.
_EXACT_BLOCK = 16_384  # Rows scored at a time by exact_neighbours (1,000 queries: 64 MB).
_READ_CHUNK = 1 << 24  # Bytes of an ANN file read at a time when it is only verified.


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
    raise ConfigError(
      field,
      value,
      f"{instead} unless FAISS is installed: pip install 'contrastive_jax[search]' ({e})",
    ) from None
  return faiss


def check_config(ann, *, adding: bool = False):
  """Raises ConfigError for config.ann fields that cannot build an index.

  FAISS missing too, for a type named on a new index ('auto' does without:
  has_faiss). An add keeps its index's fields: check_add decides there.
  """
  if ann.type not in TYPES:
    raise ConfigError("ann.type", ann.type, f"one of {TYPES}")
  if ann.type not in ("none", "auto") and not adding:
    faiss_module("ann.type", ann.type, "'auto' or 'none'")
  fields = ("hnsw_m", "ef_construction", "ef_search", "nlist", "nprobe", "k_factor", "pq_m", "pca")
  for field in (f for f in fields if f in ann):
    if ann[field] < 0:
      raise ConfigError(f"ann.{field}", ann[field], "an integer >= 0 (0: chosen from the rows)")
  if ann.threads < 0:
    raise ConfigError("ann.threads", ann.threads, "an integer >= 0 (0: every core)")
  if not isinstance(ann.get("opq", False), bool):
    raise ConfigError("ann.opq", ann.opq, "True or False")
  if not 0 < ann.recall <= 1:
    raise ConfigError(
      "ann.recall", ann.recall, "a recall@10 in (0, 1] that nprobe left at 0 is calibrated to"
    )
  max_memory(ann)


def max_memory(ann):
  """config.ann.max_memory in bytes (int), or None for no budget ('' or 0).

  It is an integer of bytes or a string: digits, optionally with a decimal
  point, then a unit of MEMORY_UNITS ('4GB', '1.5GiB', '800mb'; decimal GB
  is 10^9 bytes, GiB 2^30).

  Raises:
    ConfigError: anything else, or a negative number.
  """
  value = ann.get("max_memory", "")
  text = str(value).strip().upper().replace(" ", "")
  number = text.rstrip("KMGTIB")
  unit = text[len(number) :] or "B"
  units = {name.upper(): size for name, size in MEMORY_UNITS.items()}
  try:
    size = float(number) * units[unit] if number else None
  except (KeyError, ValueError):
    size = None
  if size is None and text not in ("", "0") or size is not None and size < 0:
    raise ConfigError(
      "ann.max_memory",
      value,
      "the ANN index's memory budget: bytes (an integer), or a number with a unit of "
      f"{'/'.join(MEMORY_UNITS)} such as '4GB'; '' for none",
    )
  return int(size) if size else None


def human_bytes(size: int) -> str:
  """size in the largest decimal unit of at least 1, 3 significant digits: '1.23 GB'."""
  for unit in ("TB", "GB", "MB", "KB"):
    if size >= MEMORY_UNITS[unit]:
      return f"{size / MEMORY_UNITS[unit]:.3g} {unit}"
  return f"{size} B"


def has_faiss() -> bool:
  """Whether FAISS imports (the search extra, installed and not broken)."""
  try:
    faiss_module("ann.type", "auto", "'none'")
  except ConfigError:
    return False
  return True


def check_add(ann, description):
  """Raises ConfigError, before an add embeds anything, when growing its index needs FAISS.

  Args:
    ann: the index's config.ann (its type, which the add keeps).
    description: the index's ANN index (embed.json's "ann"), or None.
  Raises:
    ConfigError: FAISS does not import, and the index has an ANN index to
      grow, or its type names one to build.
  """
  if has_faiss():
    return
  if description:
    faiss_module(
      "add", True, f"False (the index's ANN index {description['file']} grows with its rows)"
    )
  if ann.type not in ("none", "auto"):
    faiss_module("ann.type", ann.type, "'auto' or 'none'")


def choose(num_rows: int, dim: int, ann) -> dict:
  """The index type and parameters for num_rows rows of dimension dim: config.ann's, or chosen.

  Returns {"type", "factory", "params", "calibration"} (and "memory" within a
  budget: choose_within), or None for ann.type 'none'. Without
  config.ann.max_memory, 'auto' is 'flat' below EXACT_BELOW rows and 'ivf'
  from there; a parameter of 0 takes its default (IVF: nlist 4 sqrt(N)
  rounded to a power of two, FAISS's guideline, at most N / MIN_ROWS_PER_LIST;
  'ivfpq': dim / 2 codes of 4 bits, k_factor IVFPQ_K_FACTOR; 'ivfsq8' and
  'ivfpq8': k_factor RERANK_K_FACTOR, 'ivfpq8' dim / 4 bytes of code (pq_m),
  'ivfsq8' a PCA to ann.pca dimensions first when it is > 0, 'ivfpq8' an OPQ rotation
  first when ann.opq;
  HNSW: efSearch HNSW_EF_SEARCH). When IVF's nprobe is 0, "calibration" is
  {"param": "nprobe", "target": ann.recall} and params holds None for it:
  build calibrates it. Otherwise "calibration" is None.

  Raises:
    ConfigError: config.ann.max_memory is below what the index needs
      (choose_within); pq_m does not divide dim, or pca exceeds it.
  """
  kind = ann.type
  if kind == "none":
    return None
  budget = max_memory(ann)
  if budget is not None:
    return choose_within(budget, num_rows, dim, ann)
  if kind == "auto":
    kind = "flat" if num_rows < EXACT_BELOW else "ivf"
  return _spec(kind, num_rows, dim, ann)


def _spec(kind: str, num_rows: int, dim: int, ann, pq_m: int = 0, opq=None) -> dict:
  """choose's spec of the named type `kind` (not 'auto' or 'none'); pq_m: 'ivfpq8''s bytes,
  opq: whether an OPQ rotation comes first ('ivfpq8'; None: ann.opq)."""
  if kind == "flat":
    return {"type": "flat", "factory": "Flat", "params": {}, "calibration": None}
  if kind == "hnsw":
    m = ann.hnsw_m or HNSW_M
    params = {
      "M": m,
      "efConstruction": ann.ef_construction or HNSW_EF_CONSTRUCTION,
      "efSearch": ann.ef_search or HNSW_EF_SEARCH,
    }
    return {"type": "hnsw", "factory": f"HNSW{m},Flat", "params": params, "calibration": None}
  nlist = ann.nlist or min(
    int(2 ** round(np.log2(4 * np.sqrt(max(num_rows, 1))))),
    int(2 ** np.floor(np.log2(max(num_rows / MIN_ROWS_PER_LIST, 1)))),
  )
  nlist = min(nlist, max(num_rows, 1))  # k-means needs at least one row per list.
  calibration = None if ann.nprobe else {"param": "nprobe", "target": ann.recall}
  params = {"nlist": nlist, "nprobe": min(ann.nprobe, nlist) or None}
  if kind == "ivf":
    return {
      "type": "ivf",
      "factory": f"IVF{nlist},Flat",
      "params": params,
      "calibration": calibration,
    }
  if kind in RERANKED:
    params = dict(params, k_factor=ann.k_factor or RERANK_K_FACTOR)
    if kind == "ivfsq8":
      pca = ann.get("pca", 0)
      if pca > dim:
        raise ConfigError("ann.pca", pca, f"at most the embeddings' dimension ({dim}); 0: none")
      factory = f"PCAR{pca},IVF{nlist},SQ8" if pca else f"IVF{nlist},SQ8"
      params = dict(params, pca=pca) if pca else params
    else:
      m = pq_m or ann.get("pq_m", 0) or max(dim // 4, 1)
      if dim % m:
        raise ConfigError(
          "ann.pq_m", m, f"a divisor of the embeddings' dimension ({dim}); 0: D / 4"
        )
      # 'np': no polysemous training (a slow reordering of the codes for Hamming
      # filtering, which the search does not use).
      factory, params = f"IVF{nlist},PQ{m}x8np", dict(params, m=m)
      if ann.get("opq", False) if opq is None else opq:
        # OPQ: a rotation trained so that the m sub-vectors quantize better (Ge et al.
        # 2013, "Optimized Product Quantization"); applied to each row and query first.
        factory, params = f"OPQ{m},{factory}", dict(params, opq=True)
    return {"type": kind, "factory": factory, "params": params, "calibration": calibration}
  codes = dim // 2 if dim % 2 == 0 else dim  # 2 dimensions per 4-bit code (1 if dim is odd).
  return {
    "type": "ivfpq",
    "factory": f"IVF{nlist},PQ{codes}x4fs,RFlat",
    "params": dict(params, k_factor=ann.k_factor or IVFPQ_K_FACTOR),
    "calibration": calibration,
  }


def estimate_bytes(spec: dict, num_rows: int, dim: int) -> int:
  """The bytes of spec's index of num_rows rows of dimension dim, as FAISS serializes it.

  What it holds in memory once built: per row its code (4 D bytes for the
  vectors themselves, D for SQ8, m for PQ with 8-bit codes, D / 4 for
  'ivfpq''s 4-bit codes plus the vectors it re-ranks with; 'ivfsq8' with
  pca: pca bytes, and the PCA's matrices; 'ivfpq8' with opq: the D x D rotation) and, in
  an inverted file, its
  int64 id; per list its centroid (4 D bytes) and size;
  the quantizers' tables (SQ8: a minimum and a range per dimension; PQ: 2^bits
  centroids of each sub-vector). HNSW: the vectors and M int32 links per row
  on average over its levels (2 M on level 0), an upper bound within a few
  percent. The FAISS headers (a few hundred bytes) are left out.
  """
  n, vectors = num_rows, 4 * num_rows * dim
  kind, params = spec["type"], spec["params"]
  if kind == "flat":
    return vectors
  if kind == "hnsw":
    return vectors + n * (2 * params["M"] * 4 + 8 + 4 + 4)
  lists = params["nlist"] * (4 * dim + 8) + 8 * n  # Centroids, list sizes, ids.
  if kind == "ivf":
    return lists + vectors
  if kind == "ivfsq8" and params.get("pca"):  # The lists in pca dimensions, and the PCA.
    kept = params["pca"]
    # The projection and its bias; the mean, eigenvalues and whole PCA matrix FAISS keeps.
    pca = 4 * (dim * kept + kept + 2 * dim + dim * dim)
    return params["nlist"] * (4 * kept + 8) + 8 * n + n * kept + 2 * 4 * kept + pca
  if kind == "ivfsq8":
    return lists + n * dim + 2 * 4 * dim
  if kind == "ivfpq8":  # With OPQ: its D x D rotation too.
    return lists + n * params["m"] + 256 * 4 * dim + (4 * dim * dim if params.get("opq") else 0)
  codes = dim // 2 if dim % 2 == 0 else dim  # 'ivfpq': 4-bit codes, in blocks of 32 rows.
  blocks = -(-n // 32) + params["nlist"]
  return lists + blocks * 32 * codes // 2 + 16 * 4 * dim + vectors


def candidates(num_rows: int, dim: int, ann) -> list:
  """The specs 'auto' chooses from within a memory budget, the largest (and most accurate) first.

  today's choice without a budget ('flat' below EXACT_BELOW rows, 'ivf' from
  there: the vectors themselves), then IVF lists of codes re-ranked from the
  shards on disk: SQ8 (D bytes a row), then PQ with 8-bit codes of D / 2, D / 4,
  ... bytes (m dividing D, down to 1), those of sub-vectors of OPQ_MIN_SUBDIM or more
  dimensions first after an OPQ rotation (4 D^2 bytes more) and then without. A finer
  code ranks the candidates better, and OPQ's codes better than plain PQ's of the same
  bytes where the code is coarse, so the target recall takes fewer lists probed
  (benchmarks/ann.py, docs/search.md).
  """
  first = "flat" if num_rows < EXACT_BELOW else "ivf"
  specs = [_spec(first, num_rows, dim, ann), _spec("ivfsq8", num_rows, dim, ann)]
  m = dim // 2
  while m >= 1:
    if dim % m == 0:
      if dim // m >= OPQ_MIN_SUBDIM:
        specs.append(_spec("ivfpq8", num_rows, dim, ann, pq_m=m, opq=True))
      specs.append(_spec("ivfpq8", num_rows, dim, ann, pq_m=m, opq=False))
    m //= 2
  return specs


def choose_within(budget: int, num_rows: int, dim: int, ann) -> dict:
  """choose's spec within budget bytes: ann.type's, or for 'auto' the first of candidates that fits.

  Returns the spec with "memory": {"budget", "estimate"} (estimate_bytes).

  Raises:
    ConfigError: no index fits the budget (for 'auto' the smallest of
      candidates, else the type named): names the bytes the smallest needs.
  """
  specs = (
    candidates(num_rows, dim, ann) if ann.type == "auto" else [_spec(ann.type, num_rows, dim, ann)]
  )
  for spec in specs:
    need = estimate_bytes(spec, num_rows, dim)
    if need <= budget:
      return dict(spec, memory={"budget": budget, "estimate": need})
  other = "" if ann.type == "auto" else " (or ann.type='auto' to choose one that fits)"
  raise ConfigError(
    "ann.max_memory",
    ann.max_memory,
    f"at least {need} bytes ({human_bytes(need)}): the smallest index of {num_rows} rows "
    f"of dimension {dim} that works, {spec['factory']}, needs that for its codes, ids "
    f"and centroids{other}",
  )


def set_search_params(faiss, index, spec: dict):
  """Sets the spec's search-time parameters (efSearch, nprobe, k_factor) on a FAISS index."""
  if spec["type"] == "hnsw":
    faiss.downcast_index(index).hnsw.efSearch = spec["params"]["efSearch"]
  if spec["type"] in ("ivf", "ivfpq", *RERANKED):
    faiss.extract_index_ivf(index).nprobe = spec["params"]["nprobe"]
  if spec["type"] == "ivfpq":
    faiss.downcast_index(index).k_factor = spec["params"]["k_factor"]


def build(embeddings, spec: dict, *, threads: int = 0):
  """A FAISS index of spec (choose) holding every row of embeddings, id i for row i.

  Args:
    embeddings: float32 [N, D] unit rows; any array-like with len, shape and
      slices (a memory-mapped .npy, index.Parts).
    spec: {"type", "factory", "params", "calibration"} from choose.
    threads: FAISS's OpenMP threads (0: every core).
  Returns:
    (the faiss.Index, its search parameters set; the spec as built, its
    params complete and its calibration calibrate's). An IVF index trains its
    k-means (and scalar or product quantizer) on at most 64 rows per list or
    65,536 rows, whichever is more, drawn with a fixed seed; then it is
    filled shard by shard (add), so that no more rows than the sample and
    one chunk are held in memory besides the index.
  Raises:
    ConfigError: a spec within a memory budget whose calibration cannot
      reach its target recall (calibrate).
  """
  faiss = faiss_module("ann.type", spec["type"], "'none'")
  if threads:
    faiss.omp_set_num_threads(threads)
  dim = embeddings.shape[1]
  index = faiss.index_factory(dim, spec["factory"], faiss.METRIC_INNER_PRODUCT)
  if spec["type"] == "hnsw":
    faiss.downcast_index(index).hnsw.efConstruction = spec["params"]["efConstruction"]
  if spec["type"] in ("ivf", "ivfpq", *RERANKED):
    count = min(len(embeddings), max(64 * spec["params"]["nlist"], 65_536))
    sample = np.sort(np.random.default_rng(0).choice(len(embeddings), count, replace=False))
    index.train(np.ascontiguousarray(embeddings[sample], np.float32))
  add(index, embeddings, 0)
  if spec["calibration"]:
    spec = calibrate(index, embeddings, spec)
  set_search_params(faiss, index, spec)
  if spec["type"] != "flat":
    spec = score(index, embeddings, spec)
  return index, spec


def exact_neighbours(embeddings, rows: np.ndarray, k: int):
  """(scores float32 [Q, k], ids int64 [Q, k]): each of `rows`' k most similar other rows.

  Exact: float32 dot products of embeddings[rows] with every row, in blocks of
  _EXACT_BLOCK rows; best first. Raises ValueError unless 0 < k < len(embeddings).
  """
  if not 0 < k < len(embeddings):
    raise ValueError(f"k={k}: must be in [1, {len(embeddings) - 1}] (the other rows)")
  queries = np.ascontiguousarray(embeddings[rows], np.float32)
  scores, ids = [], []
  for begin in range(0, len(embeddings), _EXACT_BLOCK):
    block = queries @ np.asarray(embeddings[begin : begin + _EXACT_BLOCK], np.float32).T
    own = (rows >= begin) & (rows < begin + block.shape[1])
    block[np.flatnonzero(own), rows[own] - begin] = -np.inf
    kept = min(k, block.shape[1])
    best = np.argpartition(block, block.shape[1] - kept, axis=1)[:, -kept:]
    scores.append(np.take_along_axis(block, best, axis=1))
    ids.append(best + begin)
  scores, ids = np.concatenate(scores, axis=1), np.concatenate(ids, axis=1)
  order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
  return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)


def calibrate(index, embeddings, spec: dict) -> dict:
  """spec with its nprobe the smallest that finds its calibration target.

  The recall is recall@k (k = CALIBRATION_K) of the index on its own rows:
  for each of up to CALIBRATION_QUERIES rows drawn with a fixed seed, the
  share of the k rows the index returns (the row itself left out) that score
  at least its k-th nearest other row's exact score (exact_neighbours, less
  TIE_TOLERANCE: among identical rows any is a right answer), averaged. The
  index's scores are exact (IVF-Flat, and IVF-PQ's re-ranking). It searches
  k + 1 rows, so IVF-PQ re-ranks k_factor more candidates than a search of k
  does. nprobe is found by bisection over [1, nlist]: recall grows with it
  (for IVF-PQ nearly: a list more can push a neighbour out of the candidates
  re-ranked). When even nlist misses the target, the target becomes nlist's
  recall less SHORTFALL_TOLERANCE, with a warning.

  Args:
    index: the IVF faiss.Index of spec, holding every row of embeddings.
    embeddings: float32 [N, D] unit rows, row i FAISS id i.
    spec: the index's spec; spec["calibration"] has "param" ("nprobe") and
      "target" (in (0, 1]).
  Returns:
    A new spec: params["nprobe"] set, and "calibration": {"param", "target",
    "recall" (measured at the value chosen), "k", "queries"}.
  """
  faiss = faiss_module("ann.type", spec["type"], "'none'")
  param, target = spec["calibration"]["param"], spec["calibration"]["target"]
  n = len(embeddings)
  k = min(CALIBRATION_K, n - 1)
  rows = np.sort(np.random.default_rng(0).choice(n, min(CALIBRATION_QUERIES, n), replace=False))
  # The k-th nearest other row's score, per query (one row: nothing to find).
  kth = exact_neighbours(embeddings, rows, k)[0][:, -1] - TIE_TOLERANCE if k else None
  queries = np.ascontiguousarray(embeddings[rows], np.float32)
  measured = {}

  rerank = reranker(spec, embeddings)

  def recall_at(value):
    if value not in measured:
      set_search_params(faiss, index, dict(spec, params=dict(spec["params"], **{param: value})))
      if rerank is None:
        scores, found = index.search(queries, k + 1)
      else:
        scores, found = search(index, queries, k + 1, rerank)
      measured[value] = _recall(scores, found, rows, kth, k)
    return measured[value]

  def smallest(low, high, wanted):  # The smallest value in [low, high] reaching `wanted`.
    while low < high:
      middle = (low + high) // 2
      if recall_at(middle) >= wanted:
        high = middle
      else:
        low = middle + 1
    return low

  most = spec["params"]["nlist"]
  value = smallest(1, most, target)
  if recall_at(value) < target and spec.get("memory"):
    raise ConfigError(
      "ann.max_memory",
      spec["memory"]["budget"],
      f"more than {human_bytes(spec['memory']['budget'])}, or ann.recall at most "
      f"{measured[most]:.3f}: the index that fits it, {spec['factory']} (k_factor "
      f"{spec['params']['k_factor']}), finds {measured[most]:.3f} of the {k} nearest at "
      f"most (all {most} lists probed), less than ann.recall={target}",
    )
  if recall_at(value) < target:
    value = smallest(1, most, recall_at(most) - SHORTFALL_TOLERANCE)
    logging.warning(
      "The %s index finds %.3f of the %d nearest at most (%s=%d), less than "
      "ann.recall=%s: searched with %s=%d, within %s of that.",
      spec["factory"],
      measured[most],
      k,
      param,
      most,
      target,
      param,
      value,
      SHORTFALL_TOLERANCE,
    )
  logging.info(
    "Calibrated %s=%d: recall@%d %.3f on %d of the index's rows (target %s).",
    param,
    value,
    k,
    measured[value],
    len(rows),
    target,
  )
  return dict(
    spec,
    params=dict(spec["params"], **{param: value}),
    calibration={
      "param": param,
      "target": target,
      "recall": measured[value],
      "k": k,
      "queries": len(rows),
    },
  )


def _recall(scores, found, rows, kth, k) -> float:
  """Recall@k of search results (scores, found: [Q, >= k + 1]) of rows of the index: the
  share of the k best other rows found that score at least kth (per query), averaged."""
  if not k:
    return 1.0
  hits = [np.sum(s[(f != r) & (f >= 0)][:k] >= t) for s, f, r, t in zip(scores, found, rows, kth)]
  return float(np.mean(hits) / k)


def score(index, embeddings, spec: dict) -> dict:
  """spec with "score": the index's recall@10 and speed, measured as autofaiss's score_index does.

  On up to SCORE_QUERIES rows of the index drawn with a fixed seed and held
  out of the calibration's sample (all rows when there are too few others):
  "recall" is recall@k (k = SCORE_K, as calibrate counts it: the row itself
  left out, ties within TIE_TOLERANCE of the k-th exact score found); each
  query is searched alone, as a service would, giving "single_query_ms"
  {"mean", "p99"}; "queries_per_second" is the batch of them searched at once
  and "exact_queries_per_second" exact search's (exact_neighbours, numpy) of
  the same batch. Times are wall-clock with FAISS's threads at the time
  (one untimed warm-up search first), so they vary between runs and machines.

  Args:
    index: the faiss.Index of spec holding every row of embeddings (its
      search parameters are set to spec's).
    embeddings: float32 [N, D] unit rows (memory-mapped shards), row i FAISS id i.
    spec: the index's spec (its type; a RERANKED type re-ranks with the rows).
  Returns:
    A new spec with "score": {"recall", "k", "queries", "held_out",
    "queries_per_second", "exact_queries_per_second", "single_query_ms"}.
  """
  n = len(embeddings)
  k = min(SCORE_K, n - 1)
  if k < 1:
    return spec
  set_search_params(faiss_module("ann.type", spec["type"], "'none'"), index, spec)
  calibrated = np.random.default_rng(0).choice(n, min(CALIBRATION_QUERIES, n), replace=False)
  pool = np.random.default_rng(1).choice(n, min(n, SCORE_QUERIES + len(calibrated)), replace=False)
  held_out = pool[~np.isin(pool, calibrated)][:SCORE_QUERIES]
  rows = np.sort(held_out if len(held_out) else pool[:SCORE_QUERIES])
  start = time.perf_counter()
  kth = exact_neighbours(embeddings, rows, k)[0][:, -1] - TIE_TOLERANCE
  exact_s = time.perf_counter() - start
  queries = np.ascontiguousarray(embeddings[rows], np.float32)
  rerank = reranker(spec, embeddings)
  search(index, queries[:1], k + 1, rerank)  # Warm-up.
  times = []
  for query in queries:
    start = time.perf_counter()
    search(index, query[None], k + 1, rerank)
    times.append(time.perf_counter() - start)
  start = time.perf_counter()
  scores, found = search(index, queries, k + 1, rerank)
  batch_s = time.perf_counter() - start
  result = {
    "recall": _recall(scores, found, rows, kth, k),
    "k": k,
    "queries": len(rows),
    "held_out": bool(len(held_out)),
    "queries_per_second": len(rows) / max(batch_s, 1e-9),
    "exact_queries_per_second": len(rows) / max(exact_s, 1e-9),
    "single_query_ms": {
      "mean": 1e3 * float(np.mean(times)),
      "p99": 1e3 * float(np.percentile(times, 99)),
    },
  }
  logging.info(
    "Scored the %s index: recall@%d %.3f on %d rows%s; %.0f queries/s in a batch "
    "(exact search %.0f), %.3f ms a query alone (p99 %.3f ms).",
    spec["factory"],
    k,
    result["recall"],
    len(rows),
    " held out of the calibration" if result["held_out"] else "",
    result["queries_per_second"],
    result["exact_queries_per_second"],
    result["single_query_ms"]["mean"],
    result["single_query_ms"]["p99"],
  )
  return dict(spec, score=result)


def add(index, embeddings, start: int):
  """Adds rows start.. of embeddings (float32 [N, D]) to a FAISS index, shard by shard.

  embeddings: an array, or index.Parts of the shards (its "parts"): each
  shard is added on its own, in chunks of at most _ADD_CHUNK rows, so that
  one chunk of one shard is in memory at a time.
  """
  offset = 0
  for shard in getattr(embeddings, "parts", [embeddings]):
    for begin in range(max(start - offset, 0), len(shard), _ADD_CHUNK):
      index.add(np.ascontiguousarray(shard[begin : begin + _ADD_CHUNK], np.float32))
    offset += len(shard)


def write(workdir: str, index, spec: dict, *, generation: int, embed_run: str) -> dict:
  """Writes the FAISS index to WORKDIR/ann.GENERATION.faiss atomically; returns its description.

  spec: build's (or a description's): its "calibration" is recorded. The
  description is what ann.json holds (the module docstring); the caller
  writes it (index.py writes embed.json, then ann.json).
  """
  faiss = faiss_module("ann.type", spec["type"], "'none'")
  name = f"ann.{generation}.faiss"
  content = faiss.serialize_index(index).tobytes()
  files.write_atomic(f"{workdir}/{name}", content)
  return {
    "format_version": FORMAT_VERSION,
    "library": "faiss",
    "library_version": faiss.__version__,
    "file": name,
    "bytes": len(content),
    "crc32": zlib.crc32(content),
    "type": spec["type"],
    "factory": spec["factory"],
    "params": spec["params"],
    "calibration": spec.get("calibration"),
    **{key: spec[key] for key in ("memory", "score") if spec.get(key)},
    "metric": "inner_product",
    "rows": int(index.ntotal),
    "dim": int(index.d),
    "embed_run": embed_run,
  }


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
    raise JobError(
      f"{where}: the ANN index's format_version={version!r}: must be "
      f"{FORMAT_VERSION} (written by another version of contrastive_jax; embed "
      "again, or build it with --config.ann.type)"
    )
  for key, want in (("embed_run", embed_run), ("dim", dim), ("rows", rows)):
    if description.get(key) != want:
      raise JobError(
        f"{where}: the ANN index {description.get('file')} has {key}="
        f"{description.get(key)!r}: must be the embeddings' ({want!r}); it was "
        "built from another embed run or dimension"
      )


def check_meta_file(workdir: str, description: dict, *, where: str):
  """Raises JobError unless WORKDIR/ann.json is the description embed.json holds a copy of.

  ann.json is what a search service reads, embed.json's copy what the jobs
  read: both must say the same.

  Args:
    workdir: the index's folder.
    description: embed.json's "ann" (not None).
    where: the index folder as the user gave it, for the message.
  Raises:
    JobError: ann.json is missing, not JSON, of a format_version other than
      FORMAT_VERSION, or differs from description (naming the first field
      that differs).
  """
  path = f"{workdir}/{META}"
  if not tf.io.gfile.exists(path):
    raise JobError(
      f"{where}: {META} is missing: embed.json lists the ANN index "
      f"{description.get('file')}, which {META} must describe; embed again"
    )
  try:
    with tf.io.gfile.GFile(path) as f:
      found = json.load(f)
  except ValueError as e:
    raise JobError(f"{where}: {META} must be the JSON an embed job writes ({e})") from None
  version = found.get("format_version") if isinstance(found, dict) else None
  if version != FORMAT_VERSION:
    raise JobError(
      f"{where}: {META} has format_version={version!r}: must be "
      f"{FORMAT_VERSION} (written by another version of contrastive_jax; embed "
      "again, or build it with --config.ann.type)"
    )
  differing = sorted(
    key for key in set(found) | set(description) if found.get(key) != description.get(key)
  )
  if differing:
    key = differing[0]
    raise JobError(
      f"{where}: {META} has {key}={found.get(key)!r} where embed.json's copy of "
      f"it has {description.get(key)!r}: they must be the same (one of them was "
      "edited or replaced); embed again"
    )


def _read(workdir: str, description: dict, *, where: str, keep: bool):
  """Reads the ANN file description names and checks its size and checksum.

  Returns its bytes (keep) or None. Raises JobError: missing, of another
  size, or (when ann.json records one) of another CRC-32.
  """
  name = description["file"]
  path = f"{workdir}/{name}"
  if not tf.io.gfile.exists(path):
    raise JobError(
      f"{where}: the ANN index {name} is missing; it must be the file {META} describes"
    )
  size = tf.io.gfile.stat(path).length
  if size != description["bytes"]:
    raise JobError(
      f"{where}: the ANN index {name} has {size} bytes: must have "
      f"{description['bytes']} ({META}); it is truncated or was replaced"
    )
  if "crc32" not in description and not keep:
    return None
  checksum, chunks = 0, []
  with tf.io.gfile.GFile(path, "rb") as f:
    while chunk := f.read(_READ_CHUNK):
      checksum = zlib.crc32(chunk, checksum)
      if keep:
        chunks.append(chunk)
  if "crc32" in description and checksum != description["crc32"]:
    raise JobError(
      f"{where}: the ANN index {name} has CRC-32 {checksum}: must have "
      f"{description['crc32']} ({META}); its bytes are damaged or were replaced"
    )
  return b"".join(chunks) if keep else None


def verify(workdir: str, description: dict, *, where: str):
  """Checks the ANN file description names as load does, without deserializing it.

  For an index searched exactly instead: the file a search service would
  load is still checked (checked_by says how).

  Raises:
    JobError: the file is missing, or of another size or CRC-32 (as load).
  """
  _read(workdir, description, where=where, keep=False)


def checked_by(description: dict) -> str:
  """How load and verify check the file description names, in words, for a log line."""
  if "crc32" in description:
    return "size and CRC-32 checked"
  return f"size checked ({META} records no CRC-32)"


def load(workdir: str, description: dict, *, where: str):
  """The FAISS index description names in workdir, its search parameters set.

  Raises:
    ConfigError: FAISS is not installed.
    JobError: the file is missing, truncated (fewer bytes than described),
      of another CRC-32 than described (when ann.json records one) or not a
      FAISS index.
  """
  faiss = faiss_module("search", "auto", "'exact'")
  content = _read(workdir, description, where=where, keep=True)
  try:
    index = faiss.deserialize_index(np.frombuffer(content, np.uint8))
  except RuntimeError as e:
    raise JobError(
      f"{where}: the ANN index {description['file']} must be a FAISS index "
      f"({str(e).splitlines()[-1]})"
    ) from None
  set_search_params(faiss, index, description)
  return index


class Rerank(NamedTuple):
  """What a RERANKED index's search re-ranks with: the rows (float32 [N, D], memory-mapped
  shards: an array or index.Parts) and the candidates per neighbour (k_factor)."""

  embeddings: object
  k_factor: int


def reranker(description: dict, embeddings):
  """The Rerank of an index of description's type over embeddings, or None (not RERANKED)."""
  if description["type"] not in RERANKED:
    return None
  return Rerank(embeddings, description["params"]["k_factor"])


def search(index, queries: np.ndarray, k: int, rerank: Optional[Rerank] = None):
  """(scores float32 [Q, k], rows int64 [Q, k]) of the k best rows per query, best first.

  queries: float32 [Q, D] unit vectors. At least CALIBRATION_K rows are
  searched for and the best k kept: an IVF-PQ index re-ranks k_factor x k
  candidates, and fewer than its calibration's would find less than it was
  calibrated to (at k=3 a new photo of a 21,000-photo index missed itself
  where k=10 found it). An index of a RERANKED type needs `rerank`
  (reranker): its best k_factor x max(k, CALIBRATION_K) candidates by their
  codes are scored exactly with their rows read from the shards, and the best
  k of those kept. An approximate index may find fewer than k rows for a query
  (IVF with few lists probed); the missing ones are row -1 with score -inf, last.
  """
  queries = np.ascontiguousarray(queries, np.float32)
  wanted = max(k, CALIBRATION_K)
  if rerank is None:
    scores, rows = index.search(queries, wanted)
  else:
    scores, rows = _reranked(rerank, queries, index.search(queries, wanted * rerank.k_factor)[1])
  scores, rows = scores[:, :k], rows[:, :k]
  return np.where(rows < 0, -np.inf, scores).astype(np.float32), rows


def _reranked(rerank: Rerank, queries: np.ndarray, candidates: np.ndarray):
  """(scores, rows) [Q, C] of candidates (int64 [Q, C], -1 for none) sorted by exact score.

  The rows are gathered from rerank.embeddings in blocks of queries of at
  most _RERANK_BYTES, each row read once per block (sorted, for the memory map).
  """
  dim = queries.shape[1]
  block = max(1, _RERANK_BYTES // (4 * dim * max(candidates.shape[1], 1)))
  all_scores = np.full(candidates.shape, -np.inf, np.float32)
  for begin in range(0, len(queries), block):
    rows = candidates[begin : begin + block]
    found = rows >= 0
    unique = np.unique(rows[found])
    if not len(unique):
      continue
    vectors = np.asarray(rerank.embeddings[unique], np.float32)
    gathered = vectors[np.searchsorted(unique, np.where(found, rows, unique[0]))]
    scores = np.einsum("qd,qcd->qc", queries[begin : begin + block], gathered)
    all_scores[begin : begin + block] = np.where(found, scores, -np.inf)
  order = np.argsort(-all_scores, axis=1, kind="stable")
  return np.take_along_axis(all_scores, order, axis=1), np.take_along_axis(candidates, order, 1)

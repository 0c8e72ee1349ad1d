"""One searcher for an embedding index: its ANN index (FAISS) or exact search, chosen once.

The neighbours and audit jobs search through it, so both choose alike and
describe the search alike (neighbours.json's and summary.json's "search").
"""

from absl import logging
import numpy as np

from contrastive_jax.search import ann as ann_lib
from contrastive_jax.search import exact
from contrastive_jax.search import index as index_lib

MODES = ("auto", "exact")  # config.search: the ANN index where there is one, or exact search.
_QUERY_BLOCK = 65_536  # Queries searched in the ANN index at a time, to bound the results' memory.


class Searcher:
  """Searches the rows of an index for the nearest of queries by cosine similarity.

  With mode 'auto' and an approximate ANN index beside the embeddings (HNSW or
  IVF: ann.py), FAISS searches it (an index of codes only, ann.RERANKED,
  re-ranks its candidates with the rows, memory-mapped from the shards);
  otherwise (no ANN index, an exact 'flat' one, or mode 'exact')
  exact.top_k_cosine does, streaming the embeddings
  through the device in chunks of chunk_size rows. An ANN file that is not
  searched is still checked to be there whole (ann.verify: its size and, when
  ann.json records it, its CRC-32), so a broken file is never passed over in
  silence. Either way one log line says how the rows are searched and how the
  file was checked.

  Attributes:
    description: how it searches, as the jobs record it: {"method": "ann",
      "type", "params", "file"} or {"method": "exact"}.

  Raises (from the constructor):
    ConfigError: an ANN index to search without FAISS installed.
    JobError: its ANN file missing, truncated, damaged (its CRC-32) or not a
      FAISS index (ann.load, ann.verify).
  """

  def __init__(
    self, index: index_lib.Index, index_workdir: str, *, mode: str, chunk_size: int, where: str
  ):
    self._embeddings, self._chunk_size = index.embeddings, chunk_size
    described = index.ann
    self._ann = None
    if mode == "auto" and described and described["type"] != "flat":
      self._ann = ann_lib.load(index_workdir, described, where=where)
      # Codes that rank candidates only: re-ranked with the rows, memory-mapped from the shards.
      self._rerank = ann_lib.reranker(described, index.embeddings)
      self.description = {
        "method": "ann",
        **{key: described[key] for key in ("type", "params", "file")},
      }
      logging.info(
        "Searching the %d rows through the %s ANN index %s (%s)%s.",
        len(index.rows),
        described["type"],
        described["file"],
        ann_lib.checked_by(described),
        ", its candidates re-ranked with the rows of the shards" if self._rerank else "",
      )
      return
    self.description = {"method": "exact"}
    if described:
      ann_lib.verify(index_workdir, described, where=where)
      why = (
        "config.search='exact'"
        if mode == "exact"
        else f"its ANN index {described['file']} is 'flat', itself exact"
      )
      logging.info(
        "Searching the %d rows exactly (%s); %s: %s.",
        len(index.rows),
        why,
        described["file"],
        ann_lib.checked_by(described),
      )
    else:
      logging.info("Searching the %d rows exactly (the index has no ANN index).", len(index.rows))

  def search(self, queries, k: int):
    """(scores float32 [Q, k], rows int [Q, k]) of each query's k best rows, best first.

    queries: float32 [Q, D] unit vectors (any array-like). An approximate index
    may find fewer than k rows for a query; the missing ones are row -1 with
    score -inf, last.
    """
    if self._ann is None:
      return exact.top_k_cosine(queries, self._embeddings, k, chunk_size=self._chunk_size)
    found = [
      ann_lib.search(self._ann, np.asarray(queries[start : start + _QUERY_BLOCK]), k, self._rerank)
      for start in range(0, len(queries), _QUERY_BLOCK)
    ]
    return np.concatenate([s for s, _ in found]), np.concatenate([r for _, r in found])

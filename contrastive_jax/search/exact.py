"""Exact search: the k rows of an embedding bank most similar to each query, on the device.

The baseline of every approximate search (ann.py) and what an index below
ann.EXACT_BELOW rows is searched with.

A bank of at most RESIDENT_BYTES goes to the device once and every block of
queries is searched over all of it in one jitted call (lax.map over the blocks,
lax.scan over the bank's chunks); a larger one (a memory-mapped index) is
streamed through the device chunk by chunk. Each chunk's top-k is exact and
found in two steps: the maximum of each group of GROUP columns, the k best
groups, then the top-k of those k x GROUP scores (the k best scores lie in the
k groups with the best maxima), which costs far less than lax.top_k over the
whole chunk.
"""

import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

# Banks up to this size are copied to the device whole and searched in one call
# per query block; larger ones are streamed chunk by chunk.
RESIDENT_BYTES = 1 << 31
# Columns per group in a chunk's two-step top-k (_chunk_top_k).
GROUP = 256
# Queries per device step by default: on 1,000,000 x 128 rows (CPU, 2 cores)
# 1,000 queries per step searched about 1.7 times as fast as 256 (fewer passes
# over the bank, a better-shaped matmul); docs/search.md.
QUERY_BATCH = 1024


def _chunk_top_k(sims, k: int):
  """(scores, columns int32) of the k largest of each line of sims [Q, C], best first.

  Exact, and among equal scores the lower column first, as lax.top_k. When C
  splits into more than k groups of GROUP columns: every one of the k best
  scores lies in one of the k groups whose maxima are best (ties: the lower
  group), since each other group has k groups before it, each holding a score
  before its maximum; so only those k groups' scores are ranked.
  """
  queries, columns = sims.shape
  if columns % GROUP or columns // GROUP <= k:
    scores, cols = lax.top_k(sims, min(k, columns))
    return scores, cols.astype(jnp.int32)
  groups = sims.reshape(queries, columns // GROUP, GROUP)
  _, chosen = lax.top_k(groups.max(axis=2), k)
  # In column order, so that lax.top_k's lower-index-first rule keeps ties in column order.
  chosen = jnp.sort(chosen, axis=1)
  candidates = jnp.take_along_axis(groups, chosen[:, :, None], axis=1).reshape(queries, -1)
  scores, pos = lax.top_k(candidates, k)
  cols = jnp.take_along_axis(chosen, pos // GROUP, axis=1) * GROUP + pos % GROUP
  return scores, cols.astype(jnp.int32)


def _merge(best_scores, best_rows, queries, chunk, start, valid, k: int):
  """Merges the top-k of queries . chunk^T (its first `valid` rows, bank rows start...) into
  the best."""
  # HIGHEST: float32 products on every backend (DEFAULT is TF32 or bfloat16 passes
  # on GPU and TPU; on CPU it costs nothing, both are float32).
  sims = jnp.matmul(queries, chunk.T, precision=lax.Precision.HIGHEST)
  if valid is not None:
    sims = jnp.where(jnp.arange(chunk.shape[0]) < valid, sims, -jnp.inf)
  scores, cols = _chunk_top_k(sims, k)
  # The best so far come first and hold only lower rows, so among equal scores
  # the lower row stays first (lax.top_k keeps the lower index of a tie first).
  scores = jnp.concatenate([best_scores, scores], axis=1)
  rows = jnp.concatenate([best_rows, cols + start], axis=1)
  top, pos = lax.top_k(scores, k)
  return top, jnp.take_along_axis(rows, pos, axis=1)


def _empty(queries: int, k: int):
  return jnp.full((queries, k), -jnp.inf, jnp.float32), jnp.full((queries, k), -1, jnp.int32)


@functools.partial(jax.jit, static_argnames=("k", "chunk"))
def _search_resident(query_blocks, bank, *, k: int, chunk: int):
  """The top-k of each block of query_blocks [B, Q, D] over all of bank [N, D] (on the
  device), one block after the other in one call: the call's scores buffer
  (Q x chunk) is allocated, and its pages first touched, once for all blocks."""
  full = bank.shape[0] // chunk

  def search(queries):
    def step(best, i):
      part = lax.dynamic_slice_in_dim(bank, i * chunk, chunk)
      return _merge(*best, queries, part, i * chunk, None, k), None

    best, _ = lax.scan(step, _empty(queries.shape[0], k), jnp.arange(full, dtype=jnp.int32))
    # The rest, no padding: its whole groups of GROUP rows, then the last < GROUP rows
    # (columns not a multiple of GROUP would take lax.top_k over all of them).
    rest = full * chunk
    for end in (bank.shape[0] - bank.shape[0] % GROUP, bank.shape[0]):
      if end > rest:
        best = _merge(*best, queries, bank[rest:end], rest, None, k)
        rest = end
    return best

  return lax.map(search, query_blocks)


@functools.partial(jax.jit, static_argnames="k")
def _merge_chunk(best_scores, best_rows, queries, chunk, start, valid, *, k: int):
  return _merge(best_scores, best_rows, queries, chunk, start, valid, k)


def top_k_cosine(queries, bank, k: int, *, chunk_size: int, query_batch: int = QUERY_BATCH):
  """The k rows of bank with the largest dot product with each query, best first.

  With L2-normalised rows the dot product is the cosine similarity. Exact:
  float32 products (Precision.HIGHEST on every backend). A bank of at most
  RESIDENT_BYTES is copied to the device once and all blocks of query_batch
  queries searched over it in one call (one compile for each number of
  blocks); a larger one goes to the device chunk_size rows at a time (only
  the last chunk padded), each chunk's top-k merged into the running top-k of
  every query, so the device then holds one chunk and Q x (query_batch / Q x
  chunk_size + 2k) scores.

  Args:
    queries: float32 [Q, D].
    bank: float32 [N, D], N >= k; any array-like (a memory-mapped .npy is
      read chunk by chunk).
    k: neighbours per query; may exceed chunk_size.
    chunk_size: bank rows per device step.
    query_batch: queries per device step.
  Returns:
    (scores float32 [Q, k], rows int32 [Q, k]) as numpy, each line sorted by
    score, largest first; equal scores in row order.
  Raises:
    ValueError: k is not in [1, N], or D differs between queries and bank.
  """
  num_rows, dim = len(bank), bank.shape[1]
  if not 0 < k <= num_rows:
    raise ValueError(f"k={k}: must be in [1, {num_rows}] (the bank's rows)")
  if queries.shape[1] != dim:
    raise ValueError(f"queries have dimension {queries.shape[1]}: must be the bank's, {dim}")
  chunk = min(chunk_size, num_rows)
  if chunk > GROUP:  # Whole groups of columns: the two-step top-k (_chunk_top_k).
    chunk -= chunk % GROUP
  count = len(queries)
  block = min(query_batch, count)
  # The last block padded: one compiled shape.
  blocks = np.zeros((-(-count // block), block, dim), np.float32)
  blocks.reshape(-1, dim)[:count] = queries
  if num_rows * dim * 4 <= RESIDENT_BYTES:
    on_device = jnp.asarray(np.asarray(bank, np.float32))
    scores, rows = _search_resident(jnp.asarray(blocks), on_device, k=k, chunk=chunk)
  else:
    device_blocks = [jnp.asarray(q) for q in blocks]
    found = [_empty(block, k) for _ in device_blocks]
    for start in range(0, num_rows, chunk):
      part = np.asarray(bank[start : start + chunk], np.float32)
      valid = len(part)
      if valid < chunk:  # Only the last chunk is padded (masked by valid).
        part = np.concatenate([part, np.zeros((chunk - valid, dim), np.float32)])
      part = jnp.asarray(part)
      found = [
        _merge_chunk(*best, q, part, np.int32(start), np.int32(valid), k=k)
        for best, q in zip(found, device_blocks)
      ]
    scores, rows = (np.stack([np.asarray(b[i]) for b in found]) for i in (0, 1))
  return np.asarray(scores).reshape(-1, k)[:count], np.asarray(rows).reshape(-1, k)[:count]

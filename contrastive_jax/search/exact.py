"""Exact search: the k rows of an embedding bank most similar to each query, on the device.

The baseline of every approximate search (ann.py) and what an index below
ann.EXACT_BELOW rows is searched with.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, static_argnames="k")
def _merge_chunk(best_scores, best_rows, queries, chunk, start, valid, *, k: int):
  """Merges the top-k of queries . chunk^T (its first `valid` rows, bank rows start...) into the best."""
  sims = jnp.matmul(queries, chunk.T, precision=jax.lax.Precision.HIGHEST)
  sims = jnp.where(jnp.arange(chunk.shape[0]) < valid, sims, -jnp.inf)
  scores, cols = jax.lax.top_k(sims, min(k, chunk.shape[0]))
  # The best so far come first and hold only lower rows, so among equal scores
  # the lower row stays first (lax.top_k keeps the lower index of a tie first).
  scores = jnp.concatenate([best_scores, scores], axis=1)
  rows = jnp.concatenate([best_rows, cols.astype(jnp.int32) + start], axis=1)
  top, pos = jax.lax.top_k(scores, k)
  return top, jnp.take_along_axis(rows, pos, axis=1)


def top_k_cosine(queries, bank, k: int, *, chunk_size: int, query_batch: int = 256):
  """The k rows of bank with the largest dot product with each query, best first.

  With L2-normalised rows the dot product is the cosine similarity. The bank
  goes to the device chunk_size rows at a time and each chunk's top-k is
  merged into the running top-k (jax.lax.top_k), so the device holds at most
  query_batch x (chunk_size + 2k) scores whatever the bank's size.

  Args:
    queries: float32 [Q, D].
    bank: float32 [N, D], N >= k; any array-like (a memory-mapped .npy is
      read chunk by chunk).
    k: neighbours per query.
    chunk_size: bank rows per device step.
    query_batch: queries per device step.
  Returns:
    (scores float32 [Q, k], rows int32 [Q, k]) as numpy, each line sorted by
    score, largest first; equal scores in row order.
  """
  num_rows = len(bank)
  chunk = min(chunk_size, num_rows)
  block = min(query_batch, len(queries))
  scores, rows = [], []
  for q0 in range(0, len(queries), block):
    q = np.zeros((block, queries.shape[1]), np.float32)
    q[: len(queries[q0 : q0 + block])] = queries[q0 : q0 + block]
    best = (jnp.full((block, k), -jnp.inf), jnp.full((block, k), -1, jnp.int32))
    for start in range(0, num_rows, chunk):
      part = np.zeros((chunk, bank.shape[1]), np.float32)
      valid = len(bank[start : start + chunk])
      part[:valid] = bank[start : start + chunk]
      best = _merge_chunk(*best, q, part, np.int32(start), np.int32(valid), k=k)
    scores.append(np.asarray(best[0]))
    rows.append(np.asarray(best[1]))
  count = len(queries)
  return np.concatenate(scores)[:count], np.concatenate(rows)[:count]

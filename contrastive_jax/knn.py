"""Weighted kNN monitor (Wu et al. 2018, arXiv 1805.01978, Sec. 3.4).

Features h of the whole train split form the bank and every test image is a
query; the encoder runs in eval mode (running BN statistics). Each query's k
nearest bank entries by cosine similarity vote for their label with weight
exp(sim / temperature); the class with the largest vote wins.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from contrastive_jax import input_pipeline
from contrastive_jax import train_state as ts


@functools.partial(jax.jit, static_argnames=("num_classes", "k"))
def knn_predict(queries, bank, bank_labels, *, num_classes: int, k: int, temperature: float):
  """Weighted kNN class predictions.

  Args:
    queries: float [Q, D] L2-normalised query features.
    bank: float [N, D] L2-normalised bank features; bank_labels int [N].
    num_classes: number of classes C; k: neighbours (clipped to N).
    temperature: vote weight exp(sim / temperature), > 0.
  Returns:
    int32 [Q] predicted classes (ties go to the smaller class index).
  """
  sims = jnp.matmul(queries, bank.T, precision=jax.lax.Precision.HIGHEST)
  top_sims, top_idx = jax.lax.top_k(sims, min(k, bank.shape[0]))
  votes = jax.nn.one_hot(bank_labels[top_idx], num_classes) * jnp.exp(top_sims / temperature)[..., None]
  return jnp.argmax(jnp.sum(votes, axis=1), axis=1).astype(jnp.int32)


def make_embed_fn(encoder, mesh):
  """Jitted (variables, uint8 images [B, S, S, 3]) -> L2-normalised h [B, D] float32."""
  def embed(variables, images):
    h = encoder.apply(variables, images.astype(jnp.float32) / 255.0, train=False)
    return h / jnp.maximum(jnp.linalg.norm(h, axis=1, keepdims=True), 1e-12)
  return jax.jit(embed, out_shardings=ts.batch_sharded(mesh))


def extract_features(embed_fn, variables, ds, mesh):
  """Features and labels of every real (unmasked) example of an eval dataset.

  Returns numpy (features float32 [N, D], labels int32 [N]) gathered from all
  processes, in the same order on each.
  """
  feats, labels = [], []
  for batch in input_pipeline.device_batches(ds, ts.batch_sharded(mesh)):
    f = embed_fn(variables, batch["image"])
    f, y, m = multihost_utils.process_allgather((f, batch["label"], batch["mask"]), tiled=True)
    feats.append(f[m])
    labels.append(y[m])
  return np.concatenate(feats), np.concatenate(labels)


def evaluate(embed_fn, variables, train_ds, test_ds, mesh, *, num_classes: int, k: int,
             temperature: float, query_chunk: int = 1024) -> dict:
  """Runs the monitor; returns {'knn_top1': fraction of test images right, in [0, 1]}."""
  bank, bank_labels = extract_features(embed_fn, variables, train_ds, mesh)
  queries, labels = extract_features(embed_fn, variables, test_ds, mesh)
  bank, bank_labels = jnp.asarray(bank), jnp.asarray(bank_labels)
  correct = 0
  for start in range(0, len(queries), query_chunk):
    pred = knn_predict(jnp.asarray(queries[start:start + query_chunk]), bank, bank_labels,
                       num_classes=num_classes, k=k, temperature=temperature)
    correct += int(np.sum(np.asarray(pred) == labels[start:start + query_chunk]))
  return {"knn_top1": correct / len(queries)}

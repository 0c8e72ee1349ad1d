"""Weighted kNN classifier on hand-worked cases."""
import jax.numpy as jnp
import numpy as np

from contrastive_jax import knn


def test_weighted_vote_hand_worked():
  # Query at angle 0. Bank: two class-1 points at +-60 degrees (sim 0.5 each),
  # one class-0 point at 0 degrees (sim 1.0). With t = 0.1:
  # class 0 vote e^10 = 22026; class 1 votes 2 e^5 = 297 -> class 0.
  # With t = 1: class 0 e^1 = 2.72; class 1 2 e^0.5 = 3.30 -> class 1.
  c, s = np.cos(np.pi / 3), np.sin(np.pi / 3)
  bank = jnp.array([[c, s], [c, -s], [1.0, 0.0]])
  labels = jnp.array([1, 1, 0])
  query = jnp.array([[1.0, 0.0]])
  assert int(knn.knn_predict(query, bank, labels, num_classes=2, k=3, temperature=0.1)[0]) == 0
  assert int(knn.knn_predict(query, bank, labels, num_classes=2, k=3, temperature=1.0)[0]) == 1
  # k = 1 keeps only the nearest neighbour, whatever the temperature.
  assert int(knn.knn_predict(query, bank, labels, num_classes=2, k=1, temperature=1.0)[0]) == 0


def test_k_larger_than_bank_uses_whole_bank():
  bank = jnp.eye(3)
  pred = knn.knn_predict(jnp.eye(3), bank, jnp.array([2, 0, 1]), num_classes=3, k=200,
                         temperature=0.1)
  np.testing.assert_array_equal(pred, [2, 0, 1])

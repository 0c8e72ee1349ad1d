"""NT-Xent against a numpy transcription of the reference's loss; sharded loss and
gradients vs one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.methods import simclr


def nt_xent_numpy(u1, u2, t):
  """SimCLR Eq. 1 written out literally, in float64, anchor by anchor, reduced as the
  reference's objective.add_contrastive_loss: loss_a (the mean over view-1 anchors)
  + loss_b (the mean over view-2 anchors). Returns (loss, top-1 over all anchors)."""
  z = np.concatenate([u1, u2]).astype(np.float64)
  z = z / np.linalg.norm(z, axis=1, keepdims=True)
  n = u1.shape[0]
  losses, hits = [], []
  for i in range(2 * n):
    j = (i + n) % (2 * n)
    sims = {k: z[i] @ z[k] / t for k in range(2 * n) if k != i}
    denom = sum(np.exp(s) for s in sims.values())
    losses.append(-np.log(np.exp(sims[j]) / denom))
    hits.append(max(sims, key=sims.get) == j)
  return np.mean(losses[:n]) + np.mean(losses[n:]), np.mean(hits)


def numeric_grad(f, x, eps=1e-6):
  g = np.zeros_like(x)
  for idx in np.ndindex(x.shape):
    d = np.zeros_like(x)
    d[idx] = eps
    g[idx] = (f(x + d) - f(x - d)) / (2 * eps)
  return g


@pytest.mark.parametrize("t", [0.1, 0.5])
def test_nt_xent_value_and_gradient_match_numpy(t):
  rng = np.random.default_rng(0)
  u1, u2 = rng.normal(size=(2, 6, 5))
  loss, top1 = simclr.nt_xent(jnp.asarray(u1), jnp.asarray(u2), t)
  ref_loss, ref_top1 = nt_xent_numpy(u1, u2, t)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(top1, ref_top1)
  g1, g2 = jax.grad(lambda a, b: simclr.nt_xent(a, b, t)[0], argnums=(0, 1))(
    jnp.asarray(u1, jnp.float32), jnp.asarray(u2, jnp.float32)
  )
  np.testing.assert_allclose(g1, numeric_grad(lambda a: nt_xent_numpy(a, u2, t)[0], u1), atol=1e-5)
  np.testing.assert_allclose(g2, numeric_grad(lambda b: nt_xent_numpy(u1, b, t)[0], u2), atol=1e-5)


def test_nt_xent_hand_worked_case():
  # Two images, orthogonal, each view identical to its pair: sim(i, j) = 1,
  # the other two candidates have sim 0. l = -log(e^(1/t) / (e^(1/t) + 2)) for
  # every anchor, so loss_a = loss_b = l and the loss is 2 l.
  z1 = jnp.array([[1.0, 0.0], [0.0, 1.0]])
  loss, top1 = simclr.nt_xent(z1, z1, 0.5)
  np.testing.assert_allclose(loss, -2 * np.log(np.exp(2) / (np.exp(2) + 2)), rtol=1e-6)
  assert top1 == 1.0


def test_sharded_nt_xent_and_gradients_equal_single_device():
  mesh = mesh_lib.make_mesh()
  assert mesh.size == 8
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
  x1, x2 = (jnp.asarray(a, jnp.float32) for a in rng.normal(size=(2, 16, 5)))

  def loss_of(w, x1, x2, axis_name):
    return simclr.nt_xent(jnp.tanh(x1 @ w), jnp.tanh(x2 @ w), 0.2, axis_name)[0]

  single, single_grad = jax.value_and_grad(loss_of)(w, x1, x2, None)
  sharded_fn = jax.jit(
    jax.shard_map(
      jax.value_and_grad(lambda w, a, b: loss_of(w, a, b, mesh_lib.DATA_AXIS)),
      mesh=mesh,
      in_specs=(jax.P(), jax.P(mesh_lib.DATA_AXIS), jax.P(mesh_lib.DATA_AXIS)),
      out_specs=jax.P(),
    )
  )
  put = lambda a, s: jax.device_put(a, s)
  sharded, sharded_grad = sharded_fn(
    put(w, mesh_lib.replicated(mesh)),
    put(x1, mesh_lib.batch_sharded(mesh)),
    put(x2, mesh_lib.batch_sharded(mesh)),
  )
  np.testing.assert_allclose(sharded, single, rtol=1e-6)
  np.testing.assert_allclose(sharded_grad, single_grad, rtol=1e-5, atol=1e-7)

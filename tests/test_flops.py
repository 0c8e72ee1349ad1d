"""benchmarks/flops.py against hand counts and XLA's own cost analysis."""

from helpers import load_benchmark
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from contrastive_jax.core import mesh as mesh_lib

flops = load_benchmark("flops")
common = load_benchmark("common")


def conv(x, w, stride=1, padding="SAME"):
  """NHWC input, HWIO kernel, as the models' convolutions."""
  return jax.lax.conv_general_dilated(
    x, w, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


def test_a_dot_is_2mnk_and_a_batched_dot_times_its_batch():
  m, k, n, b = 6, 5, 4, 3
  assert flops.model_flops(jnp.matmul, jnp.ones((m, k)), jnp.ones((k, n))) == 2 * m * k * n
  batched = flops.model_flops(jnp.matmul, jnp.ones((b, m, k)), jnp.ones((b, k, n)))
  assert batched == 2 * b * m * k * n


def test_a_convolution_is_2_x_outputs_x_window_x_input_features():
  n, h, c_in, c_out, k = 2, 8, 3, 4, 3
  x, w = jnp.ones((n, h, h, c_in)), jnp.ones((k, k, c_in, c_out))
  assert flops.model_flops(conv, x, w) == 2 * (n * h * h * c_out) * (k * k * c_in)
  strided = flops.model_flops(lambda x, w: conv(x, w, 2), x, w)
  assert strided == 2 * (n * (h // 2) ** 2 * c_out) * (k * k * c_in)


def test_a_valid_convolution_counts_what_xla_counts():
  # No padding, so XLA's count (valid positions only) and the nominal one agree.
  x, w = jnp.ones((2, 9, 9, 3)), jnp.ones((3, 3, 3, 5))
  compiled = jax.jit(lambda x, w: conv(x, w, padding="VALID")).lower(x, w).compile()
  valid = flops.model_flops(lambda x, w: conv(x, w, padding="VALID"), x, w)
  assert valid == common.cost(compiled)["flops"] == 2 * 2 * 7 * 7 * 5 * 27


@pytest.mark.parametrize("stride", [1, 2])
def test_both_gradients_of_a_same_convolution_cost_what_its_forward_costs(stride):
  # Input gradient: a convolution over the output gradient dilated by the stride (the zeros
  # it puts in multiply nothing); kernel gradient: the input against the output gradient.
  x, w = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 4))
  forward = flops.model_flops(lambda x, w: conv(x, w, stride), x, w)
  loss = lambda x, w: conv(x, w, stride).sum()  # noqa: E731
  both = flops.model_flops(jax.grad(loss, argnums=(0, 1)), x, w)
  assert both == pytest.approx(3 * forward)


def test_a_scan_counts_its_body_once_per_trip_and_a_cond_its_costliest_branch():
  a = jnp.ones((4, 4))
  one = 2 * 4 * 4 * 4

  def scanned(a):
    return jax.lax.scan(lambda c, _: (c @ a, None), a, None, length=5)[0]

  assert flops.model_flops(scanned, a) == 5 * one
  branches = lambda p, a: jax.lax.cond(p, lambda a: a @ a @ a, lambda a: a, a)  # noqa: E731
  assert flops.model_flops(branches, True, a) == 2 * one


def test_a_shard_map_body_counts_once_per_device_so_the_total_is_the_global_work():
  mesh = mesh_lib.make_mesh()
  spec = jax.P(mesh_lib.DATA_AXIS)
  x = jax.device_put(np.ones((16, 8, 8, 3), np.float32), mesh_lib.batch_sharded(mesh))
  w = jax.device_put(np.ones((3, 3, 3, 4), np.float32), mesh_lib.replicated(mesh))
  per_device = jax.shard_map(conv, mesh=mesh, in_specs=(spec, jax.P()), out_specs=spec)
  assert mesh.size == 8
  assert flops.model_flops(per_device, x, w) == flops.model_flops(conv, x, w)

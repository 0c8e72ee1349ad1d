"""The device mesh and the shardings every job places values with.

One 1-D mesh over every device of every process, axis DATA_AXIS: data
parallelism, the batch split along axis 0 and the state held whole on every
device. Nothing here touches a device until it is called.
"""

import jax

DATA_AXIS = "data"


def make_mesh(devices=None) -> jax.sharding.Mesh:
  """A 1-D mesh, axis DATA_AXIS, over `devices` (default: every device of every process)."""
  devices = jax.devices() if devices is None else devices
  return jax.make_mesh((len(devices),), (DATA_AXIS,), devices=devices)


def replicated(mesh):
  """The sharding of a value held whole on every device."""
  return jax.sharding.NamedSharding(mesh, jax.P())


def batch_sharded(mesh):
  """The sharding of a batch split along axis 0 over the data axis."""
  return jax.sharding.NamedSharding(mesh, jax.P(DATA_AXIS))

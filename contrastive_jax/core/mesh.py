"""The device mesh and the shardings every job places values with.

One 1-D mesh over every device of every process, axis DATA_AXIS: data
parallelism, the batch split along axis 0 and the state held whole on every
device. Nothing here touches a device until it is called.
"""

import collections
from typing import Iterable, Iterator

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


def device_batches(batches: Iterable[dict], sharding, prefetch: int = 2) -> Iterator[dict]:
  """Yields global jax.Arrays assembled from this process's local numpy batches.

  batches: dicts of numpy arrays whose first axis is this process's part of the
  global batch. Keeps `prefetch` batches in flight: device_put is asynchronous,
  so the transfer of batch i+1 overlaps the step on batch i.
  """
  queue = collections.deque()
  for local in batches:
    queue.append(jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local))
    if len(queue) > prefetch:
      yield queue.popleft()
  while queue:
    yield queue.popleft()

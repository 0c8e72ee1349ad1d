"""One process of the host-count equality check (tests/test_multihost_equality.py).

usage: python multihost_equality_worker.py NUM_PROCESSES PROCESS_ID PORT OUT_DIR

The job has 4 CPU devices in all: NUM_PROCESSES=1 holds them in this process
(the single-host reference, XLA's in-process collectives); 2 holds 2 here and
2 in the other process (jax.distributed on 127.0.0.1, gloo collectives).
Every process builds the same global batches from the seed and passes its own
rows with jax.make_array_from_process_local_data, as input_pipeline does, so
that both set-ups train on the same data. It runs, with the package's own
functions, STEPS train steps of each method (pretrain.build), the kNN monitor
and the online probe's classifier evaluator on fixed parameters, and STEPS
steps of the linear-probe job's train step, and writes what they give to
OUT_DIR/process_PROCESS_ID.npz: every state leaf as [local devices, ...] (each
local device's copy) and the metrics of every step.
"""

import os
import sys

from helpers import load_config
from helpers import tiny_config
import jax
import numpy as np

from contrastive_jax import models
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.jobs import pretrain
from contrastive_jax.methods import encoder_variables
from contrastive_jax.methods import get_method
from contrastive_jax.methods import optim
from contrastive_jax.training import downstream
from contrastive_jax.training import evaluators
from contrastive_jax.training import probe_presets

NUM_DEVICES = 4
STEPS = 3
# SimCLR crosses hosts in every way a method can (the all-gathered NT-Xent batch, global BN,
# the gradient all-reduce) and MoCo v2 adds shuffle BN's permutation across hosts; BYOL's
# collectives are SimCLR's (global BN, the gradient sum), so a third compile adds no case.
METHODS = ("simclr", "moco_v2")


def method_config(method: str):
  """tests/helpers.tiny_config(method) with the changes below."""
  config = tiny_config(method)
  # Torchvision's shortcuts. With SimCLR's first-stage projection the kNN monitor of the
  # initial encoder gave 0.156 on two hosts against 0.094 on one (measured): on these noise
  # images its features nearly tie, so a last-bit difference between the device layouts
  # reorders neighbours. The evaluators' counting is what this compares.
  config.model.stage_projection = False
  config.evaluators.knn.k = 20  # Fewer than a device's part of the bank: top-k merging counts.
  if method == "moco_v2":
    # 4 images per BN group: with 2, BN amplifies the all-reduce's last-bit
    # differences (see the test) to 7e-4 in the optimizer state in 3 steps.
    config.moco.bn_group_size = 4
  return config


def global_batch(seed: int, step: int, batch_size: int, image_size: int, num_views: int):
  """The global batch of a step, the same in every process: uint8 noise images, labels."""
  rng = np.random.default_rng([seed, step])
  return {
    "image": rng.integers(
      0, 256, (batch_size, num_views, image_size, image_size, 3), dtype=np.uint8
    ),
    "label": rng.integers(0, 10, (batch_size,), dtype=np.int32),
  }


def this_process_rows(batch, sharding):
  """The global batch as jax.Arrays, each process passing only its own rows.

  The mesh lists process 0's devices first, so process p holds rows
  [p * B / P, (p + 1) * B / P): what mesh_lib.device_batches passes.
  """
  p, n = jax.process_index(), jax.process_count()

  def rows(x):
    local = len(x) // n
    return jax.make_array_from_process_local_data(sharding, x[p * local : (p + 1) * local])

  return jax.tree.map(rows, batch)


def local_copies(tree, prefix: str) -> dict:
  """{prefix/path: [local devices, ...]} of every leaf of a replicated pytree."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {
    f"{prefix}/{jax.tree_util.keystr(path)}": np.stack(
      [np.asarray(shard.data) for shard in leaf.addressable_shards]
    )
    for path, leaf in flat
  }


def fixed(tree, mesh, seed: int):
  """Standard-normal values of tree's shapes, replicated on mesh, the same in every process."""
  rng = np.random.default_rng(seed)

  def leaf(x):
    value = rng.standard_normal(x.shape).astype(x.dtype)
    return jax.make_array_from_callback(
      x.shape, mesh_lib.replicated(mesh), lambda index: value[index]
    )

  return jax.tree.map(leaf, tree)


def pretrain_runs(mesh, out: dict):
  """STEPS train steps of each method; the kNN and classifier evaluators on SimCLR's init.

  Returns SimCLR's initial encoder variables.
  """
  for method in METHODS:
    config = method_config(method)
    pretrain.check_config(config, jax.device_count())
    task = pretrain.build(config, mesh, None, workdir=None)  # It writes nothing.
    state = task.init()
    if method == "simclr":
      encoder = encoder_variables(task.init())  # A copy: the train step donates `state`.
      # The online probe starts at zero (all logits equal): evaluate fixed weights instead.
      probe = dict(state.probe, params=fixed(state.probe["params"], mesh, config.seed))
      for _, evaluator in evaluators.build(
        config.evaluators, task.eval_model, mesh, task.num_classes, task.steps_per_epoch
      ):
        for name, value in evaluator(state.replace(probe=probe)).items():
          out[f"eval/{name}"] = np.float64(value)
    for step in range(STEPS):
      batch = global_batch(config.seed, step, config.batch_size, config.image_size, 2)
      state, metrics = task.train_step(
        state, this_process_rows(batch, mesh_lib.batch_sharded(mesh))
      )
      out.update(local_copies(metrics, f"{method}/metrics/{step}"))
    out.update(local_copies(state, f"{method}/state"))
  return encoder


def probe_run(mesh, pretrained, out: dict):
  """STEPS steps of the linear-probe job's train step on the encoder variables `pretrained`."""
  pretrain_config = method_config("simclr")
  encoder = get_method("simclr").build_model(pretrain_config).encoder
  # The 'standardised' preset: its head has a BN, whose statistics must agree too.
  config = probe_presets.fill_probe_preset(load_config("linear_probe", "runlocal"), "standardised")
  config.batch_size = 16
  head = downstream.LinearHead(10)
  tx = optim.build_optimizer(
    config.optimizer, optim.learning_rate_schedule(config.optimizer, config.batch_size, 16, 100)
  )
  feature_dim = models.encoder_width(pretrain_config.model)

  def init():  # As linear_probe.build initialises its state.
    return downstream.probe_state(head, tx, feature_dim, config.seed)

  state = jax.jit(init, out_shardings=mesh_lib.replicated(mesh))()
  train_step = downstream.make_probe_step(head, tx, encoder)
  for step in range(STEPS):
    batch = global_batch(config.seed + 1, step, config.batch_size, pretrain_config.image_size, 1)
    state, metrics = train_step(
      state, this_process_rows(batch, mesh_lib.batch_sharded(mesh)), pretrained
    )
    out.update(local_copies(metrics, f"probe/metrics/{step}"))
  out.update(local_copies(state, "probe/state"))


def main(num_processes: int, process_id: int, port: int, out_dir: str):
  jax.config.update("jax_num_cpu_devices", NUM_DEVICES // num_processes)
  if num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id
    )
  mesh = mesh_lib.make_mesh()
  assert mesh.size == NUM_DEVICES, mesh
  out = {}
  probe_run(mesh, pretrain_runs(mesh, out), out)
  np.savez(os.path.join(out_dir, f"process_{process_id}.npz"), **out)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])

"""The train path with `import tensorflow` and `import tensorflow_datasets` made to fail.

Run as a script (tests/test_without_tensorflow.py does, in a subprocess; on an image
without TensorFlow it runs as it is): `python tests/without_tensorflow_worker.py
[METHOD ...]` (default: simclr moco_v2 byol). It first puts a finder on sys.meta_path
that raises ImportError for both packages, then imports every module of the TF-free
set (docs/design.md, 'Without TensorFlow': tf_free_modules), and for each
method's tiny config (helpers.tiny_config) runs two real train steps on random images,
saves the state and config with core.checkpointing, restores them, and writes metrics
through core.metrics. It asserts the values (finite loss, the restored state equal to
the saved one bit for bit, the saved config equal to the run's, metrics.jsonl's
records) and prints one line, 'RESULT ' + JSON, for the test to read; any failure
exits non-zero with its traceback.
"""

import importlib
import json
import os
import pkgutil
import re
import sys
import tempfile
import time

BLOCKED = ("tensorflow", "tensorflow_datasets")
METHODS = ("simclr", "moco_v2", "byol")


class _Blocker:
  """A meta path finder that refuses BLOCKED and their submodules."""

  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in BLOCKED:
      raise ModuleNotFoundError(f"No module named {name!r} (blocked: no TensorFlow here)")
    return None


def block_tensorflow():
  """Makes BLOCKED look not installed: `import tensorflow` raises ModuleNotFoundError.

  Two parts, as Python reports a package that is absent: a None entry in
  sys.modules, so that importlib.util.find_spec('tensorflow') is None (etils.epath
  asks it to choose its gs:// backend) and the import fails; and the finder first on
  sys.meta_path, which fails any other way of finding them (a submodule, a removed
  entry).
  """
  for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED:
      raise RuntimeError(f"{name} was imported before the blocker was installed")
  sys.meta_path.insert(0, _Blocker())
  for name in BLOCKED:
    sys.modules[name] = None


DESIGN = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "design.md"
)


def tf_free_modules(package_dir: str) -> list:
  """The dotted names of the TF-free set: the one list in docs/design.md's 'Without
  TensorFlow' section (its line of `entries`), each `PACKAGE/*` expanded to the package and
  every module in package_dir/PACKAGE, each `a/b.py` to contrastive_jax.a.b.

  Raises:
    ValueError: the section holds no such line or more than one.
  """
  with open(DESIGN) as f:
    section = f.read().split("\n## Without TensorFlow\n", 1)[-1].split("\n## ", 1)[0]
  lines = [line for line in section.splitlines() if re.fullmatch(r"`[^`]+`(, `[^`]+`)*", line)]
  if len(lines) != 1:
    raise ValueError(f"{DESIGN}: 'Without TensorFlow' needs one line of `modules`, not {lines}")
  names = []
  for entry in re.findall(r"`([^`]+)`", lines[0]):
    if entry.endswith("/*"):
      package = entry[:-2]
      names.append(f"contrastive_jax.{package}")
      names += sorted(
        f"contrastive_jax.{package}.{m.name}"
        for m in pkgutil.iter_modules([os.path.join(package_dir, package)])
      )
    else:
      names.append("contrastive_jax." + entry.removesuffix(".py").replace("/", "."))
  return names


def import_train_path() -> list:
  """Imports every module of the TF-free set (tf_free_modules); returns their names."""
  import contrastive_jax  # pylint: disable=import-outside-toplevel

  names = tf_free_modules(os.path.dirname(contrastive_jax.__file__))
  for name in names:
    importlib.import_module(name)
  return names


def run_method(name: str, workdir: str) -> dict:
  """Two train steps of tiny_config(name), a checkpoint round trip and a metrics write."""
  # pylint: disable=import-outside-toplevel
  from helpers import tiny_config
  import jax
  import numpy as np

  from contrastive_jax.core import checkpointing
  from contrastive_jax.core import mesh as mesh_lib
  from contrastive_jax.core import metrics
  from contrastive_jax.data import augment
  from contrastive_jax.methods import common
  from contrastive_jax.methods import get_method
  from contrastive_jax.methods import optim
  from contrastive_jax.methods import run_keys

  config = tiny_config(name)
  config.data_dir = ""  # No dataset is read here.
  if jax.device_count() % 8:  # MoCo's shuffled BN groups span 8 devices; one device: one group.
    if "moco" in config:
      config.moco.bn_group_size = 1
  mesh = mesh_lib.make_mesh()
  method = get_method(config.method)
  length, t0 = common.RunLength(num_steps=2, steps_per_epoch=16), time.time()
  num_steps = length.num_steps
  schedule = optim.learning_rate_schedule(
    config.optimizer, config.batch_size, length.steps_per_epoch, num_steps
  )
  tx = optim.build_optimizer(config.optimizer, schedule)
  model = method.build_model(config)
  init_rng, rng = run_keys(config.seed)
  replicated = mesh_lib.replicated(mesh)
  state = jax.jit(
    lambda: method.init_state(config, model, tx, init_rng, rng), out_shardings=replicated
  )()
  views = tuple(
    augment.ViewAugment.from_config(config.augment[v], f"augment.{v}") for v in ("view1", "view2")
  )
  step_fn = jax.jit(
    method.make_train_step(config, model, tx, views, mesh, length), donate_argnums=0
  )
  images = np.random.default_rng(0).integers(
    0, 256, (num_steps, config.batch_size, 2, config.image_size, config.image_size, 3), np.uint8
  )
  losses = []
  for step in range(num_steps):
    batch = {"image": images[step], "label": np.zeros(config.batch_size, np.int32)}
    state, step_metrics = step_fn(state, jax.device_put(batch, mesh_lib.batch_sharded(mesh)))
    losses.append(float(step_metrics["loss"]))
  assert all(np.isfinite(losses)), losses
  assert int(state.step) == num_steps, int(state.step)

  saved = jax.device_get(state)
  checkpointer = checkpointing.Checkpointer(f"{workdir}/checkpoints")
  checkpointer.save(num_steps, state, config)
  checkpointer.close()
  reader = checkpointing.Checkpointer(f"{workdir}/checkpoints", read_only=True)
  assert reader.latest_step() == num_steps
  restored = reader.restore(checkpointing.abstract_like(state, replicated))
  saved_config = reader.saved_config()
  reader.close()
  leaves, restored_leaves = jax.tree.leaves(saved), jax.tree.leaves(jax.device_get(restored))
  assert jax.tree.structure(saved) == jax.tree.structure(jax.device_get(restored))
  for a, b in zip(leaves, restored_leaves):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert a.tobytes() == b.tobytes(), "a restored leaf differs from the saved one"
  assert checkpointing.config_differences(saved_config.to_dict(), config, ()) == []

  writer = metrics.create_writer(workdir, resumed_step=None)
  writer.write_hparams(config.to_dict())
  for step, loss in enumerate(losses, 1):
    writer.write_scalars(step, {"loss": loss})
  writer.close()
  with open(f"{workdir}/metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert records == [{"step": s, "loss": loss} for s, loss in enumerate(losses, 1)], records
  events = [n for n in os.listdir(workdir) if n.startswith("events.out.tfevents")]
  return {
    "losses": losses,
    "leaves": len(leaves),
    "events": events,
    "seconds": round(time.time() - t0, 1),
  }


def main(argv):
  block_tensorflow()
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # helpers
  modules = import_train_path()
  import jax  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  jax.config.update("jax_num_cpu_devices", 8)  # As the tests' conftest: 8 CPU devices.
  # As the tests' conftest too: Orbax writes each array from one device, the same files,
  # without compiling a slicing program per array and device (most of the saves' time here).
  ocp.type_handlers.register_type_handler(
    jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True
  )

  result = {
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "devices": jax.device_count(),
    "modules": modules,
    "methods": {},
  }
  with tempfile.TemporaryDirectory() as tmp:
    for name in argv[1:] or METHODS:
      result["methods"][name] = run_method(name, os.path.join(tmp, name))
  leaked = sorted(n for n, m in sys.modules.items() if m is not None and n.split(".")[0] in BLOCKED)
  assert not leaked, leaked
  print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main(sys.argv)

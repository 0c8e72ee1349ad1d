"""Test helpers that touch no JAX device (the multi-host worker imports them too)."""

import functools
import glob
import importlib.util
import os
import shutil
import signal
import socket

import numpy as np

TESTS = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared")
TFDS_DIR = os.path.abspath(
  os.environ.get("TFDS_DATA_DIR", os.path.join(SHARED, "tensorflow_datasets"))
)
CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")


def load_config(name: str, variant: str = ""):
  """configs/NAME.py's get_config(variant), as --config=configs/NAME.py:variant loads it."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(CONFIG_DIR, name + ".py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


def load_benchmark(name: str):
  """benchmarks/NAME.py as a module (its flags are defined by define_flags(), not at import)."""
  path = os.path.join(TESTS, "..", "benchmarks", name + ".py")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def reference_state_dict(make, case: str) -> dict:
  """make.random_state_dict(case) of a tests/reference_outputs module `make`, drawn once in
  a process (the float32 tensors of a ResNet-50 or a ViT-S take about a second of CPU to
  draw): each call a new dict of the same arrays, which are read-only, so that a test may
  add or drop names but an in-place change of a tensor raises."""
  return dict(_drawn_state_dict(make, case))


@functools.cache
def _drawn_state_dict(make, case: str) -> dict:
  tensors = make.random_state_dict(case)
  for value in tensors.values():
    value.flags.writeable = False
  return tensors


# tiny_config's views on the command line of a SimCLR CIFAR-10 job (its views have no blur or
# solarisation): crops and flips only. The colour jitter and grayscale compile to about as
# much as a tiny network's whole step: ~8 s of CPU in each job process started.
CROPS_AND_FLIPS_ARGS = tuple(
  f"--config.augment.{view}.{field}=0.0"
  for view in ("view1", "view2")
  for field in ("color_jitter_prob", "grayscale_prob")
)


def tiny_config(method: str = "simclr", variant: str = "runlocal", photometric: bool = False):
  """configs/METHOD_cifar10.py:VARIANT shrunk to seconds: 8 devices x 2 images, 4 steps,
  a ResNet-10 (one basic block per stage) at width 0.0625 or a 1-block ViT of D = 12
  (runlocal_vit), read through the host pipeline.

  The views keep their crops and flips but leave out the photometric augmentations
  (colour jitter, grayscale, blur, solarisation) unless `photometric`: they compile to
  about as much as the tiny network's whole step (SimCLR's tiny step: 10.3 -> 5.2 s of
  CPU to trace and compile), and their code is every method's (common.augmented_views),
  checked against references in test_augment and test_recipes, and end to end by
  test_unchanged's runlocal runs and test_runner's resume.
  """
  config = load_config(f"{method}_cifar10", variant)
  if method == "moco_v2":
    config.moco.queue_size = 64
    config.moco.bn_group_size = 8  # One image of each group per device on 8 devices.
  config.data_dir = TFDS_DIR
  config.train_split = "train[:256]"
  config.on_device_data = False  # DINO's runlocals hold CIFAR-10 on the device.
  for evaluator in config.evaluators.values():
    evaluator.split = "test[:64]"
    evaluator.batch_size = 64
    evaluator.every = "1000 steps"
  config.evaluators.knn.bank_split = "train[:128]"
  config.batch_size = 16
  config.duration = "4 steps"
  config.model.width = 0.0625
  if not photometric:
    for view in ("view1", "view2"):
      config.augment[view] = dict(
        color_jitter_prob=0.0, grayscale_prob=0.0, blur_prob=0.0, solarize_prob=0.0
      )
  if "depth" in config.model:  # A ViT.
    config.model.depth = 1
  else:
    config.model.name = "resnet10"
  config.log_every = "1 steps"
  config.checkpoint_every = "2 steps"
  config.shuffle_buffer = 256
  config.data_threads = 1
  return config


# A 2-block ViT of D = 12 at patch 4: the distillation tests' teacher.
TINY_TEACHER = dict(
  name="vit_tiny",
  width=0.0625,
  depth=2,
  patch_size=4,
  dtype="float32",
  random_patch_projection=False,
  input_mean=(0.485, 0.456, 0.406),
  input_std=(0.229, 0.224, 0.225),
)

# TINY_TEACHER shaped as a DINOv3 ViT (recipes.dinov3_model): patch 16, RoPE, 4 storage
# tokens, layer scale, the masked key bias, LayerNorm eps 1e-5.
TINY_DINOV3_TEACHER = dict(
  TINY_TEACHER,
  patch_size=16,
  position_embedding="rope",
  layer_scale=True,
  registers=4,
  mask_key_bias=True,
  norm_epsilon=1e-5,
)


def tiny_teacher_file(directory, image_size: int = 32, seed: int = 7, model=None) -> str:
  """Writes a randomly initialised `model` (a model config dict, TINY_TEACHER by default),
  its variables those of init at PRNGKey(seed), as a safetensors state dict in `directory`
  (touches the device when called); returns its path."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top

  from contrastive_jax import models  # pylint: disable=g-import-not-at-top
  from contrastive_jax.core import tensor_files  # pylint: disable=g-import-not-at-top
  from contrastive_jax.models import state_dicts  # pylint: disable=g-import-not-at-top

  model = ml_collections.ConfigDict(model or TINY_TEACHER)
  x = jnp.zeros((1, image_size, image_size, 3), jnp.float32)
  variables = models.build_encoder(model).init(jax.random.PRNGKey(seed), x, train=False)
  kind = "dinov3" if model.get("position_embedding") == "rope" else "vit"
  path = os.path.join(str(directory), f"teacher_{kind}_{seed}.safetensors")
  tensor_files.write(path, state_dicts.to_state_dict(model, variables, image_size))
  return path


def tiny_distill_config(directory, loss: str = "v3", teacher=None):
  """tiny_config of configs/distill_cifar10.py:runlocal,model=vit_tiny with `teacher` (a model
  config dict, TINY_TEACHER by default) written in `directory` as its teacher and a queue
  of 32."""
  config = tiny_config("distill", f"runlocal,model=vit_tiny,loss={loss}")
  teacher = teacher or TINY_TEACHER
  config.distill.teacher = tiny_teacher_file(directory, config.image_size, model=teacher)
  config.distill.teacher_model = dict(teacher)
  config.distill.queue_size = 32
  return config


def sigterm_after_first_train_batch(monkeypatch):
  """Sends SIGTERM while the loop runs step 2, so the job stops after it."""
  from contrastive_jax.core import mesh as mesh_lib  # pylint: disable=g-import-not-at-top

  original = mesh_lib.device_batches

  def device_batches(batches, sharding, prefetch=2):
    for i, batch in enumerate(original(batches, sharding, prefetch)):
      yield batch
      # The loop resumes this generator when it fetches the next batch; eval batches
      # carry a mask.
      if i == 0 and "mask" not in batch:
        os.kill(os.getpid(), signal.SIGTERM)

  monkeypatch.setattr(mesh_lib, "device_batches", device_batches)


def damaged_copy(data_dir, name: str, into, how: str):
  """A copy in `into` of data_dir's dataset `name` (one ArrayRecord shard) with that shard damaged.

  how: 'truncated' keeps its first half; 'flipped' inverts 64 bytes at its middle.
  Returns (the copy's data_dir, the damaged shard's path).
  """
  copy = os.path.join(into, f"{how}_data")
  shutil.copytree(data_dir, copy)
  [shard] = glob.glob(os.path.join(copy, name, "*", f"{name}-*.array_record-*"))
  size = os.path.getsize(shard)
  if how == "truncated":
    os.truncate(shard, size // 2)
  else:
    with open(shard, "r+b") as f:
      f.seek(size // 2)
      flipped = bytes(b ^ 0xFF for b in f.read(64))
      f.seek(size // 2)
      f.write(flipped)
  return copy, shard


def free_port() -> int:
  """A TCP port on 127.0.0.1 that is free now (for a jax.distributed coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def receive_ctrl_c():
  """A Popen preexec_fn: the child takes SIGINT (Ctrl-C) as a terminal's foreground job does.

  A command started in the background of a non-interactive shell (`cmd &`,
  as a CI runner may start pytest) ignores SIGINT, and so would every process
  it starts; Python then installs no KeyboardInterrupt handler.
  """
  signal.signal(signal.SIGINT, signal.SIG_DFL)


def subprocess_env(**extra) -> dict:
  """This environment for a test's Python subprocess, importing this checkout's package:
  it carries conftest's XLA flags and compilation cache."""
  return dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.path.dirname(TESTS)]), **extra)


def checkpoints_are_finite(directory):
  """Asserts every float leaf of every checkpoint in `directory` is finite; returns the steps."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  steps = sorted(int(name) for name in os.listdir(directory) if name.isdigit())
  assert sorted(os.listdir(directory)) == sorted(map(str, steps))  # No half-written step.
  for step in steps:
    state = ocp.StandardCheckpointer().restore(os.path.join(directory, str(step), "state"))
    for leaf in _leaves(state):
      if np.issubdtype(np.asarray(leaf).dtype, np.floating):
        assert np.all(np.isfinite(leaf)), step
  return steps


def _leaves(tree):
  if isinstance(tree, dict):
    for value in tree.values():
      yield from _leaves(value)
  elif isinstance(tree, (list, tuple)):
    for value in tree:
      yield from _leaves(value)
  elif tree is not None:
    yield tree

"""Test setup: 8 simulated CPU devices, set before JAX starts, and a compilation cache.

The README's command runs the tests in pytest-xdist workers, one per core, each test
file in one worker (--dist loadfile: a file's module fixtures are made once): on a
2-core machine compiling, single-threaded, is most of the time, so two workers take
two thirds of one's time. Each worker is a pytest session of its own, with its own
8 simulated devices. A worker that crashes (a segfault in an extension) ends the run
with the test it was running named (--max-worker-restart=0): pytest-xdist 3.8's
loadfile scheduling can wait forever for a restarted worker's work.

Many tests run the same small programs again (a run, its killed twin, its resume;
the multi-host workers; another file's run of the same tiny config): JAX's
persistent compilation cache, in a fresh directory per run of pytest that its
workers share, compiles each of them once. The session that starts the workers
makes it and removes it at the end; the environment variables carry it to the
workers and to the subprocesses the tests start. JAX writes an entry once (a second
writer finds it there), and reads one it cannot load, such as one still being written
by another worker, as a miss, with a warning.

XLA's CPU backend compiles at optimisation level 0 and without its fusion emitters:
the tests' programs are small and compiled once each, so compilation, not running
them, is most of the suite's time. Level 0 halves it (the contract test of BYOL:
136 s -> 68 s on this 2-core machine); the emitters off save about a fifth more (the
suite in two workers: 941 s -> 715 s). The programs are the same, their machine code
less fused. Every comparison in the tests is between programs compiled alike or
against tolerances that hold at any setting.
"""

import os
import shutil
import tempfile

import jax
import orbax.checkpoint as ocp
import pytest

from contrastive_jax.core import runtime

# Every process setting as main.py makes them (core/runtime.py), once, though pytest-xdist's
# workers inherit them from the session that starts them; and the compile options above. No
# re-execution: pytest-xdist starts its workers with a program read from stdin, which a
# re-executed worker could not read again, and the suite's time does not depend on it.
runtime.setup(
  huge_pages=False,
  xla_options=("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"),
)

# Made by the session that starts pytest-xdist's workers (or the only one), before it
# starts them: the workers inherit its environment.
_CACHE_OWNER = "PYTEST_XDIST_WORKER" not in os.environ
if _CACHE_OWNER:
  os.environ["CONTRASTIVE_JAX_TEST_CACHE"] = tempfile.mkdtemp(prefix="contrastive_jax_test_cache_")
_CACHE = os.environ["CONTRASTIVE_JAX_TEST_CACHE"]
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

# Orbax saves an array that several devices hold whole in slices, one per device
# (replica-parallel), each slice a small program compiled for its shape and device: on 8
# simulated CPU devices sharing one memory that buys nothing and costs a seventh of a tiny
# run's time (SimCLR's resume test: 53 -> 45 s of CPU). The tests' in-process saves write each
# array from one device, the same files; jobs started as subprocesses keep Orbax's default.
ocp.type_handlers.register_type_handler(
  jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True
)


# The files that take longest, longest first (seconds of one worker in the suite on the 2-core
# VM: about 130 for test_images, 40 to 105 for the next eleven, 30 to 60 for the rest), run first:
# pytest-xdist hands a worker the next file in this order when it finishes one, so a long file
# left for last would run beside an idle worker. test_unchanged follows test_runner at a
# distance: its runs compile the programs of test_runner's first runs, which the shared
# compilation cache then holds.
_SLOWEST_FIRST = (
  "test_images.py",
  "test_runner.py",
  "test_multihost.py",
  "test_label_efficiency.py",
  "test_weights.py",
  "test_interruptions.py",
  "test_unchanged.py",
  "test_dinov2.py",
  "test_methods.py",
  "test_map.py",
  "test_launcher.py",
  "test_device_benchmark.py",
  "test_multihost_equality.py",
  "test_dino.py",
  "test_speedrun.py",
  "test_device_data.py",
  "test_conv.py",
  "test_distillation.py",
  "test_linear_probe.py",
  "test_embed_beam.py",
  "test_byol.py",
  "test_export.py",
  "test_main.py",
  "test_capacity.py",
  "test_finetune.py",
  "test_search.py",
  "test_without_tensorflow.py",
)


def pytest_configure(config):
  """Keeps _SLOWEST_FIRST's order in pytest-xdist's scheduling: its default for --dist loadfile
  (loadscope_reorder) hands out the files with the most tests first, which put the long
  files of few tests (the pod, the two hosts, the recorded runs) last, beside an idle worker."""
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
  """Orders the test files _SLOWEST_FIRST, then the rest as collected (tests within a
  file keep their order)."""
  del session, config
  rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_sessionfinish(session, exitstatus):
  """Removes the run's compilation cache, which nothing after the run reads, in the
  session that made it: after its workers have finished."""
  del session, exitstatus
  if _CACHE_OWNER:
    shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def array_record_cifar(tmp_path_factory):
  """data_dir holding 'cifar_array_record': CIFAR-10's first 2,000 training images as ArrayRecord.

  Read from the shared TFRecord CIFAR-10 (TFDS_DATA_DIR), stored with their
  labels and ids in the same order (disable_shuffling), PNG-encoded as there:
  record i is train[i] of the shared dataset.
  """
  from helpers import TFDS_DIR  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  cifar = tfds.builder("cifar10", data_dir=TFDS_DIR)
  examples = tfds.as_numpy(cifar.as_dataset(split="train[:2000]", shuffle_files=False))
  data_dir = str(tmp_path_factory.mktemp("array_record"))
  tfds.dataset_builders.store_as_tfds_dataset(
    name="cifar_array_record",
    version="1.0.0",
    features=cifar.info.features,
    split_datasets={"train": ((i, e) for i, e in enumerate(examples))},
    data_dir=data_dir,
    file_format="array_record",
    disable_shuffling=True,
  )
  return data_dir

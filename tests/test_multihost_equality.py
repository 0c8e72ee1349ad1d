"""Host-count equality: 2 processes x 2 CPU devices compute what 1 process x 4 devices does.

tests/multihost_equality_worker.py runs, in each set-up, 3 train steps of SimCLR
and MoCo v2 (tiny configs with one ResNet block per stage) on the same
global batches (each process passes its own rows), the kNN monitor and the
online probe's classifier on fixed parameters, and 3 steps of the linear-probe
job's train step. The three processes (the reference and the two hosts) start
together; compiling is most of their time.

What is bitwise and what is not, and why:
- Every device of both hosts holds the same state, bit for bit (the replicated
  state is updated identically everywhere from all-reduce results that every
  device receives whole).
- The evaluators' numbers are equal: they count correct predictions with
  integer sums; similarities and logits are computed per row.
- Training matches one host within 1e-5, not bitwise. A float all-reduce (the
  gradient sum, BN's global statistics, losses) adds the 4 devices'
  contributions in a different order: XLA's in-process CPU all-reduce adds them
  in device order, ((d0 + d1) + d2) + d3, element by element, while gloo's ring
  all-reduce between hosts sums each chunk of the buffer starting from another
  device. Float addition is not associative, so sums differ in the last bit
  (about 1e-7 relative), and the steps after carry that on. Everything else is
  the same program on the same rows with the same per-device PRNG keys.
"""

import os
import subprocess
import sys

from helpers import free_port
from helpers import subprocess_env
import numpy as np
import pytest

WORKER = os.path.join(os.path.dirname(__file__), "multihost_equality_worker.py")
METHODS = ("simclr", "moco_v2")  # As the worker's: why not BYOL, there.
# Absolute for values near or below 1, relative for larger ones (gradient norms of 24
# under MoCo's torchvision initialisation differ by 6e-5 between the layouts).
TOLERANCE = 1e-5
# MoCo's BN groups of 4 images amplify the last-bit differences more: 1.8e-5 in the
# momentum of a stage-1 kernel after 3 steps with torchvision's initialisation, whose
# blocks do not start as the identity.
MOCO_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """{'one_host': {key: [4 devices, ...]}, 'two_hosts': the same, both processes' devices}."""
  out = tmp_path_factory.mktemp("equality")
  port = free_port()  # The 1-process reference ignores it.
  procs = []
  for setup, num_processes, process_id in [
    ("one_host", 1, 0),
    ("two_hosts", 2, 0),
    ("two_hosts", 2, 1),
  ]:
    os.makedirs(out / setup, exist_ok=True)
    log = out / setup / f"process_{process_id}.log"
    with open(log, "w") as f:  # A file, not a pipe: a full pipe would stall a process.
      procs.append(
        (
          subprocess.Popen(
            [sys.executable, WORKER, str(num_processes), str(process_id), str(port), out / setup],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=subprocess_env(),
          ),
          log,
        )
      )
  try:
    for proc, log in procs:
      proc.wait(timeout=900)
      assert proc.returncode == 0, log.read_text()[-3000:]
  finally:
    for proc, _ in procs:
      proc.kill()
  one = np.load(out / "one_host" / "process_0.npz")
  two = [np.load(out / "two_hosts" / f"process_{i}.npz") for i in range(2)]
  assert sorted(one.files) == sorted(two[0].files) == sorted(two[1].files)
  return {
    "one_host": {k: np.atleast_1d(one[k]) for k in one.files},
    "two_hosts": {k: np.concatenate([np.atleast_1d(t[k]) for t in two]) for k in one.files},
  }


def _keys(runs, prefix):
  keys = [k for k in runs["one_host"] if k.startswith(prefix)]
  assert keys, prefix
  return keys


def test_every_device_of_both_hosts_holds_the_same_values_bitwise(runs):
  for setup, processes in (("one_host", 1), ("two_hosts", 2)):
    for key, copies in runs[setup].items():
      # One copy per device; an evaluator's numbers, one per process.
      assert len(copies) == (processes if key.startswith("eval/") else 4), key
      for copy in copies[1:]:
        np.testing.assert_array_equal(copy, copies[0], err_msg=f"{setup} {key}")


def _assert_matches_one_host(runs, prefix):
  for key in _keys(runs, prefix):
    one, two = runs["one_host"][key][0], runs["two_hosts"][key][0]
    if np.issubdtype(one.dtype, np.floating):
      tol = MOCO_TOLERANCE if key.startswith("moco") else TOLERANCE
      np.testing.assert_allclose(two, one, rtol=tol, atol=tol, err_msg=key)
    else:  # Steps, PRNG keys, the queue pointer.
      np.testing.assert_array_equal(two, one, err_msg=key)


@pytest.mark.parametrize("method", METHODS)
def test_pretraining_state_and_metrics_match_one_host(runs, method):
  _assert_matches_one_host(runs, f"{method}/")


def test_moco_queue_and_pointer_match_one_host(runs):
  ptr = runs["two_hosts"]["moco_v2/state/.extra['queue_ptr']"]
  np.testing.assert_array_equal(ptr, [48] * 4)  # 3 steps of 16 keys into a queue of 64.
  np.testing.assert_array_equal(runs["one_host"]["moco_v2/state/.extra['queue_ptr']"], ptr)
  _assert_matches_one_host(runs, "moco_v2/state/.extra['queue")


def test_knn_and_classifier_give_the_same_numbers(runs):
  keys = _keys(runs, "eval/")
  assert sorted(keys) == ["eval/knn_top1", "eval/online_probe_top1", "eval/online_probe_top5"]
  for key in keys:
    assert runs["two_hosts"][key][0] == runs["one_host"][key][0], key


def test_linear_probe_train_step_matches_one_host(runs):
  _assert_matches_one_host(runs, "probe/")

"""benchmarks/speedrun.py --tiny on this CPU with TensorFlow and TFDS blocked (as on the
accelerator image), from an .npz of real CIFAR-10 images: a run resumed across two calls, its
table, and its one-line refusals."""

import json
import os
import subprocess
import sys

from helpers import TESTS
from helpers import TFDS_DIR
from helpers import load_benchmark
from helpers import subprocess_env
import numpy as np
import pytest

from contrastive_jax.data import device_data

ROOT = os.path.dirname(TESTS)
SCRIPT = os.path.join(ROOT, "benchmarks", "speedrun.py")
# Runs the script as __main__ after the TF-free worker's blocker is installed; BLOCK names one
# more package to make absent (sys.modules[name] = None: importlib finds no such module).
BLOCKED_RUN = (
  "import runpy, sys; sys.path.insert(0, {tests!r}); "
  "import without_tensorflow_worker as w; w.block_tensorflow(); "
  "[sys.modules.__setitem__(n, None) for n in {absent!r}]; "
  "sys.argv = [{script!r}] + sys.argv[1:]; runpy.run_path({script!r}, run_name='__main__')"
)


@pytest.fixture(scope="module")
def cifar_npz(tmp_path_factory):
  """An .npz of the shared CIFAR-10's first 256 train and 128 test images, as
  benchmarks/make_device_data.py writes it (the image files as TFDS stores them)."""
  make = load_benchmark("make_device_data")
  splits = {
    split: make.read("cifar10", TFDS_DIR, f"{split}[:{count}]", encoded=True)
    for split, count in (("train", 256), ("test", 128))
  }
  path = str(tmp_path_factory.mktemp("data") / "cifar10.npz")
  device_data.save_encoded_npz(path, splits)
  return path


def _run(*args, absent=()):
  command = [
    sys.executable,
    "-c",
    BLOCKED_RUN.format(tests=TESTS, script=SCRIPT, absent=list(absent)),
    *args,
  ]
  return subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=900)


def _one_line(done) -> str:
  """The refusal: status non-zero, one line on stderr naming the script, no traceback."""
  assert done.returncode != 0, done.stdout[-2000:]
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("benchmarks/speedrun.py"), done.stderr[-3000:]
  assert "Traceback" not in done.stderr
  return lines[0]


def test_tiny_run_resumes_across_two_calls_and_writes_its_table(cifar_npz, tmp_path):
  workdir, out = tmp_path / "run", tmp_path / "out"
  common = ("--tiny", f"--data={cifar_npz}", f"--workdir={workdir}", f"--out={out}")
  first = _run(*common, "--call_epochs=1")
  assert first.returncode == 0, first.stderr[-4000:]
  assert "stopped at step 16 of 32" in first.stdout
  assert sorted(os.listdir(workdir / "checkpoints")) == ["16"]
  halfway = json.loads((out / "speedrun.json").read_text())
  assert [e["epoch"] for e in halfway["evals"]] == [1.0]

  second = _run(*common)
  assert second.returncode == 0, second.stderr[-4000:]
  assert "step 16 of 32" in second.stdout and "stopped" not in second.stdout
  results = json.loads((out / "speedrun.json").read_text())
  env = results["environment"]
  assert env["backend"] == "cpu" and env["tiny"] and env["steps_per_epoch"] == 256 // 16
  assert env["num_steps"] == 32 and env["epochs"] == 2
  assert results["calls"] == [
    {"start_step": 0, "end_step": 16},
    {"start_step": 16, "end_step": 32},
  ]
  evals = results["evals"]
  assert [(e["step"], e["epoch"]) for e in evals] == [(16, 1.0), (32, 2.0)]
  assert evals[0] == halfway["evals"][0]  # The first call's record, kept as it was.
  for e in evals:
    assert 0.0 <= e["knn_top1"] <= 1.0 and np.isfinite(e["loss"]), e
  # The clocks add up across the calls: steps, compilation (one first step a call), evaluation.
  assert 0 < evals[0]["train_s"] < evals[1]["train_s"]
  assert 0 < evals[0]["compile_s"] < evals[1]["compile_s"]
  assert evals[1]["eval_s"] == pytest.approx(evals[0]["knn_s"] + evals[1]["knn_s"])
  last = results["saves"][-1]
  assert last["step"] == 32 and last["train_s"] == evals[1]["train_s"]
  # The thresholds: the first evaluation at or above each (hand-checked from the evals).
  for threshold, reached in results["thresholds"].items():
    above = [e for e in evals if e["knn_top1"] >= float(threshold)]
    assert reached == (above[0] if above else None), threshold
  recipe = {r["field"]: r for r in env["recipe"]}
  assert recipe["temperature"]["value"] == 0.5 and "lightly" in recipe["temperature"]["source"]
  table = (out / "speedrun.md").read_text()
  assert table in second.stdout
  assert "(--tiny)" in table and "| 0.848 |" in table and "| 0.858 |" in table
  assert f"| 2 | {evals[1]['knn_top1']:.4f} |" in table

  # The same run in one call: the resumed run computed what it computes (the batches are a
  # function of the step, the state restored bit for bit).
  whole = _run("--tiny", f"--data={cifar_npz}", f"--workdir={tmp_path / 'whole'}")
  assert whole.returncode == 0, whole.stderr[-4000:]
  one_call = json.loads((tmp_path / "whole" / "results" / "speedrun.json").read_text())
  assert [(e["knn_top1"], e["loss"]) for e in one_call["evals"]] == [
    (e["knn_top1"], e["loss"]) for e in evals
  ]

  # A later call with another budget in the same workdir: the checkpoint is another recipe's.
  line = _one_line(_run(*common, "--epochs=3"))
  assert "another recipe" in line and "speedrun.epochs: 2 there, 3 here" in line


def test_bad_input_is_one_line_before_any_compute(cifar_npz, tmp_path):
  workdir = tmp_path / "run"
  common = ("--tiny", f"--workdir={workdir}")
  line = _one_line(_run(*common, f"--data={tmp_path / 'absent.npz'}"))
  assert "absent.npz is no file" in line and "make_device_data.py" in line
  line = _one_line(_run(*common, f"--data={cifar_npz}", "--epochs=3", "--eval_every=4"))
  assert "--epochs=3 is below --eval_every=4: no kNN evaluation would run" in line
  line = _one_line(_run(*common, f"--data={cifar_npz}", "--minutes=0.0001"))
  assert "--minutes=0.0001 (0 epochs) is below --eval_every=1" in line
  line = _one_line(_run(*common, f"--data={cifar_npz}", absent=["ml_collections"]))
  assert line == (
    "benchmarks/speedrun.py needs ml-collections: install them or carry their wheels (docs/gpu.md)"
  )
  assert not workdir.exists()  # Nothing was written.


def test_first_reached_takes_the_first_evaluation_at_or_above_each_threshold():
  speedrun = load_benchmark("speedrun")
  evals = [{"epoch": e, "knn_top1": k} for e, k in ((10, 0.79), (20, 0.848), (30, 0.85), (40, 0.9))]
  assert speedrun.first_reached(evals) == {
    "0.8": evals[1],
    "0.848": evals[1],
    "0.858": evals[3],
    "0.9": evals[3],
  }
  assert speedrun.first_reached(evals[:1]) == dict.fromkeys(("0.8", "0.848", "0.858", "0.9"))

"""benchmarks/device.py --tiny on this CPU, with TensorFlow and TFDS blocked as on the
accelerator image, from an .npz of real CIFAR-10 images; and its one-line refusals."""

import importlib.util
import json
import os
import subprocess
import sys

from helpers import TESTS
from helpers import TFDS_DIR
from helpers import load_benchmark
from helpers import subprocess_env
import numpy as np

from contrastive_jax.data import device_data

ROOT = os.path.dirname(TESTS)
SCRIPT = os.path.join(ROOT, "benchmarks", "device.py")
# Runs the script as __main__ after the TF-free worker's blocker is installed.
BLOCKED_RUN = (
  "import runpy, sys; sys.path.insert(0, {tests!r}); "
  "import without_tensorflow_worker as w; w.block_tensorflow(); "
  "sys.argv = [{script!r}] + sys.argv[1:]; runpy.run_path({script!r}, run_name='__main__')"
)


def _cifar_npz(path, train: int, test: int):
  """An .npz of the first `train` and `test` images of the shared CIFAR-10, as
  make_device_data.py writes it (the image files as TFDS stores them)."""
  make = load_benchmark("make_device_data")
  splits = {}
  for split, count in (("train", train), ("test", test)):
    files, labels = make.read("cifar10", TFDS_DIR, f"{split}[:{count}]", encoded=True)
    splits[split] = (files, labels)
  device_data.save_encoded_npz(path, splits)


def _run(*args):
  command = [sys.executable, "-c", BLOCKED_RUN.format(tests=TESTS, script=SCRIPT), *args]
  return subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=900)


def test_tiny_run_without_tensorflow_prints_and_writes_every_section(tmp_path):
  data = str(tmp_path / "cifar10.npz")
  # 512 train images: a kNN bank above the monitor's k (200); a larger one only adds the
  # time to read, encode and search it.
  _cifar_npz(data, train=512, test=256)
  out = tmp_path / "out"
  # One row and the supervised reference: every section; each other row's network is
  # test_tiny_rows_shrink_each_network_and_keep_its_family's, DINO's multi-crop step
  # test_capacity's.
  rows = ["SimCLR ResNet-18 CIFAR bf16"]
  done = _run(
    "--tiny", f"--data={data}", f"--out={out}", f"--rows={','.join(rows)}", "--steps=1",
    "--train_seconds=1",
  )  # fmt: skip
  assert done.returncode == 0, done.stderr[-4000:]
  results = json.loads((out / "device.json").read_text())
  env = results["environment"]
  assert env["backend"] == "cpu" and env["tiny"] and env["peak_tflops"] is None
  # The first row, then the supervised reference (the pretraining runs before any other row).
  assert [r["row"] for r in results["steps"]] == [rows[0], "supervised ResNet-50 224 bf16"]
  for row in results["steps"]:
    assert row["batch"] == 16 and row["images_per_s"] > 0, row
    assert row["tflop_per_step"] > 0 and row["memory_gib"] > 0, row
    assert row["mfu"] is None, row  # No peak is known for a CPU.
  pretrain = results["pretraining"]
  assert pretrain["train_images"] == 512 and pretrain["test_images"] == 256
  assert pretrain["steps"] >= 1 and np.isfinite(pretrain["final_loss"])
  assert 0.0 <= pretrain["knn_top1"] <= 1.0
  table = (out / "device.md").read_text()
  assert table in done.stdout
  for row in rows:
    assert f"| {row} | 16 |" in table
  assert "kNN top-1" in table and "(--tiny)" in table


def test_tiny_rows_shrink_each_network_and_keep_its_family():
  """--tiny: every row at batch 16 and 32 px; ResNet-18 as ResNet-10, ResNet-50 kept (at
  width 1/8), the ViTs at one block, DINO's head at 256 outputs."""
  device = load_benchmark("device")
  for label, name, arg, overrides in device.ROWS:
    full = device.row_config(name, arg, overrides, tiny=False)
    tiny = device.row_config(name, arg, overrides, tiny=True)
    assert (tiny.batch_size, tiny.image_size) == (16, 32), label
    if "depth" in full.model:
      assert tiny.model.depth == 1 and tiny.model.name == full.model.name, label
    else:
      expected = {"resnet18": "resnet10", "resnet50": "resnet50"}[full.model.name]
      assert (tiny.model.name, tiny.model.width) == (expected, 0.125), label
    if "dino" in full:
      assert (tiny.dino.out_dim, tiny.dino.hidden_dim, tiny.dino.bottleneck_dim) == (256, 64, 32)


def test_a_missing_data_file_or_package_is_one_line(tmp_path, monkeypatch):
  done = _run("--tiny", f"--data={tmp_path / 'none.npz'}")
  assert done.returncode != 0 and "Traceback" not in done.stderr
  [line] = done.stderr.strip().splitlines()
  assert "--data=" in line and "make_device_data.py" in line
  done = _run("--tiny", "--data=x.npz", "--rows=BYOL")
  assert done.returncode != 0 and "Traceback" not in done.stderr
  [line] = done.stderr.strip().splitlines()
  assert "--rows=BYOL must choose the first row" in line

  device = load_benchmark("device")
  real = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, "find_spec", lambda name, *a: None if name == "ml_collections" else real(name)
  )
  assert device.missing_packages() == ["ml-collections"]


def test_a_garbage_or_truncated_data_file_is_one_line_before_any_compute(tmp_path):
  whole = str(tmp_path / "whole.npz")
  images = np.zeros((8, 4, 4, 3), np.uint8)
  device_data.save_npz(whole, {"train": (images, np.arange(8)), "test": (images, np.arange(8))})
  data = open(whole, "rb").read()
  for name, content, why in (
    ("garbage.npz", bytes(range(256)) * 64, "neither a zip archive nor an .npy array"),
    ("truncated.npz", data[: len(data) - 100], "no whole zip archive, truncated or damaged"),
  ):
    path, out = tmp_path / name, tmp_path / f"out_{name}"
    path.write_bytes(content)
    done = _run("--tiny", f"--data={path}", f"--out={out}")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"benchmarks/device.py: config.device_data_file='{path}'"), line
    assert why in line, line
    assert not out.exists() and "JAX" not in done.stdout  # Refused before the first row.

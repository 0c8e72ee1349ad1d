"""benchmarks/throughput.py end to end on 12 real photos, and its FLOP count and peaks."""

import math
import os
import shutil

from helpers import SHARED
from helpers import load_benchmark
from helpers import load_config
import jax
import jax.numpy as jnp
import pytest

from contrastive_jax.data import sources
from contrastive_jax.jobs import prepare

throughput = load_benchmark("throughput")
common = load_benchmark("common")


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
  """The benchmark's report on train/{hat,shoes} of 6 clothing photos each, stored at full
  size (400-900 px): a ResNet-10 at width 0.0625, batches of 8 (one per test device) at 64 px."""
  src = tmp_path_factory.mktemp("photos")
  for cls in ("hat", "shoes"):
    folder = os.path.join(SHARED, "images", "clothing", "train", cls)
    os.makedirs(src / "train" / cls)
    for name in sorted(os.listdir(folder))[:6]:
      shutil.copy(os.path.join(folder, name), src / "train" / cls / name)
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  prepare_config = load_config("prepare")
  prepare_config.src, prepare_config.name, prepare_config.image_size = str(src), "photos", 0
  prepare_config.beam.direct_num_workers = 1
  prepare.run(prepare_config, data_dir)
  config = load_config("simclr_images", "runlocal")
  config.dataset, config.data_dir = "photos", data_dir
  config.model.name, config.model.width = "resnet10", 0.0625
  config.batch_size, config.image_size, config.data_threads = 8, 64, 2
  source = sources.get_source(config, {"train_split": config.train_split})
  m = throughput.measure(
    config,
    source,
    warmup_batches=1,
    batches=2,
    rounds=1,
    steps=2,
    peak_tflops=0.0,
    matmul_size=256,
    config_name="simclr_images.py:runlocal (tiny)",
  )
  return m, throughput.report(m)


def _rows(report: str) -> dict:
  """First cell -> the other cells, of every markdown table row but headers and rules."""
  rows = [line.strip("|").split("|") for line in report.splitlines() if line.startswith("|")]
  cells = [[c.strip() for c in row] for row in rows if not set("".join(row)) <= set("-")]
  return {row[0]: row[1:] for row in cells if row[0] not in ("measured", "chips")}


def _number(cell: str):
  try:
    return float(cell)
  except ValueError:
    return None


def test_report_has_every_row_with_positive_finite_numbers(measured):
  m, report = measured
  rows = _rows(report)
  assert set(rows) == {
    throughput.PROJECT,
    throughput.PEER_WINDOW,
    throughput.PEER_WHOLE,
    "step: train step on a fixed batch",
    "1",
  }  # "1": the verdict's chips.
  for label, cells in rows.items():
    numbers = [n for n in map(_number, cells) if n is not None]
    assert numbers, label
    assert all(math.isfinite(n) and n > 0 for n in numbers), (label, cells)
  assert 0 < m.mfu <= 1
  assert float(rows["step: train step on a fixed batch"][3]) == pytest.approx(m.mfu, abs=1e-3)
  assert rows["1"][-1] in ("the host pipeline", "the step")
  # 8 CPU devices, one machine: the cost analysis is per device, the step runs on all 8.
  assert m.num_devices == 8 and m.chips == 1


def test_cost_analysis_counts_a_matmul_as_2mnk_flops():
  m, k, n = 64, 48, 40
  compiled = jax.jit(jnp.matmul).lower(jnp.ones((m, k)), jnp.ones((k, n))).compile()
  assert common.cost(compiled)["flops"] == 2 * m * n * k


def test_peaks_come_from_the_flag_else_the_device_kind():
  flops, source = throughput.peak_flops("float32", peak_tflops=2.0, matmul_size=8)
  assert flops == 2e12 * jax.device_count() and "--peak_tflops" in source
  names = {
    kind: throughput.accelerator_name(kind)
    for kind in (
      "TPU v4",
      "TPU v5 lite",
      "TPU v5",
      "TPU v5p",
      "TPU v6 lite",
      "NVIDIA A100-SXM4-40GB",
      "NVIDIA H100 80GB HBM3",
      "NVIDIA H100 PCIe",
      "NVIDIA H200",
      "cpu",
    )
  }
  assert names == {
    "TPU v4": "tpu_v4",
    "TPU v5 lite": "tpu_v5e",
    "TPU v5": "tpu_v5p",
    "TPU v5p": "tpu_v5p",
    "TPU v6 lite": "tpu_v6e",
    "NVIDIA A100-SXM4-40GB": "a100",
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H100 PCIe": None,
    "NVIDIA H200": "h200",
    "cpu": None,
  }

"""Every value the CIFAR-10 runlocal jobs log equals the committed record, at a fixed seed.

The three pretraining runlocals (SimCLR, MoCo v2, BYOL), the linear probe's and
the label-efficiency job's (500 labels) run from the command line a user types
(main --config=configs/X.py:runlocal --config.FIELD=VALUE... --workdir=DIR,
parsed by main's flags and run by main.run_job in this process, on conftest's 8
devices: a subprocess would start JAX and compile anew for each job), each
shrunk by --config overrides alone to a few steps on a few images (the
pretraining ResNet-18s cut to ResNet-10s), with its evaluators (the kNN monitor
and the online probe) hit on the way. The linear probe and the label-efficiency
job start from the SimCLR run. What they log (each metrics.jsonl record, every
key but the throughput ones, which measure the clock) and what the
label-efficiency job writes (curve.csv, summary.json) must equal, exactly as
written, the record in reference_outputs/unchanged.json: a change that keeps
every job's results keeps them bit for bit.

The record was made with this file (tests/reference_outputs/make_unchanged.py
runs it under pytest with UNCHANGED_RECORD=1), so under conftest's XLA options;
a change meant to change results re-records it, and its commit says why.
"""

import csv
import json
import math
import os
import sys
from unittest import mock

from absl import flags
from absl.testing import flagsaver
from helpers import CONFIG_DIR
from helpers import TFDS_DIR
import pytest

from contrastive_jax import main

RECORD = os.path.join(os.path.dirname(__file__), "reference_outputs", "unchanged.json")

# The runs' throughput: measured by the clock, so different at every run.
TIMING_KEYS = ("steps_per_sec", "images_per_sec")

# Every run reads few images of the shared CIFAR-10 in one thread.
DATA = (
  f"--config.data_dir={TFDS_DIR}",
  "--config.data_threads=1",
)

# A pretraining runlocal in 4 steps of 16 of 256 images, its ResNet-18 cut to a ResNet-10 at
# width 0.0625 (compiling it is most of the time): the kNN monitor (at step 0, 2
# and 4) and the online probe (at 2 and 4) on 64 test images, a bank of 128.
PRETRAIN = (
  *DATA,
  "--config.log_every=1 steps",
  "--config.train_split=train[:256]",
  "--config.shuffle_buffer=256",
  "--config.batch_size=16",
  "--config.model.name=resnet10",
  "--config.model.width=0.0625",
  "--config.duration=4 steps",
  "--config.checkpoint_every=2 steps",
  "--config.evaluators.knn.every=2 steps",
  "--config.evaluators.knn.split=test[:64]",
  "--config.evaluators.knn.bank_split=train[:128]",
  "--config.evaluators.knn.batch_size=32",
  "--config.evaluators.online_probe.every=2 steps",
  "--config.evaluators.online_probe.split=test[:64]",
  "--config.evaluators.online_probe.batch_size=32",
)

PRETRAINING = {
  "simclr": ("simclr_cifar10", ()),
  # MoCo's queue a multiple of the batch, its shuffled BN in two groups of 8.
  "moco_v2": ("moco_v2_cifar10", ("--config.moco.queue_size=64", "--config.moco.bn_group_size=8")),
  "byol": ("byol_cifar10", ()),
}

# The probe's runlocal in 3 steps of 16 of 64 images, scored on 40 test images.
LINEAR_PROBE = (
  *DATA,
  "--config.log_every=1 steps",
  "--config.train_split=train[:64]",
  "--config.shuffle_buffer=64",
  "--config.batch_size=16",
  "--config.duration=3 steps",
  "--config.evaluators.linear_probe.split=test[:40]",
  "--config.evaluators.linear_probe.batch_size=40",
)

# The label-efficiency runlocal at 500 labels of 1,000 images (400 train, 100 validate), one
# seed, its protocols (kNN, probe, fine-tuning) in one or two epochs, on 96 test images.
LABEL_EFFICIENCY = (
  *DATA,
  "--config.train_split=train[:1000]",
  "--config.test_split=test[:96]",
  "--config.labels=500",
  "--config.seeds=1",
  "--config.eval_batch_size=96",
  "--config.linear_probe.epochs=2",
  "--config.linear_probe.eval_every=1",
  "--config.linear_probe.batch_size=64",
  "--config.finetune.epochs=1",
  "--config.finetune.eval_every=1",
  "--config.finetune.batch_size=64",
)


def run(config: str, workdir: str, *overrides: str):
  """Runs `main --config=configs/CONFIG OVERRIDES... --workdir=WORKDIR`: main's own flags parse
  the command line (config file, its arguments, the --config.FIELD overrides), then main runs
  the job, in this process (its 8 devices, conftest's XLA options). The overrides' flags are
  made from sys.argv, as ml_collections' config flag reads them."""
  argv = ["main", f"--config={CONFIG_DIR}/{config}", *overrides, f"--workdir={workdir}"]
  with flagsaver.flagsaver(), mock.patch.object(sys, "argv", argv):
    main.parse_flags(argv)
    main.run_job(flags.FLAGS.config, flags.FLAGS.workdir)


def logged(workdir: str) -> list:
  """WORKDIR/metrics.jsonl's records, less their TIMING_KEYS."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def outputs(root) -> dict:
  """Runs the five jobs in directories under root; returns what each logged or wrote."""
  out = {}
  for name, (config, overrides) in PRETRAINING.items():
    workdir = os.path.join(root, name)
    run(f"{config}.py:runlocal", workdir, *PRETRAIN, *overrides)
    out[name] = logged(workdir)
  simclr = os.path.join(root, "simclr")
  probe = os.path.join(root, "linear_probe")
  run("linear_probe.py:runlocal", probe, f"--config.pretrain_workdir={simclr}", *LINEAR_PROBE)
  out["linear_probe"] = logged(probe)
  curve = os.path.join(root, "label_efficiency")
  run(
    "label_efficiency.py:runlocal",
    curve,
    f"--config.pretrain_workdir={simclr}",
    *LABEL_EFFICIENCY,
  )
  with open(os.path.join(curve, "curve.csv")) as f:
    rows = list(csv.DictReader(f))
  with open(os.path.join(curve, "summary.json")) as f:
    summary = json.load(f)
  out["label_efficiency"] = {"curve.csv": rows, "summary.json": summary}
  return out


def comparable(value):
  """value with each NaN as the string 'nan' (NaN equals nothing, itself included)."""
  if isinstance(value, dict):
    return {k: comparable(v) for k, v in value.items()}
  if isinstance(value, list):
    return [comparable(v) for v in value]
  if isinstance(value, float) and math.isnan(value):
    return "nan"
  return value


@pytest.fixture(scope="module")
def now(tmp_path_factory):
  """This checkout's outputs; with UNCHANGED_RECORD=1 in the environment, also recorded."""
  result = outputs(str(tmp_path_factory.mktemp("unchanged")))
  if os.environ.get("UNCHANGED_RECORD") == "1":
    with open(RECORD, "w") as f:
      json.dump(result, f, indent=1, sort_keys=True)
      f.write("\n")
  return result


@pytest.mark.parametrize(
  "job", [*PRETRAINING, "linear_probe", "label_efficiency"], ids=lambda job: job
)
def test_every_logged_value_is_the_recorded_one(now, job):
  with open(RECORD) as f:
    recorded = json.load(f)[job]
  assert comparable(now[job]) == comparable(recorded)

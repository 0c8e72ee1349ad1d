"""The label-efficiency job: its subsets, scores and interval, its bad inputs, and a tiny run."""

import csv
import inspect
import json
import math
import os
import re
import shutil

import helpers
from helpers import TFDS_DIR
from helpers import load_config
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from PIL import Image
import pytest
from test_finetune import pretrained  # noqa: F401  # The fixture: a tiny SimCLR checkpoint.
from test_finetune import pretrained_state  # noqa: F401  # What `pretrained` is made from.

from contrastive_jax import config_files
from contrastive_jax import main
from contrastive_jax import models
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import tensor_files
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import ResumeError
from contrastive_jax.data import in_memory
from contrastive_jax.data import sources
from contrastive_jax.jobs import label_efficiency
from contrastive_jax.methods import common
from contrastive_jax.models import state_dicts
from contrastive_jax.training import label_efficiency as le
from contrastive_jax.training import protocols
from contrastive_jax.training import restore


def _split(per_class=(30, 20, 12)):
  """ids 'x0'... and labels of a small split with per_class[c] examples of class c, shuffled."""
  labels = np.concatenate([np.full(n, c) for c, n in enumerate(per_class)])
  labels = np.random.default_rng(0).permutation(labels).astype(np.int32)
  return np.array([f"x{i}" for i in range(len(labels))], object), labels


def test_subset_is_class_balanced_disjoint_and_fixed_by_the_seed():
  ids, labels = _split()
  subset = le.draw_subset(ids, labels, 20, seed=3, num_classes=3, validation_fraction=0.25)
  both = np.concatenate([subset.train, subset.validation])
  assert len(set(both.tolist())) == 20  # Disjoint parts, 20 examples.
  # 20 = 3 x 6 + 2: two classes give 7, one gives 6; a quarter of each validates.
  assert sorted(np.bincount(labels[both], minlength=3).tolist()) == [6, 7, 7]
  for c in range(3):
    share = np.sum(labels[both] == c)
    assert np.sum(labels[subset.validation] == c) == max(1, math.floor(share / 4 + 0.5))
  again = le.draw_subset(ids, labels, 20, seed=3, num_classes=3, validation_fraction=0.25)
  assert all(np.array_equal(a, b) for a, b in zip(subset, again))
  # The draw follows the (id, label) pairs, not their order.
  order = np.random.default_rng(1).permutation(len(ids))
  shuffled = le.draw_subset(ids[order], labels[order], 20, 3, 3, 0.25)
  assert set(ids[order][shuffled.train]) == set(ids[subset.train])
  other = le.draw_subset(ids, labels, 20, seed=4, num_classes=3, validation_fraction=0.25)
  assert set(ids[other.train]) != set(ids[subset.train])


def test_label_counts_absolute_or_fractions():
  assert le.parse_counts("0.01,5000,500", 50_000) == (500, 5000)
  assert le.parse_counts("100", 1000) == (100,)
  for bad in ("0", "1.5", "-3", "many", "2000"):
    with pytest.raises(ConfigError, match=r"^config\.labels="):
      le.parse_counts(bad, 1000)


def test_counts_no_class_can_give_are_refused_naming_the_class():
  ids, labels = _split()
  with pytest.raises(ConfigError, match=r"class 2 \('c'\) has 12 in the train split"):
    le.check_counts([45], labels, 3, class_names=["a", "b", "c"])  # 15 of each class.
  with pytest.raises(ConfigError, match="at least 2 per class"):
    le.check_counts([5], labels, 3)
  le.check_counts([36], labels, 3)  # 12 of each: fits.


def test_top1_and_balanced_accuracy_by_hand():
  scores = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.7, 0.3]])
  labels = np.array([0, 1, 1, 0])
  assert le.top1(scores, labels) == 0.75
  # Class 0: 2 of 2 right; class 1: 1 of 2.
  assert le.balanced_accuracy(scores, labels) == pytest.approx(0.75)
  assert le.balanced_accuracy(scores, np.array([0, 0, 0, 1])) == pytest.approx((2 / 3 + 0) / 2)


def test_auroc_by_hand():
  # Positives score 0.8, 0.4, 0.4; negatives 0.5, 0.4. Pairs (pos > neg) counted 1, ties 1/2:
  # 0.8 beats both (2); each 0.4 loses to 0.5 and ties 0.4 (0.5 + 0.5): 3 of 6.
  scores = np.array([0.8, 0.4, 0.4, 0.5, 0.4])
  positive = np.array([True, True, True, False, False])
  assert le.binary_auroc(scores, positive) == pytest.approx(3 / 6)
  # A binary task's AUROC is class 1's; three classes: the mean of one-vs-rest.
  two = np.stack([1 - scores, scores], 1)
  assert le.auroc(two, positive.astype(int)) == pytest.approx(0.5)
  three = np.array([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.2, 0.7], [0.5, 0.1, 0.4]])
  labels = np.array([0, 1, 2, 2])
  # Class 0: pos 0.6 vs 0.2, 0.1, 0.5 -> 1. Class 1: pos 0.5 vs 0.3, 0.2, 0.1 -> 1.
  # Class 2: pos 0.7, 0.4 vs 0.1, 0.3: 0.7 beats both, 0.4 beats both -> 1.
  assert le.auroc(three, labels) == pytest.approx(1.0)
  three[3] = [0.5, 0.1, 0.2]  # Now 0.2 < 0.3: class 2 wins 3 of 4 pairs.
  assert le.auroc(three, labels) == pytest.approx((1 + 1 + 0.75) / 3)
  with pytest.raises(ValueError, match="positives and negatives"):
    le.auroc(three, np.array([0, 1, 1, 1]))  # Class 2 absent.


def test_scores_agree_with_scikit_learn():
  metrics = pytest.importorskip("sklearn.metrics")
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 4, 200)
  logits = rng.normal(size=(200, 4)) + np.eye(4)[labels]
  logits[:20] = np.round(logits[:20])  # Ties.
  probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
  assert le.auroc(probs, labels) == pytest.approx(
    metrics.roc_auc_score(labels, probs, multi_class="ovr", average="macro")
  )
  binary = labels % 2
  assert le.auroc(probs[:, :2], binary) == pytest.approx(metrics.roc_auc_score(binary, probs[:, 1]))
  assert le.balanced_accuracy(probs, labels) == pytest.approx(
    metrics.balanced_accuracy_score(labels, probs.argmax(1))
  )


def test_paired_interval_is_the_t_interval_of_the_differences():
  a, b = [0.52, 0.61, 0.58], [0.40, 0.47, 0.49]
  d = np.subtract(a, b)
  # t_{0.975, 2} = 4.302652729911275, from a table of Student's t.
  half = 4.302652729911275 * np.sqrt(np.sum((d - d.mean()) ** 2) / 2) / np.sqrt(3)
  interval = le.paired_interval(a, b)
  assert interval["pairs"] == 3
  assert interval["mean"] == pytest.approx(d.mean())
  assert interval["low"] == pytest.approx(d.mean() - half)
  assert interval["high"] == pytest.approx(d.mean() + half)
  five = le.paired_interval([1, 2, 3, 4, 6], [0, 0, 0, 0, 0])  # t_{0.975, 4} = 2.776445105
  assert five["high"] - five["mean"] == pytest.approx(
    2.776445105 * np.std([1, 2, 3, 4, 6], ddof=1) / np.sqrt(5)
  )
  assert math.isnan(le.paired_interval([1.0], [0.5])["low"])


def test_summary_picks_by_validation_and_pairs_by_seed():
  rows = []
  for seed, (pre_knn, pre_lp, rnd) in enumerate(
    [(0.5, 0.6, 0.3), (0.55, 0.7, 0.35), (0.52, 0.62, 0.3)]
  ):
    # The probe validates worse than kNN for the pretrained init, though it tests better.
    rows.append(
      dict(init="pretrained", protocol="knn", labels=40, seed=seed, val_top1=0.9, top1=pre_knn)
    )
    rows.append(
      dict(
        init="pretrained", protocol="linear_probe", labels=40, seed=seed, val_top1=0.5, top1=pre_lp
      )
    )
    rows.append(dict(init="random", protocol="knn", labels=40, seed=seed, val_top1=0.3, top1=rnd))
  summary = le.summarise(rows, ["pretrained", "random"], ["top1"])["labels"]["40"]
  assert summary["best"]["pretrained"]["protocol"] == "knn"
  assert summary["best"]["pretrained"]["top1"] == pytest.approx(np.mean([0.5, 0.55, 0.52]))
  gain = summary["gain"]["random"]["top1"]
  expected = le.paired_interval([0.5, 0.55, 0.52], [0.3, 0.35, 0.3])
  assert gain == pytest.approx(expected)


def test_fit_and_select_validates_every_few_epochs_and_keeps_the_first_best():
  """Each step adds 1 to the parameter: after epoch e of 2 batches it is 2e. Validated at
  epochs 3, 6 and 7 (the last), scoring 0.5, 0.5, 0.4: epoch 3 is kept, with its parameter."""
  state = common.TrainState.create(params=jnp.zeros(()), tx=optax.identity(), rng=None)
  step = lambda state, batch: (state.replace(params=state.params + batch), {})
  score = {6.0: 0.5, 12.0: 0.5, 14.0: 0.4}
  validated = []

  def validate(variables):
    validated.append(float(variables["params"]))
    return score[validated[-1]]

  best = protocols.fit_and_select(state, step, lambda epoch: [1.0, 1.0], 7, 3, validate)
  assert validated == [6.0, 12.0, 14.0]
  assert (best[0], float(best[1]["params"]), best[2]) == (0.5, 6.0, 3)


def test_select_rate_keeps_the_first_best_scale_and_names_it():
  part = ml_collections.ConfigDict(dict(lr_grid="0.5,1,2", optimizer=dict(base_lr=0.1)))
  fitted = {0.5: (0.3, "a", 4, "p"), 1.0: (0.6, "b", 2, "q"), 2.0: (0.6, "c", 1, "r")}
  assert protocols.select_rate(part, fitted.__getitem__) == (0.6, "b", "lr=0.1, epoch=2", "q")
  part.lr_grid = "2"
  assert protocols.select_rate(part, fitted.__getitem__) == (0.6, "c", "epoch=1", "r")
  assert list(protocols.PROTOCOLS) == list(label_efficiency.PROTOCOLS)


def test_in_memory_parts_are_sources_holding_the_subsets_images():
  for method in ("num_examples", "process_counts", "read"):
    assert inspect.signature(getattr(in_memory.InMemory, method)) == inspect.signature(
      getattr(sources.Source, method)
    )
  source = sources.TfdsSource("cifar10", TFDS_DIR)
  ids, labels = source.ids_and_labels("test[:30]")
  parts = [np.array([7, 2, 20]), np.array([0, 11])]
  read = in_memory.read_parts(source, "test[:30]", parts, ids, labels)
  every = list(source.read("test[:30]", drop_remainder=False).as_numpy_iterator())
  for part, served in zip(parts, read):
    assert isinstance(served, sources.Source) and served.num_examples("", "") == len(part)
    got = list(served.read("", drop_remainder=False).as_numpy_iterator())
    for index, (image, label) in zip(part, got):
      np.testing.assert_array_equal(image, every[index][0])
      assert label == every[index][1] == labels[index]
  with pytest.raises(ValueError, match="decoded images without names only"):
    read[0].read("", drop_remainder=False, names=True)


def test_old_saved_configs_are_upgraded_to_a_single_rate_from_h():
  saved = tiny_config("/absent").to_dict()
  for part in ("linear_probe", "finetune"):
    del saved[part]["lr_grid"]
  del saved["finetune"]["projector_layers"]
  upgraded = config_files.upgrade_config(ml_collections.ConfigDict(saved))
  assert upgraded.linear_probe.lr_grid == upgraded.finetune.lr_grid == "1"
  assert upgraded.finetune.projector_layers == 0


def tiny_config(pretrain_workdir, **overrides):
  """configs/label_efficiency.py on 200 train and 40 test images: 2 label counts, 2 seeds."""
  config = load_config("label_efficiency")
  config.pretrain_workdir = pretrain_workdir
  config.data_dir = TFDS_DIR
  config.train_split = "train[:200]"
  config.test_split = "test[:40]"
  config.labels = "20,40"
  config.seeds = 2
  config.validation_fraction = 0.5
  config.eval_batch_size = 40
  config.knn.k = "1,3"
  config.linear_probe.update(epochs=2, eval_every=1, batch_size=16)
  config.finetune.update(epochs=2, eval_every=1, batch_size=8)
  config.data_threads = 1
  config.update(overrides)
  return config


@pytest.fixture(scope="module")
def curve(pretrained, tmp_path_factory):
  """A finished tiny job: (config, workdir, summary)."""
  workdir = str(tmp_path_factory.mktemp("curve"))
  config = tiny_config(pretrained)
  return config, workdir, main.run_job(config, workdir)


def test_the_job_writes_a_cell_per_init_protocol_count_and_seed(curve):
  config, workdir, summary = curve
  with open(f"{workdir}/curve.csv") as f:
    rows = list(csv.DictReader(f))
  assert list(rows[0])[:7] == list(label_efficiency.COLUMNS)
  cells = {(r["init"], r["protocol"], int(r["labels"]), int(r["seed"])) for r in rows}
  assert len(rows) == len(cells) == 2 * 3 * 2 * 2
  for r in rows:
    for metric in ("top1", "balanced_accuracy", "auroc", "val_top1"):
      assert 0 <= float(r[metric]) <= 1
  assert set(summary["labels"]) == {"20", "40"}
  gain = summary["labels"]["20"]["gain"]["random"]["top1"]
  assert gain["pairs"] == 2 and gain["low"] <= gain["mean"] <= gain["high"]
  with open(f"{workdir}/summary.json") as f:
    assert json.load(f) == summary
  picture = np.asarray(Image.open(f"{workdir}/curve.png"))
  assert picture.ndim == 3 and len(np.unique(picture.reshape(-1, 3), axis=0)) > 3


def test_a_job_killed_between_cells_resumes_at_the_next_one(curve, pretrained, tmp_path):
  config, workdir, _ = curve
  resumed = str(tmp_path / "resumed")
  shutil.copytree(workdir, resumed)
  names = sorted(os.listdir(f"{resumed}/cells"))
  # A job killed after its first cells: the later cells are not there. The job computes the
  # cells count by count, seed by seed: those of the last count and seed (every init and
  # protocol) are missing, the three (count, seed) pairs before it are whole.
  later = [name for name in names if name.endswith("-40-1.json")]
  assert len(later) == 6
  for name in later:
    os.remove(f"{resumed}/cells/{name}")
  # Marks a kept cell: a job that computed it again would write the file anew.
  kept = f"{resumed}/cells/{names[0]}"
  with open(kept) as f:
    row = json.load(f)
  with open(kept, "w") as f:
    json.dump(dict(row, marked=True), f)
  main.run_job(config, resumed)
  assert sorted(os.listdir(f"{resumed}/cells")) == names
  with open(kept) as f:
    assert json.load(f)["marked"]
  for name in names:  # Computed again, a cell gives what it gave.
    with open(f"{workdir}/cells/{name}") as f, open(f"{resumed}/cells/{name}") as g:
      a, b = json.load(f), json.load(g)
      b.pop("marked", None)
      assert a == b, name
  with open(f"{workdir}/curve.csv") as f, open(f"{resumed}/curve.csv") as g:
    assert f.read() == g.read()
  with pytest.raises(ResumeError, match="config.seeds=3"):
    main.run_job(tiny_config(pretrained, seeds=3), resumed)


def test_choices_are_made_without_the_test_split(curve, pretrained, tmp_path):
  """Cells scored on other test images make the same choices on the same validation scores."""
  config, workdir, _ = curve
  other = str(tmp_path / "other_test")
  # One seed: a cell of another seed makes its choices by the same code on its own subset.
  overrides = dict(test_split="test[40:80]", labels="20", seeds=1, curve_metric="auroc")
  main.run_job(tiny_config(pretrained, **overrides), other)
  assert os.path.exists(f"{other}/curve.png")
  with open(f"{workdir}/curve.csv") as f, open(f"{other}/curve.csv") as g:
    first = {
      (r["init"], r["protocol"], r["seed"]): r
      for r in csv.DictReader(f)
      if r["labels"] == "20" and r["seed"] == "0"
    }
    second = {(r["init"], r["protocol"], r["seed"]): r for r in csv.DictReader(g)}
  assert set(first) == set(second)
  for key in first:
    assert (first[key]["val_top1"], first[key]["choice"]) == (
      second[key]["val_top1"],
      second[key]["choice"],
    ), key
  assert any(first[k]["top1"] != second[k]["top1"] for k in first)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (dict(labels="400"), r"at most the train split's size \(200 images\)"),
    (dict(labels="190"), r"class \d \('\w+'\) has \d+ in the train split"),
    (dict(labels="12"), "at least 2 per class"),
    (dict(protocols="knn,svm"), "config.protocols="),
    (dict(auroc=False, curve_metric="auroc"), "config.curve_metric='auroc'"),
    (dict(inits="pretrained,weights"), "config.weights=None"),
    (
      dict(inits="pretrained,weights", weights="/absent/w.safetensors"),
      r"config.weights_config=None: must be the pretraining config",
    ),
    (
      dict(inits="pretrained,dino", weights="dino=/a.pth;dinov2=/b.pth"),
      r"config.weights=.*'dinov2' is not one: add it to inits",
    ),
    (dict(inits="pretrained,dino,b"), r"config.weights=None: .*none for 'dino'"),
    (dict(inits="pretrained,dino", weights="dino=/a.pth;/b.pth"), r"'/b.pth' is not NAME="),
    (dict(inits="pretrained,di/no"), r"config.inits='pretrained,di/no': must be distinct"),
    (dict(test_split="test[:5]"), r"config.auroc=True: .* class \d has 0 of the 5 images"),
    (dict(finetune=dict(layer_decay=0.0)), r"config.finetune.layer_decay=0.0: must be in \(0, 1\]"),
    (
      dict(protocols="finetune,lp_ft", finetune=dict(projector_layers=1)),
      r"config.finetune.projector_layers=1: must be 0 with 'lp_ft' in protocols",
    ),
    (
      dict(finetune=dict(projector_layers=2)),
      r"config.finetune.projector_layers=2: must be an integer in \[0, 1\]",
    ),
    (
      dict(linear_probe=dict(optimizer=dict(decay_fractions=(1.5,)))),
      r"config.optimizer.decay_fractions=\(1.5,\)",
    ),
    (dict(finetune=dict(lr_grid="1,-3")), r"config.finetune.lr_grid='1,-3': must be distinct"),
    (dict(linear_probe=dict(lr_grid="1,x")), r"config.linear_probe.lr_grid='1,x': must be"),
    (dict(linear_probe=dict(lr_grid="1,inf")), r"config.linear_probe.lr_grid='1,inf': must"),
  ],
)
def test_bad_input_stops_before_any_compute(pretrained, tmp_path, overrides, message):
  with pytest.raises(ConfigError, match=message):
    main.run_job(tiny_config(pretrained, **overrides), str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w" / "cells")


def test_lp_ft_fine_tunes_from_a_probe(pretrained, tmp_path):
  config = tiny_config(pretrained, labels="20", seeds=1, inits="pretrained", protocols="lp_ft")
  summary = main.run_job(config, str(tmp_path / "lp_ft"))
  with open(tmp_path / "lp_ft" / "curve.csv") as f:
    (row,) = list(csv.DictReader(f))
  assert row["protocol"] == "lp_ft" and 0 <= float(row["top1"]) <= 1
  assert re.fullmatch(r"probe epoch=[12], epoch=[12]", row["choice"])
  assert summary["labels"]["20"]["best"]["pretrained"]["protocol"] == "lp_ft"


def curve_row(curve, init, protocol, labels, seed):
  """The curve fixture's row of a cell: what a job of the same config with that init,
  protocol, count and seed alone gives (a cell reads nothing of the others; a cell computed
  again gives what it gave: test_a_job_killed_between_cells_resumes_at_the_next_one)."""
  _, workdir, _ = curve
  with open(f"{workdir}/curve.csv") as f:
    (row,) = [
      r
      for r in csv.DictReader(f)
      if (r["init"], r["protocol"], r["labels"], r["seed"]) == (init, protocol, labels, seed)
    ]
  return row


def test_finetune_cells_from_the_heads_first_layer(curve, pretrained, tmp_path):
  """finetune.projector_layers=1: the cell fine-tunes the encoder with the head's first layer
  (SimCLR v2) and scores differently from fine-tuning from h (projector_layers=0, the curve
  fixture's cell) on the same subset."""
  config = tiny_config(pretrained, labels="20", seeds=1, inits="pretrained", protocols="finetune")
  config.finetune.projector_layers = 1
  main.run_job(config, str(tmp_path / "1"))
  with open(tmp_path / "1" / "curve.csv") as f:
    (row,) = csv.DictReader(f)
  scores = {0: curve_row(curve, "pretrained", "finetune", "20", "0"), 1: row}
  assert curve[0].finetune.projector_layers == 0
  assert 0 <= float(scores[1]["top1"]) <= 1
  assert scores[0]["auroc"] != scores[1]["auroc"]


def test_an_lr_grid_keeps_the_rate_validation_picks(curve, pretrained, tmp_path):
  """With lr_grid '0.5,1' each protocol's cell is the single-rate cell of higher validation
  top-1 (the first of equal ones), and its choice names that rate. The rate 1 cells are the
  curve fixture's (lr_grid '1')."""

  def cell(grid):
    config = tiny_config(
      pretrained, labels="20", seeds=1, inits="pretrained", protocols="linear_probe,finetune"
    )
    config.linear_probe.lr_grid = config.finetune.lr_grid = grid
    main.run_job(config, str(tmp_path / grid))
    with open(tmp_path / grid / "curve.csv") as f:
      return {r["protocol"]: r for r in csv.DictReader(f)}

  assert curve[0].linear_probe.lr_grid == curve[0].finetune.lr_grid == "1"
  whole = {p: curve_row(curve, "pretrained", p, "20", "0") for p in ("linear_probe", "finetune")}
  half, grid = cell("0.5"), cell("0.5,1")
  base = {"linear_probe": 0.1, "finetune": 0.05}  # configs/label_efficiency.py's rates.
  for protocol, row in grid.items():
    single = (
      half if float(half[protocol]["val_top1"]) >= float(whole[protocol]["val_top1"]) else whole
    )
    chosen = base[protocol] * (0.5 if single is half else 1)
    assert row["choice"] == f"lr={chosen:.4g}, {single[protocol]['choice']}"
    for metric in ("top1", "auroc", "val_top1"):
      assert row[metric] == single[protocol][metric], (protocol, metric)


def _weights_file(tmp_path, model_name: str, variables=None):
  """A .safetensors of helpers.tiny_config()'s encoder as `model_name` (its variables, or
  values drawn on the host in its variables' shapes), and a config file (configs/X.py) of
  that model.

  The drawn values: kernels He-normal (fan-in), BN scales and variances in [0.5, 1.5), the
  rest normal with deviation 0.1 (compiling the ResNet's initialisers, op by op, would take
  longer than the job's kNN cell).
  """
  config = helpers.tiny_config()
  config.model.name = model_name
  if variables is None:
    encoder = models.build_encoder(config.model)
    shapes = jax.eval_shape(
      lambda: encoder.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False)
    )
    rng = np.random.default_rng(0)

    def draw(path, leaf):
      if path[-1].key == "kernel":
        return rng.normal(0, np.sqrt(2 / np.prod(leaf.shape[:-1])), leaf.shape).astype(np.float32)
      if path[-1].key in ("scale", "var"):
        return rng.uniform(0.5, 1.5, leaf.shape).astype(np.float32)
      return rng.normal(0, 0.1, leaf.shape).astype(np.float32)

    variables = jax.tree_util.tree_map_with_path(draw, shapes)
  path = str(tmp_path / f"{model_name}.safetensors")
  tensor_files.write(path, state_dicts.to_state_dict(config.model, variables, 32))
  config_file = tmp_path / f"{model_name}.py"
  config_file.write_text(
    f"import sys\nsys.path.insert(0, {helpers.TESTS!r})\nimport helpers\n\n\n"
    f"def get_config(variant=''):\n  config = helpers.tiny_config()\n"
    f"  config.model.name = {model_name!r}\n  return config\n"
  )
  return path, str(config_file)


def test_weights_files_are_inits_of_their_names_beside_the_checkpoint(pretrained, tmp_path):
  """Two weights files in one run, each an init of its own name: the checkpoint's own encoder
  as a file scores what the checkpoint scores; a file of another model (a ResNet-18 beside
  the checkpoint's ResNet-10) is an init like it; the gains are over both; a job started
  again computes only the missing cells."""
  config = tiny_config(pretrained, labels="20", seeds=1, protocols="knn")
  variables = restore.restore_encoder(config, mesh_lib.make_mesh()).variables
  path, config_file = _weights_file(tmp_path, "resnet10", variables)
  other, other_file = _weights_file(tmp_path, "resnet18")
  config.update(
    inits="own,pretrained,other-net",
    weights=f"own={path}; other-net={other}",
    weights_config=f"own={config_file};other-net={other_file}",
  )
  workdir = str(tmp_path / "files")
  summary = main.run_job(config, workdir)
  with open(f"{workdir}/curve.csv") as f:
    rows = {r["init"]: r for r in csv.DictReader(f)}
  assert set(rows) == {"own", "pretrained", "other-net"}
  for field in ("top1", "auroc", "balanced_accuracy", "val_top1", "choice"):
    assert rows["own"][field] == rows["pretrained"][field], field
  assert 0 <= float(rows["other-net"]["top1"]) <= 1
  assert set(summary["labels"]["20"]["gain"]) == {"pretrained", "other-net"}
  assert summary["labels"]["20"]["gain"]["pretrained"]["top1"]["mean"] == 0
  with open(f"{workdir}/config.json") as f:
    assert json.load(f)["pretrain_step"] >= 0  # The checkpoint's step, not a file's 0.
  # Started again: the other file's missing cell alone is computed.
  kept = f"{workdir}/cells/own-knn-20-0.json"
  with open(kept) as f:
    row = json.load(f)
  with open(kept, "w") as f:
    json.dump(dict(row, marked=True), f)
  os.remove(f"{workdir}/cells/other-net-knn-20-0.json")
  main.run_job(config, workdir)
  with open(kept) as f:
    assert json.load(f)["marked"]
  with open(f"{workdir}/curve.csv") as f:
    assert {r["init"]: r for r in csv.DictReader(f)}["other-net"] == rows["other-net"]
  with pytest.raises(ResumeError, match=r"config.weights="):
    main.run_job(
      dict_with(
        config,
        weights=f"own={path};other-net={path}",
        weights_config=f"own={config_file};other-net={config_file}",
      ),
      workdir,
    )
  config.update(
    inits="own", weights=f"own={path}", weights_config=f"own={config_file}", protocols="finetune"
  )
  config.finetune.projector_layers = 1
  with pytest.raises(
    ConfigError, match=r"config.finetune.projector_layers=1: must be 0: a weights file holds no"
  ):
    main.run_job(config, str(tmp_path / "head"))


def test_the_older_one_file_form_is_the_init_weights():
  """A config saved (or given) with one bare file in weights names the init 'weights'."""
  saved = tiny_config("/absent", inits="pretrained,weights").to_dict()
  saved.update(weights="/w/r50.safetensors", weights_config="configs/dinov2.py:model=x,dtype=y")
  upgraded = config_files.upgrade_config(ml_collections.ConfigDict(saved))
  assert upgraded.weights == "weights=/w/r50.safetensors"
  assert upgraded.weights_config == "weights=configs/dinov2.py:model=x,dtype=y"
  assert label_efficiency.weights_files(upgraded) == {
    "weights": ("/w/r50.safetensors", "configs/dinov2.py:model=x,dtype=y")
  }
  again = config_files.upgrade_config(upgraded)  # The named form is kept as it is.
  assert (again.weights, again.weights_config) == (upgraded.weights, upgraded.weights_config)
  assert config_files.named_entries(" a=1 ; b-2=x=y;") == {"a": "1", "b-2": "x=y"}
  for bad in ("a=1;a=2", "a=", "/w.pth", "1a=x"):
    with pytest.raises(ValueError):
      config_files.named_entries(bad)


def dict_with(config, **fields):
  """A copy of config with fields set."""
  config = config.copy_and_resolve_references()
  config.update(fields)
  return config

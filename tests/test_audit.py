"""The audit job (jobs/audit.py): planted duplicates and leaks among real photos, and bad input."""

import csv
import json
import os
import shutil
import types

from helpers import load_benchmark
from helpers import load_config
from helpers import tiny_config
import jax
import ml_collections
import numpy as np
from PIL import Image
import pytest
from test_search import embed_config  # The embed config of the search tests.

from contrastive_jax import main
from contrastive_jax import models
from contrastive_jax.core import checkpointing
from contrastive_jax.core import pictures
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.jobs import audit
from contrastive_jax.search import ann as ann_lib
from contrastive_jax.search import exact
from contrastive_jax.search import index as index_lib

pytest.importorskip("faiss")
CLOTHING = os.path.join(
  os.path.dirname(__file__), "..", "..", "shared", "images", "clothing", "test"
)


def _photo(cls, number):
  return os.path.join(CLOTHING, cls, sorted(os.listdir(os.path.join(CLOTHING, cls)))[number])


def _copy(source, target, scale=1.0, quality=None):
  """Copies a photo; with scale or quality, re-encoded (resized bicubic, JPEG at quality)."""
  os.makedirs(os.path.dirname(target), exist_ok=True)
  if scale == 1.0 and quality is None:
    shutil.copy(source, target)
    return
  image = Image.open(source).convert("RGB")
  size = (round(image.width * scale), round(image.height * scale))
  image.resize(size, Image.BICUBIC).save(target, quality=quality or 90)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A pretraining workdir whose encoder is random, its BN statistics those of real photos.

  The tiny SimCLR config with a ResNet-18 (the figures below are its) at
  initialisation (residual branches not zeroed), its BN running statistics then
  set to those of 64 clothing photos at 32 px
  (train-mode passes until the running averages settle, as a BN
  recalibration). An untrained encoder's h, BN left at its initial statistics,
  is nearly one vector for every photo (cosines above 0.9999 here); centred
  by the photos' statistics, h tells photos apart while a resized copy keeps
  its photo's h, as a trained encoder does, in seconds.
  """
  config = tiny_config()
  config.model.name = "resnet18"
  config.model.zero_init_residual = False
  encoder = models.build_encoder(config.model)
  photos = np.stack(
    [
      np.asarray(Image.open(_photo(cls, n)).convert("RGB").resize((32, 32)))
      for cls in ("longsleeve", "outwear", "pants", "shirt", "shorts", "t-shirt", "shoes", "dress")
      for n in range(6, 14)
    ]
  ) / np.float32(255)
  variables = encoder.init(jax.random.PRNGKey(0), photos[:1], train=False)
  step = jax.jit(lambda v: encoder.apply(v, photos, train=True, mutable=["batch_stats"])[1])
  for _ in range(60):  # BN momentum 0.9: the initial statistics' weight falls to 0.9^60.
    variables = {"params": variables["params"], **step(variables)}
  workdir = str(tmp_path_factory.mktemp("pretrain"))
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"))
  ckpt.save(0, {name: {"encoder": variables[name]} for name in ("params", "batch_stats")}, config)
  ckpt.close()
  return workdir


@pytest.fixture(scope="module")
def indexes(pretrained, tmp_path_factory):
  """(train index, test index, planted pairs as {(kind, test or train name, train name)}).

  train: 4 photos of each of 3 classes, 2 of them also as resized, re-encoded
  copies (duplicates); test: 2 other photos of 2 classes and resized copies of
  2 train photos (leaks). The train index has an HNSW index (forced: few rows).
  """
  root = tmp_path_factory.mktemp("audit")
  train, test = root / "train", root / "test"
  for cls in ("dress", "hat", "shoes"):
    for number in range(4):
      _copy(_photo(cls, number), str(train / cls / f"{number}.jpg"))
  for cls in ("dress", "hat"):
    for number in (4, 5):
      _copy(_photo(cls, number), str(test / cls / f"{number}.jpg"))
  # Resized only where the shorter side's scale keeps the 32-px centre crop's rows (400 x 534
  # photos): dress 0's 400 x 711 at 0.7 rounds to one more row, which moves the crop by half
  # a pixel and its random encoder's h to a cosine of 0.64.
  _copy(_photo("dress", 0), str(train / "dress" / "dup.jpg"), quality=60)
  _copy(_photo("hat", 1), str(train / "hat" / "dup.jpg"), scale=1.3, quality=80)
  _copy(_photo("shoes", 2), str(test / "shoes" / "leak.jpg"), scale=0.6, quality=70)
  _copy(_photo("dress", 3), str(test / "dress" / "leak.jpg"), scale=0.8, quality=50)
  planted = {
    ("duplicate", f"{train}/dress/0.jpg", f"{train}/dress/dup.jpg"),
    ("duplicate", f"{train}/hat/1.jpg", f"{train}/hat/dup.jpg"),
    ("leak", f"{test}/shoes/leak.jpg", f"{train}/shoes/2.jpg"),
    ("leak", f"{test}/dress/leak.jpg", f"{train}/dress/3.jpg"),
  }
  hnsw = dict(embed_config(None).ann.to_dict(), type="hnsw")
  train_index, test_index = str(root / "train_index"), str(root / "test_index")
  main.run_job(embed_config(pretrained, dataset=None, folder=str(train), ann=hnsw), train_index)
  main.run_job(embed_config(pretrained, dataset=None, folder=str(test)), test_index)
  return train_index, test_index, planted


def audit_config(index_workdir, against="", **overrides):
  config = load_config("audit")
  config.index_workdir, config.against = index_workdir, against
  config.k, config.cell = 3, 32
  config.update(overrides)
  return config


def _numpy_pairs(train, test, threshold):
  """The independent reference: {(kind, name a, name b): score} from all pairs, float64."""
  x, y = (np.asarray(index_lib.load_index(d).embeddings, np.float64) for d in (train, test))
  names = [[r["name"] for r in index_lib.load_index(d).rows] for d in (train, test)]
  within, across = x @ x.T, y @ x.T
  pairs = {
    ("duplicate", names[0][i], names[0][j]): within[i, j]
    for i in range(len(x))
    for j in range(i + 1, len(x))
    if within[i, j] >= threshold
  }
  pairs.update(
    {
      ("leak", names[1][i], names[0][j]): across[i, j]
      for i in range(len(y))
      for j in range(len(x))
      if across[i, j] >= threshold
    }
  )
  return pairs


def _read_csv(workdir):
  with open(os.path.join(workdir, audit.PAIRS)) as f:
    return list(csv.DictReader(f))


def test_the_planted_duplicates_and_leaks_are_the_top_pairs_and_exactly_those_found(
  indexes, tmp_path
):
  train, test, planted = indexes
  every = _numpy_pairs(train, test, -1.0)
  lowest_planted = min(every[p] for p in planted)
  highest_other = max(score for p, score in every.items() if p not in planted)
  # Resized, re-encoded copies score above any two different photos, with a margin.
  assert lowest_planted > highest_other + 1e-3, (lowest_planted, highest_other)
  threshold = float((lowest_planted + highest_other) / 2)
  workdir = str(tmp_path / "audit")
  summary = main.run_job(audit_config(train, test, threshold=threshold, search="exact"), workdir)
  table = _read_csv(workdir)
  assert {(r["kind"], r["name_a"], r["name_b"]) for r in table} == planted
  for r in table:
    assert float(r["score"]) == pytest.approx(every[r["kind"], r["name_a"], r["name_b"]], abs=1e-5)
  assert [float(r["score"]) for r in table] == sorted(
    (float(r["score"]) for r in table), reverse=True
  )
  # The summary agrees with the CSV; the picture holds the 4 pairs on one line of 8 cells.
  assert summary == json.load(open(os.path.join(workdir, audit.SUMMARY)))
  assert summary["pairs"] == {"duplicate": 2, "leak": 2}
  assert summary["threshold"] == threshold and summary["search"] == {"method": "exact"}
  train_folder, test_folder = (index_lib.load_index(d).config.folder for d in (train, test))
  assert summary["splits"] == {
    train_folder: {"rows": 14, "pairs": 2, "images_in_pairs": 4},
    test_folder: {"rows": 6, "pairs": 2, "images_in_pairs": 2},
  }
  assert {(r["class_a"], r["class_b"]) for r in table} == {
    ("dress", "dress"),
    ("hat", "hat"),
    ("shoes", "shoes"),
  }
  assert summary["classes"] == {
    "dress": {"duplicate": 1, "leak": 1},
    "hat": {"duplicate": 1, "leak": 0},
    "shoes": {"duplicate": 0, "leak": 1},
  }
  assert summary["different_classes"] == {"duplicate": 0, "leak": 0}
  assert summary["rows_with_k_pairs"] == {"duplicate": 0, "leak": 0}
  # Captions in full, wrapped to the 32 px cells: '0.9999 duplicate' takes 3 lines
  # ('0.9999', 'duplic', 'ate'), the line's longest caption.
  picture = np.asarray(Image.open(os.path.join(workdir, audit.PICTURE)))
  assert picture.shape == (2 + 32 + 3 * pictures.LINE_HEIGHT + 2, 2 + 8 * (32 + 2), 3)
  # The same pairs through the train index's HNSW index ('auto').
  approximate = main.run_job(audit_config(train, test, threshold=threshold), str(tmp_path / "ann"))
  assert approximate["search"]["method"] == "ann" and approximate["search"]["type"] == "hnsw"
  found = _read_csv(str(tmp_path / "ann"))
  assert {(r["kind"], r["name_a"], r["name_b"]) for r in found} == planted
  # A picture of 2 pairs shows the best of each kind: the best leak and the best duplicate.
  main.run_job(
    audit_config(train, test, threshold=threshold, picture_pairs=2), str(tmp_path / "two")
  )
  best = {
    kind: max(float(r["score"]) for r in table if r["kind"] == kind)
    for kind in ("duplicate", "leak")
  }
  assert audit._shown([(r["kind"], float(r["score"])) for r in table], 2) == sorted(
    best.items(), key=lambda p: -p[1]
  )
  picture = np.asarray(Image.open(os.path.join(tmp_path, "two", audit.PICTURE)))
  assert picture.shape == (2 + 32 + 3 * pictures.LINE_HEIGHT + 2, 2 + 4 * (32 + 2), 3)


@pytest.mark.parametrize("k", [13, 2])
def test_pairs_at_a_low_threshold_are_numpys_all_pairs_up_to_k_per_row(indexes, tmp_path, k):
  train, test, _ = indexes
  scores = sorted(_numpy_pairs(train, test, -1.0).values(), reverse=True)
  threshold = float((scores[39] + scores[40]) / 2)  # 40 pairs of many photos and both kinds.
  want = _numpy_pairs(train, test, threshold)
  workdir = str(tmp_path / str(k))
  os.makedirs(workdir)
  Image.new("RGB", (4, 4)).save(os.path.join(workdir, audit.PICTURE))  # An earlier audit's.
  summary = audit.run(
    audit_config(train, test, threshold=threshold, k=k, search="exact", picture_pairs=0), workdir
  )
  found = {(r["kind"], r["name_a"], r["name_b"]): float(r["score"]) for r in _read_csv(workdir)}
  assert not os.path.exists(os.path.join(workdir, audit.PICTURE)) and summary["picture"] is None
  if k == 13:  # Every other train row searched, and no row has 13 pairs: all of numpy's pairs.
    assert found.keys() == want.keys()
    assert summary["rows_with_k_pairs"] == {"duplicate": 0, "leak": 0}
  else:  # At most k per row, each among numpy's; the rows with k may have had more.
    assert found.keys() < want.keys()
    x = np.asarray(index_lib.load_index(train).embeddings, np.float64)
    y = np.asarray(index_lib.load_index(test).embeddings, np.float64)
    within = x @ x.T
    np.fill_diagonal(within, -np.inf)
    kth = np.sort(within, axis=1)[:, -k]
    leak_kth = np.sort(y @ x.T, axis=1)[:, -k]
    assert summary["rows_with_k_pairs"] == {
      "duplicate": int((kth >= threshold).sum()),
      "leak": int((leak_kth >= threshold).sum()),
    }
  for key, score in found.items():
    assert score == pytest.approx(want[key], abs=1e-5)
  assert summary["pairs"] == {
    kind: sum(key[0] == kind for key in found) for kind in ("duplicate", "leak")
  }


def _edit_json(path, **fields):
  with open(path) as f:
    content = json.load(f)
  content.update(fields)
  with open(path, "w") as f:
    json.dump(content, f)


def test_bad_input_is_refused_in_one_line_before_any_search(
  pretrained, indexes, tmp_path, monkeypatch
):
  train, test, _ = indexes

  def no_search(*args, **kwargs):
    raise AssertionError("searched before the input was checked")

  monkeypatch.setattr(exact, "top_k_cosine", no_search)
  monkeypatch.setattr(ann_lib, "search", no_search)
  other = str(tmp_path / "other_checkpoint")
  shutil.copytree(test, other)
  meta = json.load(open(os.path.join(other, index_lib.META)))
  _edit_json(os.path.join(other, index_lib.META), config=dict(meta["config"], pretrain_step=7))
  other_dim = str(tmp_path / "other_dim")
  shutil.copytree(test, other_dim)
  _edit_json(os.path.join(other_dim, index_lib.META), dim=meta["dim"] + 1)
  for config, match in [
    (
      audit_config(train, test, threshold=1.5),
      r"config.threshold=1.5: must be a cosine similarity in \[-1, 1\]$",
    ),
    (audit_config(train, test, threshold=-1.01), r"config.threshold=-1.01: must be"),
    (audit_config(train, test, threshold=float("nan")), r"config.threshold=nan: must be"),
    (
      audit_config(pretrained, test),
      f"config.index_workdir='{pretrained}': must be the workdir of a finished embed job",
    ),
    (
      audit_config(train, f"{test},{pretrained}"),
      f"config.against=.*: must be comma-separated workdirs of finished embed jobs "
      f"\\('{pretrained}' holds no embed.json\\)",
    ),
    (audit_config(train, train), "config.against=.*is named twice"),
    (
      audit_config(train, other),
      r"config.against=.*: must be embed outputs of config.index_workdir's encoder: "
      r".*was embedded with pretrain_step 7 \(the reference's: 0\); embed it again",
    ),
    (audit_config(train, f"{test},{other}"), "pretrain_step 7"),
    (
      audit_config(train, test, k=14),
      r"config.k=14: must be at most the reference's rows "
      r"less one \(13\)",
    ),
    (audit_config(train, test, search="fast"), "config.search='fast': must be one of"),
  ]:
    with pytest.raises(ConfigError, match=match) as raised:
      audit.run(config, str(tmp_path / "out"))
    assert "\n" not in str(raised.value)
  with pytest.raises(Exception, match="other_dim") as raised:
    audit.run(audit_config(train, other_dim), str(tmp_path / "out"))
  assert "\n" not in str(raised.value)
  assert not os.path.exists(tmp_path / "out" / audit.PAIRS)


def test_the_benchmarks_ground_truth_pairs_re_uploads_by_what_they_show(tmp_path):
  benchmark = load_benchmark("audit")
  manifest = tmp_path / "manifest.csv"
  # 1 re-uploads 0; 2 re-uploads 1, a re-upload itself: the tool draws 2 from 1's own draw
  # (another crop), so 2 is another view of 1's photo, no copy; 3 another crop of 0's photo;
  # 4 another photo of its class; 5 one of another class.
  manifest.write_text(
    "id,split,class,source,crop_xywh,size,quality,duplicate_of\n"
    "0,train,hat,a.jpg,0 0 10 10,300x300,90,\n"
    "1,test,hat,a.jpg,0 0 10 10,400x400,80,0\n"
    "2,train,hat,a.jpg,5 5 20 20,500x500,85,1\n"
    "3,train,hat,a.jpg,2 2 8 8,300x300,90,\n"
    "4,train,hat,c.jpg,0 0 10 10,300x300,90,\n"
    "5,train,dress,d.jpg,0 0 10 10,300x300,90,\n"
  )
  truth = benchmark.ground_truth(str(manifest))
  assert [
    benchmark.relation(truth, a, b)
    for a, b in [("0", "1"), ("1", "2"), ("0", "2"), ("0", "3"), ("0", "4"), ("0", "5")]
  ] == ["reupload", "view", "view", "view", "class", "other"]
  manifest.write_text(
    manifest.read_text().replace("1,test,hat,a.jpg,0 0 10 10", "1,test,hat,a.jpg,1 1 10 10")
  )
  with pytest.raises(ValueError, match="1, a re-upload of 0's draw, shows another photo or crop"):
    benchmark.ground_truth(str(manifest))


def test_an_index_grown_from_other_folders_is_named_by_all_of_them():
  def index(folder, split, part_folders):
    config = ml_collections.ConfigDict({"folder": folder, "split": split})
    return types.SimpleNamespace(
      config=config, meta={"parts": [{"folder": f} for f in part_folders]}
    )

  assert audit.split_name(index(None, "test", [None])) == "test"
  assert audit.split_name(index("/a", None, ["/a"])) == "/a"
  assert audit.split_name(index("/a", None, ["/a", "/b", "/a"])) == "/a, /b"

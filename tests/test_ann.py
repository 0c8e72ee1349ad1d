"""The ANN index (jobs/ann.py) of an embed job, its search, and adding images to an index."""

import json
import os
import shutil
import sys
import zlib

from helpers import load_benchmark
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

# The tiny pretraining workdir and the job configs of the embed and neighbours tests.
from test_search import embed_config  # noqa: F401
from test_search import neighbours_config  # noqa: F401
from test_search import pretrained  # noqa: F401

from contrastive_jax.core import files
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.jobs import embed
from contrastive_jax.jobs import neighbours
from contrastive_jax.search import ann as ann_lib
from contrastive_jax.search import index as index_lib
from contrastive_jax.search import shards as shards_lib

faiss = pytest.importorskip("faiss")
CLOTHING = os.path.join(
  os.path.dirname(__file__), "..", "..", "shared", "images", "clothing", "test"
)


def _unit(rng, n, d):
  x = rng.normal(size=(n, d)).astype(np.float32)
  return x / np.linalg.norm(x, axis=1, keepdims=True)


def _exact(queries, bank, k):
  """numpy, float64: (scores, rows) of the k largest dot products, best first."""
  sims = queries.astype(np.float64) @ bank.T.astype(np.float64)
  rows = np.argsort(-sims, axis=1, kind="stable")[:, :k]
  return np.take_along_axis(sims, rows, axis=1), rows


def _ann_config(**fields):
  config = embed_config("unused").ann
  config.update(fields)
  return config


def test_choose_is_exact_below_the_measured_size_then_ivf_unless_told():
  auto = _ann_config()
  assert ann_lib.choose(ann_lib.EXACT_BELOW - 1, 128, auto)["type"] == "flat"
  assert ann_lib.choose(ann_lib.EXACT_BELOW, 128, auto)["type"] == "ivf"
  assert ann_lib.choose(999_999, 128, auto)["factory"] == "IVF4096,Flat"
  assert ann_lib.choose(10_000_000, 128, auto) == {
    "type": "ivf",
    "factory": "IVF16384,Flat",
    "params": {"nlist": 16384, "nprobe": None},
    "calibration": {"param": "nprobe", "target": 0.95},
  }
  ivfpq = ann_lib.choose(1_000_000, 128, _ann_config(type="ivfpq"))
  assert ivfpq == {
    "type": "ivfpq",
    "factory": "IVF4096,PQ64x4fs,RFlat",
    "params": {"nlist": 4096, "nprobe": None, "k_factor": ann_lib.IVFPQ_K_FACTOR},
    "calibration": {"param": "nprobe", "target": 0.95},
  }
  assert ann_lib.choose(10, 7, _ann_config(type="ivfpq", nlist=4))["factory"] == (
    "IVF4,PQ7x4fs,RFlat"
  )
  hnsw = ann_lib.choose(10, 128, _ann_config(type="hnsw", hnsw_m=8, ef_search=20))
  assert (
    hnsw["params"] == {"M": 8, "efConstruction": ann_lib.HNSW_EF_CONSTRUCTION, "efSearch": 20}
    and hnsw["calibration"] is None
  )
  assert ann_lib.choose(10, 128, _ann_config(type="ivf", recall=0.8))["calibration"] == {
    "param": "nprobe",
    "target": 0.8,
  }
  given = ann_lib.choose(1_000_000, 128, _ann_config(type="ivf", nprobe=9))
  assert given["params"] == {"nlist": 4096, "nprobe": 9} and given["calibration"] is None
  assert ann_lib.choose(10, 128, _ann_config(type="none")) is None
  for recall in (0.0, 1.5):
    with pytest.raises(ConfigError, match=f"config.ann.recall={recall}: must be a recall@10 in"):
      ann_lib.check_config(_ann_config(recall=recall))


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf", "ivfpq"])
def test_each_index_type_written_and_read_back_finds_numpy_exact_neighbours(kind, tmp_path):
  rng = np.random.default_rng(0)
  bank, queries = _unit(rng, 3000, 32), _unit(rng, 200, 32)
  # IVF probing every list is exact; HNSW and IVFPQ (4-bit codes, then the best
  # 20 x 10 re-ranked) are approximate: recall@10 against numpy.
  config = _ann_config(type=kind, nlist=16, nprobe=16, threads=1)
  spec = ann_lib.choose(len(bank), 32, config)
  built, spec = ann_lib.build(bank, spec, threads=1)
  description = ann_lib.write(str(tmp_path), built, spec, generation=0, embed_run="run")
  assert description["rows"] == 3000 and description["dim"] == 32
  scores, rows = ann_lib.search(ann_lib.load(str(tmp_path), description, where="x"), queries, 10)
  want_scores, want_rows = _exact(queries, bank, 10)
  if kind in ("hnsw", "ivfpq"):
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows, want_rows)])
    assert recall >= 0.95, recall
  else:
    np.testing.assert_array_equal(rows, want_rows)
  found = np.take_along_axis(queries @ bank.T, rows, axis=1)
  np.testing.assert_allclose(scores, found, atol=1e-5)  # Scores are the cosines of the rows.
  # Fewer neighbours re-rank as many candidates (search's docstring): the first of the ten.
  np.testing.assert_array_equal(ann_lib.search(built, queries, 1)[1], rows[:, :1])
  if kind in ("flat", "ivf"):
    np.testing.assert_allclose(scores, want_scores, atol=1e-5)


def _clustered(rng, n, d, clusters):
  """float32 [n, d] unit rows around `clusters` random centres: structure, as embeddings have."""
  x = _unit(rng, clusters, d)[rng.integers(clusters, size=n)] + 0.25 * _unit(rng, n, d)
  return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _self_recall(index, bank, k=10):
  """Recall@k of a FAISS index on every row of bank, the row itself left out: the share of the
  k rows found whose score reaches the k-th exact one (numpy, float64), so identical rows tie."""
  sims = bank.astype(np.float64) @ bank.T.astype(np.float64)
  np.fill_diagonal(sims, -np.inf)
  kth = np.sort(sims, axis=1)[:, -k]
  scores, found = index.search(bank, k + 1)
  return np.mean(
    [
      np.sum(s[(f != i) & (f >= 0)][:k] >= t - 1e-6) / k
      for i, (s, f, t) in enumerate(zip(scores, found, kth))
    ]
  )


def test_calibration_takes_the_smallest_nprobe_that_finds_the_target_recall(monkeypatch):
  """On every row (the sample made the whole bank): nprobe p reaches the target, p - 1 does not;
  clustered rows need far fewer lists than random ones."""
  monkeypatch.setattr(ann_lib, "CALIBRATION_QUERIES", 10**6)
  rng = np.random.default_rng(0)
  chosen = {}
  for name, bank in (
    ("random", _unit(rng, 3000, 32)),
    ("clustered", _clustered(rng, 3000, 32, 40)),
  ):
    spec = ann_lib.choose(len(bank), 32, _ann_config(type="ivf", nlist=64, recall=0.9))
    index, built = ann_lib.build(bank, spec, threads=1)
    p = built["params"]["nprobe"]
    assert built["calibration"] == {
      "param": "nprobe",
      "target": 0.9,
      "k": 10,
      "queries": 3000,
      "recall": pytest.approx(_self_recall(index, bank), abs=1e-9),
    }
    assert built["calibration"]["recall"] >= 0.9
    faiss.extract_index_ivf(index).nprobe = p - 1
    assert _self_recall(index, bank) < 0.9
    chosen[name] = p
  assert chosen["clustered"] * 4 <= chosen["random"], chosen


def test_calibration_stands_for_new_queries_and_says_when_the_target_is_out_of_reach(
  monkeypatch, caplog
):
  # Rows as queries (the calibration) and new queries find about as much (calibrate's docstring).
  rng = np.random.default_rng(2)
  rows = _clustered(rng, 5500, 16, 30)  # One set of clusters for both.
  bank, fresh = rows[:5000], rows[5000:]
  index, built = ann_lib.build(
    bank, ann_lib.choose(5000, 16, _ann_config(type="ivfpq", nlist=64, recall=0.9)), threads=1
  )
  _, found = index.search(fresh, 10)
  fresh_recall = np.mean(
    [len(set(a) & set(b)) / 10 for a, b in zip(found, _exact(fresh, bank, 10)[1])]
  )
  assert abs(fresh_recall - built["calibration"]["recall"]) < 0.03, fresh_recall
  bank = bank[:2000]
  monkeypatch.setattr(ann_lib, "CALIBRATION_QUERIES", 10**6)
  # One exactly re-ranked candidate per neighbour: 4-bit codes alone cannot rank every
  # neighbour right, so even every list probed misses recall 1; it takes the fewest lists
  # within SHORTFALL_TOLERANCE of every list's recall, and says so.
  spec = ann_lib.choose(2000, 16, _ann_config(type="ivfpq", nlist=16, k_factor=1, recall=1.0))
  with caplog.at_level("WARNING"):
    index, built = ann_lib.build(bank, spec, threads=1)
  assert "less than ann.recall=1.0" in caplog.text
  chosen = built["params"]["nprobe"]
  at = {}
  for nprobe in (chosen, 16):
    faiss.extract_index_ivf(index).nprobe = nprobe
    at[nprobe] = _self_recall(index, bank)
  assert at[16] < 1.0 and at[chosen] >= at[16] - ann_lib.SHORTFALL_TOLERANCE
  assert built["calibration"]["recall"] == pytest.approx(at[chosen], abs=1e-9)
  # The exact neighbours behind it, against numpy, in blocks that split the rows.
  monkeypatch.setattr(ann_lib, "_EXACT_BLOCK", 300)
  rows = np.array([0, 299, 300, 1999])
  sims = bank[rows].astype(np.float64) @ bank.T.astype(np.float64)
  sims[np.arange(4), rows] = -np.inf
  scores, ids = ann_lib.exact_neighbours(bank, rows, 7)
  np.testing.assert_array_equal(ids, np.argsort(-sims, axis=1, kind="stable")[:, :7])
  np.testing.assert_allclose(scores, np.sort(sims, axis=1)[:, ::-1][:, :7], atol=1e-6)
  with pytest.raises(ValueError, match="k=2000: must be in"):
    ann_lib.exact_neighbours(bank, rows, 2000)


def test_identical_rows_tie_in_the_calibration(monkeypatch):
  """Every row twice (a folder added again under another path): any copy is a right answer,
  so the calibration probes as few lists as for the rows once."""
  monkeypatch.setattr(ann_lib, "CALIBRATION_QUERIES", 10**6)
  bank = _clustered(np.random.default_rng(3), 2000, 16, 30)
  chosen = {}
  for copies in (1, 2):
    rows = np.concatenate([bank] * copies)
    spec = ann_lib.choose(len(rows), 16, _ann_config(type="ivf", nlist=32, recall=0.95))
    index, built = ann_lib.build(rows, spec, threads=1)
    assert built["calibration"]["recall"] == pytest.approx(_self_recall(index, rows), abs=1e-9)
    assert built["calibration"]["recall"] >= 0.95
    chosen[copies] = built["params"]["nprobe"]
  assert chosen[2] <= chosen[1] + 2 < 32, chosen


def _folder(tmp_path, name, classes, per_class=2):
  """A folder of real photos (clothing test images), `per_class` of each class; their paths."""
  folder = tmp_path / name
  for cls in classes:
    (folder / cls).mkdir(parents=True, exist_ok=True)
    for f in sorted(os.listdir(os.path.join(CLOTHING, cls)))[:per_class]:
      shutil.copy(os.path.join(CLOTHING, cls, f), folder / cls / f)
  return str(folder)


@pytest.fixture()
def photos(pretrained, tmp_path):
  """(index workdir, folder): an index of 6 photos with an HNSW index (forced: few rows)."""
  folder = _folder(tmp_path, "photos", ["dress", "hat", "shoes"])
  workdir = str(tmp_path / "index")
  embed.run(
    embed_config(pretrained, dataset=None, folder=folder, ann=_ann_config(type="hnsw").to_dict()),
    workdir,
  )
  return workdir, folder


def test_embed_writes_an_ann_index_a_service_reads_with_faiss_alone(photos):
  workdir, _ = photos
  with open(os.path.join(workdir, ann_lib.META)) as f:
    description = json.load(f)
  with open(os.path.join(workdir, index_lib.META)) as f:
    meta = json.load(f)
  assert meta["ann"] == description and description["embed_run"] == meta["run_id"]
  assert (description["type"], description["rows"], description["dim"]) == ("hnsw", 6, meta["dim"])
  assert description["format_version"] == ann_lib.FORMAT_VERSION
  read = faiss.read_index(os.path.join(workdir, description["file"]))
  embeddings = np.load(os.path.join(workdir, shards_lib.names(0)["embeddings"]))
  _, rows = read.search(embeddings, 6)
  np.testing.assert_array_equal(rows, _exact(embeddings, embeddings, 6)[1])


def test_neighbours_searches_the_ann_index_and_says_so(photos, tmp_path):
  workdir, _ = photos
  saved = index_lib.load_index(workdir)
  want_scores, want_rows = _exact(np.asarray(saved.embeddings), np.asarray(saved.embeddings), 4)
  results = {}
  for search in ("auto", "exact"):
    results[search] = neighbours.run(
      neighbours_config(workdir, query_rows="0,1,2,3,4,5", search=search), str(tmp_path / search)
    )
    got = results[search]["queries"]
    np.testing.assert_array_equal([[n["row"] for n in q["neighbours"]] for q in got], want_rows)
    np.testing.assert_allclose(
      [[n["score"] for n in q["neighbours"]] for q in got], want_scores, atol=1e-5
    )
  assert results["auto"]["search"] == {
    "method": "ann",
    "type": "hnsw",
    "params": saved.ann["params"],
    "file": saved.ann["file"],
  }
  assert results["exact"]["search"] == {"method": "exact"}


def test_adding_files_embeds_only_new_ones_rows_continue_and_their_queries_find_them(
  pretrained, photos, tmp_path
):
  workdir, folder = photos
  before = index_lib.load_index(workdir)
  first_shard = os.path.join(workdir, shards_lib.names(0)["embeddings"])
  first_bytes = open(first_shard, "rb").read()
  new = _folder(tmp_path, "photos", ["pants", "skirt"], per_class=1)  # Into the same folder.
  added = embed.run(embed_config(None, dataset=None, folder=folder, add=True), workdir)
  assert added.shape == (2, before.embeddings.shape[1])
  after = index_lib.load_index(workdir)
  new_names = [
    os.path.join(new, cls, f)
    for cls in ("pants", "skirt")
    for f in sorted(os.listdir(os.path.join(new, cls)))
  ]
  # Class folders label the rows; the new classes join the index's after its own.
  assert [r["label"] for r in before.rows] == [0, 0, 1, 1, 2, 2]
  assert after.class_names == ["dress", "hat", "shoes", "pants", "skirt"]
  assert list(after.rows) == list(before.rows) + [
    {"name": name, "label": label} for name, label in zip(new_names, [3, 4])
  ]
  # The first part is as it was; the new rows are a new part, embedded as a fresh index does.
  assert open(first_shard, "rb").read() == first_bytes
  assert shards_lib.is_complete(workdir, 1)
  alone = str(tmp_path / "alone")
  only_new = _folder(tmp_path, "only_new", ["pants", "skirt"], per_class=1)
  embed.run(embed_config(pretrained, dataset=None, folder=only_new), alone)
  np.testing.assert_allclose(
    np.asarray(after.embeddings)[6:], index_lib.load_index(alone).embeddings, atol=1e-5
  )
  assert after.ann["rows"] == 8 and after.ann["file"] == "ann.1.faiss"

  assert sorted(f for f in os.listdir(workdir) if f.endswith(".faiss")) == ["ann.1.faiss"]
  # The new files, as query files, find themselves first through the ANN index.
  results = neighbours.run(
    neighbours_config(workdir, queries=",".join(new_names)), str(tmp_path / "search")
  )
  assert results["search"]["method"] == "ann"
  for i, query in enumerate(results["queries"]):
    assert query["neighbours"][0]["row"] == 6 + i
    assert query["neighbours"][0]["score"] == pytest.approx(1.0, abs=1e-5)
  # Adding the same folder again embeds nothing and changes nothing.
  assert len(embed.run(embed_config(None, dataset=None, folder=folder, add=True), workdir)) == 0
  assert index_lib.load_index(workdir).meta == after.meta
  # A folder without class folders adds rows without a label; the classes stay.
  flat = tmp_path / "flat"
  flat.mkdir()
  shutil.copy(os.path.join(new, "pants", os.listdir(os.path.join(new, "pants"))[0]), flat / "a.jpg")
  embed.run(embed_config(None, dataset=None, folder=str(flat), add=True), workdir)
  grown = index_lib.load_index(workdir)
  assert grown.rows[-1] == {"name": str(flat / "a.jpg")} and grown.class_names == after.class_names


def test_an_interrupted_add_leaves_the_previous_index_as_it_was(photos, tmp_path, monkeypatch):
  workdir, folder = photos
  before = index_lib.load_index(workdir)
  listing = {
    os.path.relpath(os.path.join(d, f), workdir): open(os.path.join(d, f), "rb").read()
    for d, _, names in os.walk(workdir)
    for f in names
    if f != files.LOCK
  }
  _folder(tmp_path, "photos", ["pants"], per_class=1)
  original = files.write_atomic

  def killed_before_the_marker(path, content):
    if path.endswith("/" + index_lib.META):
      raise KeyboardInterrupt  # As a Ctrl-C between the part files and embed.json.
    original(path, content)

  monkeypatch.setattr(files, "write_atomic", killed_before_the_marker)
  with pytest.raises(KeyboardInterrupt):
    embed.run(embed_config(None, dataset=None, folder=folder, add=True), workdir)
  monkeypatch.setattr(files, "write_atomic", original)
  for name, content in listing.items():  # Every file of the index unchanged ...
    assert open(os.path.join(workdir, name), "rb").read() == content, name
  again = index_lib.load_index(workdir)  # ... and it loads and searches as it did.
  assert list(again.rows) == list(before.rows) and again.meta == before.meta
  results = neighbours.run(neighbours_config(workdir, query_rows="5"), str(tmp_path / "search"))
  assert results["queries"][0]["neighbours"][0]["row"] == 5
  # The add, run again, completes over what the interrupted one left.
  embed.run(embed_config(None, dataset=None, folder=folder, add=True), workdir)
  assert len(index_lib.load_index(workdir).rows) == 7


def _edit_json(path, **fields):
  with open(path) as f:
    content = json.load(f)
  content.update(fields)
  with open(path, "w") as f:
    json.dump(content, f)


def test_bad_indexes_and_adds_are_refused_in_one_line(pretrained, photos, tmp_path, monkeypatch):
  workdir, folder = photos
  out = str(tmp_path / "out")
  meta_path = os.path.join(workdir, index_lib.META)
  pristine = open(meta_path).read()
  ann_file = os.path.join(workdir, json.loads(pristine)["ann"]["file"])
  ann_bytes = open(ann_file, "rb").read()
  search = neighbours_config(workdir, query_rows="0")
  add = embed_config(None, dataset=None, folder=folder, add=True)

  def refused(error, match, job, config):
    with pytest.raises(error, match=match) as raised:
      job.run(config, out if job is neighbours else workdir)
    assert "\n" not in str(raised.value)

  # Another embed run's or dimension's ANN index; an unknown format (ann.json and its copy in
  # embed.json both edited); a truncated file.
  meta = json.loads(pristine)
  ann_path = os.path.join(workdir, ann_lib.META)
  ann_pristine = open(ann_path).read()
  for field, value, match in [
    ("embed_run", "0123", "has embed_run='0123': must be the embeddings' .*another embed run"),
    ("dim", 7, "has dim=7: must be the embeddings' .*another embed run or dimension"),
    ("format_version", 99, "format_version=99: must be 1 "),
  ]:
    _edit_json(meta_path, ann=dict(meta["ann"], **{field: value}))
    _edit_json(ann_path, **{field: value})
    refused(JobError, "config.index_workdir=.*" + match, neighbours, search)
    refused(JobError, f"--workdir={workdir}: .*" + match, embed, add)
    open(ann_path, "w").write(ann_pristine)
  open(meta_path, "w").write(pristine)
  # ann.json alone: of an unknown version, other than embed.json's copy, missing, not JSON.
  for edit, match in [
    (lambda: _edit_json(ann_path, format_version=99), "ann.json has format_version=99: must be 1 "),
    (
      lambda: _edit_json(ann_path, params={"efSearch": 1}),
      r"ann.json has params=\{'efSearch': 1\} where embed.json's copy of it has .*the same",
    ),
    (
      lambda: os.remove(ann_path),
      "ann.json is missing: embed.json lists the ANN index ann.0.faiss",
    ),
    (lambda: open(ann_path, "w").write("{"), "ann.json must be the JSON an embed job"),
  ]:
    edit()
    refused(JobError, "config.index_workdir=.*: " + match, neighbours, search)
    refused(JobError, f"--workdir={workdir}: " + match, embed, add)
    refused(
      JobError,
      "config.index_workdir=.*: " + match,
      neighbours,
      neighbours_config(workdir, query_rows="0", search="exact"),
    )
    open(ann_path, "w").write(ann_pristine)
  _edit_json(meta_path, format_version=index_lib.FORMAT_VERSION + 1)
  refused(
    JobError,
    f"embed.json has format_version={index_lib.FORMAT_VERSION + 1}: must be 1 to "
    f"{index_lib.FORMAT_VERSION}",
    neighbours,
    search,
  )
  open(meta_path, "w").write(pristine)
  with open(ann_file, "wb") as f:
    f.write(ann_bytes[:1000])
  refused(
    JobError,
    f"ann.0.faiss has 1000 bytes: must have {len(ann_bytes)} .*truncated",
    neighbours,
    search,
  )
  # Sizes agree (no checksum recorded): FAISS refuses it.
  unchecked = {k: v for k, v in meta["ann"].items() if k != "crc32"}
  _edit_json(meta_path, ann=dict(unchecked, bytes=1000))
  open(ann_path, "w").write(json.dumps(dict(unchecked, bytes=1000)))
  refused(JobError, "ann.0.faiss must be a FAISS index", neighbours, search)
  open(meta_path, "w").write(pristine)
  open(ann_path, "w").write(ann_pristine)
  # The same size, one byte flipped: its CRC-32 differs, for the search and for the add.
  with open(ann_file, "wb") as f:
    f.write(ann_bytes[:500] + bytes([ann_bytes[500] ^ 1]) + ann_bytes[501:])
  crc = meta["ann"]["crc32"]
  for job, config in ((neighbours, search), (embed, add)):
    refused(JobError, f"ann.0.faiss has CRC-32 [0-9]+: must have {crc} .*damaged", job, config)
  with open(ann_file, "wb") as f:
    f.write(ann_bytes)
  embeddings = os.path.join(workdir, shards_lib.names(0)["embeddings"])
  whole = open(embeddings, "rb").read()
  with open(embeddings, "wb") as f:
    f.write(whole[:200])
  refused(
    JobError,
    "img_emb/img_emb_00000.npy and metadata/metadata_00000.parquet must be the files of 6 "
    "rows .*truncated",
    neighbours,
    search,
  )
  with open(embeddings, "wb") as f:
    f.write(whole)
  # Adds with another checkpoint, from no folder or one that cannot be read, to no index.
  other = str(tmp_path / "other")
  shutil.copytree(pretrained, other)
  for config, match in [
    (
      embed_config(other, dataset=None, folder=folder, add=True),
      "config.pretrain_workdir=.*other': must be unset or the index's checkpoint .*step 0",
    ),
    (
      embed_config(None, dataset=None, folder=folder, add=True, pretrain_step=3),
      "config.pretrain_step=3: must be -1 or 0",
    ),
    (
      embed_config(None, dataset=None, folder=str(tmp_path / "nowhere"), add=True),
      "config.folder=.*nowhere': must be an existing folder",
    ),
    (embed_config(pretrained, add=True), "config.folder=None: must be .* when config.add"),
    (
      embed_config(
        None, dataset=None, folder=folder, add=True, ann=_ann_config(type="annoy").to_dict()
      ),
      "config.ann.type='annoy'",
    ),
  ]:
    refused(ConfigError, match, embed, config)
  with pytest.raises(JobError, match=f"--workdir={out}: must hold a finished embed job's index"):
    embed.run(add, out)
  # A query file that cannot be read, with an ANN index too.
  broken = tmp_path / "broken.jpg"
  broken.write_bytes(b"\xff\xd8\xff not a JPEG")
  refused(
    ConfigError,
    f"config.queries='{broken}': must be an image file that can be read",
    neighbours,
    neighbours_config(workdir, queries=str(broken)),
  )
  # Without FAISS (the base install): one line saying what to install.
  monkeypatch.setitem(sys.modules, "faiss", None)
  refused(
    ConfigError,
    r"config.search='auto': must be 'exact' unless FAISS is installed: pip "
    r"install 'contrastive_jax\[search\]'",
    neighbours,
    search,
  )
  refused(
    ConfigError,
    r"config.add=True: must be False \(the index's ANN index ann.0.faiss "
    r"grows with its rows\) unless FAISS is installed: pip install "
    r"'contrastive_jax\[search\]'",
    embed,
    add,
  )
  assert neighbours.run(neighbours_config(workdir, query_rows="0", search="exact"), out)[
    "search"
  ] == {"method": "exact"}
  assert open(meta_path).read() == pristine


def test_a_flat_index_searched_exactly_still_has_its_file_checked_and_says_how(
  pretrained, tmp_path, caplog
):
  """The default below EXACT_BELOW rows: neighbours never loads the file, but checks it."""
  folder = _folder(tmp_path, "photos", ["dress", "hat"])
  workdir = str(tmp_path / "index")
  embed.run(embed_config(pretrained, dataset=None, folder=folder), workdir)
  described = index_lib.load_index(workdir).ann
  path = os.path.join(workdir, described["file"])
  content = open(path, "rb").read()
  assert described["type"] == "flat" and described["crc32"] == zlib.crc32(content)
  search = neighbours_config(workdir, query_rows="0")
  with caplog.at_level("INFO"), caplog.at_level("INFO", logger="absl"):
    assert neighbours.run(search, str(tmp_path / "out"))["search"] == {"method": "exact"}
  assert (
    "Searching the 4 rows exactly (its ANN index ann.0.faiss is 'flat', itself exact); "
    "ann.0.faiss: size and CRC-32 checked."
  ) in caplog.text
  # A garbled file of the same size: refused in one line where it would be passed over.
  with open(path, "wb") as f:
    f.write(content[:-8] + bytes(8))
  with pytest.raises(
    JobError,
    match=r"config.index_workdir=.*: the ANN index ann.0.faiss has "
    rf"CRC-32 {zlib.crc32(content[:-8] + bytes(8))}: must have "
    rf"{described['crc32']} \(ann.json\); its bytes are damaged",
  ) as raised:
    neighbours.run(search, str(tmp_path / "out2"))
  assert "\n" not in str(raised.value)
  # An ann.json written without a checksum: its size only, and the log line says so.
  for name in (ann_lib.META, index_lib.META):
    meta = json.load(open(os.path.join(workdir, name)))
    if name == ann_lib.META:
      del meta["crc32"]
    else:
      del meta["ann"]["crc32"]
    open(os.path.join(workdir, name), "w").write(json.dumps(meta))
  caplog.clear()
  with caplog.at_level("INFO"), caplog.at_level("INFO", logger="absl"):
    neighbours.run(
      neighbours_config(workdir, query_rows="0", search="exact"), str(tmp_path / "out3")
    )
  assert (
    "Searching the 4 rows exactly (config.search='exact'); ann.0.faiss: size checked "
    "(ann.json records no CRC-32)."
  ) in caplog.text


def _part(workdir, number, h, first_id, folder):
  """Writes h as shard `number` of unlabelled rows named by their ids; its part's entry."""
  ids = list(range(first_id, first_id + len(h)))
  rows = {"id": ids, "name": [str(i) for i in ids], "label": [None] * len(h), "split": "all"}
  shards_lib.write(workdir, number, h, rows, [])
  return {
    "shards": [shards_lib.entry(number, len(h))],
    "num_images": len(h),
    "ids": [first_id, first_id + len(h)],
    "folder": folder,
  }


def test_an_add_that_crosses_the_exact_size_rebuilds_auto_as_ivf(tmp_path, monkeypatch):
  rng = np.random.default_rng(1)
  monkeypatch.setattr(ann_lib, "EXACT_BELOW", 150)
  config = ml_collections.ConfigDict(dict(ann=_ann_config().to_dict()))
  first, second = _unit(rng, 100, 16), _unit(rng, 100, 16)
  workdir = str(tmp_path)
  run_id = "r"
  description = index_lib._write_ann(workdir, config, first, generation=0, run_id=run_id)
  assert description["type"] == "flat"
  meta = {
    "format_version": index_lib.FORMAT_VERSION,
    "run_id": run_id,
    "config": {"folder": "/x"},
    "eval_crop": {"size": 32, "fraction": 1.0, "resize": "bilinear"},
    "num_images": 100,
    "dim": 16,
    "class_names": None,
    "unreadable": 0,
    "parts": [],
    "ann": description,
  }
  meta["parts"].append(_part(workdir, 0, first, 0, "/x"))
  index_lib._commit(workdir, meta, None)
  index_lib.append(
    workdir,
    index_lib.load_index(workdir),
    config.ann,
    _part(workdir, 1, second, 100, "/y"),
    None,
    0,
  )
  grown = index_lib.load_index(workdir)
  assert grown.ann["type"] == "ivf" and grown.ann["rows"] == 200
  assert sorted(f for f in os.listdir(workdir) if f.endswith(".faiss")) == ["ann.1.faiss"]
  bank = np.concatenate([first, second])
  scores, rows = ann_lib.search(ann_lib.load(workdir, grown.ann, where="x"), bank[150:], 1)
  np.testing.assert_array_equal(rows[:, 0], np.arange(150, 200))
  assert grown.ann["calibration"]["queries"] == 200
  # A further add grows the IVF-PQ index in place and calibrates its nprobe again, on 260 rows:
  # what calibrating the grown index afresh gives.
  third = _unit(rng, 60, 16)
  index_lib.append(workdir, grown, config.ann, _part(workdir, 2, third, 200, "/z"), None, 0)
  again = index_lib.load_index(workdir)
  assert again.ann["file"] == "ann.2.faiss" and again.ann["calibration"]["queries"] == 260
  loaded = ann_lib.load(workdir, again.ann, where="x")
  fresh = ann_lib.calibrate(
    loaded,
    np.concatenate([bank, third]),
    dict(again.ann, calibration={"param": "nprobe", "target": 0.95}),
  )
  assert (fresh["params"], fresh["calibration"]) == (again.ann["params"], again.ann["calibration"])


def test_an_index_from_before_ann_indexes_is_read_and_an_add_gives_it_one(photos, tmp_path):
  workdir, folder = photos
  meta_path = os.path.join(workdir, index_lib.META)
  with open(meta_path) as f:
    meta = json.load(f)
  old = {
    key: value
    for key, value in meta.items()
    if key not in ("format_version", "run_id", "parts", "ann")
  }
  del old["config"]["ann"], old["config"]["add"]
  crop = old.pop("eval_crop")  # Format 1 held the eval crop's size and fraction, no resize.
  old.update(image_size=crop["size"], crop_fraction=crop["fraction"])
  # And its rows in one embeddings.npy and index.jsonl rather than shards.
  saved = index_lib.load_index(workdir)
  np.save(os.path.join(workdir, index_lib.EMBEDDINGS), np.asarray(saved.embeddings))
  with open(os.path.join(workdir, index_lib.INDEX), "w") as f:
    f.write("".join(json.dumps(row) + "\n" for row in saved.rows))
  for folder_name in (shards_lib.EMBEDDINGS_DIR, shards_lib.METADATA_DIR):
    shutil.rmtree(os.path.join(workdir, folder_name))
  with open(meta_path, "w") as f:
    json.dump(old, f)
  for name in (ann_lib.META, meta["ann"]["file"]):
    os.remove(os.path.join(workdir, name))
  before = index_lib.load_index(workdir)
  assert before.ann is None and len(before.rows) == 6
  results = neighbours.run(neighbours_config(workdir, query_rows="2"), str(tmp_path / "search"))
  assert results["search"] == {"method": "exact"}
  _folder(tmp_path, "photos", ["pants"], per_class=1)
  embed.run(embed_config(None, dataset=None, folder=folder, add=True), workdir)
  after = index_lib.load_index(workdir)
  assert after.meta["format_version"] == index_lib.FORMAT_VERSION and len(after.rows) == 7
  assert after.ann["type"] == "flat" and after.ann["embed_run"] == after.meta["run_id"]
  assert after.rows[:6] == list(before.rows)
  # The added image is shard 0, its id numbered on from the old part's rows.
  assert after.meta["parts"][1]["shards"] == [shards_lib.entry(0, 1)]
  assert after.meta["parts"][1]["ids"] == [6, 7]


def test_the_benchmark_measures_exact_search_and_each_index_against_it():
  bench = load_benchmark("ann")
  assert bench.recall(np.array([[1, 2, 3], [5, 6, 7]]), np.array([[3, 4, 1], [5, 6, 7]])) == (
    pytest.approx((2 / 3 + 1) / 2)
  )
  rng = np.random.default_rng(0)
  table = bench.measure(
    bench.unit_rows(rng, 4000, 32),
    bench.unit_rows(rng, 100, 32),
    k=10,
    threads=1,
    types=["ivf", "ivfpq"],
    ef_search=[],
    nprobe_fractions=[1.0],
    k_factors=[],
    scann=False,
  )
  rows = {name: numbers for name, *numbers in table}
  assert table[0][0] == "exact: faiss IndexFlatIP" and table[0][3:6:2] == (1.0, 1.0)
  # IVF probing all of its 64 lists (4,000 / 39 rows: MIN_ROWS_PER_LIST) is exact search;
  # the calibrated nprobe (first) finds about its target of 0.95 with fewer.
  assert rows["IVF64,Flat nprobe=64"][2] == 1.0
  ivf, ivfpq = (
    [name for name in rows if name.startswith(f"IVF64,{codes}")]
    for codes in ("Flat", "PQ16x4fs,RFlat")
  )
  assert len(ivf) == 2 and ivf[0].endswith(" (calibrated)") and 0.9 < rows[ivf[0]][2] < 1.0
  assert int(ivf[0].split("=")[1].split()[0]) < 64
  assert len(ivfpq) == 2 and ivfpq[1] == "IVF64,PQ16x4fs,RFlat nprobe=64 k_factor=50"
  assert all(size > 0 and qps > 0 for size, qps in ((n[1], n[3]) for n in rows.values()))
  lines = bench.report(table, 10).splitlines()
  assert len(lines) == len(table) + 2 and lines[2].startswith("| exact: faiss IndexFlatIP | ")


def test_the_base_install_embeds_without_faiss_and_searches_exactly(
  pretrained, tmp_path, monkeypatch
):
  """ann.type 'auto' without FAISS: no ANN index, a warning, exact search; a type named needs it."""
  folder = _folder(tmp_path, "photos", ["dress", "hat"])
  monkeypatch.setitem(sys.modules, "faiss", None)
  with pytest.raises(
    ConfigError,
    match=r"config.ann.type='hnsw': must be 'auto' or 'none' "
    r"unless FAISS",
  ):
    embed.run(
      embed_config(pretrained, dataset=None, folder=folder, ann=_ann_config(type="hnsw").to_dict()),
      str(tmp_path / "named"),
    )
  workdir = str(tmp_path / "index")
  h = embed.run(embed_config(pretrained, dataset=None, folder=folder), workdir)
  with open(os.path.join(workdir, index_lib.META)) as f:
    assert json.load(f)["ann"] is None
  assert not os.path.exists(os.path.join(workdir, ann_lib.META))
  out = neighbours.run(neighbours_config(workdir, query_rows="0"), str(tmp_path / "out"))
  assert out["search"] == {"method": "exact"}
  np.testing.assert_array_equal([n["row"] for n in out["queries"][0]["neighbours"]][:1], [0])
  assert len(h) == 4
  # An add to it needs no FAISS either: no ANN index to grow.
  _folder(tmp_path, "photos", ["pants"], per_class=1)
  assert len(embed.run(embed_config(None, dataset=None, folder=folder, add=True), workdir)) == 1
  grown = index_lib.load_index(workdir)
  assert len(grown.rows) == 5 and grown.ann is None


def test_the_benchmarks_new_images_have_no_view_in_the_bank():
  bench = load_benchmark("ann")
  image = np.tile(np.arange(10), 3)  # 3 views of each of 10 images, view-major.
  rows = np.stack([image, np.arange(30)], axis=1).astype(np.float32)
  bank, queries = bench.new_images_views(np.random.default_rng(0), rows, image, 4)
  new = queries[:, 0]
  assert len(queries) == 4 and len(set(new)) == 4 and list(new) == sorted(new)
  np.testing.assert_array_equal(queries[:, 1], new)  # The first view: row = image number.
  assert len(bank) == 18 and not set(bank[:, 0]) & set(new)


def test_the_benchmarks_views_are_a_function_of_seed_image_and_view():
  make_views = load_benchmark("view_embeddings").views_fn(32, "pil_bilinear", 1.0, seed=0)
  images = jnp.asarray(np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3)), jnp.uint8)
  positions = jnp.arange(6, dtype=jnp.int32)
  views = np.asarray(make_views(images, positions, 0))
  # The whole image (area 1 to 1), mirrored or not.
  for image, view in zip(np.asarray(images), views):
    assert np.array_equal(view, image) or np.array_equal(view, image[:, ::-1])
  assert not all(np.array_equal(v, i) for v, i in zip(views, np.asarray(images)))
  np.testing.assert_array_equal(make_views(images, positions, 0), views)
  assert not np.array_equal(make_views(images, positions, 1), views)

"""An ANN index within a memory budget (config.ann.max_memory): its choice, size, recall,
shard-by-shard fill, re-ranking from the shards, and the budgets refused."""

import json
import os

from helpers import tiny_config
import ml_collections
import numpy as np
import pytest

# The tiny pretraining workdir and the job configs of the embed and neighbours tests.
from test_search import NUM
from test_search import embed_config  # noqa: F401
from test_search import neighbours_config  # noqa: F401
from test_search import pretrained  # noqa: F401

from contrastive_jax import models
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.jobs import embed
from contrastive_jax.jobs import neighbours
from contrastive_jax.search import ann as ann_lib
from contrastive_jax.search import index as index_lib
from contrastive_jax.search import shards as shards_lib

faiss = pytest.importorskip("faiss")
N, D, CLUSTERS = 20_000, 32, 200


def _unit(rng, n, d):
  x = rng.normal(size=(n, d)).astype(np.float32)
  return x / np.linalg.norm(x, axis=1, keepdims=True)


def _clustered(rng, n, centres):
  """float32 [n, D] unit rows around the centres: structure, as image embeddings have."""
  x = centres[rng.integers(len(centres), size=n)] + 0.25 * _unit(rng, n, centres.shape[1])
  return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def data():
  """(bank [N, D], new queries [500, D] from the same clusters, not in the bank)."""
  rng = np.random.default_rng(0)
  centres = _unit(rng, CLUSTERS, D)
  return _clustered(rng, N, centres), _clustered(rng, 500, centres)


@pytest.fixture(scope="module")
def opq_index(data):
  """(index, spec): ann_lib.build of the whole bank within 400 KB, OPQ4,IVF512,PQ4x8np.

  Built once: OPQ's training is most of the cost of the tests that read it.
  """
  spec = ann_lib.choose(N, D, _ann(max_memory="400KB"))
  return ann_lib.build(data[0], spec, threads=1)


def _ann(**fields):
  config = embed_config("unused").ann
  config.update(dict(threads=1, **fields))
  return config


def _numpy_top(queries, bank, k):
  sims = queries.astype(np.float64) @ bank.T.astype(np.float64)
  return np.argsort(-sims, axis=1, kind="stable")[:, :k]


def test_max_memory_takes_bytes_or_units_and_refuses_anything_else_in_one_line():
  for given, want in [
    ("4GB", 4 * 10**9),
    ("1.5GiB", 3 * 2**29),
    ("800 mb", 8 * 10**8),
    ("12345", 12345),
    ("", None),
    ("0", None),
  ]:
    assert ann_lib.max_memory(ml_collections.ConfigDict({"max_memory": given})) == want, given
  for bad in ("abc", "-1GB", "GB", "4 parsecs"):
    with pytest.raises(ConfigError, match=rf"config.ann.max_memory='{bad}': must be the ANN") as e:
      ann_lib.check_config(_ann(max_memory=bad))
    assert "\n" not in str(e.value)


def test_the_estimate_is_faiss_serialized_size(data, opq_index):
  """Codes + ids + centroids + the quantizers' tables, by hand, and FAISS's own bytes."""
  for kind, pq_m, pca, opq in (
    ("flat", 0, 0, False),
    ("ivf", 0, 0, False),
    ("ivfsq8", 0, 0, False),
    ("ivfsq8", 0, 16, False),
    ("ivfpq8", 4, 0, False),
    ("ivfpq8", 4, 0, True),  # The whole bank's, built by opq_index.
    ("ivfpq", 0, 0, False),
  ):
    if opq:
      bank = data[0]
      spec = ann_lib.choose(len(bank), D, _ann(max_memory="400KB"))
    else:
      bank = data[0][:5000]
      spec = ann_lib.choose(len(bank), D, _ann(type=kind, pq_m=pq_m, pca=pca, opq=opq, nprobe=4))
    nlist = spec["params"].get("nlist", 0)
    lists = nlist * (4 * D + 8) + 8 * len(bank)
    by_hand = {
      "flat": 4 * len(bank) * D,
      "ivf": lists + 4 * len(bank) * D,
      "ivfsq8": lists + len(bank) * D + 2 * 4 * D,
      "ivfpq8": lists + len(bank) * 4 + 256 * 4 * D,
    }
    if pca:  # Lists and codes of 16 dimensions; the PCA: D x 16 and D x D floats and 3 vectors.
      assert spec["factory"] == "PCAR16,IVF128,SQ8"
      by_hand[kind] = nlist * (4 * 16 + 8) + 8 * len(bank) + len(bank) * 16 + 2 * 4 * 16
      by_hand[kind] += 4 * (D * 16 + D * D + 16 + 2 * D)
    if opq:  # The rotation: D x D floats before the lists.
      assert spec["factory"] == "OPQ4,IVF512,PQ4x8np"
      by_hand[kind] += 4 * D * D
    estimate = ann_lib.estimate_bytes(spec, len(bank), D)
    if kind in by_hand:
      assert estimate == by_hand[kind], kind
    built = opq_index[0] if opq else ann_lib.build(bank, spec, threads=1)[0]
    size = len(faiss.serialize_index(built))
    # FAISS's headers: a few hundred bytes; 'ivfpq''s fast-scan blocks are padded per list.
    assert abs(size - estimate) <= (512 if kind in by_hand else 0.03 * size), (kind, size)


def test_a_budget_chooses_the_largest_index_that_fits_and_its_reranked_recall_reaches_the_target(
  data, opq_index
):
  bank, queries = data
  exact = _numpy_top(queries, bank, 10)
  chosen = {}
  for budget, want in (("3MB", "Flat"), ("1MB", "IVF512,SQ8"), ("400KB", "OPQ4,IVF512,PQ4x8np")):
    spec = ann_lib.choose(N, D, _ann(max_memory=budget))
    assert spec["factory"] == want
    assert (
      spec["memory"]["estimate"]
      <= spec["memory"]["budget"]
      == ann_lib.max_memory(ml_collections.ConfigDict({"max_memory": budget}))
    )
    if want == "Flat":
      continue
    if want == "OPQ4,IVF512,PQ4x8np":  # Built by opq_index from this spec.
      built, spec = opq_index
    else:
      built, spec = ann_lib.build(bank, spec, threads=1)
    assert len(faiss.serialize_index(built)) <= spec["memory"]["budget"]
    assert spec["calibration"]["recall"] >= 0.95
    rerank = ann_lib.reranker(spec, bank)
    scores, rows = ann_lib.search(built, queries, 10, rerank)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows, exact)])
    assert recall >= 0.95, (want, recall)
    # The scores are the rows' cosines: re-ranked with the rows themselves, best first.
    np.testing.assert_allclose(
      scores, np.take_along_axis(queries @ bank.T, rows, axis=1), atol=1e-5
    )
    assert np.all(np.diff(scores, axis=1) <= 0)
    # The score, as autofaiss reports one: recall@10 on held-out rows and speeds.
    score = spec["score"]
    assert score["k"] == 10 and score["queries"] == 500 and score["held_out"]
    assert score["recall"] >= 0.9 and score["queries_per_second"] > 0
    chosen[want] = built
  # Without re-ranking, the codes alone rank the candidates worse.
  _, coded = ann_lib.search(chosen["OPQ4,IVF512,PQ4x8np"], queries, 10)
  assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(coded, exact)]) < 0.9


def test_shard_by_shard_fill_is_the_one_shot_build_and_hands_faiss_one_shard_at_a_time(
  data, tmp_path
):
  bank = data[0][:3000]
  paths = []
  for number, (begin, stop) in enumerate(((0, 1200), (1200, 2500), (2500, 3000))):
    paths.append(str(tmp_path / f"img_emb_{number:05d}.npy"))
    np.save(paths[-1], bank[begin:stop])
  parts = index_lib.Parts([np.load(p, mmap_mode="r") for p in paths])
  rows = np.array([[5, 1199], [1200, 2999], [2500, 0]])
  np.testing.assert_array_equal(parts[rows], bank[rows])
  trained = faiss.index_factory(D, "IVF16,SQ8", faiss.METRIC_INNER_PRODUCT)
  trained.train(bank[::3])
  one_shot, sharded = faiss.clone_index(trained), faiss.clone_index(trained)
  one_shot.add(bank)
  ann_lib.add(sharded, parts, 0)
  assert bytes(faiss.serialize_index(sharded)) == bytes(faiss.serialize_index(one_shot))

  class Recorder:  # What add hands FAISS.
    def __init__(self):
      self.chunks = []

    def add(self, x):
      self.chunks.append(x.copy())

  recorder = Recorder()
  ann_lib.add(recorder, parts, 1000)  # An add from row 1000: the rest of shard 0, then 1 and 2.
  assert [len(c) for c in recorder.chunks] == [200, 1300, 500]
  np.testing.assert_array_equal(np.concatenate(recorder.chunks), bank[1000:])


def test_budgets_refused_in_one_line(data):
  bank = data[0][:5000]
  nlist = 128  # 4 sqrt(5000) as a power of two.
  smallest = nlist * (4 * D + 8) + 8 * 5000 + 5000 * 1 + 256 * 4 * D  # IVF128,PQ1x8np.
  with pytest.raises(
    ConfigError,
    match=rf"config.ann.max_memory='10KB': must be at least {smallest} bytes .*"
    rf"5000 rows of dimension {D} that works, IVF128,PQ1x8np",
  ):
    ann_lib.choose(5000, D, _ann(max_memory="10KB"))
  with pytest.raises(
    ConfigError, match=r"config.ann.max_memory='100KB': must be at least .*ann.type='auto'"
  ):
    ann_lib.choose(5000, D, _ann(type="ivf", max_memory="100KB"))
  with pytest.raises(ConfigError, match=rf"config.ann.pq_m=5: must be a divisor of .*\({D}\)"):
    ann_lib.choose(5000, D, _ann(type="ivfpq8", pq_m=5))
  with pytest.raises(ConfigError, match=rf"config.ann.pca=64: must be at most .*\({D}\)"):
    ann_lib.choose(5000, D, _ann(type="ivfsq8", pca=64))
  with pytest.raises(ConfigError, match=r"config.ann.pca=-1: must be an integer >= 0"):
    ann_lib.check_config(_ann(pca=-1))
  # Fits, but one candidate re-ranked per neighbour of 1-byte codes cannot find 0.999.
  spec = ann_lib.choose(5000, D, _ann(max_memory=str(smallest), k_factor=1, recall=0.999))
  with pytest.raises(ConfigError) as raised:
    ann_lib.build(bank, spec, threads=1)
  message = str(raised.value)
  assert "\n" not in message
  reached = float(message.split("ann.recall at most ")[1].split(":")[0])
  assert reached < 0.999 and "IVF128,PQ1x8np (k_factor 1), finds" in message


def test_the_neighbours_job_searches_a_budget_index_with_reranking(pretrained, tmp_path):
  """Below the raw vectors' bytes the embed job builds SQ8 codes, re-ranked from the shards:
  the neighbours job finds the exact neighbours (one list: every row a candidate)."""
  workdir = str(tmp_path / "index")
  dim = models.encoder_width(tiny_config().model)  # pretrained's encoder.
  budget = 4 * NUM * dim - 1  # A byte less than the vectors.
  embed.run(embed_config(pretrained, ann=_ann(max_memory=str(budget)).to_dict()), workdir)
  with open(os.path.join(workdir, ann_lib.META)) as f:
    described = json.load(f)
  assert described["type"] == "ivfsq8" and described["memory"]["budget"] == budget
  assert described["bytes"] <= budget and "recall" in described["score"]
  saved = index_lib.load_index(workdir)
  bank = np.asarray(saved.embeddings)
  assert bank.shape == (NUM, dim)
  result = neighbours.run(
    neighbours_config(workdir, query_rows="0,1,2,3"), str(tmp_path / "search")
  )
  assert result["search"]["method"] == "ann" and result["search"]["type"] == "ivfsq8"
  found = [[n["row"] for n in q["neighbours"]] for q in result["queries"]]
  np.testing.assert_array_equal(found, _numpy_top(bank[:4], bank, 4))


def test_the_benchmark_measures_the_indexes_within_a_budget_against_exact_search():
  from helpers import load_benchmark  # pylint: disable=g-import-not-at-top

  bench = load_benchmark("ann")
  rng = np.random.default_rng(0)
  rows = bench.clustered_rows(rng, 3100, 16, 30)
  np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
  table = bench.measure_budget(
    rows[:3000], rows[3000:], k=10, threads=1, max_memory="100KB", indexes=2, pca=8
  )
  assert [name for name, *_ in table] == [
    "exact: faiss IndexFlatIP",
    "IVF64,SQ8 (chosen)",  # 3,000 x 16 x 4 = 192 KB of vectors: over the budget.
    "IVF64,PQ8x8np",  # Sub-vectors of 2 dimensions: no OPQ tried before it.
    "PCAR8,IVF64,SQ8",
  ]
  for name, estimate, size, nprobe, calibrated, found, qps, ratio in table[1:]:
    assert size <= 100_000 and abs(size - estimate) <= 512 and 1 <= nprobe <= 64
    assert calibrated >= 0.95 and 0.9 <= found <= 1.0 and qps > 0 and ratio > 0
  lines = bench.report_budget(table, 10).splitlines()
  assert len(lines) == len(table) + 2 and lines[3].startswith("| IVF64,SQ8 (chosen) | 0.")


def _part(workdir, number, h, first_id):
  """Writes h as shard `number` of unlabelled rows named by their ids; its part's entry."""
  ids = list(range(first_id, first_id + len(h)))
  rows = {"id": ids, "name": [str(i) for i in ids], "label": [None] * len(h), "split": "all"}
  shards_lib.write(workdir, number, h, rows, [])
  return {
    "shards": [shards_lib.entry(number, len(h))],
    "num_images": len(h),
    "ids": [first_id, first_id + len(h)],
    "folder": "/x",
  }


def test_an_add_grows_a_budget_index_in_place_until_another_index_is_chosen(
  data, tmp_path, monkeypatch
):
  bank = data[0][:2700, :16] / np.linalg.norm(data[0][:2700, :16], axis=1, keepdims=True)
  workdir = str(tmp_path)
  ann = _ann(max_memory="100KB")  # 2,000 x 16 x 4 = 128 KB of vectors: SQ8 codes.
  part = _part(workdir, 0, bank[:2000], 0)
  meta = {
    "format_version": index_lib.FORMAT_VERSION,
    "run_id": "r",
    "config": {"folder": "/x"},
    "eval_crop": {"size": 32, "fraction": 1.0, "resize": "bilinear"},
    "num_images": 2000,
    "dim": 16,
    "class_names": None,
    "unreadable": 0,
    "parts": [part],
    "ann": index_lib._write_ann(
      workdir,
      ml_collections.ConfigDict({"ann": ann.to_dict()}),
      index_lib.Parts(index_lib.part_arrays(workdir, part, "x")),
      generation=0,
      run_id="r",
    ),
  }
  assert meta["ann"]["factory"] == "IVF32,SQ8"  # 2,000 / 39 rows a list.
  index_lib._commit(workdir, meta, None)
  builds = []
  build = ann_lib.build
  monkeypatch.setattr(ann_lib, "build", lambda *a, **kw: builds.append(1) or build(*a, **kw))
  for number, (begin, stop, factory, built) in enumerate(
    ((2000, 2100, "IVF32,SQ8", 0), (2100, 2700, "IVF64,SQ8", 1)), start=1
  ):
    index = index_lib.load_index(workdir)
    index_lib.append(workdir, index, ann, _part(workdir, number, bank[begin:stop], begin), None, 0)
    grown = index_lib.load_index(workdir).ann
    assert len(builds) == built  # The first add grows the index; the second builds another.
    assert (grown["factory"], grown["rows"], grown["file"]) == (
      factory,
      stop,
      f"ann.{number}.faiss",
    )
    assert grown["memory"]["estimate"] <= grown["memory"]["budget"] == 100_000
    assert grown["bytes"] <= 100_000 and grown["score"]["recall"] >= 0.9
    loaded = ann_lib.load(workdir, grown, where="x")
    rerank = ann_lib.reranker(grown, bank[:stop])
    _, rows = ann_lib.search(loaded, bank[begin:stop], 1, rerank)
    np.testing.assert_array_equal(rows[:, 0], np.arange(begin, stop))  # Each finds itself.

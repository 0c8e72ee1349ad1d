"""The embed job's shards: resumed after a kill, read as clip-retrieval does, checked when read."""

import glob
import json
import os
import shutil

import numpy as np
from PIL import Image
import pyarrow.parquet as pq
import pytest
from test_search import NUM
from test_search import embed_config
from test_search import neighbours_config
from test_search import pretrained  # noqa: F401

from contrastive_jax.core.errors import JobError
from contrastive_jax.jobs import embed
from contrastive_jax.jobs import neighbours
from contrastive_jax.search import index as index_lib
from contrastive_jax.search import shards as shards_lib

SHARD_ROWS = 6  # test[:20]: shards of 6, 6, 6 and 2 rows.


class Killed(Exception):
  """Stands for the end of a process killed while it writes its second shard."""


@pytest.fixture(scope="module")
def sharded(pretrained, tmp_path_factory):  # noqa: F811
  """An uninterrupted embed of test[:20] in shards of SHARD_ROWS."""
  workdir = str(tmp_path_factory.mktemp("sharded"))
  embed.run(embed_config(pretrained, shard_rows=SHARD_ROWS), workdir)
  return workdir


def _shard_files(workdir):
  return sorted(glob.glob(f"{workdir}/img_emb/*.npy") + glob.glob(f"{workdir}/metadata/*"))


def test_a_killed_embed_resumes_at_its_first_missing_shard_and_writes_the_same_bytes(
  pretrained,  # noqa: F811
  sharded,
  tmp_path,
  monkeypatch,
):
  write, written = shards_lib.write, []

  def dies_on_the_second_shard(workdir, number, h, rows, unreadable):
    if written:
      # Killed after the embeddings' file, before the metadata's: an incomplete shard.
      write(workdir, number, h, rows, unreadable)
      os.remove(f"{workdir}/{shards_lib.names(number)['metadata']}")
      raise Killed()
    written.append(number)
    write(workdir, number, h, rows, unreadable)

  monkeypatch.setattr(shards_lib, "write", dies_on_the_second_shard)
  workdir = str(tmp_path / "killed")
  with pytest.raises(Killed):
    embed.run(embed_config(pretrained, shard_rows=SHARD_ROWS), workdir)
  assert not index_lib.is_index(workdir) and shards_lib.is_complete(workdir, 0)
  assert not shards_lib.is_complete(workdir, 1)
  first = open(f"{workdir}/{shards_lib.names(0)['embeddings']}", "rb").read()

  def counts(workdir, number, h, rows, unreadable):
    written.append(number)
    write(workdir, number, h, rows, unreadable)

  written.clear()
  monkeypatch.setattr(shards_lib, "write", counts)
  embed.run(embed_config(pretrained, shard_rows=SHARD_ROWS), workdir)
  assert written == [1, 2, 3]  # Shard 0 was kept, the incomplete shard 1 written again.
  assert open(f"{workdir}/{shards_lib.names(0)['embeddings']}", "rb").read() == first
  names = [os.path.relpath(f, workdir) for f in _shard_files(workdir)]
  assert names == [os.path.relpath(f, sharded) for f in _shard_files(sharded)]
  for name in names:
    assert open(f"{workdir}/{name}", "rb").read() == open(f"{sharded}/{name}", "rb").read(), name
  resumed, whole = index_lib.load_index(workdir), index_lib.load_index(sharded)
  assert list(resumed.rows) == list(whole.rows) and resumed.meta["parts"] == whole.meta["parts"]


def test_an_unfinished_embed_of_other_images_is_refused_not_overwritten(
  pretrained,  # noqa: F811
  tmp_path,
  monkeypatch,
):
  def killed(*args):
    raise Killed()

  monkeypatch.setattr(shards_lib, "write", killed)
  workdir = str(tmp_path / "killed")
  with pytest.raises(Killed):
    embed.run(embed_config(pretrained, shard_rows=SHARD_ROWS), workdir)
  monkeypatch.undo()
  plan = open(f"{workdir}/{embed.PLAN}").read()
  for config, differ in [
    (embed_config(pretrained, shard_rows=5), "shard_rows"),
    (embed_config(pretrained, shard_rows=SHARD_ROWS, split="test[:12]"), "num_images, split"),
  ]:
    with pytest.raises(
      JobError,
      match=rf"--workdir=.*killed: holds the shards of an unfinished "
      rf"embed .*\({embed.PLAN} differs in {differ}\)",
    ):
      embed.run(config, workdir)
  assert open(f"{workdir}/{embed.PLAN}").read() == plan
  # Shards without the plan that says what they hold are not taken for this run's.
  stray = str(tmp_path / "stray")
  os.makedirs(f"{stray}/metadata")
  open(f"{stray}/{shards_lib.names(2)['metadata']}", "wb").write(b"PAR1")
  with pytest.raises(JobError, match=r"holds metadata/metadata_00002.parquet but no embed_plan"):
    embed.run(embed_config(pretrained, shard_rows=SHARD_ROWS), stray)


def test_shards_read_with_numpy_and_pyarrow_as_clip_retrieval_and_autofaiss_do(sharded):
  embeddings = sorted(glob.glob(f"{sharded}/img_emb/img_emb_*.npy"))
  metadata = sorted(glob.glob(f"{sharded}/metadata/metadata_*.parquet"))
  assert [os.path.basename(f) for f in embeddings] == [f"img_emb_{i:05d}.npy" for i in range(4)]
  assert [os.path.basename(f) for f in metadata] == [f"metadata_{i:05d}.parquet" for i in range(4)]
  h = np.concatenate([np.load(f) for f in embeddings])
  table = [pq.read_table(f).to_pydict() for f in metadata]
  assert [len(t["id"]) for t in table] == [6, 6, 6, 2]
  columns = {key: sum((t[key] for t in table), []) for key in ("id", "name", "label", "split")}
  saved = index_lib.load_index(sharded)
  assert h.dtype == np.float32 and h.shape == saved.embeddings.shape
  np.testing.assert_array_equal(h, saved.embeddings)
  np.testing.assert_allclose(np.linalg.norm(h, axis=1), 1.0, atol=1e-6)
  assert columns["id"] == list(range(NUM))
  assert columns["split"] == [f"test[:{NUM}]"] * NUM
  assert [{"name": n, "label": label} for n, label in zip(columns["name"], columns["label"])] == (
    list(saved.rows)
  )
  with open(f"{sharded}/{index_lib.META}") as f:
    meta = json.load(f)
  assert meta["format_version"] == 4 and meta["parts"][0]["ids"] == [0, NUM]
  assert [s["embeddings"] for s in meta["parts"][0]["shards"]] == [
    os.path.relpath(f, sharded) for f in embeddings
  ]


def test_an_index_reads_its_rows_metadata_from_the_shards_only_when_asked(sharded):
  saved = index_lib.load_index(sharded)
  assert saved.rows.held == [] and len(saved.rows) == NUM  # Loaded: row counts only.
  # The reference: each shard's parquet read whole with pyarrow, as another tool would.
  expected = []
  for path in sorted(glob.glob(f"{sharded}/metadata/*.parquet")):
    table = pq.read_table(path)
    expected += [
      {"name": n, "label": la}
      for n, la in zip(table["name"].to_pylist(), table["label"].to_pylist())
    ]
  assert saved.rows[13] == expected[13] and saved.rows.held == [2]  # Row 13: shard 2 of 6 rows.
  assert saved.rows[-1] == expected[-1] and saved.rows.held == [2, 3]
  assert saved.rows[0] == expected[0] and saved.rows.held == [3, 0]  # At most CACHED held.
  picked = [19, 0, 7, 7, 12]
  assert saved.rows.take(picked) == [expected[r] for r in picked]
  assert saved.rows[4:9] == expected[4:9] and list(saved.rows) == expected
  assert list(saved.rows.names()) == [row["name"] for row in expected]
  wanted = [expected[16]["name"], expected[2]["name"], "not a row"]
  assert saved.rows.find(wanted) == {expected[16]["name"]: 16, expected[2]["name"]: 2}
  with pytest.raises(IndexError):
    saved.rows.take([NUM])


@pytest.mark.parametrize("damage", ["missing", "truncated", "fewer rows"])
def test_a_shard_missing_truncated_or_of_another_row_count_is_one_line_naming_it(
  sharded, damage, tmp_path
):
  workdir = str(tmp_path / "index")
  shutil.copytree(sharded, workdir)
  path = f"{workdir}/{shards_lib.names(1)['embeddings']}"
  if damage == "missing":
    os.remove(path)
  elif damage == "truncated":
    whole = open(path, "rb").read()
    open(path, "wb").write(whole[: len(whole) // 2])
  else:
    np.save(path, np.load(path)[:5])
  match = {
    "missing": "img_emb/img_emb_00001.npy and metadata/metadata_00001.parquet must be the "
    "files of 6 rows embed.json lists; they are missing, truncated or damaged",
    "truncated": "img_emb/img_emb_00001.npy and metadata/metadata_00001.parquet must be the "
    "files of 6 rows embed.json lists; they are missing, truncated or damaged",
    "fewer rows": r"img_emb/img_emb_00001.npy holds \(5, \d+\) and "
    "metadata/metadata_00001.parquet 6 rows: must be 6 rows of dimension",
  }[damage]
  with pytest.raises(JobError, match=match) as error:
    index_lib.load_index(workdir)
  assert "\n" not in str(error.value)
  with pytest.raises(JobError, match=match):
    neighbours.run(neighbours_config(workdir, query_rows="0"), str(tmp_path / "out"))


def test_an_index_of_format_3_still_loads_and_searches(sharded, tmp_path):
  """The files an embed wrote before shards: embeddings.npy, index.jsonl and embed.json v3."""
  saved = index_lib.load_index(sharded)
  workdir = tmp_path / "old"
  workdir.mkdir()
  np.save(workdir / "embeddings.npy", np.asarray(saved.embeddings))
  (workdir / "index.jsonl").write_text("".join(json.dumps(r) + "\n" for r in saved.rows))
  old_part = {
    "embeddings": "embeddings.npy",
    "rows": "index.jsonl",
    "num_images": NUM,
    "folder": None,
  }
  meta = dict(saved.meta, format_version=3, parts=[old_part], ann=None)  # Exact search.
  (workdir / index_lib.META).write_text(json.dumps(meta))
  old = index_lib.load_index(str(workdir))
  assert (
    list(old.rows) == list(saved.rows) and old.meta["format_version"] == index_lib.FORMAT_VERSION
  )
  np.testing.assert_array_equal(old.embeddings, saved.embeddings)
  assert old.meta["parts"][0]["shards"] == [
    {"embeddings": "embeddings.npy", "metadata": "index.jsonl", "num_images": NUM}
  ]
  assert index_lib.next_shard(old.meta) == 0 and index_lib.next_id(old.meta) == NUM
  results = neighbours.run(neighbours_config(str(workdir), query_rows="3"), str(tmp_path / "out"))
  assert results["queries"][0]["neighbours"][0]["row"] == 3


def test_a_folders_undecodable_file_leaves_a_gap_in_its_shards_ids_and_is_listed(
  pretrained,  # noqa: F811
  tmp_path,
):
  images = [np.full((32, 32, 3), 60 * i, np.uint8) for i in range(3)]
  folder = tmp_path / "photos"
  (folder / "sub").mkdir(parents=True)
  for image, rel in zip(images, ["b.png", "sub/a.png", "a.png"]):
    Image.fromarray(image).save(folder / rel)
  (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")
  workdir = str(tmp_path / "index")
  # Sorted paths a.png, b.png | broken.jpg, sub/a.png: shards of 2 positions.
  embed.run(embed_config(pretrained, dataset=None, folder=str(folder), shard_rows=2), workdir)
  tables = [pq.read_table(f"{workdir}/{shards_lib.names(i)['metadata']}") for i in range(2)]
  assert [t["id"].to_pylist() for t in tables] == [[0, 1], [3]]
  assert tables[1]["name"].to_pylist() == [str(folder / "sub/a.png")]
  assert tables[1]["label"].to_pylist() == [None] and tables[1]["split"].to_pylist() == ["all"]
  broken = f"{folder / 'broken.jpg'}\t"
  shard_list = open(f"{workdir}/{shards_lib.names(1)['unreadable']}").read().splitlines()
  assert len(shard_list) == 1 and shard_list[0].startswith(broken)
  assert not os.path.exists(f"{workdir}/{shards_lib.names(0)['unreadable']}")
  assert open(f"{workdir}/{index_lib.UNREADABLE}").read().splitlines() == shard_list
  saved = index_lib.load_index(workdir)
  assert [r["name"] for r in saved.rows] == [
    str(folder / f) for f in ("a.png", "b.png", "sub/a.png")
  ]
  assert saved.meta["parts"][0]["ids"] == [0, 4] and saved.meta["unreadable"] == 1
  assert not os.path.exists(f"{workdir}/{embed.PLAN}")  # Deleted once embed.json lists the part.

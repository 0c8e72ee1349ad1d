"""Embeddings and search by image: the embed and neighbours jobs, the chunked top-k."""

import json
import os
import re
import socket
import subprocess
import sys

from helpers import TFDS_DIR
from helpers import load_config
from helpers import tiny_config
import jax
import numpy as np
from PIL import Image
import pytest
import tensorflow_datasets as tfds

from contrastive_jax import main
from contrastive_jax import models
from contrastive_jax.core import checkpointing
from contrastive_jax.core import files
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core import pictures
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.jobs import embed
from contrastive_jax.jobs import neighbours
from contrastive_jax.methods import common
from contrastive_jax.search import exact
from contrastive_jax.search import index as index_lib
from contrastive_jax.search import shards as shards_lib
from contrastive_jax.training import restore

NUM = 20  # test[:20]: two global batches of 16, the second padded.


def _reference_top_k(queries, bank, k):
  """Brute force: every score, sorted by (score descending, row ascending)."""
  sims = queries.astype(np.float64) @ bank.T.astype(np.float64)
  order = np.lexsort((np.broadcast_to(np.arange(len(bank)), sims.shape), -sims), axis=-1)[:, :k]
  return np.take_along_axis(sims, order, axis=1), order


@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("group", [4, 256])
@pytest.mark.parametrize("chunk_size", [3, 16, 40])
def test_chunked_top_k_equals_brute_force_with_ties_across_chunks(
  chunk_size, group, resident, monkeypatch
):
  """Resident (one call) and streamed banks, the two-step top-k (GROUP 4) and lax.top_k's."""
  monkeypatch.setattr(exact, "GROUP", group)
  if not resident:
    monkeypatch.setattr(exact, "RESIDENT_BYTES", 0)
  rng = np.random.default_rng(0)
  # Small integer vectors: exact dot products and many equal scores, with
  # repeated bank rows falling in different chunks.
  bank = rng.integers(-2, 3, (23, 4)).astype(np.float32)
  bank[[5, 11, 17, 22]] = bank[2]
  queries = rng.integers(-2, 3, (5, 4)).astype(np.float32)
  for k in (4, 23):
    scores, rows = exact.top_k_cosine(queries, bank, k, chunk_size=chunk_size, query_batch=2)
    want_scores, want_rows = _reference_top_k(queries, bank, k)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(scores, want_scores)
  # Unit rows in float32: cosine similarities, no ties.
  bank = rng.normal(size=(50, 8)).astype(np.float32)
  bank /= np.linalg.norm(bank, axis=1, keepdims=True)
  scores, rows = exact.top_k_cosine(bank[:3], bank, 5, chunk_size=chunk_size)
  want_scores, want_rows = _reference_top_k(bank[:3], bank, 5)
  np.testing.assert_array_equal(rows, want_rows)
  np.testing.assert_allclose(scores, want_scores, atol=1e-6)
  assert list(rows[:, 0]) == [0, 1, 2]


@pytest.mark.parametrize("resident", [True, False])
def test_top_k_with_many_ties_k_beyond_a_chunk_and_a_ragged_last_chunk(resident, monkeypatch):
  """Every score tied in groups: rows must come in row order; k larger than a chunk."""
  monkeypatch.setattr(exact, "GROUP", 8)
  if not resident:
    monkeypatch.setattr(exact, "RESIDENT_BYTES", 0)
  rng = np.random.default_rng(1)
  bank = rng.integers(-1, 2, (203, 3)).astype(np.float32)  # 203 = 3 x 64 + 11.
  queries = rng.integers(-1, 2, (7, 3)).astype(np.float32)
  for k in (5, 70, 203):
    scores, rows = exact.top_k_cosine(queries, bank, k, chunk_size=64, query_batch=3)
    want_scores, want_rows = _reference_top_k(queries, bank, k)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(scores, want_scores)
    assert scores.dtype == np.float32 and rows.dtype == np.int32
  with pytest.raises(ValueError, match="k=204: must be in"):
    exact.top_k_cosine(queries, bank, 204, chunk_size=64)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A pretraining workdir of the tiny SimCLR config whose checkpoint holds a random encoder.

  Only what downstream jobs read (the encoder's params and BN statistics, in
  the TrainState's layout, and the config): drawn with numpy from the
  encoder's shapes, BN scales and statistics included, which spares the
  compilation of the whole initial state (about 20 s here).
  """
  workdir = str(tmp_path_factory.mktemp("pretrain"))
  config = tiny_config()
  encoder = models.build_encoder(config.model)
  shapes = jax.eval_shape(
    lambda: encoder.init(jax.random.PRNGKey(0), np.zeros((1, 32, 32, 3)), train=False)
  )
  rng = np.random.default_rng(0)
  variables = jax.tree.map(
    lambda s: (
      0.5 + rng.random(s.shape) * 0.1 if len(s.shape) == 1 else rng.normal(size=s.shape) * 0.2
    ).astype(np.float32),
    shapes,
  )
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"))
  ckpt.save(0, {name: {"encoder": variables[name]} for name in ("params", "batch_stats")}, config)
  ckpt.close()
  return workdir


def embed_config(pretrained, **overrides):
  config = load_config("embed")
  config.pretrain_workdir = pretrained
  config.dataset, config.data_dir, config.split = "cifar10", TFDS_DIR, f"test[:{NUM}]"
  config.batch_size = 16
  config.data_threads = 1
  config.update(overrides)
  return config


def neighbours_config(index_workdir, **overrides):
  config = load_config("neighbours")
  config.index_workdir = index_workdir
  config.k = 4
  config.chunk_size = 8
  config.cell = 32
  config.update(overrides)
  return config


@pytest.fixture(scope="module")
def index(pretrained, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("index"))
  main.run_job(embed_config(pretrained), workdir)  # Through the entry point's dispatch.
  return workdir


def _cifar_test():
  ds = tfds.builder("cifar10", data_dir=TFDS_DIR).as_dataset(
    split=f"test[:{NUM}]", shuffle_files=False
  )
  examples = list(tfds.as_numpy(ds))
  return np.stack([e["image"] for e in examples]), [int(e["label"]) for e in examples]


def test_embeddings_are_unit_h_of_every_image_in_split_order(pretrained, index):
  saved = index_lib.load_index(index)
  assert saved.embeddings.dtype == np.float32 and saved.embeddings.shape[0] == NUM
  np.testing.assert_allclose(np.linalg.norm(saved.embeddings, axis=1), 1.0, atol=1e-6)
  images, labels = _cifar_test()
  encoder, variables, _, step, _ = restore.restore_encoder(
    embed_config(pretrained), mesh_lib.make_mesh()
  )
  assert step == 0 and saved.config.pretrain_step == 0
  encode = jax.jit(lambda v, x: models.encode(encoder, v, x))  # One program, not one per op.
  want = common.l2_normalize(encode(jax.device_get(variables), images))
  np.testing.assert_allclose(saved.embeddings, want, atol=1e-5)
  assert [r["label"] for r in saved.rows] == labels
  # cifar10's own 'id' feature names its examples (sources.ID_FEATURES).
  ids = tfds.builder("cifar10", data_dir=TFDS_DIR).as_dataset(split=f"test[:{NUM}]")
  assert [r["name"] for r in saved.rows] == [x["id"].decode() for x in tfds.as_numpy(ids)]
  # An index is never overwritten.
  with pytest.raises(JobError, match="already holds embeddings"):
    embed.run(embed_config(pretrained), index)


def test_an_embed_cut_short_before_its_embed_json_is_done_again(pretrained, index, tmp_path):
  (tmp_path / "embeddings.npy").write_bytes(b"cut short")  # No embed.json: not an index.
  embed.run(embed_config(pretrained), str(tmp_path))
  np.testing.assert_array_equal(
    index_lib.load_index(str(tmp_path)).embeddings, index_lib.load_index(index).embeddings
  )


def test_neighbours_of_rows_names_and_files_find_themselves(index, tmp_path):
  images, labels = _cifar_test()
  query_file = str(tmp_path / "query.png")
  Image.fromarray(images[7]).save(query_file)
  name_5 = index_lib.load_index(index).rows[5]["name"]
  workdir = tmp_path / "out"
  results = neighbours.run(
    neighbours_config(index, query_rows="3", queries=f"{query_file},{name_5}"), str(workdir)
  )
  with open(workdir / neighbours.RESULTS) as f:
    assert json.load(f) == results
  assert [q["row"] for q in results["queries"]] == [3, None, 5]
  for query, row in zip(results["queries"], [3, 7, 5]):
    found = query["neighbours"]
    assert len(found) == 4 and found[0]["row"] == row and found[0]["label"] == labels[row]
    assert found[0]["score"] == pytest.approx(1.0, abs=1e-5)
    assert [n["score"] for n in found] == sorted((n["score"] for n in found), reverse=True)
  picture = np.asarray(Image.open(workdir / neighbours.PICTURE))
  # Each row's captions ('query', then '<score> <class>' in full) are wrapped to the 32 px
  # cells: a row's caption band has its longest caption's lines, two at least since a score
  # and a class do not fit on one line ('0.999 cat': 2 lines, '0.999 automobile': 3).
  pad, line = pictures._PAD, pictures.LINE_HEIGHT
  names = index_lib.load_index(index).class_names
  heights = [
    line
    * max(
      len(pictures.caption_lines(f"{n['score']:.3f} {names[n['label']]}", 32))
      for n in query["neighbours"]
    )
    for query in results["queries"]
  ]
  assert min(heights) >= 2 * line
  assert picture.shape == (sum(32 + h + pad for h in heights) + pad, 5 * (32 + pad) + pad, 3)
  # Row 2 of the grid: the query file, then itself (CIFAR is 32 px: shown as is).
  top = pad + (32 + heights[0] + pad) + (32 + heights[1] + pad)
  for column in (0, 1):
    left = pad + column * (32 + pad)
    np.testing.assert_array_equal(picture[top : top + 32, left : left + 32], images[5])
  assert any(name.startswith("events.out.tfevents") for name in os.listdir(workdir))


def test_a_file_whose_name_has_a_comma_is_a_query_of_the_queries_file(index, tmp_path):
  images, _ = _cifar_test()
  comma_file = tmp_path / "photo 7, copy.png"
  Image.fromarray(images[7]).save(comma_file)
  names = [row["name"] for row in index_lib.load_index(index).rows]
  listed = tmp_path / "queries.txt"
  # Lines as they are (the comma and spaces kept), blank lines skipped, CRLF endings too.
  listed.write_text(f"{comma_file}\r\n\n{names[5]}\n", newline="")
  results = neighbours.run(
    neighbours_config(index, queries=names[2], queries_file=str(listed)), str(tmp_path / "out")
  )
  assert [q["query"] for q in results["queries"]] == [names[2], str(comma_file), names[5]]
  assert [q["neighbours"][0]["row"] for q in results["queries"]] == [2, 7, 5]
  assert results["queries"][1]["neighbours"][0]["score"] == pytest.approx(1.0, abs=1e-5)
  # The same name in config.queries is split at its comma: one line says where it goes.
  with pytest.raises(
    ConfigError,
    match=(
      f"config.queries='{re.escape(str(tmp_path))}/photo 7': must be an image file or the name "
      "of a row .*"
      r"\(a query whose name has a comma goes in config.queries_file, one per line\)$"
    ),
  ):
    neighbours.run(neighbours_config(index, queries=str(comma_file)), str(tmp_path / "out2"))
  listed.write_text(f"{names[5]}\nmissing.jpg\n")
  for config, match in [
    (
      neighbours_config(index, queries_file=str(listed)),
      f"config.queries_file='{re.escape(str(listed))}': must be a file of queries, one per "
      "line; line 2 "
      "\\('missing.jpg'\\) must be an image file or the name of a row",
    ),
    (
      neighbours_config(index, queries_file=str(tmp_path / "nowhere.txt")),
      "config.queries_file=.*nowhere.txt': must be a UTF-8 text file of queries, one per line",
    ),
  ]:
    with pytest.raises(ConfigError, match=match):
      neighbours.run(config, str(tmp_path / "out2"))
  assert not os.path.exists(tmp_path / "out2" / neighbours.RESULTS)


def test_folder_of_files_embeds_like_the_dataset_and_lists_what_it_cannot_read(
  pretrained, index, tmp_path
):
  images, _ = _cifar_test()
  folder = tmp_path / "photos"
  (folder / "sub").mkdir(parents=True)
  for i, rel in [(0, "b.png"), (1, "sub/a.png"), (2, "a.jpg.png")]:
    Image.fromarray(images[i]).save(folder / rel)
  (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")
  (folder / ".hidden.png").write_bytes(b"")
  workdir = tmp_path / "folder_index"
  embed.run(embed_config(pretrained, dataset=None, folder=str(folder)), str(workdir))
  saved = index_lib.load_index(str(workdir))
  names = [str(folder / rel) for rel in ("a.jpg.png", "b.png", "sub/a.png")]
  assert [r["name"] for r in saved.rows] == names and "label" not in saved.rows[0]
  # Lossless files of the same pixels: the same embeddings as the dataset's.
  np.testing.assert_allclose(
    saved.embeddings, index_lib.load_index(index).embeddings[[2, 0, 1]], atol=1e-5
  )
  unreadable = (workdir / index_lib.UNREADABLE).read_text().splitlines()
  assert len(unreadable) == 1 and unreadable[0].startswith(f"{folder / 'broken.jpg'}\t")
  results = neighbours.run(
    neighbours_config(str(workdir), k=3, queries=names[2]), str(tmp_path / "out")
  )
  assert [n["name"] for n in results["queries"][0]["neighbours"]][0] == names[2]


def test_class_folders_label_a_folder_index_and_files_beside_them_are_listed(pretrained, tmp_path):
  images, labels = _cifar_test()
  folder = tmp_path / "photos"
  for i, rel in [(0, "cat/x.png"), (1, "ship/y.png"), (2, "ship/z.png")]:
    (folder / rel).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(images[i]).save(folder / rel)
  (folder / "LICENSE").write_text("CC BY 4.0")
  workdir = tmp_path / "labelled_index"
  embed.run(embed_config(pretrained, dataset=None, folder=str(folder)), str(workdir))
  saved = index_lib.load_index(str(workdir))
  assert saved.class_names == ["cat", "ship"]
  assert list(saved.rows) == [
    {"name": str(folder / "cat/x.png"), "label": 0},
    {"name": str(folder / "ship/y.png"), "label": 1},
    {"name": str(folder / "ship/z.png"), "label": 1},
  ]
  assert saved.config.split is None
  unreadable = (workdir / index_lib.UNREADABLE).read_text().splitlines()
  assert unreadable == [
    f"{folder / 'LICENSE'}\tnot in a class folder (the folder has class folders)"
  ]
  results = neighbours.run(
    neighbours_config(str(workdir), k=2, query_rows="0"), str(tmp_path / "out")
  )
  assert [n["label"] for n in results["queries"][0]["neighbours"]][0] == 0


def test_bad_input_is_refused_before_any_compute(pretrained, index, tmp_path):
  broken = tmp_path / "broken.jpg"
  broken.write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")
  out = str(tmp_path / "out")
  cases = [
    (
      neighbours_config(index, queries=str(broken)),
      rf"config.queries='{broken}': must be an image file that can be read: ",
    ),
    (
      neighbours_config(index, queries="missing.jpg"),
      "config.queries='missing.jpg': must be an image file or the name of a row",
    ),
    (neighbours_config(index), "config.queries='': must be at least one query"),
    (neighbours_config(index, query_rows="3,20"), r"config.query_rows='3,20': must be .*\[0, 20\)"),
    (neighbours_config(index, query_rows="1", k=21), "config.k=21: must be at most the size"),
    (neighbours_config(str(tmp_path), query_rows="1"), "config.index_workdir=.*finished embed job"),
  ]
  for config, match in cases:
    with pytest.raises(ConfigError, match=match):
      neighbours.run(config, out)
  for config, match in [
    (embed_config(pretrained, folder=str(tmp_path)), "config.folder=.*only when"),
    (
      embed_config(pretrained, dataset=None, folder=str(tmp_path / "nowhere")),
      "config.folder=.*an existing folder",
    ),
    (
      embed_config(pretrained, dataset=None, folder=str(tmp_path / "empty")),
      "config.folder=.*holds no file",
    ),
    (embed_config(str(tmp_path / "nowhere")), "config.pretrain_workdir=.*checkpoints"),
    (embed_config(pretrained, split="tset"), "config.split='tset': must be a non-empty split"),
  ]:
    (tmp_path / "empty").mkdir(exist_ok=True)
    with pytest.raises(ConfigError, match=match):
      embed.run(config, out)
  assert not os.path.exists(out)


def test_a_workdir_another_job_holds_is_refused(pretrained, index, tmp_path):
  workdir = str(tmp_path / "busy")
  with files.workdir_lock(workdir):
    for job, config in [
      (embed, embed_config(pretrained)),
      (neighbours, neighbours_config(index, query_rows="1")),
    ]:
      with pytest.raises(JobError, match=f"--workdir={workdir}: another job is running in it"):
        job.run(config, workdir)
  assert os.listdir(workdir) == [files.LOCK]


def test_two_hosts_write_their_own_shards_and_no_process_gathers_every_row(pretrained, tmp_path):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  worker = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
  )
  two = tmp_path / "two"
  procs = [
    subprocess.Popen(
      [sys.executable, worker, str(i), str(port), str(two), TFDS_DIR, "embed", pretrained],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=env,
    )
    for i in range(2)
  ]
  for i, p in enumerate(procs):  # Shards of 5 rows: process i writes shards i and i + 2.
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out[-3000:]
    result = re.search(
      r"RESULT process=(\d) rows=(\d+) written=\[(.*)\] held=(\d+) collected=(\d+)", out
    )
    assert result, out[-3000:]
    process, rows, written, held, collected = result.groups()
    assert (int(process), int(rows), written, int(held)) == (i, NUM, f"{i}, {i + 2}", 5)
    # What the collectives carried: flags and counts, never the rows (NUM x D values).
    assert 0 < int(collected) < NUM, out[-3000:]
  one = str(tmp_path / "one")
  embed.run(embed_config(pretrained, shard_rows=5), one)
  saved, single = index_lib.load_index(str(two)), index_lib.load_index(one)
  assert list(saved.rows) == list(single.rows) and saved.meta["parts"] == single.meta["parts"]
  np.testing.assert_allclose(saved.embeddings, single.embeddings, atol=1e-5)
  for number in range(4):
    name = shards_lib.names(number)["metadata"]
    assert (two / name).read_bytes() == open(os.path.join(one, name), "rb").read()

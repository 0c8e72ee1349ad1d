"""The embed job on Apache Beam: the JAX engine's shards, from a RunInference handler."""

import glob
import json
import os
import shutil

import numpy as np
from PIL import Image
import pyarrow.parquet as pq
import pytest
from test_search import embed_config
from test_search import pretrained  # noqa: F401

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.jobs import embed
from contrastive_jax.search import index as index_lib
from contrastive_jax.search import shards as shards_lib

beam_embed = pytest.importorskip("contrastive_jax.search.beam_embed")  # Needs the [beam] extra.

SHARD_ROWS = 6  # test[:20]: shards of 6, 6, 6 and 2 rows.


def _names(workdir):
  found = glob.glob(f"{workdir}/img_emb/*") + glob.glob(f"{workdir}/metadata/*")
  return sorted(os.path.relpath(f, workdir) for f in found)


class Killed(Exception):
  """Stands for the end of a JAX embed killed while it writes its second shard."""


@pytest.fixture(scope="module")
def jax_dir(pretrained, tmp_path_factory):  # noqa: F811
  """The JAX engine's embed of test[:20] in shards of SHARD_ROWS."""
  workdir = str(tmp_path_factory.mktemp("jax"))
  embed.run(embed_config(pretrained, shard_rows=SHARD_ROWS), workdir)
  return workdir


def _assert_same_shards(workdir, reference, numbers):
  for number in numbers:
    files = shards_lib.names(number)
    h, expected = (np.load(f"{d}/{files['embeddings']}") for d in (workdir, reference))
    assert h.shape == expected.shape == ((SHARD_ROWS if number < 3 else 2), expected.shape[1])
    np.testing.assert_allclose(h, expected, atol=1e-5)
    table = pq.read_table(f"{workdir}/{files['metadata']}")
    assert table.equals(pq.read_table(f"{reference}/{files['metadata']}"))
    assert table["id"].to_pylist() == list(range(6 * number, 6 * number + len(h)))


def test_the_beam_embed_on_two_workers_writes_the_jax_jobs_shards(pretrained, jax_dir, tmp_path):  # noqa: F811
  beam_dir = str(tmp_path / "beam")
  beam = embed_config(
    pretrained, shard_rows=SHARD_ROWS, engine="beam", runner="DirectRunner", num_workers=2
  )
  embed.run(beam, beam_dir)
  assert (
    _names(beam_dir)
    == _names(jax_dir)
    == [
      *(f"img_emb/img_emb_{i:05d}.npy" for i in range(4)),
      *(f"metadata/metadata_{i:05d}.parquet" for i in range(4)),
    ]
  )
  _assert_same_shards(beam_dir, jax_dir, range(4))
  meta_beam = json.load(open(f"{beam_dir}/{index_lib.META}"))
  meta_jax = json.load(open(f"{jax_dir}/{index_lib.META}"))
  assert meta_beam["parts"] == meta_jax["parts"]
  for key in ("num_images", "dim", "class_names", "eval_crop", "format_version"):
    assert meta_beam[key] == meta_jax[key], key
  assert meta_beam["config"]["engine"] == "beam"
  assert not os.path.exists(f"{beam_dir}/{embed.PLAN}")
  loaded = index_lib.load_index(beam_dir)
  np.testing.assert_allclose(
    np.asarray(loaded.embeddings), np.asarray(index_lib.load_index(jax_dir).embeddings), atol=1e-5
  )


def test_the_beam_embed_resumes_a_killed_jax_embed_at_its_first_missing_shard(
  pretrained,  # noqa: F811
  jax_dir,
  tmp_path,
  monkeypatch,
):
  write, written = shards_lib.write, []

  def dies_on_the_second_shard(workdir, number, h, rows, unreadable):
    if written:
      raise Killed()
    written.append(number)
    write(workdir, number, h, rows, unreadable)

  workdir = str(tmp_path / "resumed")
  with monkeypatch.context() as patch:
    patch.setattr(shards_lib, "write", dies_on_the_second_shard)
    with pytest.raises(Killed):
      embed.run(embed_config(pretrained, shard_rows=SHARD_ROWS), workdir)
  first = os.stat(f"{workdir}/{shards_lib.names(0)['embeddings']}").st_mtime_ns
  # One worker: DirectRunner runs it in this process, where shards_lib.write is watched.
  written.clear()
  monkeypatch.setattr(
    shards_lib,
    "write",
    lambda workdir, number, *rest: written.append(number) or write(workdir, number, *rest),
  )
  embed.run(embed_config(pretrained, shard_rows=SHARD_ROWS, engine="beam", num_workers=1), workdir)
  assert sorted(written) == [1, 2, 3]  # Shard 0, complete, was kept.
  assert os.stat(f"{workdir}/{shards_lib.names(0)['embeddings']}").st_mtime_ns == first
  assert _names(workdir) == _names(jax_dir)
  _assert_same_shards(workdir, jax_dir, range(4))


def test_the_beam_engine_adds_a_folders_new_files_as_the_jax_engine_does(pretrained, tmp_path):  # noqa: F811
  folder = tmp_path / "photos"
  (folder / "a").mkdir(parents=True)
  (folder / "b").mkdir()
  pixels = np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3), np.uint8)

  def save(i, cls):
    Image.fromarray(pixels[i]).save(folder / cls / f"{i}.png")

  for i, cls in enumerate("aabb"):
    save(i, cls)
  first = embed_config(pretrained, dataset=None, folder=str(folder), shard_rows=3)
  jax_dir, beam_dir = str(tmp_path / "jax"), str(tmp_path / "beam")
  embed.run(first, jax_dir)
  shutil.copytree(jax_dir, beam_dir)
  save(4, "a")  # New files of a class the index has and of a new one.
  (folder / "c").mkdir()
  save(5, "c")
  add = dict(dataset=None, folder=str(folder), add=True)
  embed.run(embed_config(None, **add), jax_dir)
  embed.run(embed_config(None, engine="beam", num_workers=1, **add), beam_dir)
  assert _names(beam_dir) == _names(jax_dir)
  assert "metadata/metadata_00002.parquet" in _names(jax_dir)  # The added part's shard.
  files = shards_lib.names(2)
  np.testing.assert_allclose(
    np.load(f"{beam_dir}/{files['embeddings']}"),
    np.load(f"{jax_dir}/{files['embeddings']}"),
    atol=1e-5,
  )
  table = pq.read_table(f"{beam_dir}/{files['metadata']}")
  assert table.equals(pq.read_table(f"{jax_dir}/{files['metadata']}"))
  assert table["name"].to_pylist() == [str(folder / "a/4.png"), str(folder / "c/5.png")]
  assert table["id"].to_pylist() == [4, 5]
  jax_index, beam_index = index_lib.load_index(jax_dir), index_lib.load_index(beam_dir)
  assert jax_index.meta["parts"] == beam_index.meta["parts"] and len(beam_index.rows) == 6
  assert list(beam_index.rows) == list(jax_index.rows)
  assert beam_index.class_names == jax_index.class_names == ["a", "b", "c"]


@pytest.mark.parametrize(
  "overrides, message",
  [
    (dict(engine="spark"), "config.engine='spark'"),
    (dict(engine="beam", num_workers=-1), "config.num_workers=-1"),
  ],
)
def test_a_bad_engine_is_one_config_error(pretrained, tmp_path, overrides, message):  # noqa: F811
  with pytest.raises(ConfigError, match=message) as raised:
    embed.run(embed_config(pretrained, **overrides), str(tmp_path / "index"))
  assert "\n" not in str(raised.value)


def test_an_unknown_or_uninstalled_runner_is_one_line_naming_it(pretrained, tmp_path):  # noqa: F811
  for runner, says in (("NoSuchRunner", "config.runner='NoSuchRunner'"),):
    with pytest.raises(JobError, match=says) as raised:
      embed.run(embed_config(pretrained, engine="beam", runner=runner), str(tmp_path / "i"))
    assert "\n" not in str(raised.value)
  assert not os.path.exists(tmp_path / "i" / index_lib.META)


def _unreadable_checkpoint():
  raise ValueError("the checkpoint cannot be read\nits details")


def test_a_failed_pipeline_is_one_line_naming_the_runner_and_the_workers_error(tmp_path):
  embedding = beam_embed.Embedding(_unreadable_checkpoint, str(tmp_path), 2, 1, 0, {})
  with pytest.raises(JobError) as raised:
    beam_embed.embed_shards(
      [shards_lib.Shard(0, 0, 2)], embedding, beam_embed.choose_runner("DirectRunner", 1, "")
    )
  assert str(raised.value).startswith(
    "config.engine='beam': the pipeline failed on FnApiRunner: ValueError: the checkpoint "
    "cannot be read (run with --runner=FnApiRunner"
  )
  assert "\n" not in str(raised.value) and not os.listdir(tmp_path)

"""The export job's 'vertex' format: the index's shards as Vertex AI Vector Search JSON lines."""

import json
import os

from helpers import load_config
import numpy as np
from PIL import Image
import pyarrow.parquet as pq
import pytest
from test_search import embed_config
from test_search import pretrained  # noqa: F401

from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.jobs import embed
from contrastive_jax.jobs import export
from contrastive_jax.search import shards as shards_lib

CIFAR10 = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _export(index_workdir, out):
  config = load_config("export")
  config.format, config.index_workdir = "vertex", index_workdir
  return export.run(config, out)


def _read_back(out):
  found = sorted(os.listdir(f"{out}/vertex"))
  return found, [[json.loads(line) for line in open(f"{out}/vertex/{name}")] for name in found]


def test_each_shard_becomes_one_json_lines_file_of_ids_embeddings_and_label_restricts(
  pretrained,  # noqa: F811
  tmp_path,
):
  index = str(tmp_path / "index")
  embed.run(embed_config(pretrained, shard_rows=6), index)  # Shards of 6, 6, 6 and 2 rows.
  out = str(tmp_path / "out")
  assert _export(index, out) == f"{out}/vertex"
  found, files = _read_back(out)
  assert found == [f"vertex_{i:05d}.json" for i in range(4)]  # No other file in the root.
  for number, records in enumerate(files):
    names = shards_lib.names(number)
    h = np.load(f"{index}/{names['embeddings']}")
    table = pq.read_table(f"{index}/{names['metadata']}")
    assert [r["id"] for r in records] == [str(i) for i in table["id"].to_pylist()]
    assert [r["id"] for r in records] == [str(i) for i in range(6 * number, 6 * number + len(h))]
    # float32 values written exactly: read back as float32, they are the shard's.
    np.testing.assert_array_equal(np.array([r["embedding"] for r in records], np.float32), h)
    assert [r["restricts"] for r in records] == [
      [{"namespace": "label", "allow": [CIFAR10[label]]}] for label in table["label"].to_pylist()
    ]
  meta = json.load(open(f"{out}/{export.META}"))
  assert meta["num_records"] == 20 and meta["files"] == [f"vertex/{f}" for f in found]
  with pytest.raises(JobError, match="already holds an export"):
    _export(index, out)


def test_an_unlabelled_folders_rows_have_no_restricts(pretrained, tmp_path):  # noqa: F811
  folder = tmp_path / "photos"
  folder.mkdir()
  for i in range(3):
    Image.fromarray(np.full((32, 32, 3), 70 * i, np.uint8)).save(folder / f"{i}.png")
  index = str(tmp_path / "index")
  embed.run(embed_config(pretrained, dataset=None, folder=str(folder), shard_rows=2), index)
  _, files = _read_back(_export(index, str(tmp_path / "out")).rsplit("/", 1)[0])
  assert [[r["id"] for r in records] for records in files] == [["0", "1"], ["2"]]
  assert all(set(r) == {"id", "embedding"} for records in files for r in records)


def test_vertex_without_an_index_is_one_line(tmp_path):
  config = load_config("export")
  config.format = "vertex"
  with pytest.raises(ConfigError, match="config.index_workdir=None"):
    export.run(config, str(tmp_path / "a"))
  with pytest.raises(JobError, match="holds no embed job's index"):
    _export(str(tmp_path), str(tmp_path / "b"))

"""The map job: a 2-D map (UMAP, t-SNE) of an embed job's index, its pictures, its table and
TensorBoard's projector files, checked through the projector plugin's own server."""

import csv
import importlib
import importlib.util
import io
import json
import os
import subprocess
import sys

from helpers import TFDS_DIR
from helpers import load_config
from helpers import subprocess_env
from helpers import tiny_config
import jax
import numpy as np
from PIL import Image
import pytest
from tensorboard.plugins.base_plugin import TBContext
from tensorboard.plugins.projector.projector_plugin import ProjectorPlugin
import tensorflow_datasets as tfds
from werkzeug.test import Client
from werkzeug.wrappers import Response

from contrastive_jax import main
from contrastive_jax import models
from contrastive_jax.core import checkpointing
from contrastive_jax.core import scatter
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.jobs import embedding_map
from contrastive_jax.search import index as index_lib

NUM = 256  # CIFAR-10 test images embedded by the tiny encoder.
SIZE = 256  # The plot's side in the tests' pictures.


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A pretraining workdir of the tiny SimCLR config whose checkpoint holds a random encoder
  drawn with numpy from the encoder's shapes (as tests/test_search.py makes one)."""
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


@pytest.fixture(scope="module")
def index(pretrained, tmp_path_factory):
  """An embed job's index of CIFAR-10's first NUM test images."""
  config = load_config("embed")
  config.pretrain_workdir = pretrained
  config.dataset, config.data_dir, config.split = "cifar10", TFDS_DIR, f"test[:{NUM}]"
  config.batch_size, config.data_threads = 64, 1
  workdir = str(tmp_path_factory.mktemp("index"))
  main.run_job(config, workdir)
  return workdir


def _cifar_test(count: int):
  ds = tfds.builder("cifar10", data_dir=TFDS_DIR).as_dataset(
    split=f"test[:{count}]", shuffle_files=False
  )
  return np.stack([e["image"] for e in tfds.as_numpy(ds)])


def hand_made_index(workdir, embeddings, labels=None, class_names=None):
  """An embed-format folder written by hand: embeddings as given (rows made unit), row i named
  after and showing CIFAR-10's test image i, labelled only if class_names is given (row i
  without a label where labels[i] is None)."""
  embeddings = np.asarray(embeddings, np.float32)
  embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
  os.makedirs(workdir, exist_ok=True)
  np.save(os.path.join(workdir, index_lib.EMBEDDINGS), embeddings)
  with open(os.path.join(workdir, index_lib.INDEX), "w") as f:
    for i in range(len(embeddings)):
      labelled = class_names and labels[i] is not None
      row = {"name": f"image {i}", **({"label": int(labels[i])} if labelled else {})}
      f.write(json.dumps(row) + "\n")
  config = load_config("embed")
  config.dataset, config.data_dir, config.split = "cifar10", TFDS_DIR, f"test[:{len(embeddings)}]"
  meta = {
    "config": config.to_dict(),
    "image_size": 32,
    "crop_fraction": 1.0,
    "crop_resize": "pil_bilinear",
    "num_images": len(embeddings),
    "dim": embeddings.shape[1],
    "class_names": class_names,
  }
  with open(os.path.join(workdir, index_lib.META), "w") as f:
    json.dump(meta, f)
  return str(workdir)


def map_config(index_workdir, **overrides):
  config = load_config("map")
  config.index_workdir = index_workdir
  config.size = SIZE
  config.update(overrides)
  return config


def _read_table(workdir):
  with open(os.path.join(workdir, embedding_map.TABLE), newline="") as f:
    lines = list(csv.reader(f))
  assert lines[0] == ["row", "name", "label", "cluster", "x", "y"]
  return lines[1:], np.asarray([[float(l[4]), float(l[5])] for l in lines[1:]], np.float32)


def _projector(workdir):
  """GET route -> (status, bytes) from TensorBoard's projector plugin serving workdir."""
  apps = ProjectorPlugin(TBContext(logdir=str(workdir))).get_plugin_apps()

  def get(route, **query):
    response = Client(apps[route], Response).get(route, query_string=query)
    return response.status_code, response.get_data()

  return get


def test_map_of_an_embed_index_draws_lists_and_projects_the_sampled_rows(index, tmp_path):
  out = tmp_path / "map"
  config = map_config(index, method="tsne", max_points=200, thumbnail=32)
  config.tsne.perplexity = 20.0
  meta = main.run_job(config, str(out))  # Through the entry point's dispatch.
  with open(out / embedding_map.META) as f:
    assert json.load(f) == meta
  assert (
    meta["method"],
    meta["sample_size"],
    meta["index_rows"],
    meta["coloured_by"],
    meta["pca_dims"],
    meta["seed"],
  ) == ("tsne", 200, NUM, "class", None, 0)  # D = 32 < 50.
  saved = index_lib.load_index(index)
  images = _cifar_test(NUM)

  # The table: 200 distinct rows of the index, ascending, each with its name and label.
  lines, xy = _read_table(out)
  rows = [int(l[0]) for l in lines]
  assert len(rows) == 200 and rows == sorted(set(rows)) and 0 <= rows[0] and rows[-1] < NUM
  assert [(l[1], int(l[2]), l[3]) for l in lines] == [
    (saved.rows[r]["name"], saved.rows[r]["label"], "") for r in rows
  ]
  assert np.all(np.isfinite(xy)) and np.ptp(xy, axis=0).min() > 0

  # map.png: every dot's centre shows the class colour of a point whose dot covers it.
  picture = np.asarray(Image.open(out / embedding_map.MAP))
  # CIFAR's 10 classes fit one legend column (20 lines of 12 px in 256 px less margins).
  assert picture.shape == (scatter.TITLE_HEIGHT + SIZE, SIZE + scatter.LEGEND_COLUMN, 3)
  colours = scatter.palette(len(saved.class_names))
  labels = np.asarray([saved.rows[r]["label"] for r in rows])
  pixels = scatter.to_pixels(xy, SIZE)
  for column, row in pixels:
    covering = labels[np.abs(pixels - [column, row]).max(axis=1) <= 2]
    shown = picture[scatter.TITLE_HEIGHT + row, column]
    assert any((colours[c] == shown).all() for c in covering), (column, row, shown)

  # thumbnails.png: the same size; each thumbnail is its CIFAR image (32 px: kept as is)
  # inside a one-pixel frame, in its square.
  view = np.asarray(Image.open(out / embedding_map.THUMBNAILS))
  assert view.shape == picture.shape
  places = scatter.thumbnail_places(xy, SIZE, 32)
  assert len(places) >= 10
  for point, (left, top) in places.items():
    top += scatter.TITLE_HEIGHT
    np.testing.assert_array_equal(
      view[top + 1 : top + 31, left + 1 : left + 31], images[rows[point]][1:31, 1:31]
    )

  # The projector, as TensorBoard serves it: the sampled rows' embeddings, names, classes
  # and thumbnails.
  get = _projector(out)
  assert get("/runs") == (200, b'["."]')
  status, info = get("/info", run=".")
  assert status == 200
  (embedding,) = json.loads(info)["embeddings"]
  assert embedding["tensorShape"] == [200, saved.embeddings.shape[1]]
  status, tensor = get("/tensor", run=".", name=embedding["tensorName"])
  assert status == 200
  np.testing.assert_allclose(
    np.frombuffer(tensor, np.float32).reshape(200, -1), saved.embeddings[rows], rtol=1e-7, atol=1e-8
  )
  status, metadata = get("/metadata", run=".", name=embedding["tensorName"])
  assert status == 200 and metadata.decode().splitlines() == ["name\tclass"] + [
    f"{saved.rows[r]['name']}\t{saved.class_names[saved.rows[r]['label']]}" for r in rows
  ]
  status, sprite = get("/sprite_image", run=".", name=embedding["tensorName"])
  sprite = np.asarray(Image.open(io.BytesIO(sprite)))
  assert status == 200 and embedding["sprite"]["singleImageDim"] == [32, 32]
  assert sprite.shape == (14 * 32, 15 * 32, 3)  # 200 thumbnails, 15 to a row.
  for i in (0, 14, 15, 199):
    np.testing.assert_array_equal(
      sprite[i // 15 * 32 : (i // 15 + 1) * 32, i % 15 * 32 : (i % 15 + 1) * 32], images[rows[i]]
    )
  assert any(name.startswith("events.out.tfevents") for name in os.listdir(out))


@pytest.mark.parametrize("method", ["tsne", "umap"])
def test_separated_clusters_stay_apart_in_2d_and_k_means_finds_them(method, monkeypatch, tmp_path):
  # A sprite of 300 thumbnails of 16 px, 18 to a row, is wider than 272 px: they shrink to 15.
  monkeypatch.setattr(embedding_map, "SPRITE_SIDE", 272)
  rng = np.random.default_rng(1)
  truth = np.arange(300) % 5
  centres = rng.normal(size=(5, 64))
  workdir = hand_made_index(tmp_path / "index", centres[truth] + 0.25 * rng.normal(size=(300, 64)))
  config = map_config(workdir, method=method, clusters=5, thumbnail=16)
  meta = embedding_map.run(config, str(tmp_path / "map"))
  assert (meta["coloured_by"], meta["clusters"], meta["sample_size"]) == ("k-means cluster", 5, 300)
  lines, xy = _read_table(tmp_path / "map")
  assert [int(l[0]) for l in lines] == list(range(300)) and {l[2] for l in lines} == {""}
  # Nearest centroid in 2-D, the centroids of the true clusters: (almost) every point is
  # nearest its own cluster's.
  centroids = np.stack([xy[truth == c].mean(axis=0) for c in range(5)])
  nearest = np.argmin(((xy[:, None] - centroids[None]) ** 2).sum(-1), axis=1)
  assert np.mean(nearest == truth) >= 0.95
  # k-means (the colours of an unlabelled index) finds the clusters: one per true cluster.
  found = np.asarray([int(l[3]) for l in lines])
  assert sorted(len(set(found[truth == c])) for c in range(5)) == [1] * 5
  assert len(set(found)) == 5
  status, info = _projector(tmp_path / "map")("/info", run=".")
  assert status == 200 and json.loads(info)["embeddings"][0]["sprite"]["singleImageDim"] == [15, 15]
  sprite = Image.open(tmp_path / "map" / embedding_map.PROJECTOR_SPRITE)
  assert sprite.size == (18 * 15, 17 * 15)
  # The same seed gives the same map (map.csv's 9 digits give the float32 values back).
  x = index_lib.load_index(workdir).embeddings
  with embedding_map.thread_limit(config):
    again, pca_dims = embedding_map.project(x, config)
  assert pca_dims == 50
  np.testing.assert_array_equal(again, xy)


def test_rows_without_a_label_in_a_labelled_index_are_one_more_group(tmp_path):
  labels = [0, 1, None] * 20
  rng = np.random.default_rng(0)
  workdir = hand_made_index(tmp_path / "index", rng.normal(size=(60, 8)), labels, ["cat", "dog"])
  config = map_config(workdir, method="tsne", thumbnail=16)
  config.tsne.perplexity = 10
  meta = embedding_map.run(config, str(tmp_path / "map"))
  assert meta["coloured_by"] == "class" and meta["sample_size"] == 60
  lines, _ = _read_table(tmp_path / "map")
  assert [l[2] for l in lines] == ["0", "1", ""] * 20
  with open(tmp_path / "map" / embedding_map.PROJECTOR_METADATA) as f:
    classes = [line.rstrip("\n").split("\t")[1] for line in f][1:]
  assert classes == ["cat", "dog", "(no label)"] * 20


def test_layout_and_sprite_against_hand_computed_values():
  # Both axes at one scale: a 2 x 1 box in a 100 px plot, less 8 px each side,
  # is 41.5 px per unit, centred vertically.
  np.testing.assert_array_equal(
    scatter.to_pixels(np.array([[0, 0], [2, 1], [1, 0.5]]), 100), [[8, 70], [91, 29], [50, 50]]
  )
  images = [np.full((2, 2, 3), 10 * i, np.uint8) for i in range(5)]
  sprite = scatter.sprite(images)  # 3 to a row, 2 rows, the sixth cell white.
  assert sprite.shape == (4, 6, 3)
  assert [sprite[r, c, 0] for r, c in [(0, 0), (0, 2), (0, 4), (2, 0), (2, 2), (2, 4)]] == [
    0,
    10,
    20,
    30,
    40,
    255,
  ]
  # One thumbnail per 10 px square, the point nearest the square's centre.
  # (At 83 px per unit from 8 px: points 2 and 3 at (13, 86) and (10, 89), both in the
  # square from (10, 80) whose centre is (15, 85).)
  places = scatter.thumbnail_places(np.array([[0, 0], [1, 1], [0.06, 0.06], [0.02, 0.02]]), 100, 10)
  assert places == {0: (0, 90), 1: (90, 0), 2: (10, 80)}


def test_scatter_draws_each_point_in_its_group_colour_at_its_place_and_nowhere_else():
  # Points at hand-picked places of a 100 px plot (to_pixels: 8 px margins, 83 px per unit):
  # (0, 0) -> (8, 91), (1, 1) -> (91, 8), (0.5, 0.5) -> (50, 50) (rounded 49.5 up), (1, 0) ->
  # (91, 91); groups 0, 1, 2, 0.
  xy = np.array([[0, 0], [1, 1], [0.5, 0.5], [1, 0]])
  groups = np.array([0, 1, 2, 0])
  picture = scatter.scatter(xy, groups, ["a", "b", "c"], size=100, title="t")
  assert picture.shape == (16 + 100, 100 + 176, 3)
  colours = scatter.palette(3)
  plot = picture[16:, :100]
  for (column, row), group in zip([(8, 91), (91, 8), (50, 50), (91, 91)], groups):
    # Each dot covers its centre and the pixels within 2 of it, in its group's colour.
    np.testing.assert_array_equal(
      plot[row - 1 : row + 2, column - 1 : column + 2], [[colours[group]] * 3] * 3
    )
  # No dot's colour anywhere else in the plot.
  inked = np.zeros((100, 100), bool)
  for colour in colours:
    inked |= (plot == colour).all(axis=-1)
  near = np.zeros((100, 100), bool)
  for column, row in [(8, 91), (91, 8), (50, 50), (91, 91)]:
    near[row - 3 : row + 4, column - 3 : column + 4] = True
  assert inked.any() and not (inked & ~near).any()


def _legend(count: int, size: int = 256, view: bool = True):
  """A scatter of 50 points in `count` groups of long names and, if `view`, their thumbnail view
  (None if not)."""
  rng = np.random.default_rng(0)
  xy, groups = rng.normal(size=(50, 2)), rng.integers(0, count, 50)
  names = [f"outerwear/winter_jackets_and_coats_{i:03d}" for i in range(count)]
  picture = scatter.scatter(xy, groups, names, size=size, title="t")
  if not view:
    return picture, None
  images = {i: np.zeros((16, 16, 3), np.uint8) for i in range(50)}
  return picture, scatter.thumbnails(xy, images, groups, names, size=size, cell=16, title="t")


def _swatches(picture, size: int, count: int):
  """{group: (row, column) of the top-left of its swatch} for the groups whose colour fills
  exactly one 9 x 9 swatch in the legend (right of the plot)."""
  # Each pixel's colour as one integer, so that one pass finds the pixels of every palette
  # colour (a comparison of the whole legend per colour takes seconds for 300 colours).
  code = lambda rgb: (
    (rgb[..., 0].astype(np.int64) << 16) | (rgb[..., 1].astype(np.int64) << 8) | rgb[..., 2]
  )
  legend = code(picture[:, size:])
  colours = code(scatter.palette(count))
  rows, columns = np.nonzero(np.isin(legend, colours))
  codes = legend[rows, columns]
  found = {}
  for i, colour in enumerate(colours):
    where = np.stack([rows[codes == colour], columns[codes == colour]], axis=1)
    if len(where) == 81 and (np.ptp(where, axis=0) == 8).all():
      found[i] = tuple(int(v) for v in where.min(axis=0))
  return found


def test_a_legend_of_100_long_names_shows_all_100_in_columns_and_each_name_in_its_column():
  # 256 px plot: (256 - 2 * 8) // 12 = 20 names a column, so 100 names take 5 columns.
  picture, view = _legend(100)
  assert scatter.legend_columns(256, 100) == (20, 5)
  assert picture.shape == view.shape == (16 + 256, 256 + 5 * 176, 3)
  assert picture.shape[:2] == scatter.layout(256, 100)
  assert len({tuple(c) for c in scatter.palette(100)}) == 100  # 100 distinct colours.
  # Name i's swatch: column i // 20, line i % 20, from the legend's top-left (8, 8) below
  # the title, 2 px into its 12 px line.
  swatches = _swatches(picture, 256, 100)
  assert swatches == {i: (16 + 8 + (i % 20) * 12 + 2, 8 + (i // 20) * 176) for i in range(100)}
  assert _swatches(view, 256, 100) == swatches
  legend = picture[16:, 256:]
  ink = (legend < 200).any(axis=-1)
  for column in range(5):
    # The 8 px before each column's swatches stay white: no name runs into the next column,
    # though every one is too long for its 154 px and is cut with an ellipsis.
    assert not ink[:, column * 176 : column * 176 + 8].any()
    # Each of the column's 20 names is drawn beside its swatch.
    names = ink[:, column * 176 + 22 : (column + 1) * 176]
    assert all(names[8 + k * 12 : 8 + (k + 1) * 12].any() for k in range(20))


def test_a_legend_beyond_256_names_shows_255_and_says_how_many_more():
  # 300 names: 256 places of 20 a column = 13 columns; 255 names, then '... and 45 more'.
  picture, _ = _legend(300, view=False)
  assert picture.shape == (16 + 256, 256 + 13 * 176, 3)
  assert len({tuple(c) for c in scatter.palette(300)}) == 300
  assert sorted(_swatches(picture, 256, 300)) == list(range(255))
  # Place 255 (column 12, line 15) holds the line of text, without a swatch.
  line = picture[16 + 8 + 15 * 12 : 16 + 8 + 16 * 12, 256 + 8 + 12 * 176 :]
  assert (line < 200).any(axis=-1).any()
  # A legend of a few names keeps one column.
  assert scatter.layout(512, 3) == scatter.layout(512, 0) == (16 + 512, 512 + 176)


def test_bad_input_is_refused_with_one_line_before_any_compute(monkeypatch, tmp_path):
  rng = np.random.default_rng(0)
  small = hand_made_index(tmp_path / "small", rng.normal(size=(40, 8)))
  out = tmp_path / "out"
  cases = [
    (
      map_config(str(tmp_path)),
      r"config.index_workdir='.*': must be the workdir of a finished "
      "embed job",
    ),
    (map_config(small, max_points=1), r"config.max_points=1: must be an integer in \[2, 100000\]"),
    (map_config(small, max_points=100_001), r"config.max_points=100001: must be an integer in"),
    (map_config(small, method="pca"), r"config.method='pca': must be one of \['umap', 'tsne'\]$"),
    (
      map_config(small, method="tsne"),
      r"config.tsne.perplexity=30.0: must be less than a third "
      r"of the points mapped \(40: ",
    ),
    (
      map_config(small, max_points=12),
      r"config.umap.n_neighbors=15: must be less than the "
      r"number of points mapped \(12: ",
    ),
    (
      map_config(small, clusters=41),
      r"config.clusters=41: must be at most the number of points "
      r"mapped \(40\), the index being unlabelled$",
    ),
    (map_config(small, thumbnail=4), r"config.thumbnail=4: must be a side in pixels in \[8, "),
  ]
  for config, match in cases:
    with pytest.raises(ConfigError, match=match) as error:
      embedding_map.run(config, str(out))
    assert "\n" not in str(error.value)
  real = embedding_map.importlib.util.find_spec
  monkeypatch.setattr(
    embedding_map.importlib.util,
    "find_spec",
    lambda name, *args: None if name == "umap" else real(name, *args),
  )
  with pytest.raises(
    ConfigError,
    match=r"^config.method='umap': must be a method whose library "
    r"is installed: 'umap' needs umap-learn \(pip install "
    r"'contrastive_jax\[map\]'\)$",
  ):
    embedding_map.run(map_config(small), str(out))
  assert not out.exists()
  (out / "done").mkdir(parents=True)
  (out / "done" / embedding_map.META).write_text("{}")
  with pytest.raises(
    JobError, match=r"--workdir=.*done: already holds a map \(map.json, map.png\)"
  ):
    embedding_map.run(map_config(small), str(out / "done"))
  assert os.listdir(out / "done") == [embedding_map.META]


def test_without_the_extra_every_module_imports_and_the_job_names_it(tmp_path):
  # None in sys.modules makes an import fail as a missing package does.
  code = (
    "import sys\n"
    "sys.modules.update(umap=None, sklearn=None)\n"
    "from absl import app\n"
    "from contrastive_jax import main\n"
    "app.run(main.main, flags_parser=main.parse_flags)\n"
  )
  result = subprocess.run(
    [
      sys.executable,
      "-c",
      code,
      f"--config={os.path.dirname(__file__)}/../configs/map.py",
      f"--config.index_workdir={tmp_path}",
      f"--workdir={tmp_path / 'out'}",
    ],
    capture_output=True,
    text=True,
    env=subprocess_env(),
    timeout=300,
    check=False,
  )
  assert result.returncode == 1, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (
    "error: config.method='umap': must be a method whose library is installed: 'umap' needs "
    "scikit-learn (pip install 'contrastive_jax[map]')"
  )
  assert not (tmp_path / "out").exists()


def _run_python(code, env):
  return subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=False
  )


def test_after_tensorflow_triton_is_kept_out_rather_than_crashing_the_process(
  monkeypatch, tmp_path
):
  # In this process, which has imported TensorFlow (through embedding_map): a stand-in Triton
  # ahead of any installed one, whose import fails with an error that is no ImportError, as
  # the real one's crashes the process (SIGSEGV in dlopen once TensorFlow's LLVM is global).
  (tmp_path / "triton").mkdir()
  (tmp_path / "triton" / "__init__.py").write_text(
    "raise RuntimeError('the stand-in Triton was imported')\n"
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  # Not imported yet; monkeypatch puts back what sys.modules held (or not) afterwards.
  monkeypatch.setitem(sys.modules, "triton", None)
  del sys.modules["triton"]
  assert "tensorflow" in sys.modules
  embedding_map._keep_triton_out()
  with pytest.raises(ImportError):
    importlib.import_module("triton")


@pytest.mark.skipif(
  any(importlib.util.find_spec(name) is None for name in ("torchvision", "triton")),
  reason="umap imports Triton (through torchvision) only where both are installed",
)
def test_umap_imports_after_tensorflow_where_torchvision_and_triton_are_installed():
  code = (
    "import tensorflow\n"
    "from contrastive_jax.jobs import embedding_map\n"
    "print(embedding_map._import('umap', None).UMAP.__name__)\n"
  )
  result = _run_python(code, subprocess_env())
  assert (result.returncode, result.stdout) == (0, "UMAP\n"), result.stderr[-3000:]

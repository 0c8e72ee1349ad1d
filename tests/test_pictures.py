"""pictures.grid: layout, exact pixels of each cell, captions wrapped to their cells, errors;
pictures.line_chart: its size, a dot and a shaded range per point where the data lies, a log x
axis and round y ticks."""

import numpy as np
import pytest

from contrastive_jax.core import pictures


def test_grid_places_each_image_in_its_cell_on_white():
  rng = np.random.default_rng(0)
  rows = [
    [rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) for _ in range(3)],
    [rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)],
  ]
  picture = pictures.grid(rows, cell=8)
  pad = pictures._PAD
  assert picture.shape == (2 * (8 + pad) + pad, 3 * (8 + pad) + pad, 3)
  for i, row in enumerate(rows):
    for j, image in enumerate(row):
      top, left = pad + i * (8 + pad), pad + j * (8 + pad)
      np.testing.assert_array_equal(picture[top : top + 8, left : left + 8], image)
  # The missing cells of the short row stay white.
  np.testing.assert_array_equal(picture[pad + 8 + pad :, pad + 8 + pad :], 255)


WHITE = np.full((4, 6, 3), 255, np.uint8)


def _ink(picture):
  """bool [H, W]: the pixels text darkened (PIL's default font is anti-aliased)."""
  return (picture < 200).any(axis=-1)


def test_captions_that_fit_add_one_line_under_each_row_and_are_drawn():
  rows = [[WHITE] * 2]
  plain = pictures.grid(rows, cell=24)
  captioned = pictures.grid(rows, [["", "0.93"]], cell=24)  # '0.93' is 20 px: one line.
  assert captioned.shape[0] == plain.shape[0] + pictures.LINE_HEIGHT
  under = captioned[pictures._PAD + 24 : pictures._PAD + 24 + pictures.LINE_HEIGHT]
  first, second = np.split(under[:, pictures._PAD : 2 * (24 + pictures._PAD)], 2, axis=1)
  assert (first == 255).all() and (second < 128).any()
  # The same caption in a 16 px cell takes two lines ('0.9', '3').
  assert pictures.grid(rows, [["", "0.93"]], cell=16).shape[0] == (
    pictures.grid(rows, cell=16).shape[0] + 2 * pictures.LINE_HEIGHT
  )


def test_a_caption_wider_than_its_cell_wraps_at_its_parts_and_makes_only_its_row_taller():
  # In PIL's default font (Aileron, 10 px) 'outerwear/winter_jackets' is 119 px wide;
  # 'outerwear/' is 52, 'winter_' 36 and 'jackets' 32: three lines in a 64 px cell.
  long = "outerwear/winter_jackets"
  assert pictures.text_width(long) == 119
  assert pictures.caption_lines(long, 64) == ["outerwear/", "winter_", "jackets"]
  rows = [[WHITE] * 3, [WHITE] * 3]
  picture = pictures.grid(rows, [["", long, ""], ["a", "0.93", ""]], cell=64)
  pad, line = pictures._PAD, pictures.LINE_HEIGHT
  # Row 0: 64 + 3 lines + pad; row 1 (short captions): 64 + 1 line + pad.
  assert picture.shape == (pad + (64 + 3 * line + pad) + (64 + line + pad), pad + 3 * (64 + pad), 3)
  band = _ink(picture[pad + 64 : pad + 64 + 3 * line])
  columns = np.flatnonzero(band.any(axis=0))
  # Every pixel of its text lies in the middle cell's columns, none in the pads or the
  # neighbouring cells, and each of its three lines has ink.
  middle = pad + 64 + pad
  assert columns.min() >= middle and columns.max() < middle + 64
  assert all(band[k * line : (k + 1) * line].any() for k in range(3))
  # The images stay where they were: row 1 starts below row 0's taller band.
  second = pad + 64 + 3 * line + pad
  assert not _ink(picture[second : second + 64]).any()
  assert _ink(picture[second + 64 : second + 64 + line, pad : pad + 64]).any()  # 'a'
  assert not _ink(picture[second + 64 + line :]).any()


def test_a_word_wider_than_a_cell_breaks_mid_word_and_too_long_a_caption_ends_in_an_ellipsis():
  word = "supercalifragilistic"  # No break character: cut where the cell is full.
  lines = pictures.caption_lines(word, 40)
  assert len(lines) == 3 and "".join(lines) == word
  assert all(pictures.text_width(l) <= 40 for l in lines)
  assert pictures.caption_lines(word, 200) == [word]  # Fits: one line, as it is.
  # 'x' is 5 px: 8 to a 40 px line; 3 lines at most, the last cut short for the ellipsis.
  long = pictures.caption_lines("x" * 100, 40)
  assert len(long) == pictures.MAX_LINES == 3
  assert long[:2] == ["x" * 8] * 2 and long[2].endswith(pictures.ELLIPSIS)
  assert long[2].rstrip(pictures.ELLIPSIS) == "x" * (len(long[2]) - 1)
  assert all(pictures.text_width(l) <= 40 for l in long)
  assert pictures.caption_lines("x" * 100, 40, max_lines=1) == [long[2]]
  # Spaces at a break are dropped; runs of whitespace are one space; '' has no lines.
  assert pictures.caption_lines("0.9999  duplicate", 32) == ["0.9999", "duplic", "ate"]
  assert pictures.caption_lines("cat|dog", 20) == ["cat|", "dog"]
  assert pictures.caption_lines("", 32) == pictures.caption_lines("  ", 32) == []
  with pytest.raises(ValueError, match="width >= 1"):
    pictures.caption_lines("a", 0)


def test_text_is_clipped_to_a_cell_narrower_than_a_letter():
  picture = pictures.grid([[WHITE] * 3], [["", "WWW", ""]], cell=4)
  pad = pictures._PAD
  assert picture.shape == (pad + 4 + 3 * pictures.LINE_HEIGHT + pad, pad + 3 * (4 + pad), 3)
  columns = np.flatnonzero(_ink(picture[pad + 4 :]).any(axis=0))
  assert len(columns) and columns.min() >= pad + 4 + pad and columns.max() < 2 * (pad + 4)


@pytest.mark.parametrize(
  "rows, captions, match",
  [
    ([], None, "at least one image"),
    ([[np.zeros((4, 4), np.uint8)]], None, r"uint8 \[H, W, 3\].*row 0, column 0"),
    ([[np.zeros((4, 4, 3), np.float32)]], None, "uint8"),
    ([[np.zeros((4, 4, 3), np.uint8)]], [["a", "b"]], "one string per image"),
  ],
)
def test_bad_input_raises_one_clear_error(rows, captions, match):
  with pytest.raises(ValueError, match=match):
    pictures.grid(rows, captions, cell=8)


def test_write_png_round_trips(tmp_path):
  from PIL import Image

  picture = np.random.default_rng(1).integers(0, 256, (5, 7, 3), dtype=np.uint8)
  pictures.write_png(str(tmp_path / "p.png"), picture)
  np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "p.png")), picture)
  assert [p.name for p in tmp_path.iterdir()] == ["p.png"]


BLUE, ORANGE = (31, 119, 180), (255, 127, 14)  # matplotlib's C0 and C1 (Tableau's first two).


def _pixel(axes, height, x, y):
  """(row, column) of the picture's pixel under the data point (x, y) of axes."""
  column, up = axes.transData.transform((x, y))
  return int(height - up), int(column)


def test_line_chart_draws_each_mean_where_it_lies_on_a_log_axis_with_round_ticks():
  # The docs' curve of old had y ticks 0.080, 0.190, 0.301, 0.412: its data spans 0.08 to 0.41.
  series = {
    "pretrained probe": {100: [0.30, 0.32], 1000: [0.40, 0.41], 10000: [0.35]},
    "random kNN": {100: [0.08, 0.12], 1000: [0.15], 10000: [0.18, 0.22]},
  }
  figure = pictures.line_figure(series, x_label="labels", y_label="test top-1")
  picture = pictures.render(figure)
  assert picture.shape == (420, 640, 3) and picture.dtype == np.uint8
  np.testing.assert_array_equal(
    pictures.line_chart(series, x_label="labels", y_label="test top-1"), picture
  )
  (axes,) = figure.axes
  # Every mean is drawn (a dot of its series' colour) at its place.
  for points, colour in zip(series.values(), (BLUE, ORANGE)):
    for x, ys in points.items():
      row, column = _pixel(axes, 420, x, np.mean(ys))
      assert picture[row, column].tolist() == list(colour), (x, ys)
  # A log x axis: 100, 1000, 10000 equally spaced.
  columns = [_pixel(axes, 420, x, 0.2)[1] for x in (100, 1000, 10000)]
  assert abs((columns[1] - columns[0]) - (columns[2] - columns[1])) <= 1
  # The range of 'random kNN' at 100 labels (0.08 to 0.12) is shaded a light blend of orange,
  # off its mean's dot; above its top the background shows.
  row, column = _pixel(axes, 420, 100, 0.09)  # 8 px below the line, 8 px right of the grid.
  shade = picture[row, column + 8].astype(int)
  np.testing.assert_allclose(shade, 0.8 * 255 + 0.2 * np.array(ORANGE), atol=3)
  row, column = _pixel(axes, 420, 100, 0.14)
  assert picture[row, column + 6].tolist() in ([255, 255, 255], [229, 229, 229])
  # Round ticks: y in steps of a round number within the data, x the label counts as written.
  ticks = [t for t in axes.get_yticks() if axes.get_ylim()[0] <= t <= axes.get_ylim()[1]]
  assert len(ticks) >= 3
  np.testing.assert_allclose(np.array(ticks) * 20, np.round(np.array(ticks) * 20), atol=1e-9)
  assert list(axes.get_xticks()) == [100, 1000, 10000]
  assert [t.get_text() for t in axes.get_xticklabels()] == ["100", "1000", "10000"]
  assert [t.get_text() for t in axes.get_legend().get_texts()] == list(series)
  assert pictures.line_chart(series, x_label="", y_label="", width=300, height=200).shape == (
    200,
    300,
    3,
  )


def test_line_chart_refuses_no_point_or_an_x_at_or_below_0():
  with pytest.raises(ValueError, match="x > 0"):
    pictures.line_chart({"a": {0: [1.0]}}, x_label="", y_label="")
  with pytest.raises(ValueError, match="x > 0"):
    pictures.line_chart({}, x_label="", y_label="")


def test_importing_pictures_loads_no_plotting_library():
  import subprocess
  import sys

  code = "import sys; from contrastive_jax.core import pictures, scatter; "
  code += "print('matplotlib' in sys.modules)"
  assert (
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    == "False\n"
  )

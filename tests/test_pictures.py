"""pictures.grid: layout, exact pixels of each cell, captions, errors."""

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


def test_captions_add_a_line_under_each_row_and_are_drawn():
  rows = [[np.full((4, 6, 3), 255, np.uint8)] * 2]
  plain = pictures.grid(rows, cell=16)
  captioned = pictures.grid(rows, [["", "0.93"]], cell=16)
  assert captioned.shape[0] == plain.shape[0] + pictures._CAPTION_HEIGHT
  under = captioned[pictures._PAD + 16 : pictures._PAD + 16 + pictures._CAPTION_HEIGHT]
  first, second = np.split(under[:, pictures._PAD : 2 * (16 + pictures._PAD)], 2, axis=1)
  assert (first == 255).all() and (second < 128).any()


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

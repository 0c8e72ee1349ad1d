"""Picture grids: rows of images with optional captions, as one RGB image.

One home for every picture a job writes (the augmented views at step 0, the
neighbours of query images), as a PNG file in the workdir and as a
TensorBoard image.
"""

import io
from typing import Optional, Sequence

import numpy as np
from PIL import Image
from PIL import ImageDraw

from contrastive_jax.core import files

# PIL's default font is about 6 pixels per character: how many characters a caption of a
# cell's width holds.
CHARS_PER_PIXEL = 1 / 6

_PAD = 2  # pixels between cells
_CAPTION_HEIGHT = 12  # pixels under a cell for one line of PIL's default font


def grid(
  rows: Sequence[Sequence[np.ndarray]],
  captions: Optional[Sequence[Sequence[str]]] = None,
  *,
  cell: int,
) -> np.ndarray:
  """Lays out rows of images as one picture, each image resized to a square cell.

  Args:
    rows: rows of uint8 [H, W, 3] images (any H, W; rows may differ in length).
    captions: None, or one string per image (same nesting as rows), drawn
      under its image; '' leaves a cell uncaptioned.
    cell: side of a cell in pixels; images are resized (bilinear) to it.

  Returns:
    uint8 [R * (cell + caption + pad) + pad, C * (cell + pad) + pad, 3] on a white
    background, C the longest row's length.

  Raises:
    ValueError: no rows, cell < 1, an image that is not uint8 [H, W, 3], or
      captions whose nesting differs from rows.
  """
  if not rows or not any(len(r) for r in rows):
    raise ValueError("grid() needs at least one image")
  if cell < 1:
    raise ValueError(f"cell must be >= 1 pixel, got {cell}")
  if captions is not None and [len(c) for c in captions] != [len(r) for r in rows]:
    raise ValueError("captions must have one string per image, row by row")
  caption = _CAPTION_HEIGHT if captions is not None else 0
  width = max(len(r) for r in rows) * (cell + _PAD) + _PAD
  height = len(rows) * (cell + caption + _PAD) + _PAD
  canvas = Image.new("RGB", (width, height), "white")
  draw = ImageDraw.Draw(canvas)
  for i, row in enumerate(rows):
    top = _PAD + i * (cell + caption + _PAD)
    for j, image in enumerate(row):
      image = np.asarray(image)
      if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(
          f"grid() images must be uint8 [H, W, 3], got {image.dtype} "
          f"{image.shape} at row {i}, column {j}"
        )
      left = _PAD + j * (cell + _PAD)
      canvas.paste(Image.fromarray(image).resize((cell, cell), Image.BILINEAR), (left, top))
      if captions is not None and captions[i][j]:
        draw.text((left, top + cell), captions[i][j], fill="black")
  return np.asarray(canvas)


def write_png(path: str, picture: np.ndarray):
  """Writes a uint8 [H, W, 3] picture as a PNG at path (local or gs://), atomically."""
  buffer = io.BytesIO()
  Image.fromarray(picture).save(buffer, format="PNG")
  files.write_atomic(path, buffer.getvalue())

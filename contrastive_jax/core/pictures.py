"""Picture grids (rows of images with optional captions) and line charts, as one RGB image.

One home for every picture a job writes (the augmented views at step 0, the
neighbours of query images, the label-efficiency curve), as a PNG file in the
workdir and as a TensorBoard image.
"""

import functools
import io
import math
from typing import Optional, Sequence

import numpy as np
from PIL import Image
from PIL import ImageDraw
from PIL import ImageFont

from contrastive_jax.core import files

_PAD = 2  # pixels between cells
LINE_HEIGHT = 12  # pixels per caption line: PIL's default font inks rows 1 to 11 of a line
MAX_LINES = 3  # caption lines at most under a cell; a longer caption ends in an ellipsis
ELLIPSIS = "\u2026"
# A line may end after these characters (a space is dropped at the break): class names
# such as 'outerwear/winter_jackets' or 'cat|dog' break at their parts, not mid-word.
_BREAKS = " /_-|"


@functools.lru_cache(maxsize=1)
def font() -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
  """PIL's default font (the one draw.text uses without a font), loaded once."""
  return ImageFont.load_default()


def text_width(text: str) -> int:
  """Pixels from a line's origin to the right edge of its ink or advance, in font()."""
  if not text:
    return 0
  return math.ceil(max(font().getlength(text), font().getbbox(text)[2]))


def _longest_fitting(text: str, width: int, suffix: str = "") -> int:
  """The most leading characters of text that, with suffix, fit in width pixels (>= 0)."""
  low, high = 0, len(text)  # text[:low] + suffix fits, or low is 0.
  while low < high:
    middle = (low + high + 1) // 2
    if text_width(text[:middle].rstrip() + suffix) <= width:
      low = middle
    else:
      high = middle - 1
  return low


def caption_lines(text: str, width: int, max_lines: int = MAX_LINES) -> list:
  """text wrapped to lines of at most width pixels each in font(), at most max_lines of them.

  Runs of whitespace count as one space. A line breaks after the last space,
  '/', '_', '-' or '|' that lets it fit (a space at a break is dropped),
  else mid-word after as many characters as fit (at least one: a cell
  narrower than one character still shows its first letters, which grid
  clips to the cell). When text needs more than max_lines lines, the last
  line is cut where it fits with ELLIPSIS after it.

  Args:
    text: the caption; '' has no lines.
    width: pixels available for a line, >= 1.
    max_lines: lines at most, >= 1.

  Returns:
    list of str, between 0 (text is blank) and max_lines lines.

  Raises:
    ValueError: width or max_lines < 1.
  """
  if width < 1 or max_lines < 1:
    raise ValueError(f"caption_lines needs width >= 1 and max_lines >= 1, got {width}, {max_lines}")
  lines, rest = [], " ".join(text.split())
  while rest:
    if text_width(rest) <= width:
      lines.append(rest)
      break
    if len(lines) == max_lines - 1:
      fit = _longest_fitting(rest, width, ELLIPSIS)
      lines.append(rest[:fit].rstrip() + ELLIPSIS)
      break
    fit = max(_longest_fitting(rest, width), 1)
    # A break at position i ends the line with rest[:i]: after a break character, or
    # before a space.
    breaks = [i for i in range(1, fit + 1) if rest[i - 1] in _BREAKS or rest[i : i + 1] == " "]
    cut = breaks[-1] if breaks else fit
    lines.append(rest[:cut].rstrip())
    rest = rest[cut:].lstrip()
  return lines


def grid(
  rows: Sequence[Sequence[np.ndarray]],
  captions: Optional[Sequence[Sequence[str]]] = None,
  *,
  cell: int,
) -> np.ndarray:
  """Lays out rows of images as one picture, each image resized to a square cell.

  A caption is wrapped to the cell's width (caption_lines: at most
  MAX_LINES lines, then an ellipsis) and drawn under its image, clipped to
  the cell's columns so no text reaches a neighbouring cell. Each row's
  caption band is as tall as that row's longest caption, so rows may differ
  in height.

  Args:
    rows: rows of uint8 [H, W, 3] images (any H, W; rows may differ in length).
    captions: None, or one string per image (same nesting as rows), drawn
      under its image; '' leaves a cell uncaptioned.
    cell: side of a cell in pixels; images are resized (bilinear) to it.

  Returns:
    uint8 [sum over rows i of (cell + L_i * LINE_HEIGHT + pad) + pad,
    C * (cell + pad) + pad, 3] on a white background, C the longest row's
    length, pad = 2 and L_i the number of caption lines of row i: 0 without
    captions, else the most lines any caption of row i takes (at least 1, at
    most MAX_LINES).

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
  if captions is None:
    wrapped, heights = None, [0] * len(rows)
  else:
    # Each caption's lines; every row has a caption band of at least one line, so rows of ''
    # line up with captioned ones.
    wrapped = [[caption_lines(c, cell) for c in row] for row in captions]
    heights = [max([len(w) for w in row] + [1]) * LINE_HEIGHT for row in wrapped]
  width = max(len(r) for r in rows) * (cell + _PAD) + _PAD
  height = sum(cell + h + _PAD for h in heights) + _PAD
  canvas = Image.new("RGB", (width, height), "white")
  top = _PAD
  for i, row in enumerate(rows):
    for j, image in enumerate(row):
      image = np.asarray(image)
      if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(
          f"grid() images must be uint8 [H, W, 3], got {image.dtype} "
          f"{image.shape} at row {i}, column {j}"
        )
      left = _PAD + j * (cell + _PAD)
      canvas.paste(Image.fromarray(image).resize((cell, cell), Image.BILINEAR), (left, top))
      if wrapped is not None and wrapped[i][j]:
        # Drawn on a cell-wide strip of its own, then pasted: ink is clipped to the cell.
        strip = Image.new("RGB", (cell, heights[i]), "white")
        draw = ImageDraw.Draw(strip)
        for k, line in enumerate(wrapped[i][j]):
          draw.text((0, k * LINE_HEIGHT), line, fill="black", font=font())
        canvas.paste(strip, (left, top + cell))
    top += cell + heights[i] + _PAD
  return np.asarray(canvas)


def write_png(path: str, picture: np.ndarray):
  """Writes a uint8 [H, W, 3] picture as a PNG at path (local or gs://), atomically."""
  buffer = io.BytesIO()
  Image.fromarray(picture).save(buffer, format="PNG")
  files.write_atomic(path, buffer.getvalue())


# Line colours, in series order (then again): Tableau's ten, distinct on white.
_COLOURS = (
  (31, 119, 180),
  (255, 127, 14),
  (44, 160, 44),
  (214, 39, 40),
  (148, 103, 189),
  (140, 86, 75),
  (227, 119, 194),
  (127, 127, 127),
  (188, 189, 34),
  (23, 190, 207),
)


def line_chart(
  series: dict, *, x_label: str, y_label: str, width: int = 640, height: int = 420
) -> np.ndarray:
  """A chart of y against x on a log x axis, as uint8 [height, width, 3].

  Args:
    series: {name: {x > 0: [y, ...]}}: a line per name through the mean of its
      ys at each x, with their range (min to max) shaded in a lighter shade of
      its colour; the names in a legend, in order.
    x_label, y_label: the axes' captions.
  Raises:
    ValueError: no point, or an x <= 0.
  """
  xs = sorted({x for points in series.values() for x in points})
  ys = [y for points in series.values() for values in points.values() for y in values]
  if not xs or xs[0] <= 0:
    raise ValueError(f"line_chart needs points with x > 0, got xs {xs}")
  left, right, top, bottom = 56, width - 12, 20, height - 40 - LINE_HEIGHT * len(series)
  lo, hi = min(ys), max(ys)
  lo, hi = (lo - 0.5, hi + 0.5) if hi == lo else (lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
  span = math.log(xs[-1] / xs[0]) or 1.0
  px = lambda x: left + (right - left) * (math.log(x / xs[0]) / span if len(xs) > 1 else 0.5)
  py = lambda y: bottom - (bottom - top) * (y - lo) / (hi - lo)
  canvas = Image.new("RGB", (width, height), "white")
  draw = ImageDraw.Draw(canvas, "RGBA")
  draw.rectangle((left, top, right, bottom), outline="black")
  for x in xs:  # The x ticks are the xs themselves.
    draw.line((px(x), bottom, px(x), bottom + 4), fill="black")
    draw.text((px(x) - text_width(f"{x:g}") / 2, bottom + 6), f"{x:g}", fill="black", font=font())
  for i in range(5):
    y = lo + (hi - lo) * i / 4
    draw.line((left - 4, py(y), left, py(y)), fill="black")
    draw.text((left - 6 - text_width(f"{y:.3f}"), py(y) - 6), f"{y:.3f}", fill="black", font=font())
  draw.text((left, bottom + 6 + LINE_HEIGHT), x_label, fill="black", font=font())
  draw.text((2, 2), y_label, fill="black", font=font())
  for n, (name, points) in enumerate(series.items()):
    colour = _COLOURS[n % len(_COLOURS)]
    at = sorted(points)
    upper = [(px(x), py(max(points[x]))) for x in at]
    lower = [(px(x), py(min(points[x]))) for x in reversed(at)]
    if len(at) > 1:
      draw.polygon(upper + lower, fill=colour + (50,))
    means = [(px(x), py(float(np.mean(points[x])))) for x in at]
    if len(means) > 1:
      draw.line(means, fill=colour, width=2)
    for x, y in means:
      draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=colour)
    legend_y = bottom + 8 + LINE_HEIGHT * (n + 2)
    draw.line((left, legend_y + 6, left + 20, legend_y + 6), fill=colour, width=2)
    draw.text((left + 26, legend_y), name, fill="black", font=font())
  return np.asarray(canvas)

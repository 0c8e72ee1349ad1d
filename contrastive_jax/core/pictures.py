"""Picture grids (rows of images with optional captions) and line charts, as one RGB image.

One home for every picture a job writes (the augmented views at step 0, the
neighbours of query images, the label-efficiency curve), as a PNG file in the
workdir and as a TensorBoard image. Grids of images are laid out with Pillow;
charts are matplotlib figures (figure, line_figure) drawn by its Agg renderer
(render), which users can read and extend; matplotlib is imported only when a
chart is drawn.
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


DPI = 128  # pixels per inch of every chart: a power of two, so inches * DPI is exactly the pixels


def render(figure) -> np.ndarray:
  """A matplotlib Figure drawn by the Agg renderer (no display), as uint8 [H, W, 3].

  H, W: the figure's size in inches times its dpi (whole pixels at DPI).
  """
  from matplotlib.backends import backend_agg  # pylint: disable=g-import-not-at-top

  canvas = backend_agg.FigureCanvasAgg(figure)
  canvas.draw()
  return np.array(canvas.buffer_rgba())[..., :3]


def figure(width: int, height: int):
  """An empty matplotlib Figure of width x height pixels at DPI, not attached to pyplot.

  Matplotlib is imported here, not at the module's top, so importing this
  module loads no plotting library and sets no backend.
  """
  from matplotlib import figure as mpl_figure  # pylint: disable=g-import-not-at-top

  return mpl_figure.Figure(figsize=(width / DPI, height / DPI), dpi=DPI)


def line_figure(series: dict, *, x_label: str, y_label: str, width: int = 640, height: int = 420):
  """line_chart's matplotlib Figure (one Axes), to draw (render) or extend.

  Args and Raises: as line_chart.
  """
  xs = sorted({x for points in series.values() for x in points})
  if not xs or xs[0] <= 0:
    raise ValueError(f"line_chart needs points with x > 0, got xs {xs}")
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top

  chart = figure(width, height)
  axes = chart.add_subplot()
  for n, (name, points) in enumerate(series.items()):
    colour = f"C{n % 10}"  # matplotlib's default cycle: Tableau's ten, distinct on white.
    at = sorted(points)
    means = [float(np.mean(points[x])) for x in at]
    axes.fill_between(
      at,
      [min(points[x]) for x in at],
      [max(points[x]) for x in at],
      color=colour,
      alpha=0.2,
      linewidth=0,
    )
    axes.plot(at, means, color=colour, marker="o", markersize=4, linewidth=1.5, label=name)
  axes.set_xscale("log")
  # The x ticks are the xs themselves (label counts), written plainly, not as powers of 10.
  axes.xaxis.set_major_locator(ticker.FixedLocator(xs))
  axes.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
  axes.xaxis.set_minor_locator(ticker.NullLocator())
  axes.yaxis.set_major_locator(ticker.MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
  axes.set_xlabel(x_label)
  axes.set_ylabel(y_label)
  axes.grid(True, color="0.9", linewidth=0.8)
  axes.set_axisbelow(True)
  axes.legend(loc="best", fontsize="small", frameon=False)
  chart.tight_layout()
  return chart


def line_chart(
  series: dict, *, x_label: str, y_label: str, width: int = 640, height: int = 420
) -> np.ndarray:
  """A chart of y against x on a log x axis, drawn by matplotlib, as uint8 [height, width, 3].

  Args:
    series: {name: {x > 0: [y, ...]}}: a line per name through the mean of its
      ys at each x (a dot at each), with their range (min to max) shaded in a
      lighter shade of its colour (matplotlib's colour cycle, C0, C1, ...); the
      names in a legend, in order. The x ticks are the xs; the y ticks round
      values (steps of 1, 2, 2.5 or 5 times a power of 10).
    x_label, y_label: the axes' captions.
    width, height: the picture's size in pixels.
  Raises:
    ValueError: no point, or an x <= 0.
  """
  return render(line_figure(series, x_label=x_label, y_label=y_label, width=width, height=height))

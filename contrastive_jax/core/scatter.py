"""Pictures of a 2-D map of points: a coloured scatter with a legend, thumbnails at their
places, and a sprite of thumbnails (TensorBoard's projector).

The scatter and the thumbnail view are matplotlib figures (map_figure,
rendered by pictures.render) that share one layout (layout, to_pixels): a title
band on top, a square plot of `size` pixels in which both axes have the same
scale (so distances on the picture are comparable in every direction), and
on the right a legend of as many columns as its names need, each column as
tall as the plot.
"""

import colorsys
import math
from typing import Sequence

import numpy as np

from contrastive_jax.core import pictures

TITLE_HEIGHT = 16  # pixels above the plot for one line of PIL's default font
LEGEND_COLUMN = 176  # pixels of one legend column: swatch, name and the gap to the next
LEGEND_MAX = 256  # names a legend shows at most; beyond, its last line says how many more
MARGIN = 8  # pixels between the plot's border and its outermost point
_LINE = 12  # pixels per legend line
_SWATCH = 14  # pixels from a legend column's left to its name: a swatch and a gap
_SWATCH_SIDE = 9  # pixels of a legend swatch's side
_FONT = 5.5  # points of the title and legend text: 9.8 pixels at pictures.DPI, within a _LINE
_NAME_CHARACTERS = 26  # characters of a legend name at most (about 140 pixels at _FONT)
_DOT = 2  # radius in pixels of a point of the scatter
_GOLDEN = (math.sqrt(5) - 1) / 2


def legend_columns(size: int, count: int):
  """(lines, columns) of the legend of count names beside a plot of size pixels.

  A column holds `lines` names, one per _LINE pixels of the plot's height
  less MARGIN above and below (at least one); `columns` is as many as
  min(count, LEGEND_MAX) names need, at least one.
  """
  lines = max(1, (size - 2 * MARGIN) // _LINE)
  return lines, max(1, math.ceil(min(count, LEGEND_MAX) / lines))


def layout(size: int, count: int):
  """(height, width) in pixels of a picture of a plot of size x size pixels and a legend of
  count names: TITLE_HEIGHT + size, size + LEGEND_COLUMN * legend_columns(size, count)[1]."""
  return TITLE_HEIGHT + size, size + LEGEND_COLUMN * legend_columns(size, count)[1]


def palette(n: int) -> np.ndarray:
  """n distinct colours, uint8 [n, 3].

  Hues step by the golden ratio around the circle, so any first few colours
  are far apart whatever n; brightness alternates to separate neighbours of
  hue among many groups.
  """
  colours = [
    colorsys.hsv_to_rgb((i * _GOLDEN) % 1.0, 0.8, 0.9 if i % 2 == 0 else 0.6) for i in range(n)
  ]
  return np.round(np.asarray(colours, np.float64).reshape(n, 3) * 255).astype(np.uint8)


def to_pixels(xy: np.ndarray, size: int) -> np.ndarray:
  """Positions in a size x size plot (x right, y up), int32 [N, 2] (column, row).

  The points' bounding box is scaled by one factor for both axes to fill
  the plot less MARGIN on each side, centred on the other axis.

  Args:
    xy: float [N, 2], N >= 1.
    size: the plot's side in pixels, > 2 * MARGIN.
  """
  xy = np.asarray(xy, np.float64)
  low, high = xy.min(axis=0), xy.max(axis=0)
  span = max(float((high - low).max()), 1e-12)  # All points in one place: the centre.
  scale = (size - 1 - 2 * MARGIN) / span
  offset = (size - 1 - (high - low) * scale) / 2
  column = offset[0] + (xy[:, 0] - low[0]) * scale
  row = size - 1 - (offset[1] + (xy[:, 1] - low[1]) * scale)
  return np.round(np.stack([column, row], axis=1)).astype(np.int32)


def _name(name: str) -> str:
  """name cut to _NAME_CHARACTERS with an ellipsis when longer, so it keeps to its column."""
  if len(name) <= _NAME_CHARACTERS:
    return name
  return name[: _NAME_CHARACTERS - 1].rstrip() + pictures.ELLIPSIS


def map_figure(size: int, title: str, names: Sequence[str], colours: np.ndarray):
  """The matplotlib Figure of the layout, with the title, the plot's frame and the legend.

  The Axes covers exactly the plot's square, in pixel units: x from -0.5 to
  size - 0.5 to the right, y from -0.5 at the top to size - 0.5 at the
  bottom, so a point drawn at to_pixels' (column, row) is centred on that
  pixel of the plot. The legend (legend_columns) fills its columns top to
  bottom, left to right, _LINE pixels a line: a square swatch of
  _SWATCH_SIDE pixels and the name (cut to _NAME_CHARACTERS with an
  ellipsis, its ink clipped to its column less MARGIN); beyond LEGEND_MAX
  names, the last place says how many more. Returns (figure, axes).
  """
  from matplotlib import patches  # pylint: disable=g-import-not-at-top
  from matplotlib import transforms  # pylint: disable=g-import-not-at-top

  height, width = layout(size, len(names))
  chart = pictures.figure(width, height)
  axes = chart.add_axes((0, 0, size / width, size / height))
  axes.set_xlim(-0.5, size - 0.5)
  axes.set_ylim(size - 0.5, -0.5)
  axes.set_xticks([])
  axes.set_yticks([])
  for spine in axes.spines.values():
    spine.set_edgecolor("0.8")
  # Text and swatches go at pixel places from the picture's top left (x right, y down).
  pixels = transforms.Affine2D().scale(1, -1).translate(0, height)
  chart.text(MARGIN, 2, title, fontsize=_FONT, va="top", transform=pixels)
  lines, _ = legend_columns(size, len(names))
  shown = len(names) if len(names) <= LEGEND_MAX else LEGEND_MAX - 1

  def place(i):  # (left, top) of legend place i, in pixels.
    column, line = divmod(i, lines)
    return size + MARGIN + column * LEGEND_COLUMN, TITLE_HEIGHT + MARGIN + line * _LINE

  for i in range(shown):
    left, top = place(i)
    chart.add_artist(
      patches.Rectangle(
        (left, top + 2),
        _SWATCH_SIDE,
        _SWATCH_SIDE,
        color=colours[i] / 255,
        transform=pixels,
        antialiased=False,
        linewidth=0,
      )
    )
    name = chart.text(
      left + _SWATCH, top + 1, _name(str(names[i])), fontsize=_FONT, va="top", transform=pixels
    )
    # Ink past the column's end (a name of wide letters) is cut, so none reaches the next.
    name.set_clip_box(
      transforms.TransformedBbox(
        transforms.Bbox.from_extents(left, 0, left + LEGEND_COLUMN - MARGIN, height), pixels
      )
    )
    name.set_clip_on(True)
  if shown < len(names):
    left, top = place(shown)
    more = f"... and {len(names) - shown} more"
    chart.text(left, top + 1, more, fontsize=_FONT, va="top", transform=pixels)
  return chart, axes


def scatter(
  xy: np.ndarray, groups: np.ndarray, names: Sequence[str], *, size: int, title: str, seed: int = 0
) -> np.ndarray:
  """The points as dots coloured by group, with a legend of the groups' names, drawn by matplotlib.

  Args:
    xy: float [N, 2] positions (any scale; see to_pixels).
    groups: int [N], each in [0, len(names)).
    names: a name per group, in the legend in this order (legend_columns:
      all of them up to LEGEND_MAX, else LEGEND_MAX - 1 and a line saying how
      many more), each cut to its column's width with an ellipsis.
    size: the plot's side in pixels.
    title: one line above the plot.
    seed: the order the dots are drawn in is a permutation seeded by it, so
      no group is drawn last over all the others.
  Returns:
    uint8 [TITLE_HEIGHT + size, size + LEGEND_COLUMN * columns, 3], columns =
    legend_columns(size, len(names))[1] (layout(size, len(names))). Each dot
    is 2 * _DOT + 1 pixels across in its group's palette colour, drawn
    without anti-aliasing: its centre pixel is exactly that colour unless a
    later dot covers it.
  """
  colours = palette(len(names))
  chart, axes = map_figure(size, title, names, colours)
  order = np.random.default_rng(seed).permutation(len(xy))
  pixels = to_pixels(xy, size)[order]
  diameter = (2 * _DOT + 1) * 72 / pictures.DPI  # points
  axes.scatter(
    pixels[:, 0],
    pixels[:, 1],
    s=diameter**2,
    c=colours[np.asarray(groups)[order]] / 255,
    linewidths=0,
    antialiased=False,
  )
  return pictures.render(chart)


def thumbnail_places(xy: np.ndarray, size: int, cell: int) -> dict:
  """{point: (column, row) of its thumbnail's top-left corner} for thumbnails that do not overlap.

  The plot is cut into squares of cell pixels; in each square that holds
  points, the point closest to the square's centre (the lowest index among
  equals) is shown, filling the square. So every thumbnail lies within
  cell pixels of its point's place, dense regions show one image per square
  and sparse ones show all their points.
  """
  pixels = to_pixels(xy, size)
  squares = np.minimum(pixels // cell, size // cell - 1)  # The last partial square joins its left.
  centres = squares * cell + cell / 2
  distance = np.square(pixels - centres).sum(axis=1)
  places = {}
  for i in np.lexsort((np.arange(len(xy)), distance)):
    key = tuple(squares[i])
    if key not in places:
      places[key] = int(i)
  return {i: (int(key[0] * cell), int(key[1] * cell)) for key, i in places.items()}


def thumbnails(
  xy: np.ndarray,
  images: dict,
  groups: np.ndarray,
  names: Sequence[str],
  *,
  size: int,
  cell: int,
  title: str,
) -> np.ndarray:
  """The map as images: thumbnail_places' images, each framed in its group's colour.

  Args:
    xy, groups, names, size, title: as for scatter (the same layout).
    images: {point: uint8 [cell, cell, 3]} for at least the points
      thumbnail_places(xy, size, cell) chooses.
    cell: a thumbnail's side in pixels, at most size.
  Returns:
    uint8 [TITLE_HEIGHT + size, size + LEGEND_COLUMN * columns, 3], columns =
    legend_columns(size, len(names))[1] (layout(size, len(names))).
  """
  colours = palette(len(names))
  chart, _ = map_figure(size, title, names, colours)
  height = layout(size, len(names))[0]
  for i, (column, row) in thumbnail_places(xy, size, cell).items():
    framed = np.array(images[i][:cell, :cell], np.uint8)
    framed[[0, -1], :] = framed[:, [0, -1]] = colours[groups[i]]
    # figimage puts the image's pixels as they are; its offset is from the bottom left.
    chart.figimage(framed, column, height - TITLE_HEIGHT - row - cell, origin="upper", zorder=3)
  return pictures.render(chart)


def sprite(images: Sequence[np.ndarray]) -> np.ndarray:
  """Equal-sized thumbnails in a square grid, row by row: TensorBoard's projector sprite.

  The projector finds point i's thumbnail at row i // C, column i % C, C the
  picture's width over the thumbnail's; cells after the last are white.

  Args:
    images: N >= 1 uint8 [s, s, 3], in the order of the points.
  Returns:
    uint8 [ceil(N / C) * s, C * s, 3], C = ceil(sqrt(N)).
  """
  side = images[0].shape[0]
  columns = math.ceil(math.sqrt(len(images)))
  rows = math.ceil(len(images) / columns)
  out = np.full((rows * side, columns * side, 3), 255, np.uint8)
  for i, image in enumerate(images):
    row, column = divmod(i, columns)
    out[row * side : (row + 1) * side, column * side : (column + 1) * side] = image
  return out

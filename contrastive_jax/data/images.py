"""Reading image files of any size and format into RGB uint8 arrays (Pillow).

The one place that turns a user's image file into pixels: preparing an image
folder (the prepare job) and reading query images both go through
load_image. Formats are those Pillow decodes (JPEG, PNG, BMP, GIF, WebP and
more); an animated GIF or WebP gives its first frame.
"""

import errno
import os
import struct
from typing import Optional

import numpy as np
from PIL import Image
from PIL import ImageOps

from contrastive_jax.core.errors import ImageError
from contrastive_jax.core.errors import JobError

# What Pillow raises for a file it cannot identify (UnidentifiedImageError is an
# OSError), cannot open, or finds malformed or cut short while decoding.
_DECODE_ERRORS = (
  OSError,
  SyntaxError,
  ValueError,
  EOFError,
  IndexError,
  struct.error,
  Image.DecompressionBombError,
)
_BACKGROUND = (255, 255, 255)  # Transparent pixels become white, as on a web page.


def open_image(path: str, *, max_pixels: int) -> Image.Image:
  """Opens an image file and reads its header only; no pixel is decoded.

  Returns:
    An open, lazy PIL image (use it as a context manager to close the file).
  Raises:
    ImageError: the file cannot be opened or is not an image Pillow
      identifies, or its header claims more than max_pixels pixels (a
      decompression bomb: refused before any decoding). Pillow's own limit
      (2 x PIL.Image.MAX_IMAGE_PIXELS, a process-wide setting) is refused the
      same way.
  """
  try:
    image = Image.open(path)
  except Image.DecompressionBombError as e:
    raise ImageError(path, f"header claims too many pixels for Pillow ({e}); not decoded") from None
  except Image.UnidentifiedImageError:
    raise ImageError(path, "not an image Pillow can decode") from None
  except _DECODE_ERRORS as e:
    raise ImageError(path, f"cannot be read ({e})") from None
  width, height = image.size
  if width * height > max_pixels:
    image.close()
    raise ImageError(
      path,
      f"header claims {width} x {height} = {width * height:,} pixels, "
      f"more than max_pixels={max_pixels:,} (a decompression bomb?); not decoded",
    )
  return image


def to_rgb(image: Image.Image) -> Image.Image:
  """An RGB copy of a decoded image of any mode.

  Transparency (RGBA, LA, palette with a transparent index) is composited
  onto white; 16- and 32-bit integer grayscale ('I;16', 'I') is scaled from
  the 16-bit range (v / 257); CMYK, YCbCr and the rest convert as Pillow
  converts them.
  """
  if image.mode == "RGB":
    return image
  if image.mode.startswith("I"):
    gray = np.clip(np.asarray(image, np.float64) / 257.0, 0, 255).round().astype(np.uint8)
    return Image.fromarray(gray, "L").convert("RGB")
  if (image.mode == "P" and "transparency" in image.info) or image.mode in (
    "PA",
    "LA",
    "La",
    "RGBa",
  ):
    image = image.convert("RGBA")
  if image.mode == "RGBA":
    background = Image.new("RGB", image.size, _BACKGROUND)
    background.paste(image, mask=image.getchannel("A"))
    return background
  return image.convert("RGB")


def load_image(path: str, *, max_pixels: int, shorter_side: Optional[int] = None) -> np.ndarray:
  """Decodes an image file to RGB pixels, upright.

  The header is checked before decoding (open_image); then the first frame
  is decoded, its EXIF orientation applied (ImageOps.exif_transpose), its
  mode converted to RGB (to_rgb) and, with shorter_side, it is downscaled
  (bicubic, with antialiasing) so that its shorter side is shorter_side,
  keeping the aspect ratio; an image already that small is kept as it is,
  never upscaled. A JPEG is decoded at a reduced scale when that still leaves
  at least shorter_side (Pillow's draft mode), which makes large photos cheap.

  Args:
    path: the file, or a binary file object open on it (e.g. tf.io.gfile's,
      for gs://).
    max_pixels: the largest width x height the header may claim.
    shorter_side: the largest shorter side (pixels) of the result, or None.
  Returns:
    uint8 [H, W, 3].
  Raises:
    ImageError (naming the file and the reason): cannot be opened, not an
      image, more than max_pixels pixels, truncated or corrupt data.
  """
  with open_image(path, max_pixels=max_pixels) as image:
    try:
      image.seek(0)
      if shorter_side and image.format == "JPEG":
        scale = shorter_side / min(image.size)
        image.draft("RGB", (round(image.width * scale), round(image.height * scale)))
      image.load()
      image = to_rgb(ImageOps.exif_transpose(image))
      if shorter_side and min(image.size) > shorter_side:
        scale = shorter_side / min(image.size)
        image = image.resize(
          (max(1, round(image.width * scale)), max(1, round(image.height * scale))),
          Image.Resampling.BICUBIC,
        )
      return np.asarray(image, np.uint8)
    except _DECODE_ERRORS as e:
      raise ImageError(path, f"cannot be decoded: truncated or corrupt ({e})") from None


def list_files(src: str, *, flag: str):
  """Every file below src, relative, '/'-separated and sorted, and the entries skipped.

  Follows symbolic links. Returns (files, skipped) with skipped a list of
  (relative path, reason) for hidden entries (names starting with '.'),
  folders that cannot be listed, links that lead nowhere or back to
  themselves (a link to itself, or a ring of links), entries that are not
  regular files (a FIFO would block the reader) and names that are not valid
  UTF-8.
  Raises:
    JobError: src does not exist or is not a folder, or a symbolic link
      points to a folder that contains it (a loop), naming the link; each
      message starts with flag=src, flag the option that gave src.
  """
  if not os.path.exists(src):
    raise JobError(f"{flag}={src!r}: does not exist")
  if not os.path.isdir(src):
    raise JobError(f"{flag}={src!r}: is not a folder")
  files, skipped = [], []

  def visit(folder, rel, ancestors):
    try:
      entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as e:
      skipped.append((rel or ".", f"folder cannot be listed ({e.strerror})"))
      return
    for entry in entries:
      path = rel + entry.name
      if entry.name.startswith("."):
        skipped.append((path, "hidden"))
        continue
      try:
        is_dir = entry.is_dir()  # Follows links.
      except OSError as e:  # ELOOP: a link that leads back to itself, never to a file.
        loop = e.errno == errno.ELOOP
        skipped.append(
          (
            path,
            "symbolic link loop: it never leads to a file"
            if loop
            else f"cannot be read ({e.strerror})",
          )
        )
        continue
      if is_dir:
        real = os.path.realpath(entry.path)
        if real in ancestors:
          raise JobError(
            f"{flag}={src!r}: symbolic link loop: {entry.path} points to {real}, "
            "a folder that contains it; remove the link"
          )
        visit(entry.path, path + "/", ancestors | {real})
      elif not os.path.exists(entry.path):
        skipped.append((path, "broken symbolic link"))
      elif not entry.is_file():
        skipped.append((path, "not a regular file"))
      elif path != path.encode("utf-8", "replace").decode("utf-8"):
        skipped.append((path, "name is not valid UTF-8"))
      else:
        files.append(path)

  visit(src, "", frozenset([os.path.realpath(src)]))
  return sorted(files), skipped

"""Small datasets held in device memory (config.on_device_data): the split, its files, its size.

A split whose images all have one size (CIFAR-10: 50,000 x 32 x 32 x 3, 146 MiB
as uint8) is read once and placed whole on every device of the mesh as uint8
(to_mesh; replicated: every device can then gather any record without
communication, and every process can compute any part of the global batch; a
CIFAR-sized split is small next to a device's memory, and the check_fits rule
refuses one that is not). device_samplers.py draws each train step's batch
from it on the device.

Multi-host: every process holds the whole split (and computes its devices' rows of
the one global batch: device_samplers.py).

The .npz helpers (save_npz, save_encoded_npz, load_npz) hold splits as numpy
arrays (raw uint8, or the image files as one byte buffer); reading them needs
neither TensorFlow nor TFDS (benchmarks/make_device_data.py writes CIFAR-10's).
"""

import os
from typing import NamedTuple, Optional
import zipfile
import zlib

import jax
import numpy as np

from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import ConfigError

# The share of a device's memory the dataset may take: the rest is the model's,
# its optimizer state and the step's activations.
DEVICE_SHARE = 0.5


class Split(NamedTuple):
  """A split held on the mesh: images uint8 [N, H, W, 3] and labels int32 [N] (-1 if
  unlabeled), both replicated on every device."""

  images: jax.Array
  labels: jax.Array


def split_bytes(num: int, height: int, width: int) -> int:
  """Bytes one copy of a split of num uint8 [height, width, 3] images and int32 labels takes."""
  return num * (height * width * 3 + 4)


def _host_available_bytes() -> Optional[int]:
  """MemAvailable of /proc/meminfo in bytes, or None where there is none."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def device_capacity(devices=None) -> tuple:
  """(bytes the dataset may use per device, what that is in words) for the local devices.

  A device that reports memory_stats()['bytes_limit'] (GPU, TPU) may give
  DEVICE_SHARE of it; devices that report none (CPU) share the host's memory,
  so DEVICE_SHARE of the host's available memory is divided among them. (None,
  reason) when neither is known: then no check is made.
  """
  devices = jax.local_devices() if devices is None else devices
  stats = devices[0].memory_stats() or {}
  if stats.get("bytes_limit"):
    limit = int(stats["bytes_limit"])
    return int(limit * DEVICE_SHARE), f"{DEVICE_SHARE:.0%} of {devices[0].device_kind}'s " + (
      f"{limit / 2**30:.1f} GiB"
    )
  available = _host_available_bytes()
  if available is None:
    return None, "unknown (no memory_stats and no /proc/meminfo)"
  return int(available * DEVICE_SHARE / len(devices)), (
    f"{DEVICE_SHARE:.0%} of the host's {available / 2**30:.1f} GiB available memory "
    f"shared by {len(devices)} {devices[0].platform} devices"
  )


def check_fits(num_bytes: int, capacity: Optional[int], where: str, dataset: str):
  """Raises ConfigError on config.on_device_data when a split of num_bytes exceeds capacity.

  capacity, where: device_capacity()'s; None capacity skips the check.
  """
  if capacity is not None and num_bytes > capacity:
    raise ConfigError(
      "on_device_data",
      True,
      f"False for {dataset}: it needs {num_bytes / 2**30:.2f} GiB on every device and "
      f"may use {capacity / 2**30:.2f} GiB ({where}); the host pipeline reads it instead",
    )


def check_config(config, source, num_steps: int):
  """Raises ConfigError, before any data is read, for an on_device_data config that cannot run.

  Checks that the train split's images have one size (the TFDS features' image
  shape: a prepared image folder's photos do not), that it fits the devices
  (check_fits), and that the stream positions of num_steps steps fit int32
  (the device computes them so). Returns (N, H, W).
  """
  features = getattr(source, "features", None)
  shape = getattr(features["image"], "shape", None) if features and "image" in features else None
  if shape is None or len(shape) != 3 or None in shape or shape[2] != 3:
    raise ConfigError(
      "on_device_data",
      True,
      f"False for {source.name}: its images have no single size (image shape {shape}); "
      "the device path holds datasets of equal-size RGB images such as cifar10",
    )
  num = source.num_examples(config.train_split, "train_split")
  height, width, _ = shape
  capacity, where = device_capacity()
  check_fits(
    split_bytes(num, height, width), capacity, where, f"{source.name} {config.train_split}"
  )
  if num_steps * config.batch_size >= 2**31:
    raise ConfigError(
      "on_device_data",
      True,
      f"False for {num_steps} steps of batch {config.batch_size}: the device path "
      "numbers stream positions in int32 (fewer than 2^31 images per run)",
    )
  return num, height, width


def read_split(source, split: str) -> tuple:
  """(images uint8 [N, H, W, 3], labels int32 [N]) of `split` in read order, on the host.

  Every process reads the whole split (source.read_range). Raises ConfigError when
  the images do not all have one size.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  num = source.num_examples(split, "train_split")
  images, labels = [], []
  try:
    for image, label in tfds.as_numpy(source.read_range(split, 0, num).batch(5000)):
      images.append(image)
      labels.append(label)
  except Exception as error:  # tf.data cannot batch images of different sizes.
    if "shape" not in str(error).lower():
      raise
    raise ConfigError(
      "on_device_data", True, f"False for {source.name}: its images differ in size"
    ) from None
  return np.concatenate(images), np.concatenate(labels).astype(np.int32)


def save_npz(path: str, splits: dict):
  """Writes {split: (images uint8 [N, H, W, 3], labels int [N])} to an .npz (np.savez_compressed).

  Arrays are stored as '<split>/images' and '<split>/labels' (int32).
  """
  arrays = {}
  for split, (images, labels) in splits.items():
    arrays[f"{split}/images"] = np.asarray(images, np.uint8)
    arrays[f"{split}/labels"] = np.asarray(labels, np.int32)
  np.savez_compressed(path, **arrays)


def save_encoded_npz(path: str, splits: dict):
  """Writes {split: (encoded image files [N] as bytes, labels int [N])} to an .npz, uncompressed.

  The files (PNG, JPEG: whatever PIL reads) are stored concatenated as
  '<split>/encoded' (uint8) with '<split>/offsets' (int64 [N + 1], file i is
  encoded[offsets[i]:offsets[i + 1]]) and '<split>/labels' (int32): no pickled
  objects, so np.load reads it safely.
  """
  arrays = {}
  for split, (files, labels) in splits.items():
    arrays[f"{split}/encoded"] = np.frombuffer(b"".join(files), np.uint8)
    arrays[f"{split}/offsets"] = np.cumsum([0] + [len(f) for f in files], dtype=np.int64)
    arrays[f"{split}/labels"] = np.asarray(labels, np.int32)
  np.savez(path, **arrays)


def _decode(buffer: np.ndarray, offsets: np.ndarray) -> np.ndarray:
  """uint8 [N, H, W, 3] of the image files in buffer (save_encoded_npz's layout), decoded with
  PIL. A JPEG's pixels may differ from TensorFlow's decode of it (another libjpeg build's
  upsampling and IDCT): by up to 4 grey levels, about 1 on average, on the shared CIFAR-10's
  files.

  Raises:
    ValueError: a file that PIL cannot decode (naming its index), or images of different sizes.
  """
  import io  # pylint: disable=g-import-not-at-top

  from PIL import Image  # pylint: disable=g-import-not-at-top

  def decode(i):
    try:
      with Image.open(io.BytesIO(buffer[offsets[i] : offsets[i + 1]].tobytes())) as image:
        return np.asarray(image.convert("RGB"))
    except OSError as e:  # PIL's UnidentifiedImageError, a truncated file.
      raise ValueError(f"its image file {i} cannot be decoded ({type(e).__name__})") from None

  return np.stack([decode(i) for i in range(len(offsets) - 1)])


def _npz_arrays(path: str, split: str) -> tuple:
  """load_npz's (images, labels), or ConfigError for a split the file lacks; whatever else is
  wrong with the file raises what numpy, zipfile or _decode raise."""
  with np.load(path) as data:
    held = sorted({key.split("/")[0] for key in data.files})
    labels = data[f"{split}/labels"] if f"{split}/labels" in data.files else None
    if labels is None:
      raise ConfigError("train_split", split, f"one of the splits in {path}: {held}")
    if f"{split}/images" in data.files:
      return data[f"{split}/images"], labels
    return _decode(data[f"{split}/encoded"], data[f"{split}/offsets"]), labels


def load_npz(path: str, split: str) -> tuple:
  """(images uint8 [N, H, W, 3], labels int32 [N]) of `split` in an .npz of save_npz (numpy
  only) or save_encoded_npz (numpy and PIL, _decode): no TensorFlow either way.

  Raises:
    ConfigError: no such file, no such split in it (naming those it holds), or a file
      that is not such an .npz, naming the file and what is wrong: another kind of file,
      a truncated or damaged one, an image file that cannot be decoded, arrays of other
      shapes.
  """
  allowed = "an .npz written by save_npz or save_encoded_npz"
  if not os.path.exists(path):
    raise ConfigError("device_data_file", path, f"{allowed} (no such file)")
  try:
    images, labels = _npz_arrays(path, split)
  except ConfigError:
    raise
  except zipfile.BadZipFile as e:
    raise ConfigError(
      "device_data_file", path, f"{allowed}; it is no whole zip archive, truncated or damaged ({e})"
    ) from None
  except ValueError as e:
    what = (
      "it is neither a zip archive nor an .npy array"
      if "pickled" in str(e)
      else f"split {split!r} cannot be read: {str(e).splitlines()[0]}"
    )
    raise ConfigError("device_data_file", path, f"{allowed}; {what}") from None
  except (OSError, EOFError, zlib.error) as e:
    raise ConfigError(
      "device_data_file", path, f"{allowed}; split {split!r} cannot be read ({e})"
    ) from None
  if (
    images.dtype != np.uint8
    or images.ndim != 4
    or images.shape[3] != 3
    or (labels.shape != images.shape[:1])
  ):
    raise ConfigError(
      "device_data_file",
      path,
      f"{allowed}; split {split!r} holds images {images.dtype} {list(images.shape)} and "
      f"labels {list(labels.shape)}, not uint8 [N, H, W, 3] and [N]",
    )
  return images, labels.astype(np.int32)


def to_mesh(images: np.ndarray, labels: np.ndarray, mesh) -> Split:
  """The split replicated on every device of the mesh (every process passes the same arrays)."""
  sharding = mesh_lib.replicated(mesh)

  def put(x):
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return Split(put(np.ascontiguousarray(images, np.uint8)), put(np.asarray(labels, np.int32)))

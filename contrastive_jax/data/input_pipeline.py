"""Host input pipeline: tf.data over a data source (sources.py), one part per process.

Training examples are two random-resized-crop-and-flip views of one image
(crops.py: each reference's crop sampler), as uint8 so that host-to-device
transfers stay small; the photometric augmentations run on the device
(augment.py).

Exact resume: the order of the stream and every random crop are functions of
(seed, process, position in the stream), so a pipeline started at step s
yields exactly what an uninterrupted one yields from step s on. The crop of
the example at stream position p is drawn with a stateless seed made from
(seed, process, p). The order depends on how the source stores the data:

  random access (ArrayRecord, records.Records): position p of a process whose
      part holds n records reads record perm_e(p mod n) of its part in epoch
      e = p // n, perm_e a stateless permutation of the whole part
      (epoch_permutation: index_shuffle's cipher, keyed by Philox draws from
      (seed, e)): a fresh order every epoch, independent of the last, and a
      resume at any step reads only what it uses.
  a stream (TFRecord): epoch e is the part in file order through a shuffle
      buffer seeded by (seed, e), a full permutation only if the buffer holds
      the whole part (CIFAR-10's presets); a resume skips the records before
      its position in the epoch. train_batches warns when either costs.

JPEG images are decoded only over their crop windows
(crops.decode_random_resized_crops), with the same pixels as a whole decode.
"""

import functools
import math
from typing import Iterator, NamedTuple, Optional

from absl import logging
import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.data import crop_spec
from contrastive_jax.data import crops


def _seed_pair(seed: int, a, b):
  """A stateless-op seed [2] int64 from (seed, a, b) (a, b scalar tensors)."""
  return tf.stack(
    [tf.cast(seed, tf.int64) * 1_000_003 + tf.cast(a, tf.int64), tf.cast(b, tf.int64)]
  )


class EvalCrop(NamedTuple):
  """The evaluation's centre crop of a pretrained encoder: how every reader of it crops images.

  size: S, the crop's side in pixels (the pretraining run's image_size);
  fraction: the share of the image's shorter side the crop covers, in (0, 1]
  (config.eval_crop_fraction); resize: the crop_spec.RESIZES name that resizes it
  (config.crop.resize). Every file the project writes stores it as
  {"size", "fraction", "resize"} under the name "eval_crop" (embed.json,
  export.json, the ONNX model's metadata).
  """

  size: int
  fraction: float
  resize: str

  @classmethod
  def of(cls, config) -> "EvalCrop":
    """The eval crop of a pretraining config (its image_size, eval_crop_fraction, crop.resize)."""
    return cls(int(config.image_size), float(config.eval_crop_fraction), str(config.crop.resize))

  def shorter_side(self, size: Optional[int] = None) -> int:
    """The shorter side (pixels) an image file is downscaled to, antialiased, before its crop
    to `size` (default S): the crop's own scale, so that the crop's resize hardly resamples."""
    return math.ceil((size or self.size) / self.fraction)

  def apply(self, image, size: Optional[int] = None):
    """center_crop of image (uint8 [H, W, 3]) to [size, size] (default S), uint8."""
    return center_crop(image, size or self.size, self.fraction, self.resize)


def center_crop(image, size: int, crop_fraction: float, resize: str):
  """Central crop of crop_fraction of the shorter side, resized to [size, size] uint8.

  image: uint8 [H, W, 3] of any size; resize: a crop_spec.RESIZES name, whose
  method (bilinear or bicubic) resizes the crop, always with antialiasing
  when it shrinks, as PIL's resize in torchvision's evaluation transform
  (MoCo). SimCLR's and BYOL's TF evaluation resizes without antialiasing; we
  antialias on purpose, so that a large photo is not aliased. A crop smaller
  than size is upscaled (antialiasing does nothing then), down to a single
  pixel. An image of exactly [size, size] with crop_fraction 1 (CIFAR) keeps
  its pixels.
  """
  if crop_fraction == 1.0 and tuple(image.shape[:2]) == (size, size):
    return image  # Already the right size (CIFAR): keep the exact pixels.
  shape = tf.shape(image)
  side = tf.cast(tf.cast(tf.minimum(shape[0], shape[1]), tf.float32) * crop_fraction, tf.int32)
  side = tf.maximum(side, 1)
  top, left = (shape[0] - side) // 2, (shape[1] - side) // 2
  crop = tf.image.resize(
    image[top : top + side, left : left + side],
    [size, size],
    method=crop_spec.RESIZES[resize][0],
    antialias=True,
  )
  return tf.cast(tf.clip_by_value(tf.round(crop), 0, 255), tf.uint8)


def _options(threads: int) -> tf.data.Options:
  options = tf.data.Options()
  options.deterministic = True
  # A private pool of `threads` threads keeps the host pipeline from competing
  # with XLA's own threads for the cores.
  options.threading.private_threadpool_size = threads
  options.threading.max_intra_op_parallelism = 1
  return options


# Rounds of index_shuffle's cipher (TF's reduced Simon). The 4 that
# tf.random.experimental.index_shuffle runs leave consecutive epochs' orders
# correlated and neighbouring positions reading related records from about
# 30,000 records on, even with well-mixed keys; 16 measured at noise level from
# 1,000 to 1,000,000 records (docs/design.md, Data order).
_ORDER_ROUNDS = 16


def _drops_top(max_index: int) -> bool:
  """Whether index_shuffle's cipher cannot hold max_index (TF 2.21).

  Its block is ceil(log2(max_index)) bits, made even and at least 16: an even
  power of two from 2^16 on needs one bit more, so the permutation maps
  max_index where it maps 0 and never returns max_index.
  """
  return max_index >= 2**16 and max_index & (max_index - 1) == 0 and max_index.bit_length() % 2 == 1


def epoch_permutation(index, num: int, seed: int, epoch):
  """perm_e(index): the index into a part of `num` records at place `index` of epoch e.

  index: int64 scalar or vector in [0, num); epoch: int64 scalar. perm_e is
  the permutation of [0, num) that index_shuffle's cipher (_ORDER_ROUNDS
  rounds) computes with a key of three int64 words drawn by Philox
  (tf.random.stateless_uniform) from the seed pair (seed * 1_000_003 + e, -1)
  (-1: the crops' seeds, (seed, process, p), have a second half >= 0).
  The key is drawn rather than (seed, e) itself because the cipher gives
  related permutations for neighbouring keys. Where the cipher would drop
  index num - 1 (_drops_top), it permutes [0, num] instead, and the index
  that lands on num takes num's image (cycle walking).
  """
  pair = tf.stack([tf.cast(seed, tf.int64) * 1_000_003 + epoch, tf.constant(-1, tf.int64)])
  key = tf.random.stateless_uniform([3], seed=pair, minval=None, maxval=None, dtype=tf.int64)
  top = num if _drops_top(num - 1) else num - 1

  def shuffle(i):
    return tf.raw_ops.RandomIndexShuffle(
      index=i, seed=key, max_index=tf.constant(top, tf.int64), rounds=_ORDER_ROUNDS
    )

  shuffled = shuffle(index)
  if top == num - 1:
    return shuffled
  return tf.where(shuffled < num, shuffled, shuffle(tf.constant(top, tf.int64)))


def epoch_order(position, num: int, seed: int):
  """The index into a part of `num` records read at stream position `position` (int64 scalars).

  Position p reads epoch_permutation(p mod num) of epoch e = p // num: a
  pure function of (seed, p), so a resume starts anywhere without a skip.
  Scalars only: one epoch's key per call.
  """
  return epoch_permutation(position % num, num, seed, position // num)


# Records fetched per call into Python on the random-access path.
_FETCH = 32


def _random_access_stream(records, seed: int, first: int, threads: int) -> tf.data.Dataset:
  """(encoded image, label) at stream positions first, first + 1, ... (epoch_order of records)."""
  num = len(records)
  indices = tf.data.Dataset.range(first, np.iinfo(np.int64).max).map(
    lambda position: epoch_order(position, num, seed)
  )
  return (
    indices.batch(_FETCH).map(lambda i: records.read(i)[:2], num_parallel_calls=threads).unbatch()
  )


def _stream(
  source, split: str, *, num: int, seed: int, first: int, cache: bool, shuffle_buffer: int
) -> tf.data.Dataset:
  """(image, label) at stream positions first, first + 1, ... of a source read in file order.

  Each epoch passes through a shuffle buffer seeded by (seed, epoch); images are
  decoded if cached, else encoded (uncached, large datasets keep them encoded
  through the shuffle buffer and the skip of a resume).
  """
  base = source.read(split, drop_remainder=True, decode=cache)
  if cache:
    base = base.cache()
  start_epoch, offset = divmod(first, num)
  ds = tf.data.Dataset.range(start_epoch, np.iinfo(np.int64).max).flat_map(
    lambda epoch: base.shuffle(shuffle_buffer, seed=seed * 10_007 + epoch)
  )
  return ds.skip(offset)


def train_dataset(
  source,
  split: str,
  *,
  local_batch: int,
  image_size: int,
  crop: crop_spec.CropSpec,
  seed: int,
  start_step: int,
  cache: bool,
  shuffle_buffer: int,
  threads: int,
  num_views: int = 2,
  local_crops: Optional[crop_spec.LocalCrops] = None,
) -> tf.data.Dataset:
  """Infinite dataset of this process's batches from step `start_step` on.

  Each element is {'image': uint8 [local_batch, num_views, S, S, 3], 'label':
  int32 [local_batch]}: num_views independent random-resized-crop-and-flip views
  of the same image in axis 1 (crops.random_resized_crop with crop's sampler,
  area_min and resize, to S = image_size). With local_crops (multi-crop), also
  'local_image': uint8 [local_batch, N, s, s, 3], N = local_crops.number views of
  s = local_crops.size pixels with area fractions in [area_min, area_max), each
  with its own seed (the global views' seeds unchanged); a JPEG is then decoded
  twice, over the union of the global windows and of the local ones. The stream is
  never padded: batches run across epoch boundaries as after repeat() and
  batch(drop_remainder=True).
  Steps per epoch for schedules: split size // global batch.

  A source with random_access is read by index in epoch_order (cache and
  shuffle_buffer unused); any other is streamed (module docstring).
  """
  num_local = source.process_counts(split, drop_remainder=True)[jax.process_index()]
  first = start_step * local_batch
  decoded = cache and not source.random_access
  if source.random_access:
    ds = _random_access_stream(source.records(split), seed, first, threads)
  else:
    ds = _stream(
      source,
      split,
      num=num_local,
      seed=seed,
      first=first,
      cache=cache,
      shuffle_buffer=shuffle_buffer,
    )
  positions = tf.data.Dataset.range(first, np.iinfo(np.int64).max)
  process = jax.process_index()

  def cropped(image, seeds, size, area_min, area_max):
    if decoded:
      return tf.stack(
        [
          crops.random_resized_crop(
            image, seeds[v], size, crop.sampler, area_min, crop.resize, area_max
          )
          for v in range(seeds.shape[0])
        ]
      )
    return crops.decode_random_resized_crops(
      image, seeds, size, crop.sampler, area_min, crop.resize, area_max
    )

  def views(example, position):
    image, label = example
    pair = _seed_pair(seed, process, position)
    seeds = tf.random.experimental.stateless_split(pair, num_views)
    out = {"image": cropped(image, seeds, image_size, crop.area_min, 1.0), "label": label}
    if local_crops is not None:
      # The local views' seeds: a split of the pair's own (the global views' stay as
      # without multi-crop).
      local_pair = tf.random.experimental.stateless_split(pair, num_views + 1)[num_views]
      local_seeds = tf.random.experimental.stateless_split(local_pair, local_crops.number)
      out["local_image"] = cropped(
        image, local_seeds, local_crops.size, local_crops.area_min, local_crops.area_max
      )
    return out

  ds = tf.data.Dataset.zip(ds, positions).map(views, num_parallel_calls=threads)
  ds = ds.batch(local_batch, drop_remainder=True).prefetch(2)
  return ds.with_options(_options(threads))


def stream_cost_warning(source, split: str, *, cache: bool, shuffle_buffer: int):
  """The warning line train_batches logs for a streamed source whose order or resume costs, or None.

  A stream (not source.random_access) is only window-shuffled when this
  process's part exceeds shuffle_buffer, and an uncached one reads its files
  up to a resume's position in its epoch before the first batch.
  """
  num = source.process_counts(split, drop_remainder=True)[jax.process_index()]
  costs = []
  if num > shuffle_buffer:
    costs.append(
      f"each epoch is shuffled only within windows of shuffle_buffer={shuffle_buffer} "
      f"of this process's {num} records, in the same file order every epoch"
    )
  if not cache:
    costs.append(
      f"a resume at step s first reads and skips the (s x local batch) mod {num} "
      "records before its position in the epoch"
    )
  if source.random_access or not costs:
    return None
  return (
    f"{source.name} {split} is stored as TFRecord and read as a stream: "
    f"{'; '.join(costs)}. Prepare it once as ArrayRecord for a fresh full shuffle every "
    "epoch and resumes at no cost: an image folder with the prepare job (it writes "
    f"ArrayRecord), a TFDS dataset with tfds.builder('{source.name}', "
    "data_dir=NEW_DATA_DIR, file_format='array_record').download_and_prepare(), then "
    "set data_dir=NEW_DATA_DIR (docs/design.md, Data order)."
  )


def eval_dataset(
  source,
  split: str,
  *,
  local_batch: int,
  eval_crop: EvalCrop,
  threads: int,
  cache: bool = False,
  names: bool = False,
) -> tf.data.Dataset:
  """This process's part of `split`, every example once, in fixed order.

  Elements are {'image': uint8 [local_batch, S, S, 3] (eval_crop.apply), 'label': int32 [b],
  'mask': bool [b]}, and with names=True 'name': string [b] (source.read's
  names). The last batches are padded with mask False (name '') so that
  every process yields the same number of batches (multi-host collectives
  need it).
  """
  counts = source.process_counts(split)
  num_batches = -(-max(counts) // local_batch)

  def example(image, label, name=None):
    named = {} if name is None else {"name": name}
    return {"image": eval_crop.apply(image), "label": label, "mask": True, **named}

  pad = tf.data.Dataset.from_tensors(
    {
      "image": tf.zeros([eval_crop.size, eval_crop.size, 3], tf.uint8),
      "label": tf.constant(0, tf.int32),
      "mask": False,
      **({"name": tf.constant("")} if names else {}),
    }
  ).repeat()
  if counts[jax.process_index()]:
    ds = source.read(split, drop_remainder=False, names=names).map(
      example, num_parallel_calls=threads
    )
    if cache:
      ds = ds.cache()
    ds = ds.concatenate(pad)
  else:  # A split smaller than the process count leaves this process nothing to read.
    ds = pad
  ds = ds.take(num_batches * local_batch)
  ds = ds.batch(local_batch, drop_remainder=True).prefetch(2)
  return ds.with_options(_options(threads))


def train_batches(source, config, sharding, *, image_size: int, num_views: int = 2):
  """A job's start_step -> iterator of global training batches (train_dataset,
  mesh_lib.device_batches).

  Reads config.train_split, batch_size (global), crop (crop_spec.CropSpec's fields),
  seed, cache, shuffle_buffer and data_threads; each process reads
  its own part. Logs stream_cost_warning's line, if any, now: before any compute.
  """
  warning = stream_cost_warning(
    source, config.train_split, cache=config.cache, shuffle_buffer=config.shuffle_buffer
  )
  if warning:
    logging.warning(warning)

  def batches(start_step: int) -> Iterator[dict]:
    return mesh_lib.device_batches(
      tfds.as_numpy(
        train_dataset(
          source,
          config.train_split,
          local_batch=config.batch_size // jax.process_count(),
          image_size=image_size,
          crop=crop_spec.CropSpec(**config.crop),
          seed=config.seed,
          start_step=start_step,
          cache=config.cache,
          shuffle_buffer=config.shuffle_buffer,
          threads=config.data_threads,
          num_views=num_views,
          local_crops=(
            crop_spec.LocalCrops(**config.local_crops) if config.get("local_crops") else None
          ),
        )
      ),
      sharding,
    )

  return batches


def eval_datasets(source, *, eval_crop: EvalCrop, threads: int, cache: bool):
  """(split, local_batch) -> an iterable of eval_dataset's numpy batches (tfds.as_numpy: each
  iteration reads the split again), built once per pair so that an in-memory cache persists
  across evaluations."""

  @functools.lru_cache(maxsize=None)
  def dataset(split, local_batch):
    return tfds.as_numpy(
      eval_dataset(
        source, split, local_batch=local_batch, eval_crop=eval_crop, threads=threads, cache=cache
      )
    )

  return dataset

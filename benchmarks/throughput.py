"""What bounds a pretraining run on this machine: the host input pipeline or the step.

  python benchmarks/throughput.py --config=configs/simclr_images.py:runlocal \\
      --dataset=NAME --data_dir=DIR --threads=2
  python benchmarks/throughput.py --config=configs/simclr_images.py --folder=PHOTOS

On the devices present (CPU, GPU or TPU), one run measures and prints as markdown:

- host: images/s (images, not views) of the project's training input pipeline,
  input_pipeline.train_dataset, on the dataset's train split, uncached, two views at
  --image_size, with --threads threads: --warmup_batches untimed batches (they fill
  the shuffle buffer), then --batches timed ones of config.batch_size. Beside it two
  peer pipelines written here with the same threads, the textbook one of SimCLR's
  and BYOL's reference code: the encoded images (source.read(decode=False)),
  shuffled, each made into two views by tf.image.sample_distorted_bounding_box on
  the shape in the JPEG header (SimCLR's crop constants, area from
  config.crop.area_min), tf.image.decode_and_crop_jpeg of that window, the config's
  resize to --image_size and a random flip; and the same with the whole image
  decoded and then cropped. Per core is images/s / min(--threads, cores), the
  cores being this process's (os.sched_getaffinity).
- step: the config's pretraining step (the job's jitted step at --image_size, with
  the online probe of a labelled dataset) on a fixed uint8 batch after compilation:
  seconds per step, images/s, and MFU = FLOPs per step (XLA's cost analysis of the
  compiled step, all devices) / step time / peak FLOP/s of all devices. The peak is
  --peak_tflops per device if given, else the accelerator's dense peak for the
  model's compute dtype (benchmarks/capacity.py's ACCELERATORS, matched by JAX's
  device_kind), else on CPU a --matmul_size square matmul in that dtype timed in
  this run, before and after the rest, the faster counting (the CPU devices share the
  machine's cores: the peak is the machine's).
- verdict: per accelerator chip (on CPU, the machine), the host cores the pipeline
  needs to feed the step (step images/s per chip / host images/s per core), and which
  of the two sets the pace with --threads here.

The dataset is --dataset in --data_dir (prepared by the prepare job or any TFDS image
dataset stored as JPEG), or --folder, a folder of photos prepared first into a
temporary folder (at full size, as the prepare job's image_size=0 stores them). On
CPU the host rows and the step are measured one after the other, each with every
core; in training they would share them.
"""

import dataclasses
import math
import os
import re
import subprocess
import sys
import tempfile
import time

# Measure the package this script sits in, not another installed copy of it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from contrastive_jax.core import runtime

if __name__ == "__main__":
  runtime.setup()  # Every process setting first, before the imports below (core/runtime.py).

from absl import app
from absl import flags
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
from ml_collections import config_flags
import tensorflow as tf

from benchmarks import capacity
from benchmarks import common
from contrastive_jax.core import metrics
from contrastive_jax.core.errors import JobError
from contrastive_jax.data import crop_spec
from contrastive_jax.data import sources
from contrastive_jax.jobs import pretrain

FOLDER_DATASET = "throughput_folder"  # The name --folder is prepared under.


def cores() -> int:
  """CPU cores this process may run on."""
  return len(os.sched_getaffinity(0))


def prepare_folder(folder: str, data_dir: str) -> str:
  """Prepares folder's photos at full size as FOLDER_DATASET in data_dir; returns the name.

  Runs the prepare job's command line (main.py's flags would clash with this script's).
  Raises:
    JobError: the prepare job failed (its last line says why).
  """
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  command = [
    sys.executable,
    "-m",
    "contrastive_jax.main",
    f"--config={os.path.join(root, 'configs', 'prepare.py')}",
    f"--config.src={folder}",
    f"--config.name={FOLDER_DATASET}",
    f"--workdir={data_dir}",
    "--config.image_size=0",
  ]
  env = dict(
    os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
  )
  done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
  if done.returncode:
    last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise JobError(f"--folder={folder!r}: the prepare job failed: {last.removeprefix('error: ')}")
  return FOLDER_DATASET


def peer_views(encoded, *, image_size: int, area_min: float, resize: str, decode_window: bool):
  """Two random crop-resize-flip views, uint8 [2, S, S, 3], of one JPEG (a string tensor).

  The crop window is tf.image.sample_distorted_bounding_box's on the header's shape
  (SimCLR's constants, crops.py); decode_window=True decodes only that window
  (tf.image.decode_and_crop_jpeg), False decodes the whole image and slices it.
  """
  method, antialias = crop_spec.RESIZES[resize]
  shape = tf.io.extract_jpeg_shape(encoded)
  image = None if decode_window else tf.io.decode_jpeg(encoded, channels=3)
  views = []
  for _ in range(2):
    begin, size, _ = tf.image.sample_distorted_bounding_box(
      shape,
      bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
      min_object_covered=crop_spec.SIMCLR_MIN_OBJECT_COVERED,
      aspect_ratio_range=crop_spec.ASPECT_RANGE,
      area_range=(area_min, 1.0),
      max_attempts=crop_spec.SIMCLR_MAX_ATTEMPTS,
      use_image_if_no_bounding_boxes=True,
    )
    if decode_window:
      crop = tf.io.decode_and_crop_jpeg(
        encoded, tf.stack([begin[0], begin[1], size[0], size[1]]), channels=3
      )
    else:
      crop = image[begin[0] : begin[0] + size[0], begin[1] : begin[1] + size[1]]
    crop = tf.image.resize(crop, [image_size, image_size], method=method, antialias=antialias)
    crop = tf.image.random_flip_left_right(crop)
    views.append(tf.cast(tf.clip_by_value(tf.round(crop), 0, 255), tf.uint8))
  return tf.stack(views)


def peer_pipeline(source, config, *, shuffle_buffer: int, decode_window: bool):
  """The textbook pipeline over source's train split: batches as train_dataset's.

  {'image': uint8 [B, 2, S, S, 3], 'label': int32 [B]}, with config's batch_size,
  image_size, crop.area_min, crop.resize and data_threads (a private pool of that many
  threads, one per op, as the project's).
  """

  def example(encoded, label):
    return {
      "image": peer_views(
        encoded,
        image_size=config.image_size,
        area_min=config.crop.area_min,
        resize=config.crop.resize,
        decode_window=decode_window,
      ),
      "label": label,
    }

  ds = source.read(config.train_split, drop_remainder=True, decode=False)
  ds = ds.shuffle(shuffle_buffer).repeat().map(example, num_parallel_calls=config.data_threads)
  ds = ds.batch(config.batch_size, drop_remainder=True).prefetch(2)
  options = tf.data.Options()
  options.threading.private_threadpool_size = config.data_threads
  options.threading.max_intra_op_parallelism = 1
  return ds.with_options(options)


def matmul_flops_per_second(size: int, dtype, repeats: int = 10) -> float:
  """FLOP/s of the fastest of `repeats` [size, size] @ [size, size] products in dtype on the
  default device, counted as 2 size^3 each (compiled and run once before)."""
  a = jnp.ones((size, size), dtype)
  matmul = jax.jit(lambda x: x @ x).lower(a).compile()
  jax.block_until_ready(matmul(a))
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(matmul(a))
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best


def accelerator_name(device_kind: str):
  """The key of capacity.ACCELERATORS whose device_kind pattern matches, or None."""
  return next(
    (
      name
      for name, acc in capacity.ACCELERATORS.items()
      if acc.device_kind and re.fullmatch(acc.device_kind, device_kind)
    ),
    None,
  )


def peak_flops(dtype: str, *, peak_tflops: float, matmul_size: int):
  """(peak FLOP/s of all devices, where it comes from) for compute dtype 'float32' or
  'bfloat16'.

  Raises:
    ValueError: an accelerator ACCELERATORS does not know, without --peak_tflops.
  """
  devices = jax.devices()
  kind = devices[0].device_kind
  if peak_tflops > 0:
    return peak_tflops * 1e12 * len(devices), f"--peak_tflops={peak_tflops:g} per device"
  if devices[0].platform == "cpu":
    measured = matmul_flops_per_second(matmul_size, jnp.dtype(dtype))
    return measured, f"measured here: {dtype} {matmul_size}^3 matmul, all {cores()} cores"
  name = accelerator_name(kind)
  if name is None:
    raise ValueError(f"no peak FLOP/s known for device_kind {kind!r}: pass --peak_tflops")
  acc = capacity.ACCELERATORS[name]
  per_device = acc.peak_bf16_flops if dtype == "bfloat16" else acc.peak_fp32_default_flops
  return per_device * len(devices), (
    f"{name} dense {dtype} peak {per_device / 1e12:g} TFLOP/s per device, {acc.source}"
  )


@dataclasses.dataclass
class Measurement:
  """One run's numbers (rates in images/s, times in seconds, FLOPs per step of all devices)."""

  config_name: str
  dataset: str
  num_train: int
  batch_size: int
  image_size: int
  threads: int
  cores: int
  batches: int  # timed per pipeline and round
  rounds: int
  host: dict  # row label -> seconds per batch, the best round's
  step_seconds: float
  step_flops: float
  peak_flops: float
  peak_source: str
  platform: str
  device_kind: str
  num_devices: int
  load: tuple  # os.getloadavg() before measuring

  @property
  def chips(self) -> int:
    """Accelerator chips fed by this host; on CPU the machine is one."""
    return 1 if self.platform == "cpu" else self.num_devices

  def host_rate(self, label: str) -> float:
    return self.batch_size / self.host[label]

  def per_core(self, label: str) -> float:
    return self.host_rate(label) / min(self.threads, self.cores)

  @property
  def step_rate(self) -> float:
    return self.batch_size / self.step_seconds

  @property
  def mfu(self) -> float:
    return self.step_flops / self.step_seconds / self.peak_flops


PROJECT = "host: project pipeline (input_pipeline.train_dataset)"
PEER_WINDOW = "host: peer, header shape + decode_and_crop_jpeg"
PEER_WHOLE = "host: peer, decode whole image, then crop"


def measure(
  config,
  source,
  *,
  warmup_batches: int,
  batches: int,
  rounds: int,
  steps: int,
  peak_tflops: float,
  matmul_size: int,
  config_name: str = "",
) -> Measurement:
  """Times the host pipelines and the step of config (already set to the dataset, image
  size and threads) on source; see the module docstring."""
  load = os.getloadavg()
  peak_before = peak_flops(config.model.dtype, peak_tflops=peak_tflops, matmul_size=matmul_size)
  shuffle_buffer = config.shuffle_buffer
  pipelines = {
    PROJECT: common.train_pipeline(config, source, shuffle_buffer=shuffle_buffer),
    PEER_WINDOW: peer_pipeline(source, config, shuffle_buffer=shuffle_buffer, decode_window=True),
    PEER_WHOLE: peer_pipeline(source, config, shuffle_buffer=shuffle_buffer, decode_window=False),
  }
  host = {label: math.inf for label in pipelines}
  # Rounds interleave the pipelines, each started afresh (a paused one would have filled
  # its buffers); the best round is the one least slowed by whatever else runs.
  for _ in range(rounds):
    for label, ds in pipelines.items():
      host[label] = min(
        host[label],
        common.seconds_per_batch(ds.as_numpy_iterator(), warmup=warmup_batches, timed=batches),
      )
  run, state, batch = common.step_setup(config)
  compiled = run.train_step.lower(state, batch).compile()
  # The cost analysis is one device's program; every device runs one.
  flops = common.cost(compiled)["flops"] * jax.device_count()
  state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  step_seconds, _ = common.seconds_per_step(compiled, state, batch, steps)
  # On CPU measured before and after all the rest, the faster counting (as the rounds).
  peak, peak_source = max(
    peak_before, peak_flops(config.model.dtype, peak_tflops=peak_tflops, matmul_size=matmul_size)
  )
  device = jax.devices()[0]
  return Measurement(
    config_name=config_name,
    dataset=f"{source.name} {config.train_split}",
    num_train=source.num_examples(config.train_split, "train_split"),
    batch_size=config.batch_size,
    image_size=config.image_size,
    threads=config.data_threads,
    cores=cores(),
    batches=batches,
    rounds=rounds,
    host=host,
    step_seconds=step_seconds,
    step_flops=flops,
    peak_flops=peak,
    peak_source=peak_source,
    platform=device.platform,
    device_kind=device.device_kind,
    num_devices=jax.device_count(),
    load=load,
  )


def report(m: Measurement) -> str:
  """The measurement as markdown: what was run, a table of rates, and the verdict."""
  used = min(m.threads, m.cores)
  lines = [
    f"{m.num_devices} x {m.platform} ({m.device_kind}); host: {m.cores} cores "
    f"(os.sched_getaffinity), --threads={m.threads}; load average "
    f"{' '.join(f'{x:.2f}' for x in m.load)} before measuring",
    f"data: {m.dataset} ({m.num_train} images), batches of {m.batch_size} images x 2 "
    f"views at {m.image_size} px; step: {m.config_name}",
    "",
    "| measured | images/s | images/s per core | s per batch or step | MFU | how |",
    "|---|---|---|---|---|---|",
  ]
  for label in m.host:
    lines.append(
      f"| {label} | {m.host_rate(label):.1f} | {m.per_core(label):.1f} | "
      f"{m.host[label]:.3f} |  | best of {m.rounds} rounds of {m.batches} batches, "
      f"{m.threads} threads on {used} cores |"
    )
  achieved = m.step_flops / m.step_seconds
  lines.append(
    f"| step: train step on a fixed batch | {m.step_rate:.1f} |  | "
    f"{m.step_seconds:.3f} | {m.mfu:.3f} | {m.step_flops:.4g} FLOP/step (XLA cost "
    f"analysis), {achieved / 1e12:.4g} of {m.peak_flops / 1e12:.4g} TFLOP/s "
    f"({m.peak_source}) |"
  )
  per_chip = m.step_rate / m.chips
  per_core = m.per_core(PROJECT)
  host_rate = m.host_rate(PROJECT)
  pace = "the host pipeline" if host_rate < m.step_rate else "the step"
  chip = (
    "the CPU (one chip: its devices share the cores)"
    if m.platform == "cpu"
    else (f"one {m.device_kind}")
  )
  lines += [
    "",
    f"Verdict, for the project pipeline: the step on {chip} takes {per_chip:.1f} "
    f"images/s; a host core makes {per_core:.1f} images/s of two views.",
    "",
    "| chips | step images/s per chip | host cores needed per chip | host cores "
    "needed, all chips | cores here | pipeline images/s here | step images/s | pace "
    "set by |",
    "|---|---|---|---|---|---|---|---|",
    f"| {m.chips} | {per_chip:.1f} | {per_chip / per_core:.2f} | "
    f"{m.step_rate / per_core:.2f} | {m.cores} | {host_rate:.1f} | {m.step_rate:.1f} | "
    f"{pace} |",
  ]
  return "\n".join(lines)


def define_flags():
  """Registers the command-line flags (not at import, so that tests can import this file)."""
  config_flags.DEFINE_config_file("config", None, "Pretraining config (overrides allowed).")
  flags.DEFINE_string("dataset", None, "A prepared TFDS dataset (JPEG images) to read.")
  flags.DEFINE_string("data_dir", None, "Where --dataset is (default: TFDS_DATA_DIR).")
  flags.DEFINE_string(
    "folder",
    None,
    "A folder of photos to prepare first (instead of --dataset), into a temporary folder.",
  )
  flags.DEFINE_integer("image_size", 224, "View size in pixels, of the pipelines and the step.")
  flags.DEFINE_integer("threads", cores(), "Host pipeline threads (default: every core).")
  flags.DEFINE_integer("warmup_batches", 3, "Untimed batches before each pipeline's timing.")
  flags.DEFINE_integer("batches", 10, "Timed batches per pipeline and round.")
  flags.DEFINE_integer("rounds", 3, "Rounds over the pipelines; each one's best counts.")
  flags.DEFINE_integer("steps", 5, "Timed steps.")
  flags.DEFINE_float(
    "peak_tflops",
    0.0,
    "Peak TFLOP/s per device for the MFU (0: known accelerators' dense peak, or on CPU measured).",
  )
  flags.DEFINE_integer("matmul_size", 2048, "Side of the matmul that measures a CPU's peak.")
  flags.mark_flag_as_required("config")


def check_flags(args):
  """Raises app.UsageError naming the first flag that cannot run."""
  if (args.dataset is None) == (args.folder is None):
    raise app.UsageError("pass one of --dataset (a prepared dataset) or --folder (photos)")
  if args.folder is not None and args.data_dir is not None:
    raise app.UsageError(
      "--data_dir goes with --dataset; --folder is prepared into a temporary folder"
    )
  for name in ("image_size", "threads", "batches", "rounds", "steps", "matmul_size"):
    if args[name].value < 1:
      raise app.UsageError(f"--{name}={args[name].value}: must be >= 1")
  if args.warmup_batches < 0 or args.peak_tflops < 0:
    raise app.UsageError("--warmup_batches and --peak_tflops must be >= 0")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  args = flags.FLAGS
  check_flags(args)
  metrics.quiet_library_logs()
  config = args.config.copy_and_resolve_references()
  config.image_size, config.data_threads = args.image_size, args.threads
  config.data_source, config.cache = "tfds", False
  try:
    with tempfile.TemporaryDirectory(prefix="throughput_") as tmp:
      if args.folder is not None:
        config.dataset, config.data_dir = prepare_folder(args.folder, tmp), tmp
      else:
        config.dataset, config.data_dir = args.dataset, args.data_dir
      pretrain.check_config(config, jax.device_count())
      source = sources.get_source(config, {"train_split": config.train_split})
      m = measure(
        config,
        source,
        warmup_batches=args.warmup_batches,
        batches=args.batches,
        rounds=args.rounds,
        steps=args.steps,
        peak_tflops=args.peak_tflops,
        matmul_size=args.matmul_size,
        config_name=common.config_name(args["config"]),
      )
  except (JobError, ValueError) as e:
    sys.exit(f"error: {e}")
  except tf.errors.InvalidArgumentError as e:
    sys.exit(f"error: {config.dataset}: the peer pipelines need JPEG images ({e.message})")
  print(report(m), flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)

"""Capacity plan: what a config needs per chip on an N-chip slice, and how fast it should run.

  python benchmarks/capacity.py --config=configs/simclr_imagenet.py --devices=32
  python benchmarks/capacity.py --config=configs/moco_v2_imagenet.py --devices=32 \
      --accelerator=tpu_v5p --mfu=0.3

Compiles the config's real train step (pretraining.setup, the same jitted, donating
function the job runs) for a simulated 1-D mesh of --devices CPU devices, from
abstract inputs only: the state comes from jax.eval_shape of the jitted init
(shapes, dtypes and its replicated sharding, nothing allocated), the batch is a
jax.ShapeDtypeStruct sharded over the 'data' axis like the job's. Each device
runs its share of the global batch, global batch / N, so the plan for a slice of
N chips is the compile at N devices.

It prints, per device:
  - the train state's bytes by part (parameters, optimizer state, BN statistics,
    the method's own state: MoCo's key encoder and queue or BYOL's target
    network, the online probe), from the state's shapes divided as they are
    sharded (everything is replicated, so each device holds the full size);
  - the compiled executable's memory analysis (arguments, outputs, the part of
    the outputs that reuses donated argument buffers, temporaries =
    activations kept for the backward pass and workspace, generated code); the
    HBM a device needs is arguments + outputs - reused + temporaries + code, what
    the runtime holds at once (the temporaries are one slab, reuse included);
  - its cost analysis: FLOPs and bytes accessed per step per device;
and then, for each --accelerator, the implied step time
max(FLOPs / (peak bf16 FLOP/s x --mfu), bytes accessed / HBM bandwidth), the
images/s of the slice, the hours for the config's duration, and whether the
HBM it needs fits in the chip's.

What the numbers are (and are not): XLA's CPU cost analysis counts what the CPU
program does. Its FLOPs are those of the HLO ops (2 per multiply-add of
convolutions and dots, 1 per elementwise op), the same arithmetic a TPU or GPU
program does, but the CPU compiler fuses, lays out and converts differently: it
may compute bf16 convolutions in float32 and fuses less, so 'bytes accessed' and
the temporaries are an estimate of, not a measurement for, an accelerator's
program (TPU layouts also pad small minor dimensions to tiles). Collectives (the
gradient all-reduce, SimCLR's all-gather, MoCo's shuffle) are counted as ops,
not as interconnect time, and the host input pipeline is assumed to keep up. The
MFU is a stated assumption, not a measurement; the FLOPs include the on-device
augmentations and the optimizer, not only the model.
"""

import dataclasses
import json
import math
import os
import sys
import time

# Plan the package this script sits in, not another installed copy of it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from contrastive_jax.core import runtime

if __name__ == "__main__":
  runtime.setup()  # Every process setting first, before the imports below (core/runtime.py).

from absl import app
from absl import flags
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
from ml_collections import config_flags

from benchmarks import common
from contrastive_jax.core import durations
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import JobError
from contrastive_jax.jobs import pretrain
from contrastive_jax.methods import get_method
from contrastive_jax.methods import pretraining


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """Public peak figures of one JAX device (a chip, except where `note` says a core)."""

  peak_bf16_flops: float  # dense (no structured sparsity), FLOP/s
  hbm_bytes: float
  hbm_bandwidth: float  # bytes/s
  hbm_label: str  # the capacity as the vendor writes it
  source: str
  note: str = ""
  # The JAX device_kind strings of this device (a regular expression, matched in full),
  # for benchmarks/throughput.py's MFU; "" matches none.
  device_kind: str = ""
  # Peak FLOP/s of a float32 dot at JAX's default precision, which computes it in reduced
  # precision: one bfloat16 pass on TPU (the MXU's bf16 peak), TF32 on NVIDIA tensor
  # cores (https://docs.jax.dev/en/latest/201/precision.html).
  peak_fp32_default_flops: float = 0.0


GB, GiB = 1e9, 2.0**30

# Public peak figures per JAX device. HBM sizes written "GB" by the vendor are taken
# as 10^9 bytes, which understates a GiB-sized memory by 7% (conservative for the
# fit). Usable HBM is a little below nominal: the runtime keeps some for itself.
#
# TPU: the "System architecture" table of each version's Cloud TPU page,
#   https://cloud.google.com/tpu/docs/v3, .../v4, .../v5e, .../v5p, .../v6e
#   (v4 and v5p chips hold two TensorCores run as one JAX device, "megacore";
#   a v3 chip's two cores are two JAX devices, so v3 is listed per core: half a
#   chip's 123 TFLOP/s, 32 GiB and 900 GB/s).
# NVIDIA: the product pages https://www.nvidia.com/en-us/data-center/h100/ and
#   .../h200/ list BF16 Tensor Core throughput "with sparsity" (1,979 TFLOP/s);
#   dense is half. The vendor pages themselves could not be read here; the numbers
#   were confirmed against copies of NVIDIA's H100 table (1,979 TFLOP/s BF16 with
#   sparsity, "1/2 lower without sparsity", 80 GB, 3,350 GB/s) and, for H200,
#   only against secondary sources (141 GB HBM3e, 4.8 TB/s, the same GH100 compute
#   as H100, hence 989 TFLOP/s dense BF16).
ACCELERATORS = {
  "tpu_v3": Accelerator(
    61.5e12,
    16 * GiB,
    450 * GB,
    "16 GiB",
    "cloud.google.com/tpu/docs/v3",
    "per core (half a chip): 32 v3 cores = 16 chips = 32 JAX devices",
    "TPU v3",
    61.5e12,
  ),
  "tpu_v4": Accelerator(
    275e12, 32 * GiB, 1200 * GB, "32 GiB", "cloud.google.com/tpu/docs/v4", "", "TPU v4", 275e12
  ),
  "tpu_v5e": Accelerator(
    197e12,
    16 * GB,
    819 * GB,
    "16 GB",
    "cloud.google.com/tpu/docs/v5e",
    "another version of the page: 800 GiB/s",
    "TPU v5( lite|e)",
    197e12,
  ),
  "tpu_v5p": Accelerator(
    459e12, 95 * GB, 2765 * GB, "95 GB", "cloud.google.com/tpu/docs/v5p", "", "TPU v5p?", 459e12
  ),
  "tpu_v6e": Accelerator(
    918e12,
    32 * GB,
    1638 * GB,
    "32 GB",
    "cloud.google.com/tpu/docs/v6e",
    "Trillium; an older version of the page: 1640 GB/s",
    "TPU v6( lite|e)",
    918e12,
  ),
  # NVIDIA's A100 datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
  # nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf; read here in a copy of its table):
  # BF16 Tensor Core 312 TFLOP/s (624 with sparsity), TF32 156 (312), the same for every
  # A100; 80 GB HBM2e at 2,039 GB/s (SXM4; the 40 GB part has 1,555 GB/s).
  "a100": Accelerator(
    312e12,
    80 * GB,
    2039 * GB,
    "80 GB",
    "nvidia.com/en-us/data-center/a100",
    "SXM4 80 GB; 624 with sparsity",
    "NVIDIA A100.*",
    156e12,
  ),
  # TF32 Tensor Core: 989 TFLOP/s with sparsity, 494.5 dense (H100 SXM and H200 SXM);
  # the PCIe and NVL parts are slower and match no device_kind here.
  "h100": Accelerator(
    989e12,
    80 * GB,
    3350 * GB,
    "80 GB",
    "nvidia.com/en-us/data-center/h100",
    "SXM; 1,979 with sparsity; vendor page not readable here, figures from copies of its table",
    "NVIDIA H100 80GB HBM3",
    494.5e12,
  ),
  "h200": Accelerator(
    989e12,
    141 * GB,
    4800 * GB,
    "141 GB",
    "nvidia.com/en-us/data-center/h200",
    "SXM; vendor page not readable here, figures from secondary sources",
    "NVIDIA H200",
    494.5e12,
  ),
}

# (train examples, classes) of the datasets the configs name; --num_train and
# --num_classes override them.
KNOWN_DATASETS = {"imagenet2012": (1_281_167, 1000), "cifar10": (50_000, 10)}

# The parts of the train state, as the plan reports them.
STATE_PARTS = (
  ("params", "parameters"),
  ("opt_state", "optimizer state"),
  ("batch_stats", "BN statistics"),
  ("extra", "method state"),
  ("probe", "online probe"),
)


def per_device_bytes(tree) -> int:
  """Bytes one device holds of an abstract pytree: each leaf's shard shape x itemsize.

  A leaf without a sharding counts in full, as does a replicated one.
  """
  total = 0
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
  return total


@dataclasses.dataclass
class Plan:
  """What one compile at `num_devices` says, per device."""

  config_name: str
  method: str
  num_devices: int
  global_batch: int
  image_size: int
  num_train: int
  steps_per_epoch: int
  num_steps: int
  state_bytes: dict  # STATE_PARTS key -> bytes per device, plus 'other' and 'total'.
  extra_bytes: dict  # the method state's parts (state.extra's keys) -> bytes per device.
  batch_bytes: int  # this device's shard of the batch.
  memory: dict  # the executable's memory_analysis(), bytes.
  flops: float  # per step per device
  bytes_accessed: float  # per step per device
  transcendentals: float
  compile_seconds: float

  @property
  def per_device_batch(self) -> int:
    return self.global_batch // self.num_devices

  @property
  def epochs(self) -> float:
    return self.num_steps * self.global_batch / self.num_train

  @property
  def hbm_needed(self) -> int:
    """Bytes a device holds while the step runs: arguments, the outputs that do not reuse
    a donated argument buffer, the temporaries' slab and the generated code.

    (XLA's peak_memory_in_bytes is not used: on CPU it can come out below the
    arguments plus the temporaries that the runtime allocates together.)
    """
    m = self.memory
    return m["argument"] + m["output"] - m["alias"] + m["temp"] + m["generated_code"]


def dataset_sizes(config, num_train: int = 0, num_classes: int = -1):
  """(train examples, probe classes) for the config: the arguments, else KNOWN_DATASETS."""
  known = KNOWN_DATASETS.get(config.dataset)
  if (num_train <= 0 or num_classes < 0) and known is None:
    raise ValueError(
      f"config.dataset={config.dataset!r} is not in KNOWN_DATASETS "
      f"({sorted(KNOWN_DATASETS)}): pass --num_train and --num_classes"
    )
  return (num_train if num_train > 0 else known[0], num_classes if num_classes >= 0 else known[1])


def plan(config, num_devices: int, *, num_train: int = 0, num_classes: int = -1) -> Plan:
  """Compiles config's train step for the first num_devices devices; allocates no state.

  Raises:
    ConfigError: the config cannot run on num_devices devices (the job's own checks).
    ValueError: fewer devices than num_devices, or an unknown dataset without sizes.
  """
  devices = jax.devices()
  if num_devices > len(devices):
    raise ValueError(
      f"{num_devices} devices asked for, {len(devices)} present: set "
      "jax_num_cpu_devices before JAX starts (benchmarks/capacity.py --devices)"
    )
  config = pretrain.with_init_model(config)  # The model of init_config's file, if it names one.
  num_train, num_classes = dataset_sizes(config, num_train, num_classes)
  pretrain.check_config(config, num_devices)
  # MoCo's check reads jax.device_count(), which the script sets to num_devices.
  get_method(config.method).check_config(config, num_train)
  mesh = mesh_lib.make_mesh(devices[:num_devices])
  steps_per_epoch = num_train // config.batch_size
  num_steps = durations.to_steps(config.duration, "duration", steps_per_epoch)
  run = pretraining.setup(config, mesh, steps_per_epoch, num_steps, num_classes)

  state = jax.eval_shape(run.init)  # ShapeDtypeStructs with the replicated sharding.
  size = config.image_size
  batch_sharding = mesh_lib.batch_sharded(mesh)
  batch = {
    "image": jax.ShapeDtypeStruct(
      (config.batch_size, 2, size, size, 3), jnp.uint8, sharding=batch_sharding
    ),
    "label": jax.ShapeDtypeStruct((config.batch_size,), jnp.int32, sharding=batch_sharding),
  }
  if config.get("local_crops") is not None:  # DINO's multi-crop: N local views of s px.
    local = config.local_crops
    batch["local_image"] = jax.ShapeDtypeStruct(
      (config.batch_size, local.number, local.size, local.size, 3),
      jnp.uint8,
      sharding=batch_sharding,
    )
  start = time.perf_counter()
  compiled = run.train_step.lower(state, batch).compile()
  compile_seconds = time.perf_counter() - start

  state_bytes = {key: per_device_bytes(getattr(state, key)) for key, _ in STATE_PARTS}
  state_bytes["total"] = per_device_bytes(state)
  state_bytes["other"] = state_bytes["total"] - sum(state_bytes[k] for k, _ in STATE_PARTS)
  extra_parts = {key: per_device_bytes(value) for key, value in state.extra.items()}
  stats = compiled.memory_analysis()
  memory = {
    "argument": stats.argument_size_in_bytes,
    "output": stats.output_size_in_bytes,
    "alias": stats.alias_size_in_bytes,
    "temp": stats.temp_size_in_bytes,
    "generated_code": stats.generated_code_size_in_bytes,
  }
  cost = common.cost(compiled)
  return Plan(
    config_name="",
    method=config.method,
    num_devices=num_devices,
    global_batch=config.batch_size,
    image_size=size,
    num_train=num_train,
    steps_per_epoch=steps_per_epoch,
    num_steps=num_steps,
    state_bytes=state_bytes,
    extra_bytes=extra_parts,
    batch_bytes=per_device_bytes(batch),
    memory=memory,
    flops=float(cost.get("flops", 0.0)),
    bytes_accessed=float(cost.get("bytes accessed", 0.0)),
    transcendentals=float(cost.get("transcendentals", 0.0)),
    compile_seconds=compile_seconds,
  )


@dataclasses.dataclass
class Estimate:
  """A plan at one accelerator."""

  compute_seconds: float  # FLOPs / (peak x mfu)
  memory_seconds: float  # bytes accessed / HBM bandwidth
  hbm_needed: int
  hbm_bytes: float
  step_seconds: float
  images_per_second: float  # the whole slice
  hours: float  # the config's duration
  fits: bool

  @property
  def bound(self) -> str:
    return "compute" if self.compute_seconds >= self.memory_seconds else "memory"


def estimate(p: Plan, accelerator: Accelerator, mfu: float, hbm_bytes: float = None) -> Estimate:
  """Step time, throughput and fit of plan p on accelerator at utilisation mfu.

  hbm_bytes overrides the accelerator's HBM per device (e.g. to keep headroom).
  """
  if not 0 < mfu <= 1:
    raise ValueError(f"mfu={mfu}: must be in (0, 1]")
  hbm = accelerator.hbm_bytes if hbm_bytes is None else hbm_bytes
  compute = p.flops / (accelerator.peak_bf16_flops * mfu)
  memory = p.bytes_accessed / accelerator.hbm_bandwidth
  step = max(compute, memory)
  return Estimate(
    compute_seconds=compute,
    memory_seconds=memory,
    hbm_needed=p.hbm_needed,
    hbm_bytes=hbm,
    step_seconds=step,
    images_per_second=p.global_batch / step if step > 0 else math.inf,
    hours=p.num_steps * step / 3600,
    fits=p.hbm_needed <= hbm,
  )


def _gib(n) -> str:
  return f"{n / GiB:.3f}"


def report(p: Plan, accelerators: dict, mfu: float) -> str:
  """The plan as markdown tables."""
  lines = [
    f"## {p.config_name or p.method}: {p.num_devices} devices",
    "",
    f"global batch {p.global_batch}, per device {p.per_device_batch} "
    f"(x2 views, {p.image_size}x{p.image_size}); {p.num_steps} steps "
    f"({p.epochs:.1f} epochs of {p.num_train} images); compiled in "
    f"{p.compile_seconds:.1f} s on CPU",
    "",
    "| per device | bytes | GiB |",
    "|---|---|---|",
  ]
  for key, label in STATE_PARTS + (("other", "step and PRNG key"), ("total", "state total")):
    lines.append(f"| state: {label} | {p.state_bytes[key]} | {_gib(p.state_bytes[key])} |")
    if key == "extra":
      for part, n in p.extra_bytes.items():
        lines.append(f"| state: method state, {part} | {n} | {_gib(n)} |")
  lines.append(
    f"| batch shard (uint8 images; int32 labels, an argument only with the probe) "
    f"| {p.batch_bytes} | {_gib(p.batch_bytes)} |"
  )
  m = p.memory
  for key, label in (
    ("argument", "compiled: arguments"),
    ("output", "compiled: outputs"),
    ("alias", "compiled: outputs in donated buffers"),
    ("temp", "compiled: temporaries (activations, workspace)"),
    ("generated_code", "compiled: generated code"),
  ):
    lines.append(f"| {label} | {m[key]} | {_gib(m[key])} |")
  lines.append(
    f"| **HBM needed** (arguments + outputs - reused + temporaries + code) | "
    f"{p.hbm_needed} | {_gib(p.hbm_needed)} |"
  )
  intensity = p.flops / p.bytes_accessed if p.bytes_accessed else math.inf
  lines += [
    "",
    f"Per step per device (XLA CPU cost analysis): {p.flops:.4g} FLOPs, "
    f"{p.bytes_accessed:.4g} bytes accessed ({intensity:.1f} FLOP/byte), "
    f"{p.transcendentals:.4g} transcendentals.",
    "",
    f"At MFU {mfu:g}: step = max(FLOPs / (peak x MFU), bytes accessed / HBM bandwidth).",
    "",
    "| accelerator | compute s | memory s | step s | bound | images/s (slice) | "
    "images/s per device | hours | HBM needed / per device | fits |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for name, acc in accelerators.items():
    e = estimate(p, acc, mfu)
    lines.append(
      f"| {name} | {e.compute_seconds:.3g} | {e.memory_seconds:.3g} | {e.step_seconds:.3g} | "
      f"{e.bound} | {e.images_per_second:.0f} | {e.images_per_second / p.num_devices:.0f} | "
      f"{e.hours:.3g} | {_gib(e.hbm_needed)} / {_gib(e.hbm_bytes)} GiB "
      f"({e.hbm_needed / e.hbm_bytes:.0%}) | {'yes' if e.fits else 'NO'} |"
    )
  lines += [
    "",
    "Caveats: the FLOPs and bytes are XLA's CPU cost analysis of the CPU program (same "
    "arithmetic, different fusion, layouts and bf16 handling than a TPU/GPU program); "
    "interconnect time and the input pipeline are not modelled; usable HBM is a little "
    "below nominal; the MFU is an assumption.",
  ]
  return "\n".join(lines)


def sources() -> str:
  lines = [
    "Public peak figures per JAX device:",
    "",
    "| accelerator | peak bf16 TFLOP/s (dense) | HBM | HBM GB/s | source | note |",
    "|---|---|---|---|---|---|",
  ]
  for name, acc in ACCELERATORS.items():
    lines.append(
      f"| {name} | {acc.peak_bf16_flops / 1e12:g} | {acc.hbm_label} | "
      f"{acc.hbm_bandwidth / GB:g} | {acc.source} | {acc.note} |"
    )
  return "\n".join(lines)


def to_json(p: Plan, accelerators: dict, mfu: float) -> dict:
  """The plan, its HBM need and its estimate at each accelerator, as plain values."""
  return dict(
    dataclasses.asdict(p),
    per_device_batch=p.per_device_batch,
    epochs=p.epochs,
    hbm_needed=p.hbm_needed,
    mfu=mfu,
    estimates={
      name: dict(dataclasses.asdict(estimate(p, acc, mfu)), bound=estimate(p, acc, mfu).bound)
      for name, acc in accelerators.items()
    },
  )


def select_accelerators(spec: str) -> dict:
  if spec == "all":
    return dict(ACCELERATORS)
  names = [s.strip() for s in spec.split(",") if s.strip()]
  unknown = [n for n in names if n not in ACCELERATORS]
  if unknown or not names:
    raise app.UsageError(f"--accelerator={spec!r}: use 'all' or names of {list(ACCELERATORS)}")
  return {n: ACCELERATORS[n] for n in names}


def define_flags():
  """Registers the command-line flags (not at import, so that tests can import this file)."""
  config_flags.DEFINE_config_file("config", None, "Pretraining config (overrides allowed).")
  flags.DEFINE_integer("devices", 8, "Simulated devices: the slice's chip count.")
  flags.DEFINE_string(
    "accelerator", "all", "An accelerator of ACCELERATORS, a comma-separated list, or 'all'."
  )
  flags.DEFINE_float("mfu", 0.4, "Assumed model-FLOPs utilisation, in (0, 1].")
  flags.DEFINE_integer(
    "num_train", 0, "Train split size (0: from KNOWN_DATASETS by config.dataset)."
  )
  flags.DEFINE_integer(
    "num_classes", -1, "Classes for the online probe (-1: from KNOWN_DATASETS; 0: no probe)."
  )
  flags.DEFINE_string("json", "", "Also write the plan and its estimates to this JSON file.")
  flags.mark_flag_as_required("config")


def main(argv):
  del argv
  args = flags.FLAGS
  # Before anything touches a backend: a CPU-only platform with --devices devices.
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", args.devices)
  accelerators = select_accelerators(args.accelerator)
  if not 0 < args.mfu <= 1:
    raise app.UsageError(f"--mfu={args.mfu}: must be in (0, 1]")
  try:
    p = plan(args.config, args.devices, num_train=args.num_train, num_classes=args.num_classes)
  except (JobError, ValueError) as e:  # One line, as the job reports a config it cannot run.
    sys.exit(f"error: {e}")
  p.config_name = common.config_name(args["config"])
  print(report(p, accelerators, args.mfu))
  print()
  print(sources())
  if args.json:
    with open(args.json, "w") as f:
      json.dump(to_json(p, accelerators, args.mfu), f, indent=1)


if __name__ == "__main__":
  define_flags()
  app.run(main)

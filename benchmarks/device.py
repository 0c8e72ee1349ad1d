"""The accelerator benchmark: what the project does on the device it runs on, as one table.

  python benchmarks/device.py --data=cifar10.npz --out=/tmp/device  # one H200: ~13 min
  python benchmarks/device.py --tiny --data=cifar10.npz --out=/tmp/device  # CPU: toy sizes

It needs JAX, flax, optax, orbax-checkpoint, numpy, Pillow, absl-py, etils and
ml_collections, and no TensorFlow, TFDS or clu, so it runs on an accelerator image
that has JAX alone (docs/gpu.md says what to carry there). --data is the .npz of
benchmarks/make_device_data.py (CIFAR-10's train and test splits). Sections:

  environment  JAX's version, the backend, the device kind and count, and the kind's
               dense bfloat16 peak (PEAK_TFLOPS, or --peak_tflops).
  steps        for each row of ROWS, its config's pretraining step
               (methods.pretraining.setup: jitted, state donated, the online probe
               of 10 classes) on a fixed uint8 batch after compilation: ms per
               step, images/s (an image and its views count once: two, or DINO's
               2 global and 8 local crops of multi-crop), model TFLOP
               per step (benchmarks/flops.py: dots and convolutions, one device's
               share), MFU = those FLOPs /
               step time / peak, and the bytes the compiled program holds (XLA's
               memory analysis: arguments, outputs and temporaries, less what
               donation aliases). Then a supervised ResNet-50 step
               (cross-entropy, SGD with momentum 0.9 and weight decay 1e-4, batch
               256, bfloat16): the reference the two-view rows are read against.
  pretraining  SimCLR ResNet-18 on CIFAR-10 (batch 512, bfloat16) from the .npz held
               on the device (data/device_data.py, data/device_samplers.py) for
               --train_seconds (the number of steps is the budget over the step time
               measured above, so the learning-rate schedule runs to its end) in the
               training jobs' loop (runner.run in a temporary workdir: one log line
               and one checkpoint, at the end), then the kNN monitor (evaluators.Knn:
               k 200, temperature 0.1, test against train). The .npz is read and
               checked before any row runs: a file that is not one gives one line.

--tiny shrinks every row to seconds on a CPU (batch 16, width 1/8, one block per
ResNet-18 stage (ResNet-10), one ViT block, DINO's head to 256 outputs, 32 px) and trains
for 20 s on the first 2,048 training images: a check that every row runs, not a
measurement (XLA_FLAGS get `--xla_cpu_experimental_ynn_fusion_type=-individual_convolution,-reduce`
unless they set that option: contrastive_jax/core/xla_flags.py and docs/gpu.md say why;
without --tiny, `-individual_convolution` as every job's). Runs the first row, the supervised row
and the pretraining section before the other rows, so that a run stopped by its time limit
keeps them; prints each row as it finishes and rewrites OUT/device.md and OUT/device.json
(every figure) after each, then prints the whole table.
"""

import importlib.util
import json
import os
import sys
import tempfile
import time

# What the script imports beyond the standard library: checked before any import,
# so that an image without one of them gets one line naming it.
REQUIRED = {
  "absl": "absl-py",
  "etils": "etils[epath]",
  "flax": "flax",
  "jax": "jax",
  "ml_collections": "ml-collections",
  "numpy": "numpy",
  "optax": "optax",
  "orbax.checkpoint": "orbax-checkpoint",
  "PIL": "pillow",
}


def missing_packages() -> list:
  """The pip names of REQUIRED's modules that this Python cannot import."""
  missing = []
  for module, package in REQUIRED.items():
    try:
      found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # A parent package is absent.
      found = False
    if not found:
      missing.append(package)
  return missing


if __name__ == "__main__" and missing_packages():
  sys.exit(
    f"benchmarks/device.py needs {', '.join(missing_packages())}: install them or carry "
    "their wheels (docs/gpu.md)"
  )

# Time the package this script sits in, not another installed copy of it.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks import batches  # noqa: E402
from benchmarks import flops  # noqa: E402
from contrastive_jax import models  # noqa: E402
from contrastive_jax.core import files  # noqa: E402
from contrastive_jax.core import mesh as mesh_lib  # noqa: E402
from contrastive_jax.core import runtime  # noqa: E402
from contrastive_jax.core import xla_flags  # noqa: E402
from contrastive_jax.core.errors import JobError  # noqa: E402
from contrastive_jax.data import device_data  # noqa: E402
from contrastive_jax.data import device_samplers  # noqa: E402
from contrastive_jax.methods import evaluated_encoder  # noqa: E402
from contrastive_jax.methods import pretraining  # noqa: E402
from contrastive_jax.training import evaluators  # noqa: E402
from contrastive_jax.training import runner  # noqa: E402

FLAGS = flags.FLAGS

# Dense bfloat16 peak FLOP/s per chip by device kind (the vendors' data sheets; the
# sparse figures are twice these). MFU is read against this whatever a row's dtype.
PEAK_TFLOPS = {
  "H200": 989.0,
  "H100": 989.0,
  "A100": 312.0,
  "L4": 121.0,
  "A6000": 155.0,
  "TPU v4": 275.0,
  "TPU v5 lite": 197.0,
  "TPU v5e": 197.0,
  "TPU v5p": 459.0,
  "TPU v6 lite": 918.0,
}

# (row, config file in configs/, its argument, field overrides): the issue's shapes,
# ResNet-18 CIFAR at batch 512 and the 224 px networks at batch 256.
ROWS = (
  ("SimCLR ResNet-18 CIFAR bf16", "simclr_cifar10", "dtype=bfloat16", {}),
  ("SimCLR ResNet-18 CIFAR f32", "simclr_cifar10", "dtype=float32", {}),
  ("MoCo v2 ResNet-18 CIFAR bf16", "moco_v2_cifar10", "dtype=bfloat16", {}),
  ("BYOL ResNet-18 CIFAR bf16", "byol_cifar10", "dtype=bfloat16", {"batch_size": 512}),
  ("MoCo v3 ResNet-18 CIFAR bf16", "mocov3_cifar10", "dtype=bfloat16", {"batch_size": 512}),
  ("SimCLR ResNet-50 224 bf16", "simclr_imagenet", "dtype=bfloat16", {"batch_size": 256}),
  ("MoCo v2 ResNet-50 224 bf16", "moco_v2_imagenet", "dtype=bfloat16", {"batch_size": 256}),
  ("BYOL ResNet-50 224 bf16", "byol_imagenet", "dtype=bfloat16", {"batch_size": 256}),
  (
    "MoCo v3 ResNet-50 224 bf16",
    "mocov3_imagenet",
    "model=resnet50,dtype=bfloat16",
    {"batch_size": 256},
  ),
  (
    "MoCo v3 ViT-S/16 224 bf16",
    "mocov3_imagenet",
    "model=vit_small,dtype=bfloat16",
    {"batch_size": 256},
  ),
  ("DINO ResNet-18 CIFAR bf16", "dino_cifar10", "model=resnet18,dtype=bfloat16", {}),
  (
    "DINO ViT-S/16 224 2+8 crops bf16",
    "dino_imagenet",
    "model=vit_small,dtype=bfloat16",
    {"batch_size": 256},
  ),
)
SUPERVISED = "supervised ResNet-50 224 bf16"
SECTIONS = ("steps", "supervised", "pretraining")
TINY_BATCH = 16


def define_flags():
  """The script's flags (not defined at import, so tests can load the module)."""
  flags.DEFINE_string("data", None, "the .npz of benchmarks/make_device_data.py (train, test)")
  flags.DEFINE_string("out", "/tmp/device", "where device.md and device.json are written")
  flags.DEFINE_bool("tiny", False, "every row at toy sizes: a CPU check, not a measurement")
  flags.DEFINE_integer("steps", 10, "timed steps per row, after compilation and one warm-up")
  flags.DEFINE_float("train_seconds", 120.0, "the pretraining section's budget (--tiny: 20)")
  flags.DEFINE_list("rows", [], "the steps rows whose names contain one of these (default: all)")
  flags.DEFINE_list(
    "sections",
    list(SECTIONS),
    f"which of {', '.join(SECTIONS)} to run (the rest of a run cut short)",
  )
  flags.DEFINE_float("peak_tflops", None, "the device's dense bf16 peak (default: PEAK_TFLOPS)")


def load_config(name: str, arg: str):
  """configs/NAME.py's get_config(arg), as --config=configs/NAME.py:arg loads it."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", name + ".py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def shrink(config):
  """config at --tiny's sizes (batch 16, width 1/8, ResNet-10 for ResNet-18, one ViT block,
  DINO's head of 256 outputs from 64 hidden units, 32 px); MoCo's BN groups and queue fitted
  to them."""
  config.batch_size = TINY_BATCH
  config.image_size = 32
  if "depth" in config.model:  # A ViT: patch 16 on 32 px is a 2 x 2 grid.
    config.model.depth = 1
  else:
    config.model.width = 0.125
    if config.model.name == "resnet18":
      config.model.name = "resnet10"
  if "dino" in config:  # The 65,536 outputs would be most of a tiny step.
    config.dino.update(out_dim=256, hidden_dim=64, bottleneck_dim=32)
  if "queue_size" in config.get("moco", {}):
    config.moco.queue_size = 4 * TINY_BATCH
  if config.get("local_crops"):  # DINO's local views: one patch of 16 px.
    config.local_crops.size = 16
  return config


def row_config(name: str, arg: str, overrides: dict, tiny: bool):
  """The config of a row of ROWS; MoCo's shuffle-BN groups made a multiple of the device count
  (one device: the config's group size is kept, its groups all on the one device)."""
  config = load_config(name, arg)
  for field, value in overrides.items():
    config[field] = value
  if tiny:
    config = shrink(config)
  if "bn_group_size" in config.get("moco", {}):
    devices = jax.device_count()
    size = max(config.moco.bn_group_size // devices, 1) * devices
    while config.batch_size % size or config.batch_size // size < 2:
      size //= 2
    config.moco.bn_group_size = size
  return config


def peak_flops(kind: str):
  """The dense bf16 FLOP/s of a device kind (PEAK_TFLOPS, --peak_tflops first), or None."""
  if FLAGS.peak_tflops:
    return FLAGS.peak_tflops * 1e12
  for name, tflops in PEAK_TFLOPS.items():
    if name.lower() in kind.lower():
      return tflops * 1e12
  return None


def compile_step(step, *args):
  """(compiled, {'flops', 'bytes'}): step compiled for args, once (the timing calls the
  compiled program itself), with one device's share of its model FLOPs (flops.model_flops:
  dots and convolutions, the same count on every backend) and the bytes it holds: XLA's
  memory analysis of the compiled program (arguments, outputs and temporaries, less what
  donation aliases), or None where the backend gives none."""
  compiled = step.lower(*args).compile()
  memory = compiled.memory_analysis()
  held = None
  if memory is not None:
    held = (
      memory.argument_size_in_bytes
      + memory.output_size_in_bytes
      - memory.alias_size_in_bytes
      + memory.temp_size_in_bytes
    )
  return compiled, {"flops": flops.model_flops(step, *args) / jax.device_count(), "bytes": held}


def time_steps(step, state, batch, steps: int):
  """(seconds per step, final state): one warm-up step, then `steps` timed, each on the state
  the previous returned, blocked on at the end only."""
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  return (time.perf_counter() - start) / steps, state


def step_row(label: str, config, mesh, peak) -> dict:
  """The steps section's measurements of one config."""
  start = time.perf_counter()
  run = pretraining.setup(config, mesh, steps_per_epoch=100, num_steps=1000, num_classes=10)
  state, batch = run.init(), batches.random_batch(config, mesh)
  step, cost = compile_step(run.train_step, state, batch)
  seconds, state = time_steps(step, state, batch, FLAGS.steps)
  del state
  return result_row(label, config.batch_size, seconds, cost, peak, time.perf_counter() - start)


def result_row(label, batch, seconds, cost, peak, wall) -> dict:
  flops = cost["flops"] * jax.device_count()
  return {
    "row": label,
    "batch": batch,
    "ms": 1e3 * seconds,
    "images_per_s": batch / seconds,
    "tflop_per_step": flops / 1e12,
    "mfu": flops / seconds / (peak * jax.device_count()) if peak else None,
    "memory_gib": cost["bytes"] / 2**30 if cost["bytes"] is not None else None,
    "wall_s": wall,
  }


def supervised_row(tiny: bool, mesh, peak) -> dict:
  """A supervised ResNet-50 step at 224 px (batch 256, bfloat16): the encoder, a linear
  classifier of 1,000 classes, softmax cross-entropy, SGD momentum 0.9, weight decay 1e-4
  on every parameter; images flipped nowhere, normalised by the encoder's stem."""
  start = time.perf_counter()
  config = load_config("simclr_imagenet", "dtype=bfloat16")
  config.batch_size = 256
  if tiny:
    config = shrink(config)
  encoder = models.build_encoder(config.model)
  head = nn.Dense(1000)
  tx = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9))
  size, batch_size = config.image_size, config.batch_size
  images = jnp.zeros((1, size, size, 3), jnp.float32)

  def init():
    variables = encoder.init(jax.random.key(0), images, train=False)
    features = encoder.apply(variables, images, train=False)
    params = {"encoder": variables["params"], "head": head.init(jax.random.key(1), features)}
    return params, variables.get("batch_stats", {}), tx.init(params)

  replicated = mesh_lib.replicated(mesh)
  state = jax.jit(init, out_shardings=replicated)()

  def step(state, batch):
    params, batch_stats, opt_state = state
    x = batch["image"][:, 0].astype(jnp.float32) / 255.0

    def loss_fn(params):
      h, updates = encoder.apply(
        {"params": params["encoder"], "batch_stats": batch_stats},
        x,
        train=True,
        mutable=["batch_stats"],
      )
      logits = head.apply(params["head"], h.astype(jnp.float32))
      # One-hot targets: an integer-label gather over the batch-sharded logits has no
      # unambiguous output sharding under an explicit mesh (JAX 0.11 refuses it).
      loss = optax.softmax_cross_entropy(logits, jax.nn.one_hot(batch["label"], 1000)).mean()
      return loss, updates["batch_stats"]

    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), batch_stats, opt_state), {"loss": loss}

  step = jax.jit(step, donate_argnums=0, out_shardings=(replicated, replicated))
  batch = batches.random_batch(config, mesh, num_views=1)
  step, cost = compile_step(step, state, batch)
  seconds, state = time_steps(step, state, batch, FLAGS.steps)
  del state
  return result_row(SUPERVISED, batch_size, seconds, cost, peak, time.perf_counter() - start)


def numpy_batches(images, labels, local_batch: int):
  """(split, local_batch) -> iterable of numpy eval batches of images uint8 [N, S, S, 3]: the
  last one padded with zeros, its padding masked out (what evaluators read)."""

  def batches():
    for start in range(0, len(images), local_batch):
      x, y = images[start : start + local_batch], labels[start : start + local_batch]
      pad = local_batch - len(x)
      mask = np.arange(local_batch) < len(x)
      yield {
        "image": np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]),
        "label": np.concatenate([y, np.zeros(pad, y.dtype)]),
        "mask": mask,
      }

  return batches


def read_data(tiny: bool) -> dict:
  """The pretraining section's data, read and checked before any compute: {'train': (images
  uint8 [N, H, W, 3], labels int32 [N]), 'test': (...), 'read_s': seconds}, --tiny's first
  2,048 and 512 images.

  Raises:
    ConfigError: --data is not a readable .npz of make_device_data.py (device_data.load_npz
      names the file and what is wrong), or its train split does not fit the devices.
  """
  start = time.perf_counter()
  train_images, train_labels = device_data.load_npz(FLAGS.data, "train")
  test_images, test_labels = device_data.load_npz(FLAGS.data, "test")
  if tiny:
    train_images, train_labels = train_images[:2048], train_labels[:2048]
    test_images, test_labels = test_images[:512], test_labels[:512]
  num, height, width, _ = train_images.shape
  capacity, where = device_data.device_capacity()
  device_data.check_fits(device_data.split_bytes(num, height, width), capacity, where, FLAGS.data)
  return {
    "train": (train_images, train_labels),
    "test": (test_images, test_labels),
    "read_s": time.perf_counter() - start,
  }


class PretrainingJob:
  """SimCLR pretraining from a split held on the device, as runner.run runs a job's Task.

  Times the loop from outside it: the first step (its batch drawn and its program
  compiled) apart, then the other steps up to the last one's end; keeps the last
  step's metrics.
  """

  def __init__(self, train: tuple, num_steps: int):
    self.train, self.num_steps = train, num_steps
    self.run = None
    # perf_counter at the first batch's draw and at the ends of the first and last steps.
    self.clock = {"steps": 0, "start": None, "first": None, "last": None, "metrics": None}

  def check_config(self, config, num_devices: int):
    runner.check_config(config, num_devices)

  def build(self, config, mesh, saved_config, workdir) -> runner.Task:
    del saved_config, workdir  # A fresh workdir: nothing to resume, no files of its own.
    steps_per_epoch = len(self.train[0]) // config.batch_size
    self.run = pretraining.setup(config, mesh, steps_per_epoch, self.num_steps, num_classes=10)
    split = device_data.to_mesh(*self.train, mesh)
    draw = device_samplers.train_batches(split, config, mesh, image_size=config.image_size)

    def train_batches(start_step: int):
      self.clock["start"] = time.perf_counter()
      yield from draw(start_step)

    def train_step(state, batch):
      state, metrics = self.run.train_step(state, batch)
      self.clock["steps"] += 1
      if self.clock["steps"] in (1, self.num_steps):
        jax.block_until_ready(metrics)
        end = time.perf_counter()
        self.clock["first" if self.clock["steps"] == 1 else "last"] = end
      self.clock["metrics"] = metrics
      return state, metrics

    return runner.Task(
      config=config,
      init=self.run.init,
      train_step=train_step,
      train_batches=train_batches,
      num_steps=self.num_steps,
      steps_per_epoch=steps_per_epoch,
      global_batch=config.batch_size,
      schedule=self.run.schedule,
      eval_model=None,  # No evaluator runs in the loop: the kNN monitor is timed after it.
      num_classes=10,
    )


def pretraining_run(tiny: bool, mesh, seconds_per_step: float, data: dict) -> dict:
  """The pretraining section: SimCLR ResNet-18 on CIFAR-10 from the .npz on the device for
  --train_seconds (runner.run's loop, in a temporary workdir), then the kNN monitor.
  seconds_per_step: the steps section's SimCLR bf16; data: read_data's."""
  (train_images, train_labels), (test_images, test_labels) = data["train"], data["test"]
  config = row_config("simclr_cifar10", "dtype=bfloat16", {}, tiny)
  num = len(train_images)
  budget = FLAGS.train_seconds if not tiny or FLAGS["train_seconds"].present else 20.0
  num_steps = max(int(budget / seconds_per_step), 1)
  knn_config = config.evaluators.knn.copy_and_resolve_references()
  # One log and one checkpoint, at the end; the kNN monitor runs after the loop, timed.
  config.evaluators = ml_collections.ConfigDict()
  config.log_every = config.checkpoint_every = f"{num_steps} steps"
  job = PretrainingJob(data["train"], num_steps)
  with tempfile.TemporaryDirectory() as workdir:
    state, _ = runner.run(job, config, os.path.join(workdir, "pretraining"))
  clock = job.clock
  compile_s = clock["first"] - clock["start"]
  train_s = (clock["last"] or clock["first"]) - clock["first"]
  loss = float(clock["metrics"]["loss"])
  knn_config.update(split="test", bank_split="train", k=200, temperature=0.1)
  knn_config.batch_size = min(knn_config.batch_size, 8 * config.batch_size)
  knn_config.batch_size -= knn_config.batch_size % jax.device_count()
  encoder = job.run.model.encoder
  splits = {"train": (train_images, train_labels), "test": (test_images, test_labels)}
  eval_model = evaluators.EvalModel(
    variables=evaluated_encoder(config.method),
    features=lambda variables, images: models.encode(encoder, variables, images),
    logits=None,
    dataset=lambda split, local_batch: numpy_batches(*splits[split], local_batch)(),
  )
  knn_start = time.perf_counter()
  knn = evaluators.Knn("knn", knn_config, eval_model, mesh, 10)(state)["knn_top1"]
  return {
    "steps": num_steps,
    "epochs": num_steps * config.batch_size / num,
    "images_per_s": (num_steps - 1) * config.batch_size / train_s if num_steps > 1 else None,
    "compile_s": compile_s,
    "train_s": train_s,
    "read_s": data["read_s"],
    "knn_s": time.perf_counter() - knn_start,
    "final_loss": loss,
    "knn_top1": knn,
    "train_images": num,
    "test_images": len(test_images),
  }


def fmt(value, spec: str) -> str:
  return "n/a" if value is None else format(value, spec)


def row_line(r: dict) -> str:
  """One steps row of the markdown table."""
  return (
    f"| {r['row']} | {r['batch']} | {r['ms']:.1f} | {r['images_per_s']:.0f} | "
    f"{r['tflop_per_step']:.3f} | {fmt(r['mfu'], '.1%')} | {fmt(r['memory_gib'], '.2f')} | "
    f"{r['wall_s']:.0f} |"
  )


def table(env: dict, rows: list, pretrain) -> str:
  """The results as markdown; pretrain None while that section has not run."""
  lines = [
    f"JAX {env['jax']}, {env['devices']} x {env['kind']} ({env['backend']}), peak "
    f"{fmt(env['peak_tflops'], '.0f')} bf16 TFLOP/s per chip{' (--tiny)' if env['tiny'] else ''}",
    "",
    "| row | batch | ms/step | images/s | TFLOP/step | MFU | memory (GiB) | wall (s) |",
    "|---|---|---|---|---|---|---|---|",
  ]
  lines += [row_line(r) for r in rows]
  p = pretrain
  if p is not None:
    lines += [
      "",
      f"SimCLR ResNet-18 CIFAR-10 from the device: {p['steps']} steps ({p['epochs']:.1f} epochs "
      f"of {p['train_images']}) in {p['train_s']:.0f} s after a {p['compile_s']:.0f} s first "
      f"step, {fmt(p['images_per_s'], '.0f')} images/s; final loss "
      f"{p['final_loss']:.3f}; kNN top-1 {p['knn_top1']:.4f} on {p['test_images']} test images "
      f"({p['knn_s']:.0f} s); data read in {p['read_s']:.0f} s",
    ]
  return "\n".join(lines) + "\n"


def save(env: dict, rows: list, pretrain) -> str:
  """Writes OUT/device.md and OUT/device.json, each atomically, with what has been measured
  so far (a run cut short keeps its finished rows); returns the markdown."""
  text = table(env, rows, pretrain)
  files.makedirs(FLAGS.out)
  files.write_atomic(os.path.join(FLAGS.out, "device.md"), text)
  results = {"environment": env, "steps": rows, "pretraining": pretrain}
  files.write_atomic(os.path.join(FLAGS.out, "device.json"), json.dumps(results, indent=1))
  return text


def main(argv):
  del argv
  chosen = [r for r in ROWS if not FLAGS.rows or any(s in r[0] for s in FLAGS.rows)]
  unknown = sorted(set(FLAGS.sections) - set(SECTIONS))
  if unknown:
    sys.exit(f"benchmarks/device.py: --sections={','.join(FLAGS.sections)}: {unknown[0]!r} is none "
             f"of {', '.join(SECTIONS)}")  # fmt: skip
  pretrains = "pretraining" in FLAGS.sections
  if pretrains and (not chosen or not chosen[0][0].startswith(ROWS[0][0])):
    sys.exit(
      f"benchmarks/device.py: --rows={','.join(FLAGS.rows)} must choose the first row "
      f"({ROWS[0][0]!r}), whose step time sizes the pretraining section; rows: "
      + "; ".join(r[0] for r in ROWS)
    )
  if "steps" not in FLAGS.sections:
    chosen = chosen[:1] if pretrains else []
  if pretrains and (not FLAGS.data or not os.path.exists(FLAGS.data)):
    sys.exit(
      f"benchmarks/device.py: --data={FLAGS.data or ''} is no file; it needs the .npz that "
      "benchmarks/make_device_data.py writes (docs/gpu.md)"
    )
  # Every process setting (core/runtime.py), here, once --tiny is read, and before the
  # backend starts; the user's own ynn option is kept. --tiny's rows run on the CPU, where
  # JAX 0.11.2's XLA:CPU computes a bfloat16 ResNet's h as NaN under jit in its YNNPACK
  # reduce fusion (the kNN monitor then refuses it).
  runtime.setup(ynn_fusion_type=xla_flags.YNN_FUSION_TYPE + (",-reduce" if FLAGS.tiny else ""))
  start = time.perf_counter()
  data = read_data(FLAGS.tiny) if pretrains else None  # Its file checked before any compute.
  mesh = mesh_lib.make_mesh()
  kind = jax.devices()[0].device_kind
  peak = peak_flops(kind)
  env = {
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "kind": kind,
    "devices": jax.device_count(),
    "peak_tflops": peak / 1e12 if peak else None,
    "tiny": FLAGS.tiny,
  }
  print(f"JAX {env['jax']} on {env['devices']} x {kind}", flush=True)
  rows, pretrain = [], None

  def add(row):
    rows.append(row)
    print(row_line(row), flush=True)
    save(env, rows, pretrain)

  # The goals' rows and the pretraining run first, so a run cut short by its lease keeps them:
  # SimCLR ResNet-18 CIFAR, the supervised reference, then the rest of the steps section.
  first, rest = chosen[:1], chosen[1:]
  for label, name, arg, overrides in first:
    add(step_row(label, row_config(name, arg, overrides, FLAGS.tiny), mesh, peak))
  if "supervised" in FLAGS.sections:
    add(supervised_row(FLAGS.tiny, mesh, peak))
  if pretrains:
    pretrain = pretraining_run(FLAGS.tiny, mesh, rows[0]["ms"] / 1e3, data)
    save(env, rows, pretrain)
    print(f"  pretraining: kNN top-1 {pretrain['knn_top1']:.4f}", flush=True)
  for label, name, arg, overrides in rest:
    add(step_row(label, row_config(name, arg, overrides, FLAGS.tiny), mesh, peak))
  env["wall_s"] = time.perf_counter() - start
  print(save(env, rows, pretrain), flush=True)


def run_main(argv):
  """main, with a JobError (a ConfigError: a bad --data file; a non-finite pretraining loss) as
  its one line on stderr and exit status 1."""
  try:
    main(argv)
  except JobError as error:
    sys.exit(f"benchmarks/device.py: {error}")


if __name__ == "__main__":
  define_flags()
  app.run(run_main)

"""The self-supervised speedrun on one accelerator: time to lightly's CIFAR-10 kNN marks.

  python benchmarks/speedrun.py --data=cifar10.npz                # 200 epochs, resumable
  python benchmarks/speedrun.py --data=cifar10.npz --minutes=5    # epochs fitted to 5 min
  python benchmarks/speedrun.py --tiny --data=cifar10.npz         # CPU: every part, seconds

SimCLR ResNet-18 pretraining on CIFAR-10 held on the device (data/device_data.py), in
bfloat16, with the kNN monitor as lightly's cifar10_benchmark.py evaluates (k 200,
temperature 0.1, the test split against the train split, encoder in eval mode) at fixed
epochs (every --eval_every and the last), timed apart from the steps. RECIPE lists every
value the run takes from the references (its `source` says whose file), on top of
configs/simclr_cifar10.py (the model, the projection head).

The budget is --epochs, or --minutes of steps at --images_per_s (the throughput measured
for this step, docs/throughput.md): epochs = minutes x 60 x images/s / training images,
rounded down. The schedule fits the budget: warm-up over RECIPE's fraction of the steps,
then cosine decay to 0 at the last step.

It prints and writes OUT/speedrun.md and OUT/speedrun.json (OUT: --out, default
WORKDIR/results): the wall time of the steps, of compilation (the first step of each
call) and of the evaluations, each kNN figure with the step time reached by then, and
for each of THRESHOLDS the epoch and time at which the kNN first reached it.

Calls: a call trains until the budget ends or until it has run --call_seconds (so a call
fits a 9-minute device command) or --call_epochs, saving a checkpoint (core.checkpointing:
state and config) after each evaluation and where it stops; the next call with the same
--workdir resumes from the newest checkpoint (the batches are a function of the step, so
it continues as one run would). A checkpoint of another recipe (any config field, the
budget and the data's sizes included) is refused with one line. Refused before any compute,
one line each: a package it needs is absent, --data is no file, a budget below one
evaluation.

It needs JAX, flax, optax, orbax-checkpoint, numpy, Pillow, absl-py, etils and
ml_collections, and no TensorFlow, TFDS or clu (docs/gpu.md: what to carry).
"""

import importlib.util
import json
import os
import sys
import time

# What the script imports beyond the standard library, checked before any import so that
# an image without one gets one line naming it: module -> pip name.
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
    f"benchmarks/speedrun.py needs {', '.join(missing_packages())}: install them or carry "
    "their wheels (docs/gpu.md)"
  )

# Run the package this script sits in, not another installed copy of it.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from contrastive_jax import config_files  # noqa: E402
from contrastive_jax import models  # noqa: E402
from contrastive_jax import recipes  # noqa: E402
from contrastive_jax.core import checkpointing  # noqa: E402
from contrastive_jax.core import files  # noqa: E402
from contrastive_jax.core import mesh as mesh_lib  # noqa: E402
from contrastive_jax.core import runtime  # noqa: E402
from contrastive_jax.core.errors import ConfigError  # noqa: E402
from contrastive_jax.data import device_data  # noqa: E402
from contrastive_jax.data import device_samplers  # noqa: E402
from contrastive_jax.methods import evaluated_encoder  # noqa: E402
from contrastive_jax.methods import get_method  # noqa: E402
from contrastive_jax.methods import pretraining  # noqa: E402
from contrastive_jax.training import evaluators  # noqa: E402

FLAGS = flags.FLAGS

LIGHTLY = "lightly docs/source/getting_started/benchmarks/cifar10_benchmark.py"
DKOBAK = "dkobak/simclr-cifar10 simclr-cifar10.py"
SOLO = "solo-learn scripts/pretrain/cifar/simclr.yaml"
GOOGLE = "google-research/simclr README, CIFAR-10 (configs/simclr_cifar10.py)"

# (config field, value, source): what the speedrun sets on configs/simclr_cifar10.py.
RECIPE = (
  ("method", "simclr", f"{LIGHTLY}: SimCLR, 0.848 kNN at 200 epochs, batch 512"),
  ("batch_size", 512, f"{LIGHTLY}: its batch-512 rows"),
  ("model.dtype", "bfloat16", "the project's measured step (docs/throughput.md)"),
  ("optimizer.name", "sgd", f"{LIGHTLY} and {DKOBAK}: SGD, momentum 0.9"),
  ("optimizer.momentum", 0.9, f"{LIGHTLY} and {DKOBAK}"),
  # lightly: lr 6e-2 x batch / 128, i.e. 0.12 x batch / 256 (0.24 at batch 512).
  ("optimizer.base_lr", 0.12, f"{LIGHTLY}: lr 6e-2 x batch/128"),
  ("optimizer.lr_scaling", "linear", f"{LIGHTLY}: lr_factor = batch/128"),
  ("optimizer.weight_decay", 5e-4, f"{LIGHTLY} and {DKOBAK}: weight decay 5e-4"),
  ("optimizer.weight_decay_mask", "all", f"{LIGHTLY}: torch SGD's decay on every parameter"),
  # 10 warm-up epochs of 200 (SimCLR's 10, and solo-learn's warmup_cosine), then cosine to 0
  # at the budget's last step (lightly's and dkobak's CosineAnnealingLR over the run).
  ("optimizer.warmup_fraction", 0.05, f"{GOOGLE}: 10 warm-up epochs; {SOLO}: warmup_cosine"),
  ("optimizer.schedule", "cosine", f"{LIGHTLY} and {DKOBAK}: CosineAnnealingLR"),
  ("temperature", 0.5, f"{LIGHTLY}: NTXentLoss's default; {DKOBAK}: infoNCE 0.5"),
  # torchvision's RandomResizedCrop(32, scale=(0.2, 1)), bilinear, as dkobak draws it.
  ("crop.sampler", "torchvision", f"{DKOBAK}: RandomResizedCrop"),
  ("crop.area_min", 0.2, f"{DKOBAK}: CROP_LOW_SCALE 0.2"),
  ("crop.resize", "pil_bilinear", f"{DKOBAK}: RandomResizedCrop's bilinear"),
  # ColorJitter(0.4, 0.4, 0.4, 0.1) with p 0.8, grayscale p 0.2, no blur on CIFAR.
  ("augment.view1", recipes.moco_v2_view(0.0), f"{DKOBAK}; {LIGHTLY}: SimCLR collate, no blur"),
  ("augment.view2", recipes.moco_v2_view(0.0), f"{DKOBAK}; {LIGHTLY}: SimCLR collate, no blur"),
  ("on_device_data", True, "CIFAR-10 held on the device (data/device_data.py)"),
)
# The kNN monitor's fields: lightly's knn_k and knn_t, the test split against the train split.
KNN = dict(split="test", bank_split="train", k=200, temperature=0.1)
EPOCHS = 200  # lightly's max_epochs.
# kNN top-1 marks: 0.80, lightly's SimCLR 0.848 at 200 epochs (batch 512), that plus one
# point, and dkobak's race to 0.90.
THRESHOLDS = (0.80, 0.848, 0.858, 0.90)
# --tiny: the first images of each split, batch 16, ResNet-10 at width 1/8.
TINY = dict(train_images=256, test_images=128, batch_size=16, epochs=2, eval_every=1)
RESULTS = ("speedrun.md", "speedrun.json")
PROGRESS = "progress.json"


def define_flags():
  """The script's flags (not defined at import, so tests can load the module)."""
  flags.DEFINE_string("data", None, "the .npz of benchmarks/make_device_data.py (train, test)")
  flags.DEFINE_string("workdir", "speedrun_runs/simclr_r18", "checkpoints and progress")
  flags.DEFINE_string("out", None, "where speedrun.md and .json go (default: WORKDIR/results)")
  flags.DEFINE_bool("tiny", False, "every part at toy sizes on a CPU: a check, not a measurement")
  flags.DEFINE_integer("epochs", None, f"the budget in epochs (default {EPOCHS}; --tiny 2)")
  flags.DEFINE_float("minutes", None, "the budget in minutes of steps, instead of --epochs")
  flags.DEFINE_float("images_per_s", 41404.0, "the step's throughput that --minutes reads")
  flags.DEFINE_integer("eval_every", None, "epochs between kNN evaluations (default 10; --tiny 1)")
  flags.DEFINE_float("call_seconds", 480.0, "this call stops (checkpointed) after about this")
  flags.DEFINE_integer("call_epochs", None, "this call stops after this many epochs")


def fail(message: str):
  """Ends the script with its one line on stderr and status 1."""
  sys.exit(f"benchmarks/speedrun.py: {message}")


def budget_epochs(train_images: int) -> int:
  """The budget in epochs: --epochs, or --minutes of steps at --images_per_s."""
  if FLAGS.minutes is not None:
    if FLAGS.epochs is not None:
      fail(f"--epochs={FLAGS.epochs} and --minutes={FLAGS.minutes}: give one budget")
    return int(FLAGS.minutes * 60 * FLAGS.images_per_s // train_images)
  if FLAGS.epochs is not None:
    return FLAGS.epochs
  return TINY["epochs"] if FLAGS.tiny else EPOCHS


def speedrun_config(tiny: bool, epochs: int, eval_every: int, train_images: int, test_images: int):
  """configs/simclr_cifar10.py with RECIPE set, the budget and the data's sizes recorded
  (config.speedrun), so that a resume from another recipe's checkpoint differs from it."""
  config = config_files.load_config_file(
    os.path.join(ROOT, "configs", "simclr_cifar10.py"), "recipe"
  )
  for field, value, _ in RECIPE:
    *parents, leaf = field.split(".")
    node = config
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  config.duration = f"{epochs} epochs"
  config.evaluators.knn.update(KNN, every=f"{eval_every} epochs")
  config.speedrun = dict(
    epochs=epochs, eval_every=eval_every, train_images=train_images, test_images=test_images
  )
  if tiny:  # Batch 16, ResNet-10 at width 1/8: every part at toy sizes. float32: on a CPU
    # bfloat16 is slower, and JAX 0.11's XLA:CPU computes its h as NaN (docs/gpu.md).
    config.batch_size = TINY["batch_size"]
    config.model.update(name="resnet10", width=0.125, dtype="float32")
    config.evaluators.knn.batch_size = 64
  return config


def eval_batches(images: np.ndarray, labels: np.ndarray, local_batch: int):
  """Yields the split's eval batches {'image' uint8 [b, S, S, 3], 'label', 'mask'}, in order,
  the last padded with zeros and its padding masked out (what evaluators read)."""
  for start in range(0, len(images), local_batch):
    x, y = images[start : start + local_batch], labels[start : start + local_batch]
    pad = local_batch - len(x)
    yield {
      "image": np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]),
      "label": np.concatenate([y, np.zeros(pad, y.dtype)]),
      "mask": np.arange(local_batch) < len(x),
    }


def first_reached(evals: list) -> dict:
  """{threshold: the first evaluation whose kNN reached it, or None} over THRESHOLDS."""
  return {f"{t:g}": next((e for e in evals if e["knn_top1"] >= t), None) for t in THRESHOLDS}


def table(env: dict, progress: dict) -> str:
  """The results as markdown: the clock, each evaluation, the thresholds."""
  evals, last = progress["evals"], progress["saves"][-1] if progress["saves"] else None
  clock = last or {"step": 0, "train_s": 0.0, "compile_s": 0.0, "eval_s": 0.0, "read_s": 0.0}
  lines = [
    f"SimCLR ResNet-18 CIFAR-10 speedrun, {env['epochs']} epochs, batch {env['batch']}: JAX "
    f"{env['jax']}, {env['devices']} x {env['kind']} ({env['backend']})"
    + (" (--tiny)" if env["tiny"] else ""),
    "",
    "| step | epoch | steps (s) | compilation (s) | evaluation (s) | data read (s) | calls |",
    "|---|---|---|---|---|---|---|",
    f"| {clock['step']} | {clock['step'] / env['steps_per_epoch']:.1f} | {clock['train_s']:.1f} | "
    f"{clock['compile_s']:.1f} | {clock['eval_s']:.1f} | {clock['read_s']:.1f} | "
    f"{len(progress['calls'])} |",
    "",
    "| epoch | kNN top-1 | steps (s) | evaluation (s) |",
    "|---|---|---|---|",
  ]
  lines += [
    f"| {e['epoch']:g} | {e['knn_top1']:.4f} | {e['train_s']:.1f} | {e['knn_s']:.1f} |"
    for e in evals
  ]
  lines += [
    "",
    "| kNN threshold | first epoch | steps (s) | steps, compilation and evaluation (s) |",
    "|---|---|---|---|",
  ]
  for threshold, e in first_reached(evals).items():
    if e is None:
      lines.append(f"| {threshold} | not reached | | |")
    else:
      total = e["train_s"] + e["compile_s"] + e["eval_s"]
      lines.append(f"| {threshold} | {e['epoch']:g} | {e['train_s']:.1f} | {total:.1f} |")
  return "\n".join(lines) + "\n"


def save_results(out: str, env: dict, progress: dict) -> str:
  """Writes OUT/speedrun.md and OUT/speedrun.json atomically; returns the markdown."""
  text = table(env, progress)
  files.makedirs(out)
  files.write_atomic(os.path.join(out, RESULTS[0]), text)
  results = dict(environment=env, thresholds=first_reached(progress["evals"]), **progress)
  files.write_atomic(os.path.join(out, RESULTS[1]), json.dumps(results, indent=1))
  return text


def resumed_progress(workdir: str, step: int) -> dict:
  """The progress record as it stood at checkpoint `step`: written before each checkpoint, so
  what it holds beyond the newest checkpoint (a call killed between the two) is dropped."""
  path = os.path.join(workdir, PROGRESS)
  if step == 0 or not os.path.exists(path):
    return {"evals": [], "saves": [], "calls": []}
  with open(path) as f:
    progress = json.load(f)
  progress["evals"] = [e for e in progress["evals"] if e["step"] <= step]
  progress["saves"] = [s for s in progress["saves"] if s["step"] <= step]
  progress["calls"] = [c for c in progress["calls"] if c["start_step"] < step]
  progress["calls"][-1]["end_step"] = step
  return progress


def main(argv):
  del argv
  tiny = FLAGS.tiny
  if not FLAGS.data or not os.path.isfile(FLAGS.data):
    fail(
      f"--data={FLAGS.data or ''} is no file; it needs the .npz that "
      "benchmarks/make_device_data.py writes (docs/gpu.md)"
    )
  eval_every = FLAGS.eval_every or (TINY["eval_every"] if tiny else 10)
  train_images = TINY["train_images"] if tiny else 50_000
  epochs = budget_epochs(train_images)
  if epochs < eval_every:
    budget = f"--minutes={FLAGS.minutes:g} ({epochs} epochs)" if FLAGS.minutes else (
      f"--epochs={epochs}"
    )  # fmt: skip
    fail(f"{budget} is below --eval_every={eval_every}: no kNN evaluation would run")
  if FLAGS.call_epochs is not None and FLAGS.call_epochs < 1:
    fail(f"--call_epochs={FLAGS.call_epochs}: at least 1")
  test_images = TINY["test_images"] if tiny else 10_000
  config = speedrun_config(tiny, epochs, eval_every, train_images, test_images)
  get_method(config.method).check_config(config, train_images)
  workdir = os.path.abspath(FLAGS.workdir)
  out = FLAGS.out or os.path.join(workdir, "results")
  # The jobs' process settings; no re-execution: a timed GPU run gains nothing from it.
  runtime.setup(huge_pages=False)
  logging.set_verbosity(logging.WARNING)  # Orbax's lines at each save would bury the table.

  files.makedirs(workdir)
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"), keep=2)
  try:
    ckpt.discard_incomplete()
    start_step = ckpt.latest_step() or 0
    if start_step:  # A resume: the checkpoint must be this recipe's, field for field.
      differences = checkpointing.config_differences(ckpt.saved_config().to_dict(), config, ())
      if differences:
        named = "; ".join(f"{f}: {saved!r} there, {now!r} here" for f, saved, now in differences)
        fail(
          f"{workdir} holds a checkpoint of another recipe ({named}); give another --workdir "
          "or the flags it was started with"
        )
    run_call(config, ckpt, workdir, out, start_step)
  finally:
    ckpt.close()


def run_call(config, ckpt, workdir: str, out: str, start_step: int):
  """This call: read the data, restore or initialise, train to the next stop, evaluate and
  checkpoint at each evaluation epoch and where it stops, write the results."""
  call_start = time.perf_counter()
  sizes = config.speedrun
  train_images, train_labels = device_data.load_npz(FLAGS.data, "train")
  test_images, test_labels = device_data.load_npz(FLAGS.data, "test")
  if len(train_images) < sizes.train_images or len(test_images) < sizes.test_images:
    fail(
      f"--data={FLAGS.data} holds {len(train_images)} train and {len(test_images)} test images; "
      f"the run needs {sizes.train_images} and {sizes.test_images}"
    )
  train_images, train_labels = (
    train_images[: sizes.train_images],
    train_labels[: sizes.train_images],
  )
  test_images, test_labels = test_images[: sizes.test_images], test_labels[: sizes.test_images]
  mesh = mesh_lib.make_mesh()
  num, height, width, _ = train_images.shape
  capacity, where = device_data.device_capacity()
  device_data.check_fits(device_data.split_bytes(num, height, width), capacity, where, FLAGS.data)
  read_s = time.perf_counter() - call_start

  steps_per_epoch = num // config.batch_size
  num_steps = sizes.epochs * steps_per_epoch
  eval_steps = [
    e * steps_per_epoch for e in range(sizes.eval_every, sizes.epochs + 1, sizes.eval_every)
  ]
  if eval_steps[-1] != num_steps:
    eval_steps.append(num_steps)
  run = pretraining.setup(config, mesh, steps_per_epoch, num_steps, num_classes=10)
  replicated = mesh_lib.replicated(mesh)
  if start_step:
    state = ckpt.restore(checkpointing.abstract_like(jax.eval_shape(run.init), replicated))
  else:
    state = run.init()
  progress = resumed_progress(workdir, start_step)
  clock = dict(progress["saves"][-1]) if progress["saves"] else dict(
    train_s=0.0, compile_s=0.0, eval_s=0.0, read_s=0.0
  )  # fmt: skip
  clock["read_s"] += read_s
  call = {"start_step": start_step, "end_step": start_step}
  progress["calls"].append(call)
  env = {
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "kind": jax.devices()[0].device_kind,
    "devices": jax.device_count(),
    "tiny": FLAGS.tiny,
    "epochs": sizes.epochs,
    "batch": config.batch_size,
    "steps_per_epoch": steps_per_epoch,
    "num_steps": num_steps,
    "recipe": [{"field": f, "value": v, "source": s} for f, v, s in RECIPE],
  }
  print(
    f"JAX {env['jax']} on {env['devices']} x {env['kind']}: step {start_step} of {num_steps} "
    f"({steps_per_epoch} a epoch), data read in {read_s:.1f} s",
    flush=True,
  )

  knn_config = config.evaluators.knn.copy_and_resolve_references()
  knn_config.batch_size -= knn_config.batch_size % jax.device_count()
  data = {"train": (train_images, train_labels), "test": (test_images, test_labels)}
  encoder = run.model.encoder
  eval_model = evaluators.EvalModel(
    variables=evaluated_encoder(config.method),
    features=lambda variables, images: models.encode(encoder, variables, images),
    logits=None,
    dataset=lambda split, local_batch: eval_batches(*data[split], local_batch),
  )
  knn = evaluators.Knn("knn", knn_config, eval_model, mesh, 10)
  batches = device_samplers.train_batches(
    device_data.to_mesh(train_images, train_labels, mesh), config, mesh,
    image_size=config.image_size,
  )(start_step)  # fmt: skip

  step, chunk_s = start_step, 0.0
  call_limit = num_steps
  if FLAGS.call_epochs is not None:
    call_limit = min(num_steps, start_step + FLAGS.call_epochs * steps_per_epoch)
  compiled = False
  while step < call_limit:
    target = min(next(s for s in eval_steps if s > step), call_limit)
    elapsed = time.perf_counter() - call_start
    if step > start_step and elapsed + chunk_s > FLAGS.call_seconds:
      break  # The next stretch would not fit this call: checkpointed, the next call goes on.
    chunk_start = time.perf_counter()
    if not compiled:  # The first step compiles: its time is compilation's, not the steps'.
      state, metrics = run.train_step(state, next(batches))
      jax.block_until_ready(metrics)
      clock["compile_s"] += time.perf_counter() - chunk_start
      step, compiled = step + 1, True
    train_start = time.perf_counter()
    while step < target:
      state, metrics = run.train_step(state, next(batches))
      step += 1
    loss = float(metrics["loss"])  # Blocks on the last step.
    clock["train_s"] += time.perf_counter() - train_start
    if not np.isfinite(loss):
      fail(f"the loss is {loss} at step {step}: nothing saved past step {call['end_step']}")
    if step in eval_steps:
      knn_start = time.perf_counter()
      top1 = float(knn(state)["knn_top1"])
      knn_s = time.perf_counter() - knn_start
      clock["eval_s"] += knn_s
      progress["evals"].append(
        dict(clock, step=step, epoch=step / steps_per_epoch, knn_top1=top1, knn_s=knn_s, loss=loss)
      )
      print(
        f"  epoch {step / steps_per_epoch:g}: kNN top-1 {top1:.4f} ({knn_s:.1f} s), loss "
        f"{loss:.3f}, steps {clock['train_s']:.1f} s",
        flush=True,
      )
    chunk_s = time.perf_counter() - chunk_start
    call["end_step"] = step
    progress["saves"].append(dict(clock, step=step))
    # The record first, then the checkpoint: a resume drops what the record holds beyond it.
    files.write_atomic(os.path.join(workdir, PROGRESS), json.dumps(progress, indent=1))
    ckpt.save(step, state, config)
  ckpt.wait()
  text = save_results(out, env, progress)
  print(text, flush=True)
  if step < num_steps:
    print(f"stopped at step {step} of {num_steps}: run the same command again to go on", flush=True)


def run_main(argv):
  """main, with a ConfigError as its one line on stderr."""
  try:
    main(argv)
  except ConfigError as error:
    fail(str(error))


if __name__ == "__main__":
  define_flags()
  app.run(run_main)

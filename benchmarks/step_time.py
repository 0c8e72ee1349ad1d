"""Times the pretraining step and the job's input pipeline; prints a table.

  python benchmarks/step_time.py --config=configs/simclr_cifar10.py:runlocal \
      --variants='model.width=0.25;model.width=0.125'

Each variant is a ';'-separated list of config overrides (field=value, comma
separated). The step is timed on a fixed uint8 batch after compilation, so it
excludes the input pipeline; the pipeline is timed alone on real data: the host's,
or for a config with on_device_data the device's batch draw, crops and flips (the
split read onto the device first, untimed). For MoCo the last column says whether
the donated state let XLA write the queue into its own buffer (no copy of the K x D
queue per step):

  python benchmarks/step_time.py --config=configs/moco_v2_cifar10.py:runlocal \
      --variants='moco.queue_size=4096;moco.queue_size=65536' --pipeline_batches=0
"""

import ast
import os
import sys

# Time the package this script sits in, not another installed copy of it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from contrastive_jax.core import runtime

if __name__ == "__main__":
  runtime.setup()  # Every process setting first, before the imports below (core/runtime.py).

from absl import app
from absl import flags
import jax  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags

from benchmarks import common
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.core.errors import JobError
from contrastive_jax.data import sources
from contrastive_jax.jobs import pretrain

_CONFIG = config_flags.DEFINE_config_file("config", None, "Base config.")
_VARIANTS = flags.DEFINE_string("variants", "", "';'-separated override sets.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per variant.")
_PIPELINE_BATCHES = flags.DEFINE_integer("pipeline_batches", 20, "Batches timed (0: skip).")


def override(config, assignments: str):
  config = config.copy_and_resolve_references()
  for assignment in filter(None, assignments.split(",")):
    if assignment == "base":
      continue
    field, value = assignment.split("=")
    *path, last = field.strip().split(".")
    node = config
    for part in path:
      node = node[part]
    try:
      node[last] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      node[last] = value
  return config


def time_step(config):
  """Seconds per step, and whether MoCo's queue buffer was reused (None for other methods)."""
  run, state, batch = common.step_setup(config)
  state, metrics = run.train_step(state, batch)
  jax.block_until_ready(metrics)
  queue = state.extra.get("queue")
  pointer = queue.addressable_data(0).unsafe_buffer_pointer() if queue is not None else None
  seconds, state = common.seconds_per_step(run.train_step, state, batch, _STEPS.value)
  in_place = (
    None
    if queue is None
    else state.extra["queue"].addressable_data(0).unsafe_buffer_pointer() == pointer
  )
  return seconds, in_place


def time_pipeline(config, source) -> float:
  """Seconds per batch of the input the pretrain job reads for config."""
  if config.get("on_device_data", False):
    num_steps = _PIPELINE_BATCHES.value + 1
    batches = pretrain.on_device_batches(config, source, mesh_lib.make_mesh(), num_steps)(0)
    batches = map(jax.block_until_ready, batches)
  else:
    batches = iter(common.train_pipeline(config, source, shuffle_buffer=1000))
  return common.seconds_per_batch(batches, warmup=1, timed=_PIPELINE_BATCHES.value)


def main(_):
  """Prints the table; a config or dataset that cannot run is one line on stderr, exit 1."""
  try:
    run_variants()
  except JobError as error:
    sys.exit(f"benchmarks/step_time.py: {error}")


def run_variants():
  print(f"{jax.device_count()} {jax.devices()[0].platform} device(s)")
  print("| variant | batch | step (s) | images/s | pipeline (s/batch) | queue in place |")
  print("|---|---|---|---|---|---|")
  for variant in _VARIANTS.value.split(";"):
    config = override(_CONFIG.value, variant)
    source = None
    if _PIPELINE_BATCHES.value:  # Opened first: a missing dataset fails before compiling.
      source = sources.get_source(config, {"train_split": config.train_split})
    step_s, in_place = time_step(config)
    pipe_s = time_pipeline(config, source) if source is not None else float("nan")
    print(
      f"| {variant or 'base'} | {config.batch_size} | {step_s:.3f} | "
      f"{config.batch_size / step_s:.0f} | {pipe_s:.3f} | "
      f"{'n/a' if in_place is None else in_place} |",
      flush=True,
    )


if __name__ == "__main__":
  app.run(main)

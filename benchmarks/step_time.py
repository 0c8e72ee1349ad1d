"""Times the pretraining step and the host input pipeline; prints a table.

  python benchmarks/step_time.py --config=configs/simclr_cifar10.py:runlocal \
      --variants='model.width=0.25;model.width=0.125'

Each variant is a ';'-separated list of config overrides (field=value, comma
separated). The step is timed on a fixed uint8 batch after compilation, so it
excludes the input pipeline; the pipeline is timed alone on real data.
"""
import ast
import time

import jax
import numpy as np
from absl import app
from absl import flags
from ml_collections import config_flags

from contrastive_jax import input_pipeline
from contrastive_jax import optim
from contrastive_jax import train
from contrastive_jax import train_state as ts
from contrastive_jax.methods import get_method

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


def time_step(config) -> float:
  method = get_method(config.method)
  mesh = ts.make_mesh()
  schedule = optim.learning_rate_schedule(config.optimizer, config.batch_size, 100, 1000)
  tx = optim.build_optimizer(config.optimizer, schedule)
  model = method.build_model(config)
  rng = jax.random.PRNGKey(0)
  state = jax.jit(lambda: method.init_state(config, model, tx, rng, rng),
                  out_shardings=ts.replicated(mesh))()
  step = jax.jit(method.make_train_step(config, model, tx, train.views(config), mesh, 1000),
                 donate_argnums=0)
  images = np.random.default_rng(0).integers(
      0, 256, (config.batch_size, 2, config.image_size, config.image_size, 3), np.uint8)
  batch = {"image": jax.device_put(images, ts.batch_sharded(mesh))}
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  t0 = time.perf_counter()
  for _ in range(_STEPS.value):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  return (time.perf_counter() - t0) / _STEPS.value


def time_pipeline(config) -> float:
  builder = input_pipeline.get_builder(config.dataset, config.data_dir, {"s": config.train_split})
  ds = input_pipeline.train_dataset(
      builder, config.train_split, local_batch=config.batch_size, image_size=config.image_size,
      crop_area_min=config.crop_area_min, seed=0, start_step=0, cache=False,
      shuffle_buffer=1000, threads=config.data_threads)
  it = iter(ds)
  next(it)
  t0 = time.perf_counter()
  for _ in range(_PIPELINE_BATCHES.value):
    next(it)
  return (time.perf_counter() - t0) / _PIPELINE_BATCHES.value


def main(_):
  print(f"{jax.device_count()} {jax.devices()[0].platform} device(s)")
  print(f"| variant | batch | step (s) | images/s | pipeline (s/batch) |")
  print(f"|---|---|---|---|---|")
  for variant in _VARIANTS.value.split(";"):
    config = override(_CONFIG.value, variant)
    step_s = time_step(config)
    pipe_s = time_pipeline(config) if _PIPELINE_BATCHES.value else float("nan")
    print(f"| {variant or 'base'} | {config.batch_size} | {step_s:.3f} | "
          f"{config.batch_size / step_s:.0f} | {pipe_s:.3f} |", flush=True)


if __name__ == "__main__":
  app.run(main)

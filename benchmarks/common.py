"""What the benchmarks share: the pretraining step on a fixed batch, the project's host
pipeline, the cost analysis of a compiled program, and timing loops.

The scripts import it as `from benchmarks import common` with the repository root first
on sys.path (each script puts it there), so that they measure this checkout.
"""

import time
from typing import Iterator

import jax
from ml_collections import config_flags

from benchmarks import batches
from contrastive_jax.core import mesh as mesh_lib
from contrastive_jax.data import crop_spec
from contrastive_jax.data import input_pipeline
from contrastive_jax.data import sources
from contrastive_jax.methods import pretraining


def config_name(config_flag) -> str:
  """'configs/x.py:variant --config.a=b ...': how a --config flag (flags.FLAGS['config']) was
  given, its overrides sorted."""
  overrides = config_flags.get_override_values(config_flag)
  return config_flags.get_config_filename(config_flag) + "".join(
    f" --config.{k}={v}" for k, v in sorted(overrides.items())
  )


def cost(compiled) -> dict:
  """The cost analysis of a compiled program as one dict ('flops', 'bytes accessed', ...).

  FLOPs count 2 per multiply-add of dots and convolutions, 1 per elementwise op; for a
  program partitioned over devices they are one device's. JAX 0.10 returns a dict; older
  versions a list with one dict per program (the first is the compiled function).
  """
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0]
  return analysis


def step_setup(config):
  """(run, state, batch): the pretraining job's step for config, its initial state and a batch.

  The step is pretraining.setup's (jitted, state donated), with the online probe when
  config's dataset is labelled, as the job runs it. The batch is fixed random uint8
  images [batch_size, 2, image_size, image_size, 3] (with config.local_crops also
  'local_image' [batch_size, N, s, s, 3]) and zero labels, placed as the job places its
  batches (split over the mesh's data axis).
  """
  mesh = mesh_lib.make_mesh()
  num_classes = sources.get_source(config, {}).num_classes or 0
  run = pretraining.setup(
    config, mesh, steps_per_epoch=100, num_steps=1000, num_classes=num_classes
  )
  return run, run.init(), batches.random_batch(config, mesh)


def seconds_per_step(step, state, batch, steps: int):
  """(seconds per call of step(state, batch) -> (state, metrics), final state) over `steps`
  calls, each on the state the previous one returned; call it after a warm-up step."""
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  return (time.perf_counter() - start) / steps, state


def train_pipeline(config, source, *, shuffle_buffer: int):
  """The project's training input pipeline (input_pipeline.train_dataset) for config.

  Uncached, from step 0, with config's batch_size, image_size, crop settings, seed,
  data_threads and local_crops: batches {'image': uint8 [B, 2, S, S, 3], 'label': int32
  [B]}, and 'local_image' uint8 [B, N, s, s, 3] with local_crops.
  """
  return input_pipeline.train_dataset(
    source,
    config.train_split,
    local_batch=config.batch_size,
    image_size=config.image_size,
    crop=crop_spec.CropSpec(**config.crop),
    seed=config.seed,
    start_step=0,
    cache=False,
    shuffle_buffer=shuffle_buffer,
    threads=config.data_threads,
    local_crops=crop_spec.LocalCrops(**local) if (local := config.get("local_crops")) else None,
  )


def seconds_per_batch(batches: Iterator, *, warmup: int, timed: int) -> float:
  """Seconds per next(batches) over `timed` calls, after `warmup` untimed ones (which fill
  shuffle buffers and start the threads)."""
  for _ in range(warmup):
    next(batches)
  start = time.perf_counter()
  for _ in range(timed):
    next(batches)
  return (time.perf_counter() - start) / timed

"""The embed job on Apache Beam (config.engine='beam'): a RunInference handler for the encoder.

Imports apache_beam (the [beam] extra): the embed job imports this module only for
config.engine='beam'.

Each element of the pipeline is one shard of the job's plan (shards.Shard) that is not yet
written. RunInference gives it to EncoderHandler, whose model is loaded once per worker
process (load_model: the checkpoint read, the source opened, by a loader the job passes
in, so that no checkpoint code is here); its run_inference embeds the shard's rows in
batches of the job's batch size (shard_embed, the code the JAX engine runs) and returns
the shard's content, which the next step writes with shards.write. So the shards are the
JAX engine's files, named and cut alike, whichever worker writes which; only shard
numbers and one shard's rows travel through the runner. The driver (the job's process)
then writes the unreadable list, the ANN index and embed.json as the JAX engine does.
"""

import dataclasses
import re
import shlex
from typing import Any, Callable, NamedTuple

import apache_beam as beam
from apache_beam.ml.inference import base

from contrastive_jax.core.errors import JobError
from contrastive_jax.data import prepare_beam
from contrastive_jax.search import shard_embed
from contrastive_jax.search import shards as shards_lib

# The line of a traceback that names the exception: 'ValueError: why'.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt): ")


class Embedding(NamedTuple):
  """What the workers need to embed and write the shards.

  load: () -> (model, mesh, source, split): restore.EmbedModel, its mesh, the images'
    source and split; picklable (a module-level function, or a partial of one).
  workdir: the index's folder. batch_size: images per batch (a multiple of a worker's
  device count). threads: decoding's parallel calls. first_id: the part's first id.
  rows: shard_embed.shard_content's rows ({"split", "relabel", "labelled"}).
  """

  load: Callable
  workdir: str
  batch_size: int
  threads: int
  first_id: int
  rows: dict


@dataclasses.dataclass(frozen=True)
class Worker:
  """A worker process's model: its encoder (restore.EmbedModel), mesh and images.

  A class, not a tuple: Beam holds a worker's model by weak reference (utils.shared).
  """

  model: Any
  mesh: Any
  source: Any
  split: str


def choose_runner(name: str, num_workers: int, options: str) -> prepare_beam.Runner:
  """The checked runner of config.runner, config.num_workers and config.beam_options.

  DirectRunner runs num_workers worker processes (0: one per core) as the prepare job's
  does (prepare_beam.choose_runner); another runner takes its workers from options. The
  pipeline runs in the job's process (Runner.driver is not used).

  Raises:
    JobError: the runner is unknown or its package is not installed (naming the fix).
  """
  return prepare_beam.choose_runner(name, num_workers, options, "config.runner")


class EncoderHandler(base.ModelHandler):
  """RunInference's handler of the project's JAX encoder: examples are shards, a prediction
  is a shard's content.

  The model is loaded once per worker process (share_model_across_processes is False:
  each process holds its own, as each JAX process does) and kept for every shard the
  process embeds. run_inference takes one shard at a time (batch_elements_kwargs) and
  embeds its rows in batches of embedding.batch_size.
  """

  def __init__(self, embedding: Embedding):
    super().__init__()
    self.embedding = embedding

  def load_model(self) -> Worker:
    return Worker(*self.embedding.load())

  def run_inference(self, batch, model: Worker, inference_args=None):
    """[(shard, (h float32 [n, D], rows, unreadable))] of the shards of batch (one)."""
    del inference_args
    encoder, mesh, source, split = model.model, model.mesh, model.source, model.split
    done = []
    for shard in batch:
      shard = shards_lib.Shard(*shard)
      batches = shard_embed.num_batches([shard], self.embedding.batch_size)
      ds = shard_embed.shard_dataset(
        source,
        split,
        shard,
        encoder.eval_crop,
        self.embedding.batch_size,
        batches,
        self.embedding.threads,
      )
      embedded = shard_embed.embed_batches(encoder, ds, mesh, batches)
      content = shard_embed.shard_content(
        shard, embedded, source, self.embedding.first_id, self.embedding.rows
      )
      done.append((shard, content))
    return done

  def batch_elements_kwargs(self):
    return {"min_batch_size": 1, "max_batch_size": 1}

  def share_model_across_processes(self) -> bool:
    return False

  def get_metrics_namespace(self) -> str:
    return "contrastive_jax_embed"


def _write(embedding: Embedding, embedded: tuple) -> int:
  shard, content = embedded
  shard_embed.write_shard(embedding.workdir, shard, content)
  return shard.number


def embed_shards(shards: list, embedding: Embedding, runner: prepare_beam.Runner) -> None:
  """Embeds and writes `shards` (shards.Shard) on runner's workers; returns when all are.

  Raises:
    JobError: the pipeline failed (a worker raised or died), in one line naming the
      runner and the cause.
  """
  if not shards:
    return
  options = prepare_beam.pipeline_options(runner.args)
  try:
    with beam.Pipeline(options=options) as pipeline:
      _ = (
        pipeline
        | "Shards" >> beam.Create([tuple(shard) for shard in shards])
        | "Embed" >> base.RunInference(EncoderHandler(embedding))
        | "Write" >> beam.Map(lambda embedded: _write(embedding, embedded))
      )
  except Exception as e:  # pylint: disable=broad-except  (any runner's, any failure)
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    # A worker process's failure comes as its traceback flattened: its exception's line.
    cause = next(
      (line for line in lines if _EXCEPTION_LINE.match(line)), f"{type(e).__name__}: {lines[0]}"
    )
    raise JobError(
      f"config.engine='beam': the pipeline failed on {runner.name}: {cause} "
      f"(run with {shlex.join(runner.args)})"
    ) from None

"""The embed job's images/s on Apache Beam's local runner with 1 and 2 workers (and on JAX).

  python benchmarks/beam_embed.py --config.pretrain_workdir=PRETRAIN_DIR \
      --config.dataset=cifar10 --config.split=test --workers=1,2

Runs the embed job (configs/embed.py with its --config overrides) once per worker count
with config.engine='beam' on DirectRunner (config.num_workers = that count), and once with
config.engine='jax' as the baseline, each into a new workdir under --tmp (deleted after),
with no ANN index (config.ann.type='none'); the Beam workers are processes whatever their
number (--direct_running_mode=multi_processing). A run's time is the job's whole wall-clock
time, worker start-up and each worker's checkpoint read included: embed enough images
(a split of thousands) that they are small beside the embedding. Prints one row per run:
engine, workers, images, seconds, images/s and the speed-up over 1 Beam worker.
"""

import os
import sys
import tempfile
import time

# Run the package this script sits in, not another installed copy of it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from contrastive_jax.core import runtime

if __name__ == "__main__":
  runtime.setup()  # Every process setting first, before the imports below (core/runtime.py).

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
from ml_collections import config_flags

from contrastive_jax.core import files
from contrastive_jax.jobs import embed

FLAGS = flags.FLAGS


def define_flags():
  """Registers the command-line flags (not at import, so that tests can import this file)."""
  config_flags.DEFINE_config_file(
    "config",
    os.path.join(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "embed.py"
    ),
    "The embed job's config.",
  )
  flags.DEFINE_list("workers", ["1", "2"], "DirectRunner worker counts to measure.")
  flags.DEFINE_string("tmp", None, "Where the workdirs go (default: the system's temp folder).")


def measure(config, engine: str, workers: int, tmp: str) -> tuple:
  """(images, seconds) of one embed job run with engine on `workers` workers (beam)."""
  run = config.copy_and_resolve_references()
  run.engine, run.num_workers, run.ann.type = engine, workers, "none"
  # Worker processes for 1 worker too (DirectRunner runs one in the job's own process
  # otherwise): each count then pays the same start-up per worker.
  run.beam_options = "--direct_running_mode=multi_processing"
  workdir = tempfile.mkdtemp(prefix=f"embed_{engine}_{workers}_", dir=tmp)
  try:
    start = time.perf_counter()
    rows = len(embed.run(run, workdir))
    return rows, time.perf_counter() - start
  finally:
    files.remove_tree(workdir)


def table(results: list) -> str:
  """The printed table of [(engine, workers, images, seconds)]; speed-up over 1 Beam worker."""
  one = next((n / s for e, w, n, s in results if e == "beam" and w == 1), None)
  lines = ["| engine | workers | images | seconds | images/s | x 1 Beam worker |", "|---" * 6 + "|"]
  for engine, workers, images, seconds in results:
    speedup = f"{images / seconds / one:.2f}" if one else "-"
    lines.append(
      f"| {engine} | {workers} | {images} | {seconds:.1f} | {images / seconds:.1f} | {speedup} |"
    )
  return "\n".join(lines)


def main(argv):
  del argv
  results = []
  for workers in [int(w) for w in FLAGS.workers]:
    results.append(("beam", workers, *measure(FLAGS.config, "beam", workers, FLAGS.tmp)))
  results.append(("jax", 1, *measure(FLAGS.config, "jax", 1, FLAGS.tmp)))
  print(table(results))


if __name__ == "__main__":
  define_flags()
  app.run(main)

"""One process of a simulated 2-host job (tests/test_multihost.py starts two).

usage: python multihost_worker.py PROCESS_ID PORT WORKDIR TFDS_DIR JOB [PRETRAIN_WORKDIR]

JOB 'pretrain' runs 3 steps of the tiny SimCLR config; 'linear_probe' probes
PRETRAIN_WORKDIR for up to 100,000 steps (the test stops it with SIGTERM); 'embed'
embeds CIFAR-10 test[:20] with PRETRAIN_WORKDIR's encoder in shards of 5 rows
(tests/test_search.py), and reports the shards this process wrote, the most rows
it held at once and the most values any collective sent it.
Imports every module first and initialises jax.distributed after, as a pod
worker does.
"""

import sys

import jax
from jax.experimental import multihost_utils
import numpy as np

from contrastive_jax.jobs import embed
from contrastive_jax.jobs import linear_probe
from contrastive_jax.jobs import pretrain
from contrastive_jax.search import shards as shards_lib
from contrastive_jax.training import runner

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(
  process_id: int, port: int, workdir: str, tfds_dir: str, job: str, pretrain_workdir: str = ""
):
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  from helpers import load_config
  from helpers import tiny_config

  if job == "embed":
    config = load_config("embed")
    config.update(
      pretrain_workdir=pretrain_workdir,
      dataset="cifar10",
      data_dir=tfds_dir,
      split="test[:20]",
      batch_size=8,
      data_threads=1,
      shard_rows=5,
    )
    seen = {"written": [], "held": 0, "collected": 0}
    _record(seen)
    rows = len(embed.run(config, workdir))
    print(
      f"RESULT process={jax.process_index()} rows={rows} written={seen['written']} "
      f"held={seen['held']} collected={seen['collected']}",
      flush=True,
    )
    return
  if job == "pretrain":
    config = tiny_config()
    config.duration = "3 steps"
    config.checkpoint_every = "3 steps"
  else:
    config = load_config("linear_probe", "runlocal")
    config.pretrain_workdir = pretrain_workdir
    config.train_split = "train[:256]"
    config.batch_size = 16
    config.duration = "100000 steps"
    config.log_every = "1 steps"
    config.shuffle_buffer = 256
    config.data_threads = 1
    config.evaluators.linear_probe.split = "test[:32]"
    config.evaluators.linear_probe.batch_size = 16
  config.data_dir = tfds_dir
  state, _ = runner.run({"pretrain": pretrain, "linear_probe": linear_probe}[job], config, workdir)
  leaf = jax.tree.leaves(state.params)[0]
  print(
    f"RESULT process={jax.process_index()} step={int(state.step)} "
    f"checksum={float(leaf.addressable_data(0).sum()):.8f}",
    flush=True,
  )


def _record(seen: dict):
  """Wraps the shard writer and the collectives that move host data to count what they carry."""
  write = shards_lib.write

  def counted_write(workdir, number, h, rows, unreadable):
    seen["written"].append(number)
    seen["held"] = max(seen["held"], len(h))
    write(workdir, number, h, rows, unreadable)

  shards_lib.write = counted_write
  for name in ("process_allgather", "broadcast_one_to_all"):
    collective = getattr(multihost_utils, name)

    def counted(x, *args, collective=collective, **kwargs):
      out = collective(x, *args, **kwargs)
      seen["collected"] = max(seen["collected"], sum(np.size(a) for a in jax.tree.leaves(out)))
      return out

    setattr(multihost_utils, name, counted)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])

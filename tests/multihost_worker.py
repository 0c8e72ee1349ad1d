"""One process of a simulated 2-host run (tests/test_multihost.py starts two).

usage: python multihost_worker.py PROCESS_ID PORT WORKDIR TFDS_DIR
"""
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(process_id: int, port: int, workdir: str, tfds_dir: str):
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  from helpers import tiny_config
  from contrastive_jax import train

  config = tiny_config()
  config.data_dir = tfds_dir
  config.total_steps = 3
  config.checkpoint_every_steps = 3
  state = train.train(config, workdir)
  leaf = jax.tree.leaves(state.params)[0]
  print(f"RESULT process={jax.process_index()} step={int(state.step)} "
        f"checksum={float(leaf.addressable_data(0).sum()):.8f}", flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])

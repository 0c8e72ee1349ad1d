"""Two processes on 127.0.0.1, 4 CPU devices each: pretraining and a preempted probe."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

from helpers import TFDS_DIR, tiny_config

from contrastive_jax import checkpointing
from contrastive_jax import pretrain
from contrastive_jax import runner


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(workdir, job, *extra):
  port = _free_port()
  worker = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
  env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__))
  return [subprocess.Popen([sys.executable, worker, str(i), str(port), str(workdir), TFDS_DIR,
                            job, *extra],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
          for i in range(2)]


def _results(procs, timeout=600):
  outputs = [p.communicate(timeout=timeout)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  return [re.search(r"RESULT process=(\d) step=(\d+) checksum=(\S+)", out).groups()
          for out in outputs]


def _steps(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["step"] for line in f]


def test_two_host_run_agrees_and_only_process_zero_writes_metrics(tmp_path):
  results = _results(_start(tmp_path, "pretrain"))
  assert [r[0] for r in results] == ["0", "1"]
  assert results[0][1:] == results[1][1:]  # Same step, same replicated params.
  assert results[0][1] == "3"
  assert _steps(tmp_path) == [0, 1, 2, 3]  # Written once, by process 0.
  assert os.path.isdir(tmp_path / "checkpoints" / "3")


def test_sigterm_to_one_process_stops_both_probe_processes_at_the_same_step(tmp_path):
  pretrained = tmp_path / "pretrain"
  config = tiny_config()
  config.duration = "1 steps"
  runner.run(pretrain, config, str(pretrained))
  probe_dir = tmp_path / "probe"
  procs = _start(probe_dir, "linear_probe", str(pretrained))
  deadline = time.time() + 300
  while not (os.path.exists(probe_dir / "metrics.jsonl") and len(_steps(probe_dir)) >= 3):
    assert time.time() < deadline and all(p.poll() is None for p in procs)
    time.sleep(0.5)
  procs[1].send_signal(signal.SIGTERM)  # Only one host hears it, as on a pod.
  results = _results(procs)
  assert results[0][1:] == results[1][1:]
  stopped = int(results[0][1])
  assert 3 <= stopped < 400
  assert checkpointing.Checkpointer(str(probe_dir / "checkpoints")).latest_step() == stopped

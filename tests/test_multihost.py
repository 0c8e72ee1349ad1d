"""Two processes on 127.0.0.1, 4 CPU devices each, train SimCLR together."""
import json
import os
import re
import socket
import subprocess
import sys

from helpers import TFDS_DIR


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_host_run_agrees_and_only_process_zero_writes_metrics(tmp_path):
  port = _free_port()
  worker = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
  env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__))
  procs = [subprocess.Popen([sys.executable, worker, str(i), str(port), str(tmp_path), TFDS_DIR],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
           for i in range(2)]
  outputs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  results = [re.search(r"RESULT process=(\d) step=(\d+) checksum=(\S+)", out).groups()
             for out in outputs]
  assert [r[0] for r in results] == ["0", "1"]
  assert results[0][1:] == results[1][1:]  # Same step, same replicated params.
  assert results[0][1] == "3"
  assert os.path.exists(tmp_path / "metrics.jsonl")
  with open(tmp_path / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == [0, 1, 2, 3]  # Written once, by process 0.
  assert os.path.isdir(tmp_path / "checkpoints" / "3")

"""Two processes on 127.0.0.1: pretraining, a preempted probe, a worker killed mid-run."""

import json
import os
import re
import signal
import subprocess
import sys
import time

from helpers import CONFIG_DIR
from helpers import TFDS_DIR
from helpers import free_port
from helpers import subprocess_env
from helpers import tiny_config
import pytest

from contrastive_jax.core import checkpointing
from contrastive_jax.core import files
from contrastive_jax.jobs import pretrain
from contrastive_jax.training import runner


def _start(workdir, job, *extra):
  port = free_port()
  worker = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
  return [
    subprocess.Popen(
      [sys.executable, worker, str(i), str(port), str(workdir), TFDS_DIR, job, *extra],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=subprocess_env(),
    )
    for i in range(2)
  ]


def _results(procs, timeout=600):
  outputs = [p.communicate(timeout=timeout)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  return [
    re.search(r"RESULT process=(\d) step=(\d+) checksum=(\S+)", out).groups() for out in outputs
  ]


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


def test_both_processes_stop_when_another_job_holds_the_workdir(tmp_path):
  with files.workdir_lock(str(tmp_path)):  # Process 0 takes the lock, and tells process 1.
    procs = _start(tmp_path, "pretrain")
    outputs = [p.communicate(timeout=300)[0] for p in procs]
  assert [p.returncode for p in procs] == [1, 1], outputs[0][-3000:]
  assert (
    f"JobError: --workdir={tmp_path}: another job is running in it (pid {os.getpid()} on host "
  ) in outputs[0]
  assert (
    f"JobError: --workdir={tmp_path}: process 0 found another job running in it" in outputs[1]
  ), outputs[1][-3000:]
  assert sorted(os.listdir(tmp_path)) == [files.LOCK]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A pretraining workdir with a 1-step tiny SimCLR checkpoint, for the probes."""
  workdir = tmp_path_factory.mktemp("pretrain")
  config = tiny_config()
  config.duration = "1 steps"
  config.evaluators = {}  # The probes read its checkpoint only; evaluating it would compile.
  runner.run(pretrain, config, str(workdir))
  return workdir


def test_sigterm_to_one_process_stops_both_probe_processes_at_the_same_step(pretrained, tmp_path):
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
  assert stopped >= 3
  assert checkpointing.Checkpointer(str(probe_dir / "checkpoints")).latest_step() == stopped


def test_a_killed_worker_stops_the_other(pretrained, tmp_path):
  """kill -9 of process 1 mid-run: process 0 exits non-zero, at the latest at --heartbeat_timeout.

  Through the real entry point (main.py --distributed), the linear probe on 2
  processes x 2 devices. Either the survivor's collective fails at once and it
  exits 1 with main.py's one line (about half the runs here), or one of its
  devices blocks in a collective whose peer is gone and JAX's coordination
  service ends it at the heartbeat timeout with its fatal message (the other
  half); rarely gloo's I/O thread aborts it first on the dead peer's last
  message (seen once in about 20 runs).
  """
  heartbeat_timeout = 10
  workdir = tmp_path / "probe"
  port = free_port()
  args = [
    f"--config={CONFIG_DIR}/linear_probe.py:runlocal",
    f"--workdir={workdir}",
    f"--config.pretrain_workdir={pretrained}",
    f"--config.data_dir={TFDS_DIR}",
    "--config.train_split=train[:256]",
    "--config.batch_size=16",
    "--config.duration=100000 steps",
    "--config.log_every=1 steps",
    "--config.shuffle_buffer=256",
    "--config.data_threads=1",
    "--config.evaluators.linear_probe.split=test[:32]",
    "--config.evaluators.linear_probe.batch_size=16",
    "--distributed",
    f"--coordinator_address=127.0.0.1:{port}",
    "--num_processes=2",
    f"--heartbeat_timeout={heartbeat_timeout}",
  ]
  env = subprocess_env(JAX_NUM_CPU_DEVICES="2", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
  logs = [tmp_path / f"process_{i}.log" for i in range(2)]
  procs = []
  for i, log in enumerate(logs):
    with open(log, "w") as f:  # A file, not a pipe: a full pipe would stall the job.
      procs.append(
        subprocess.Popen(
          [sys.executable, "-m", "contrastive_jax.main", *args, f"--process_id={i}"],
          stdout=f,
          stderr=subprocess.STDOUT,
          env=env,
        )
      )
  try:
    deadline = time.time() + 300
    while not (os.path.exists(workdir / "metrics.jsonl") and len(_steps(workdir)) >= 3):
      assert time.time() < deadline and all(p.poll() is None for p in procs), logs[0].read_text()
      time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    procs[0].wait(timeout=heartbeat_timeout + 300)  # Bounds a hang only.
  finally:
    for proc in procs:
      proc.kill()
      proc.wait()
  output = logs[0].read_text()
  assert procs[0].returncode != 0, output[-3000:]
  if procs[0].returncode == 1:  # main.py's one line.
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-3000:]
    assert errors[0].startswith("error: process 0 of 2: a computation failed: "), errors[0]
    assert "another process of this job has died" in errors[0], errors[0]
    assert "Traceback" not in output, output[-3000:]
  else:  # Aborted by JAX's coordination service or, rarely, by gloo.
    assert procs[0].returncode == -signal.SIGABRT, output[-3000:]
    assert (
      "This most likely indicates that another task died" in output
      or "Received data size doesn't match expected size" in output
    ), output[-3000:]

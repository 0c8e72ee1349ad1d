"""launch/tpu.sh end to end on a simulated 2-host pod: tests/fake_gcloud/gcloud on PATH.

The fake serves the launcher's gcloud commands with 2 local "workers" (directories
that are their homes), each running its part of a real 2-process JAX job on
127.0.0.1 with 2 CPU devices. The real launcher copies the checkout, makes the
virtualenv, starts the job detached, reports its status, stops it (a checkpoint at
one step, written by both hosts) and resumes it.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

from helpers import CROPS_AND_FLIPS_ARGS
from helpers import TFDS_DIR
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(REPO, "launch", "tpu.sh")
FAKE_GCLOUD = os.path.join(REPO, "tests", "fake_gcloud")
TPU, ZONE = "fake-pod", "us-central2-b"
WORKERS = (0, 1)


def job_args(workdir):
  """A tiny 2-host SimCLR pretraining, as command-line overrides of runlocal."""
  return [
    "--config=configs/simclr_cifar10.py:runlocal",
    f"--workdir={workdir}",
    f"--config.data_dir={TFDS_DIR}",
    "--config.train_split=train[:256]",
    "--config.batch_size=16",
    "--config.model.name=resnet10",
    "--config.model.width=0.0625",
    "--config.duration=100000 steps",
    "--config.log_every=1 steps",
    "--config.checkpoint_every=1000 steps",
    # No evaluators: their pipelines, step-0 kNN and compiles were a third of each job's
    # start; the launcher is what is tested here, the evaluators in test_runner.
    "--config.evaluators={}",
    *CROPS_AND_FLIPS_ARGS,  # In each of the four jobs.
    "--config.shuffle_buffer=256",
    "--config.data_threads=1",
  ]


class Pod:
  """The simulated pod's root and the launcher run against it."""

  def __init__(self, root):
    self.root = root
    self.env = dict(
      os.environ,
      PATH=f"{FAKE_GCLOUD}{os.pathsep}{os.environ['PATH']}",
      FAKE_GCLOUD_ROOT=str(root),
      FAKE_GCLOUD_TPU=TPU,
      FAKE_GCLOUD_ZONE=ZONE,
      FAKE_GCLOUD_PYTHON=sys.executable,
    )  # The workers use this python's packages.
    self.env.pop("GCLOUD", None)

  def launch(self, command, *args, tpu=TPU, expect=0, env=None):
    """Runs `launch/tpu.sh COMMAND TPU ZONE ARGS`; returns stdout + stderr."""
    proc = subprocess.run(
      [LAUNCHER, command, tpu, ZONE, *args],
      env=dict(self.env, **(env or {})),
      capture_output=True,
      text=True,
      timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == expect, out[-4000:]
    return out

  def path(self, worker, *parts):
    return os.path.join(self.root, f"worker-{worker}", *parts)

  def log(self, worker):
    with open(self.path(worker, "contrastive_jax_run", "job.log")) as f:
      return f.read()

  def pid(self, worker):
    with open(self.path(worker, "contrastive_jax_run", "job.pid")) as f:
      return int(f.read())

  def alive(self, worker):
    try:
      with open(f"/proc/{self.pid(worker)}/cmdline", "rb") as f:
        return b"contrastive_jax.main" in f.read()
    except (FileNotFoundError, ProcessLookupError):
      return False

  def kill_leftovers(self):
    """SIGKILLs jobs this test started that are still running (after a failure)."""
    for worker in WORKERS:
      if os.path.exists(self.path(worker, "contrastive_jax_run", "job.pid")) and self.alive(worker):
        os.kill(self.pid(worker), signal.SIGKILL)


@pytest.fixture
def pod(tmp_path):
  pod = Pod(tmp_path / "pod")
  os.makedirs(pod.root)
  try:
    yield pod
  finally:
    pod.kill_leftovers()


def _steps(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line)["step"] for line in f if line.endswith("\n")]


def _wait(condition, pod, what, timeout=300):
  deadline = time.time() + timeout
  while not condition():
    if time.time() > deadline or not all(pod.alive(w) for w in WORKERS):
      pytest.fail(f"waiting for {what}; logs:\n" + "\n".join(pod.log(w)[-3000:] for w in WORKERS))
    time.sleep(0.5)


def _checkpoint_steps(workdir):
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def test_run_status_stop_resume_on_a_simulated_pod(pod, tmp_path):
  # Spaces, quotes and a $ in the workdir: it reaches python unchanged or the
  # checkpoints land elsewhere.
  workdir = str(tmp_path / "work dir" / 'it\'s "quoted" $HOME')
  args = job_args(workdir)

  out = pod.launch("run", *args)
  assert "installing into" in out and out.count("started (pid") == 2, out
  _wait(lambda: max(_steps(workdir), default=0) >= 3, pod, "3 logged steps")
  for worker in WORKERS:
    assert "JAX process %d of 2, 2 local devices of 4." % worker in pod.log(worker)
    # The copy on the worker is what runs, from its virtualenv.
    assert os.path.isfile(pod.path(worker, "contrastive_jax", "launch", "tpu.sh"))
    python = pod.path(worker, "contrastive_jax_run", "venv", "bin", "python")
    assert python in pod.log(worker)
    origin = subprocess.run(
      [
        python,
        "-c",
        "import importlib.util; print(importlib.util.find_spec('contrastive_jax').origin)",
      ],
      cwd=pod.path(worker, "contrastive_jax"),
      capture_output=True,
      text=True,
      check=True,
      env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    ).stdout.strip()
    assert origin == pod.path(worker, "contrastive_jax", "contrastive_jax", "__init__.py")

  status = pod.launch("status")
  assert re.search(r"worker 0: running \(pid \d+\), last logged step \d+", status), status
  assert re.search(r"worker 1: running \(pid \d+\), last logged step \d+", status), status

  out = pod.launch("run", *args, expect=1)
  assert "a job is already running on 'fake-pod'" in out and out.count("\n") == 1, out

  out = pod.launch("logs", "--worker=1", "--lines=3")
  assert len(out.splitlines()) == 3, out

  out = pod.launch("stop")
  assert "Stopped: worker 0:" in out and "worker 1:" in out, out
  assert not any(pod.alive(w) for w in WORKERS)
  stopped = _checkpoint_steps(workdir)[-1]
  assert stopped >= 3
  for worker in WORKERS:  # Both hosts stopped at the step of the checkpoint.
    assert f"Stopped at step {stopped} after a preemption request." in pod.log(worker)
  status = pod.launch("status")
  assert f"worker 0: not running, last logged step {stopped}" in status, status
  assert f"worker 1: not running, last logged step {stopped}" in status, status

  # A second run resumes from the checkpoint; the install is not redone.
  out = pod.launch("run", *args)
  assert "virtualenv up to date" in out and "installing" not in out, out
  resumed = f"Resumed from {workdir}/checkpoints at step {stopped}."
  _wait(
    lambda: (
      all(resumed in pod.log(w) for w in WORKERS) and max(_steps(workdir), default=0) > stopped
    ),
    pod,
    "the resumed run's steps",
  )
  assert pod.launch("stop").startswith("Stopped: ")
  assert _checkpoint_steps(workdir)[-1] > stopped

  out = pod.launch("stop")
  assert out == "No job is running on 'fake-pod': nothing to stop.\n", out


def _bash_words(line):
  """The words bash reads from `line` (as the user would paste it)."""
  out = subprocess.run(
    ["bash", "-c", 'eval "words=($1)"; printf "%s\\0" "${words[@]}"', "-", line],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  return out.split("\0")[:-1]


def test_dry_run_prints_gcloud_commands_that_keep_every_argument(pod):
  tricky = '--config.data_dir=/a b/it\'s "q" $HOME `x` \\ \n; *'
  out = pod.launch(
    "run", "--dry-run", "--config=configs/simclr_cifar10.py", "--workdir=/w d", tricky
  )
  lines = [_bash_words(line) for line in out.splitlines()]
  assert [words[:5] for words in lines] == [
    ["gcloud", "compute", "tpus", "tpu-vm", c] for c in ("describe", "ssh", "scp", "ssh")
  ]
  assert not os.listdir(pod.root)  # Nothing ran, not even describe.
  command = [w for w in lines[3] if w.startswith("--command=")][0]
  job_line = [line for line in command.splitlines() if line.startswith("job_args=(")]
  assert _bash_words(job_line[0].removeprefix("job_args=(").removesuffix(")")) == [
    "--config=configs/simclr_cifar10.py",
    "--workdir=/w d",
    tricky,
  ]


def test_bad_input_gives_one_clear_message(pod):
  out = pod.launch("status", tpu="no-such-tpu", expect=1)
  assert (
    out.startswith("launch/tpu.sh: error: cannot use TPU VM 'no-such-tpu' in zone")
    and out.count("\n") == 1
  ), out
  out = pod.launch("status", env={"GCLOUD": "/nonexistent/gcloud"}, expect=1)
  assert "'/nonexistent/gcloud' not found: install the Google Cloud CLI" in out, out
  out = pod.launch("run", "--config=configs/simclr_cifar10.py", "--workdir=relative", expect=1)
  assert "use gs://BUCKET/... or an absolute path" in out, out
  out = pod.launch("logs", "--worker=1", expect=1)
  assert "no job log on worker 1" in out, out

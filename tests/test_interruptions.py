"""Jobs stopped from outside, through the entry point in subprocesses: a second job on the
same workdir, Ctrl-C, kill -9, a full disk and a damaged dataset file each end in one line,
and nothing is lost."""

import json
import os
import re
import signal
import subprocess
import sys
import time

from helpers import CONFIG_DIR
from helpers import CROPS_AND_FLIPS_ARGS
from helpers import TFDS_DIR
from helpers import damaged_copy
from helpers import receive_ctrl_c
from helpers import subprocess_env
import pytest

from contrastive_jax.core import checkpointing
from contrastive_jax.core import files


def command(workdir, *overrides):
  """main.py on the tiny SimCLR (1 CPU device, no evaluator, crops and flips only), logging
  every step."""
  return [
    sys.executable,
    "-m",
    "contrastive_jax.main",
    f"--config={CONFIG_DIR}/simclr_cifar10.py:runlocal",
    f"--workdir={workdir}",
    f"--config.data_dir={TFDS_DIR}",
    "--config.train_split=train[:256]",
    "--config.batch_size=16",
    "--config.model.name=resnet10",
    "--config.model.width=0.0625",
    "--config.log_every=1 steps",
    "--config.evaluators={}",
    "--config.shuffle_buffer=256",
    "--config.data_threads=1",
    *CROPS_AND_FLIPS_ARGS,
    *overrides,
  ]


def start(args, log):
  """Popen of args with stdout and stderr to the file `log` (a pipe could fill and stall it)."""
  with open(log, "w") as f:
    return subprocess.Popen(
      args,
      stdout=subprocess.DEVNULL,
      stderr=f,
      env=subprocess_env(),
      preexec_fn=receive_ctrl_c,
    )


def wait_for(condition, proc, log, timeout=300):
  deadline = time.time() + timeout
  while not condition():
    assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
    time.sleep(0.2)


def metric_steps(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line)["step"] for line in f if line.endswith("\n")]


def last_line(stderr: str) -> str:
  assert "Traceback" not in stderr, stderr[-3000:]
  return stderr.strip().splitlines()[-1]


def test_second_job_is_refused_and_ctrl_c_checkpoints_and_stops(tmp_path):
  workdir, log = tmp_path / "run", tmp_path / "first.log"
  first = start(
    command(workdir, "--config.duration=100000 steps", "--config.checkpoint_every=1000 steps"), log
  )
  try:
    wait_for(lambda: len(metric_steps(workdir)) >= 2, first, log)
    # The same command again while the first job trains: refused before it writes anything.
    second = subprocess.run(
      command(workdir, "--config.duration=100000 steps", "--config.checkpoint_every=1000 steps"),
      capture_output=True,
      text=True,
      timeout=300,
      env=subprocess_env(),
    )
    assert second.returncode == 1
    assert last_line(second.stderr).startswith(
      f"error: --workdir={workdir}: another job is running in it (pid {first.pid} on host "
    ), second.stderr[-2000:]
    assert first.poll() is None
    first.send_signal(signal.SIGINT)
    first.wait(timeout=120)
  finally:
    first.kill()
    first.wait()
  stderr = log.read_text()
  assert first.returncode == 1, stderr[-3000:]
  directory = f"{workdir}/checkpoints"
  stopped = re.fullmatch(
    rf"error: interrupted at step (\d+): the newest checkpoint is step "
    rf"(\d+) \(in {directory}\); start the same command again to resume",
    last_line(stderr),
  )
  assert stopped and stopped[1] == stopped[2], stderr[-3000:]
  step = int(stopped[1])
  assert "Ctrl-C: saving a checkpoint after this step" in stderr
  assert checkpointing.Checkpointer(directory, read_only=True).complete_steps() == [step]
  assert metric_steps(workdir) == list(range(1, step + 1))  # Each once: the second wrote none.


def test_a_killed_job_leaves_no_lock(tmp_path):
  workdir, log = tmp_path / "run", tmp_path / "job.log"
  job = start(command(workdir, "--config.duration=100000 steps"), log)
  try:
    lock = workdir / files.LOCK
    wait_for(lambda: lock.exists() and f"pid {job.pid} " in lock.read_text(), job, log)
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=60)
  finally:
    job.kill()
    job.wait()
  with files.workdir_lock(str(workdir)):  # The kernel released the dead job's lock.
    assert lock.read_text().startswith(f"pid {os.getpid()} on host ")


@pytest.fixture
def small_disk(tmp_path):
  """A 2.5 MB tmpfs (room for 2 or 3 checkpoints of the tiny model) at tmp_path/disk."""
  mount = tmp_path / "disk"
  mount.mkdir()
  made = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(mount)],
    capture_output=True,
    text=True,
  )
  if made.returncode:
    pytest.skip(f"cannot mount a tmpfs here (root needed): {made.stderr.strip()}")
  try:
    yield mount
  finally:
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_full_disk_ends_in_one_line_and_the_same_command_resumes(small_disk):
  workdir = small_disk / "run"
  args = command(
    workdir,
    "--config.duration=8 steps",  # The disk fills at step 3 or 4.
    "--config.checkpoint_every=1 steps",
    "--config.keep_checkpoints=20",
  )
  env = subprocess_env()
  full = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
  assert full.returncode == 1, full.stderr[-3000:]
  directory = f"{workdir}/checkpoints"
  stopped = re.fullmatch(
    rf"error: no space left on device while writing to {workdir}: the "
    rf"newest checkpoint is step (\d+) \(in {directory}\); free space and "
    "start the same command again to resume",
    last_line(full.stderr),
  )
  assert stopped, full.stderr[-3000:]
  step = int(stopped[1])
  assert checkpointing.Checkpointer(directory, read_only=True).complete_steps() == list(
    range(1, step + 1)
  )
  # An atomic write that finds the disk full leaves neither the file nor a partial copy.
  with pytest.raises(Exception) as error:
    files.write_atomic(f"{workdir}/big", b"x" * 4_000_000)
  assert files.is_disk_full(error.value)
  assert not {"big", "big.tmp"} & set(os.listdir(workdir))

  subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
  resumed = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"Resumed from {directory} at step {step}." in resumed.stderr
  assert sorted(os.listdir(directory), key=int) == [str(s) for s in range(1, 9)]  # No temp left.
  assert metric_steps(workdir) == list(range(1, 9))
  # The last line says what the job wrote where.
  finished = re.search(
    rf"\] Finished pretrain in \d+ s: wrote (.*) to {workdir}\.$", last_line(resumed.stderr)
  )
  assert finished and "checkpoints/" in finished[1].split(", "), resumed.stderr[-3000:]


def test_a_damaged_dataset_file_ends_in_one_line_naming_it(array_record_cifar, tmp_path):
  data_dir, shard = damaged_copy(array_record_cifar, "cifar_array_record", tmp_path, "flipped")
  workdir = tmp_path / "run"
  job = subprocess.run(
    command(
      workdir,
      "--config.dataset=cifar_array_record",
      f"--config.data_dir={data_dir}",
      "--config.train_split=train",
      "--config.duration=1000 steps",
      "--config.checkpoint_every=5 steps",
    ),
    capture_output=True,
    text=True,
    timeout=300,
    env=subprocess_env(),
  )
  assert job.returncode == 1, job.stderr[-3000:]
  directory = f"{workdir}/checkpoints"
  stopped = re.fullmatch(
    rf"error: {re.escape(shard)}: record \d+ of this file cannot be read \(Corrupted "
    r"Riegeli/records file: .*\)\. Prepare the dataset "
    r"'cifar_array_record' again \(an image folder: the prepare job with "
    r"--config.overwrite=True\) or "
    rf"restore the file from a copy; the newest checkpoint is step (\d+) \(in {directory}\); "
    "then start the same command again to resume",
    last_line(job.stderr),
  )
  assert stopped, job.stderr[-3000:]
  # The damage is read in the first epoch (125 steps), after some checkpoints: they are kept.
  newest = int(stopped[1])
  assert 5 <= newest < 125
  assert checkpointing.Checkpointer(directory, read_only=True).complete_steps()[-1] == newest
  assert metric_steps(workdir)[:newest] == list(range(1, newest + 1))

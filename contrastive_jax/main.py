"""The one entry point: python -m contrastive_jax.main --config=configs/X.py --workdir=DIR.

Runs the job the config names (config.job: a key of JOBS).
Every config field can be overridden on the command line, e.g.
--config.batch_size=512, and a config file takes arguments after a colon, e.g.
--config=configs/simclr_cifar10.py:runlocal,dtype=bfloat16 (config_files.parse_args). A
workdir that holds a checkpoint resumes from it. Expected failures (a flag
that cannot be parsed: a missing config file, an unknown argument or field; a
config that cannot run, a diverged run, a bad workdir) end with one line on
stderr and exit status 1, and so do Ctrl-C, a full disk, a damaged dataset
file (a training job's line names its newest checkpoint) and a multi-host
process whose computation fails because another process died (see
_exit_after_peer_failure). Job modules define no flags; this one defines them
all.
"""

import os
import re
import sys
import time

if __name__ == "__main__":
  # Every process setting (core/runtime.py), before the imports below: the re-execution
  # runs them again, and TensorFlow reads its settings when it loads.
  from contrastive_jax.core import runtime

  runtime.setup()

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
from absl import logging
import jax
import ml_collections
from ml_collections import config_flags

from contrastive_jax import config_files
from contrastive_jax.core import files
from contrastive_jax.core import metrics
from contrastive_jax.core.errors import ConfigError
from contrastive_jax.core.errors import JobError
from contrastive_jax.core.errors import closest
from contrastive_jax.data import unreadable as unreadable_lib
from contrastive_jax.jobs import audit
from contrastive_jax.jobs import embed
from contrastive_jax.jobs import embedding_map
from contrastive_jax.jobs import export
from contrastive_jax.jobs import finetune
from contrastive_jax.jobs import label_efficiency
from contrastive_jax.jobs import linear_probe
from contrastive_jax.jobs import neighbours
from contrastive_jax.jobs import prepare
from contrastive_jax.jobs import pretrain
from contrastive_jax.training import runner

# Training jobs (check_config, build) run in runner.run's loop;
# the others (no build) are not training loops and run themselves: job.run(config, workdir).
JOBS = {
  "pretrain": pretrain,
  "linear_probe": linear_probe,
  "finetune": finetune,
  "label_efficiency": label_efficiency,
  "embed": embed,
  "neighbours": neighbours,
  "audit": audit,
  "export": export,
  "map": embedding_map,
  "prepare": prepare,
}

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Config file (configs/*.py[:ARG,...]).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
_DISTRIBUTED = flags.DEFINE_bool(
  "distributed", False, "Call jax.distributed.initialize() first (multi-host TPU pods)."
)
# On a Cloud TPU pod jax.distributed.initialize() finds the coordinator, the process
# count and this process's id by itself. Elsewhere (the simulated pod of
# tests/test_launcher.py, a cluster JAX does not detect) these say what it cannot find:
# JAX reads JAX_COORDINATOR_ADDRESS from the environment, but no environment variable
# gives the process count or id. Each is passed to initialize() only when given.
_COORDINATOR_ADDRESS = flags.DEFINE_string(
  "coordinator_address",
  None,
  "With --distributed: host:port of process 0's coordinator (default: "
  "JAX_COORDINATOR_ADDRESS, or found by JAX on Cloud TPU).",
)
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes",
  None,
  "With --distributed: the number of processes (default: found by JAX).",
  lower_bound=1,
)
_PROCESS_ID = flags.DEFINE_integer(
  "process_id",
  None,
  "With --distributed: this process's index (default: found by JAX).",
  lower_bound=0,
)
# JAX's coordination service declares a process dead when it has sent no heartbeat for
# this long, and then ends every other process of the job (JAX's default: 100 s).
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
  "heartbeat_timeout",
  100,
  "With --distributed: seconds after which a silent (dead or hung) process ends the whole "
  "job; the bound on how long the others wait for a process that died.",
  lower_bound=1,
)
flags.mark_flags_as_required(["config", "workdir"])


def get_job(name: str):
  """The job module for config.job.

  Raises:
    ConfigError: unknown job name.
  """
  if name not in JOBS:
    raise ConfigError("job", name, f"one of {sorted(JOBS)}")
  return JOBS[name]


def run_job(config, workdir: str):
  """Runs config.job with config in workdir; returns what the job returns.

  Its last log line (process 0) says what it wrote where: the entries of the
  workdir it wrote (files.written_since) and how long it took.
  """
  job = get_job(config.get("job"))
  start = time.time()
  if hasattr(job, "build"):
    result = runner.run(job, config, workdir)
  else:
    result = job.run(config, workdir)
  if jax.process_index() == 0:
    logging.info(_finished_line(config.job, files.resolve_dir(workdir), start))
  return result


_LISTED = 12  # Names of written entries the last line lists before counting the rest.


def _finished_line(job: str, workdir: str, start: float) -> str:
  """'Finished JOB in S s: wrote A, B, ... to WORKDIR.' (or 'wrote nothing new')."""
  written = files.written_since(workdir, start - 1.0)  # Less a second: coarse file clocks.
  named = ", ".join(written[:_LISTED])
  if len(written) > _LISTED:
    named += f" and {len(written) - _LISTED} more"
  what = f"wrote {named} to" if written else "wrote nothing new in"
  return f"Finished {job} in {time.time() - start:.0f} s: {what} {workdir}."


_CONFIG_ARG = re.compile(r"^--?config(?:=(.*))?$")  # --config=FILE[:ARG,...] or --config FILE...
_OVERRIDE_ARG = re.compile(r"^--?(?:no)?config\.([^=]*)")  # --config.FIELD=VALUE, --noconfig.FIELD


def check_config_flags(argv):
  """Checks what absl's and ml_collections' parsing would end in a traceback for.

  A --config file that does not exist, an argument, value or variant the file
  does not take (config_files.parse_args), a --config.FIELD override naming no field
  of the config: each raises JobError naming the flag as given and the closest
  valid file, argument, value or field. Runs the config file's get_config itself;
  any other flag is left to absl.

  Raises:
    JobError: as above.
  """
  argv = flags.FLAGS.read_flags_from_files(argv, force_gnu=False)  # Expands --flagfile.
  value = None
  for i, arg in enumerate(argv[1:], 1):
    match = _CONFIG_ARG.match(arg)
    if match:
      value = match.group(1)
      if value is None:  # --config FILE
        value = argv[i + 1] if i + 1 < len(argv) else None
  if value is None:
    return  # absl says that --config is required.
  config = config_files.load_config_file(value, "--config")
  for arg in argv[1:]:
    match = _OVERRIDE_ARG.match(arg)
    if match:
      _check_field(config, match.group(1), arg, value)


def _check_field(config, field: str, arg: str, value: str):
  """Raises JobError unless field (dotted) names a field of config.

  The guess is the name most like the rest of field under the deepest group
  of fields it reaches (e.g. optimizer.warmup_epoch: optimizer's warmup_epochs).
  """
  parts = field.split(".")
  group, depth = config, 0
  while depth < len(parts) - 1 and isinstance(group.get(parts[depth]), ml_collections.ConfigDict):
    group, depth = group[parts[depth]], depth + 1
  if depth == len(parts) - 1 and parts[-1] in group:
    return
  prefix = "".join(part + "." for part in parts[:depth])
  guess = closest(".".join(parts[depth:]), _field_names(group))
  hint = (
    f"; did you mean {prefix + guess!r}?"
    if guess
    else f" (the fields of {('config.' + prefix)[:-1]}: {', '.join(sorted(group.keys()))})"
  )
  raise JobError(f"{arg}: no field {field!r} in --config={value}{hint}")


def _field_names(config, prefix: str = ""):
  """The dotted name of every field of config, groups of fields included."""
  for key, item in config.items():
    yield prefix + key
    if isinstance(item, ml_collections.ConfigDict):
      yield from _field_names(item, f"{prefix}{key}.")


def parse_flags(argv):
  """absl's flag parsing (app.run's flags_parser); a flag that cannot be parsed ends the
  process with one line on stderr and exit status 1."""
  try:
    check_config_flags(argv)
    return flags.FLAGS(argv)
  except (flags.Error, JobError) as e:
    sys.exit(f"error: {e}")


def _distributed_args() -> dict:
  """The jax.distributed.initialize() arguments given on the command line."""
  given = {
    "coordinator_address": _COORDINATOR_ADDRESS.value,
    "num_processes": _NUM_PROCESSES.value,
    "process_id": _PROCESS_ID.value,
  }
  return {k: v for k, v in given.items() if v is not None}


def _exit_after_peer_failure(error: jax.errors.JaxRuntimeError):
  """Ends a multi-host process whose computation failed: one line on stderr, exit status 1.

  When a process of the job dies, a survivor's collective may fail at once
  where the dead peer's connections close (CPU's gloo: 'Connection closed by
  peer' or 'reset by peer'). Returning normally would then hang: JAX's exit
  handler waits in a shutdown barrier for the dead process until the
  heartbeat timeout and then aborts with a fatal log and a C++ stack trace.
  os._exit skips it; a training job's runner has already waited for pending
  checkpoint writes. A survivor that blocks in a collective instead (one of
  its devices waiting for the other, or on TPU) never gets here: JAX's
  coordination service ends it within --heartbeat_timeout seconds, or at once
  when process 0 (the coordinator) died, with its fatal message 'Terminating
  process because the JAX distributed service detected fatal errors'.
  """
  first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
  print(
    f"error: process {jax.process_index()} of {jax.process_count()}: a computation "
    f"failed: {first_line}. If that is a lost connection, another process of this job "
    "has died (see its log); this one stops now instead of waiting for it. Starting the "
    "job again on the same workdir resumes from its newest checkpoint.",
    file=sys.stderr,
    flush=True,
  )
  logging.flush()
  os._exit(1)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  metrics.quiet_library_logs()
  if _DISTRIBUTED.value:
    jax.distributed.initialize(
      **_distributed_args(), heartbeat_timeout_seconds=_HEARTBEAT_TIMEOUT.value
    )
  elif _distributed_args():
    raise app.UsageError(
      "--coordinator_address, --num_processes and --process_id need --distributed"
    )
  logging.info(
    "JAX process %d of %d, %d local devices of %d.",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
  try:
    run_job(_CONFIG.value, _WORKDIR.value)
  except JobError as e:
    sys.exit(f"error: {e}")
  except KeyboardInterrupt:  # Training jobs say more (runner: errors.Interrupted).
    sys.exit("error: interrupted (Ctrl-C) before the job finished")
  except jax.errors.JaxRuntimeError as e:
    if jax.process_count() == 1:
      raise
    _exit_after_peer_failure(e)
  except Exception as e:  # pylint: disable=broad-except
    unreadable = unreadable_lib.read_failure(e)  # runner.run makes a training job's a DataError.
    if unreadable is not None:
      sys.exit(f"error: {unreadable}")
    if not files.is_disk_full(e):
      raise
    sys.exit(
      f"error: no space left on device while writing to {_WORKDIR.value}; free "
      "space and start the same command again"
    )


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)

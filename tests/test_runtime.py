"""core/runtime: the one process setup; which backend it expects before JAX starts, and
CONTRASTIVE_JAX_CPU_TWEAKS=0 turning the CPU tweaks off (no re-execution, no XLA option)."""

import json
import os
import platform
import shutil
import subprocess
import sys

from helpers import subprocess_env
import pytest

from contrastive_jax.core import host_memory
from contrastive_jax.core import runtime
from contrastive_jax.core import xla_flags
from contrastive_jax.core.errors import JobError

OURS = f"{xla_flags.YNN_OPTION}={xla_flags.YNN_FUSION_TYPE}"


def test_the_cpu_backend_is_expected_by_jax_platforms_or_by_the_plugins_installed(
  tmp_path, monkeypatch
):
  assert runtime.cpu_backend_expected({"JAX_PLATFORMS": "cpu"})
  assert runtime.cpu_backend_expected({"JAX_PLATFORMS": " cpu , cuda"})
  for platforms in ("cuda", "tpu", "cuda,cpu", "rocm"):
    assert not runtime.cpu_backend_expected({"JAX_PLATFORMS": platforms})
  # This machine has no accelerator plugin; a plugin under jax_plugins, or libtpu, is one.
  assert runtime.cpu_backend_expected({})
  for module in ("jax_plugins/xla_fake/__init__.py", "libtpu/__init__.py"):
    root = tmp_path / module.split("/")[0]
    (tmp_path / module).parent.mkdir(parents=True)
    (tmp_path / module).write_text("")
    with monkeypatch.context() as patch:
      patch.syspath_prepend(str(tmp_path))
      assert not runtime.cpu_backend_expected({})
      assert runtime.cpu_backend_expected({"JAX_PLATFORMS": "cpu"})
    shutil.rmtree(root)


def test_the_cpu_tweaks_switch_takes_0_or_1(monkeypatch):
  monkeypatch.delenv(runtime.CPU_TWEAKS, raising=False)
  assert runtime.cpu_tweaks()
  for value, on in (("1", True), ("0", False), (" 0 ", False)):
    monkeypatch.setenv(runtime.CPU_TWEAKS, value)
    assert runtime.cpu_tweaks() is on
  monkeypatch.setenv(runtime.CPU_TWEAKS, "off")
  with pytest.raises(JobError, match=r"CONTRASTIVE_JAX_CPU_TWEAKS='off': must be 0"):
    runtime.cpu_tweaks()


# What setup leaves in the environment, and whether JAX's backend started.
PROGRAM = """
import json, os, sys
from contrastive_jax.core import runtime
runtime.setup()
from jax._src import xla_bridge
names = ("XLA_FLAGS", "GLIBC_TUNABLES", "TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")
print(json.dumps(
  dict({n: os.environ.get(n) for n in names}, pid=os.getpid(),
       started=xla_bridge.backends_are_initialized())
))
"""


def _setup(**env) -> dict:
  """PROGRAM's line in a child process with env over the suite's environment (no XLA_FLAGS,
  no GLIBC_TUNABLES, not re-executed); the pid checked to be the child's."""
  child = subprocess_env()
  for name in ("XLA_FLAGS", "GLIBC_TUNABLES", "JAX_PLATFORMS", host_memory._REEXECUTED):
    child.pop(name, None)
  child.update(env)
  proc = subprocess.Popen(
    [sys.executable, "-c", PROGRAM],
    env=child,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  [line] = out.splitlines()  # What ran before a re-execution printed nothing.
  result = json.loads(line)
  assert result.pop("pid") == proc.pid
  return result


@pytest.mark.skipif(
  host_memory.tunables({}, platform.libc_ver(), host_memory.thp_mode()) is None,
  reason="this machine's libc or kernel makes the re-execution moot",
)
def test_setup_sets_every_setting_and_the_switch_turns_the_cpu_tweaks_off():
  tf = {"TF_CPP_MIN_LOG_LEVEL": "1", "TF_ENABLE_ONEDNN_OPTS": "0", "started": False}
  huge = "glibc.malloc.hugetlb=1"
  assert _setup() == dict(tf, XLA_FLAGS=OURS, GLIBC_TUNABLES=huge)
  assert _setup(JAX_PLATFORMS="cpu") == dict(tf, XLA_FLAGS=OURS, GLIBC_TUNABLES=huge)
  # Off the CPU: no re-execution (never measured there); the option, which XLA:GPU ignores.
  assert _setup(JAX_PLATFORMS="cuda") == dict(tf, XLA_FLAGS=OURS, GLIBC_TUNABLES=None)
  users = "--xla_backend_optimization_level=0"
  off = _setup(**{runtime.CPU_TWEAKS: "0", "XLA_FLAGS": f"{users} {OURS}"})
  assert off == dict(tf, XLA_FLAGS=users, GLIBC_TUNABLES=None)
  # The user's TensorFlow settings win.
  assert _setup(TF_CPP_MIN_LOG_LEVEL="3")["TF_CPP_MIN_LOG_LEVEL"] == "3"


def test_flags_are_checked_only_where_jax_starts_its_cpu_backend(monkeypatch):
  """A process whose JAX_PLATFORMS leave out cpu may hold flags only another backend's
  library knows: left to it. Where cpu starts, the same flags stop setup."""
  bad = "--xla_no_such_flag=1"
  monkeypatch.setenv(runtime._CHECKED, "")
  monkeypatch.setenv("XLA_FLAGS", bad)
  monkeypatch.setenv("JAX_PLATFORMS", "tpu")
  runtime.setup(huge_pages=False)
  assert os.environ["XLA_FLAGS"] == f"{bad} {OURS}"
  monkeypatch.setenv("XLA_FLAGS", bad)
  monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
  with pytest.raises(SystemExit, match="^error: XLA_FLAGS: XLA refused '--xla_no_such_flag=1'"):
    runtime.setup(huge_pages=False)
  monkeypatch.setenv(runtime.CPU_TWEAKS, "yes")
  with pytest.raises(SystemExit, match="^error: CONTRASTIVE_JAX_CPU_TWEAKS='yes': must be 0"):
    runtime.setup(huge_pages=False)

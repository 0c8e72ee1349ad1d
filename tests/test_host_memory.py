"""core/host_memory: when the process re-executes with glibc's huge-page tunable, that the
user's tunables win, and that XLA:CPU's large buffers then fault in far fewer pages."""

import platform
import subprocess
import sys

from helpers import subprocess_env
import pytest

from contrastive_jax.core import host_memory

MADVISE = "always [madvise] never\n"
OURS = "glibc.malloc.hugetlb=1"


def test_the_tunable_is_added_where_it_helps_and_the_users_value_wins():
  glibc = ("glibc", "2.36")
  assert host_memory.tunables({}, glibc, MADVISE) == OURS
  others = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
  assert host_memory.tunables(others, glibc, MADVISE) == f"glibc.malloc.arena_max=2:{OURS}"
  users_values = ("glibc.malloc.hugetlb=0", "glibc.malloc.arena_max=2: glibc.malloc.hugetlb=2")
  for users in users_values:
    assert host_memory.tunables({"GLIBC_TUNABLES": users}, glibc, MADVISE) is None
  # glibc before 2.35 has no such tunable; another libc reads none.
  for libc in (("glibc", "2.31"), ("", ""), ("musl", "1.2")):
    assert host_memory.tunables({}, libc, MADVISE) is None
  # Huge pages for every mapping already, or for none.
  for mode in ("[always] madvise never", "always madvise [never]"):
    assert host_memory.tunables({}, glibc, mode) is None


# Faults of the page tables while XLA:CPU writes a fresh 128 MiB output twice.
PROGRAM = """
import os, resource
from contrastive_jax.core import host_memory
host_memory.reexec_with_huge_pages()
import jax, jax.numpy as jnp
x = jnp.zeros((32, 1024, 1024))
add = jax.jit(lambda x: x + 1)
add(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
  add(x).block_until_ready()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(os.getpid(), os.environ.get("GLIBC_TUNABLES"), faults)
"""


@pytest.mark.skipif(
  host_memory.tunables({}, platform.libc_ver(), host_memory.thp_mode()) is None,
  reason="this machine's libc or kernel makes the tunable moot",
)
def test_the_process_reexecutes_itself_with_huge_pages_and_faults_less():
  def run(extra_env, *, stdin=False):
    env = subprocess_env()
    env.pop("GLIBC_TUNABLES", None)
    env.pop(host_memory._REEXECUTED, None)
    env.update(extra_env)
    proc = subprocess.Popen(
      [sys.executable, "-"] if stdin else [sys.executable, "-c", PROGRAM],
      env=env,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
    )
    out, err = proc.communicate(PROGRAM.encode() if stdin else b"", timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]
    [line] = out.decode().splitlines()  # What ran before the re-execution printed nothing.
    pid, value, faults = line.split()
    assert int(pid) == proc.pid  # The same process, re-executed.
    return value, int(faults)

  value, faults = run({})
  assert value == OURS
  users, users_faults = run({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})  # The opt-out.
  assert users == "glibc.malloc.hugetlb=0"
  # 2 x 32,768 pages of 4 KiB without; 2 x 64 of 2 MiB with, where the kernel has them
  # free (it falls back to small pages where it has none: a loose bound).
  assert users_faults > 30_000
  assert faults < users_faults / 2, (faults, users_faults)
  # Never twice (glibc empties GLIBC_TUNABLES in processes with file capabilities), and
  # not for a program read from stdin, which could not be read again.
  assert run({host_memory._REEXECUTED: "1"})[0] == "None"
  assert run({}, stdin=True)[0] == "None"

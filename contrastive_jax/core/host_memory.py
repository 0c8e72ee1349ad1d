"""glibc's malloc asked for transparent huge pages, by re-executing the process with the tunable.

XLA:CPU allocates each execution's temporary buffers anew and frees them after it (the
SimCLR `runlocal` step's are about a hundred MB). glibc's malloc serves allocations this
large with a fresh mmap and frees them with munmap, so every step faults in tens of
thousands of 4 KiB pages, each zeroed by the kernel. With `glibc.malloc.hugetlb=1` malloc
asks the kernel to back such mappings with 2 MiB pages (transparent huge pages in
'madvise' mode, the usual default): a few hundred faults a step, the step faster and the
host pipeline as fast, measured on CPU backends only (docs/throughput.md has the figures).
glibc reads GLIBC_TUNABLES only when a process starts, hence the re-execution
(core/runtime.py decides where it runs). Keeping freed memory in one arena instead
(mallopt) removed the faults too but halved tf.data's pace.
"""

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
# Set in the re-executed process: a second re-execution is never tried, whatever glibc did
# with GLIBC_TUNABLES (it empties them in processes with file capabilities).
_REEXECUTED = "CONTRASTIVE_JAX_REEXECUTED"


def tunables(environ, libc: tuple, thp_mode: str) -> str | None:
  """The GLIBC_TUNABLES value to re-execute with, or None where it would change nothing.

  None unless libc is glibc 2.35 or newer (the first with the tunable) and thp_mode (the
  text of _THP_MODE) selects 'madvise' ('always' backs the mappings with huge pages
  already; 'never' refuses them); None where environ's GLIBC_TUNABLES names TUNABLE (the
  user's value wins: `GLIBC_TUNABLES=glibc.malloc.hugetlb=0` opts out). Otherwise the
  user's tunables with TUNABLE=1 appended (glibc's syntax: name=value pairs joined by ':').
  libc: platform.libc_ver()'s (name, version) pair.
  """
  name, version = libc
  parts = version.split(".")[:2]
  if name != "glibc" or not all(p.isdigit() for p in parts) or tuple(map(int, parts)) < (2, 35):
    return None
  if "[madvise]" not in thp_mode:
    return None
  current = environ.get("GLIBC_TUNABLES", "")
  if any(entry.split("=")[0].strip() == TUNABLE for entry in current.split(":")):
    return None
  return ":".join(filter(None, [current, f"{TUNABLE}=1"]))


def thp_mode() -> str:
  """The kernel's transparent huge page mode, as _THP_MODE reads ('' where it cannot)."""
  try:
    with open(_THP_MODE) as f:
      return f.read()
  except OSError:
    return ""


def reexec_with_huge_pages() -> None:
  """Re-executes this process, same pid, interpreter, arguments (sys.orig_argv) and
  environment, with GLIBC_TUNABLES as tunables() says; returns where it says None, off
  Linux, once re-executed, in an interactive interpreter (IPython included) and for a
  program read from stdin (it cannot be read again), and where the exec fails. Call it
  before other work: everything before it runs twice. The re-executed process returns
  from here.
  """
  if not sys.platform.startswith("linux") or os.environ.get(_REEXECUTED):
    return
  if sys.flags.interactive or "IPython" in sys.modules or sys.orig_argv[1:2] in ([], ["-"]):
    return
  value = tunables(os.environ, platform.libc_ver(), thp_mode())
  if value is None:
    return
  before = dict(os.environ)
  os.environ.update({"GLIBC_TUNABLES": value, _REEXECUTED: "1"})
  for stream in (sys.stdout, sys.stderr):
    if stream is not None:
      stream.flush()
  try:
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
  except OSError:
    os.environ.clear()
    os.environ.update(before)

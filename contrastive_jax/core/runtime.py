"""Every process-level setting of the project's programs, in one place: setup().

main.py, every script in benchmarks/ and the tests' conftest.py call setup() first,
before anything imports TensorFlow or starts JAX's backend; no other module sets one.

CONTRASTIVE_JAX_CPU_TWEAKS=0 in the environment turns off every tweak made for XLA's CPU
backend, to time or compare a CPU run against XLA's defaults: the huge-page re-execution,
the YNNPACK option and models/conv.py's lowerings of convolutions and max-pools (which
then are lax.conv_general_dilated and flax's max_pool). Unset or 1: on.

The re-execution runs only where JAX will pick its CPU backend, the only one it was
measured on, decided before JAX starts and without starting a backend: where
JAX_PLATFORMS is set, where its first platform is 'cpu' (JAX's default is the first
listed); where it is not, where no accelerator plugin is installed (no module under the
namespace package jax_plugins, no entry point of the group jax_plugins, no libtpu). A
host with a CUDA plugin but no GPU thus runs without it unless JAX_PLATFORMS=cpu.
"""

import importlib.metadata
import importlib.util
import os
import sys

from contrastive_jax.core import host_memory
from contrastive_jax.core import xla_flags
from contrastive_jax.core.errors import JobError

CPU_TWEAKS = "CONTRASTIVE_JAX_CPU_TWEAKS"
# XLA_FLAGS as a setup() left them after checking the user's: a child process (or the
# re-executed one) that inherits them unchanged does not check them again.
_CHECKED = "CONTRASTIVE_JAX_CHECKED_XLA_FLAGS"


def setup(
  *, ynn_fusion_type: str = xla_flags.YNN_FUSION_TYPE, huge_pages: bool = True, xla_options=()
) -> None:
  """Sets this process's settings, each in the environment, where a value there wins.

  ynn_fusion_type: the YNNPACK option's value (xla_flags.merged); huge_pages False
  never re-executes; xla_options: more XLA flags. A CONTRASTIVE_JAX_CPU_TWEAKS other
  than 0 or 1, or user-set XLA_FLAGS that XLA refuses (xla_flags.refused), end the
  process (SystemExit, status 1) with one line on stderr, `error: ...`, before any
  compute.
  """
  try:
    tweaks = cpu_tweaks()
  except JobError as e:
    sys.exit(f"error: {e}")
  # glibc's malloc backs XLA:CPU's per-step buffers with huge pages: fewer page faults.
  if huge_pages and tweaks and cpu_backend_expected(os.environ):
    host_memory.reexec_with_huge_pages()  # Everything before this runs twice.
  # TensorFlow (the host pipelines) without its C++ INFO lines and the oneDNN kernels its
  # pipelines never run (the same pixels either way), each announced at its loads.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
  # A user's XLA flag that XLA refuses ends the run with one line, not XLA's abort.
  users = os.environ.get("XLA_FLAGS", "")
  if users.strip() and users != os.environ.get(_CHECKED) and _starts_cpu(os.environ):
    refusal = xla_flags.refused(users)
    if refusal:
      sys.exit(f"error: {refusal}")
  # XLA:CPU's convolutions on every core (Eigen), not YNNPACK's one: faster CPU steps.
  ynn = ynn_fusion_type if tweaks else None
  os.environ["XLA_FLAGS"] = xla_flags.merged(users, xla_options, ynn)
  os.environ[_CHECKED] = os.environ["XLA_FLAGS"]


def cpu_tweaks() -> bool:
  """Whether the CPU backend's tweaks are on: CPU_TWEAKS unset, '' or '1' (module
  docstring). Raises JobError naming CPU_TWEAKS and its value for any other value."""
  value = os.environ.get(CPU_TWEAKS, "1").strip()
  if value not in ("", "0", "1"):
    raise JobError(f"{CPU_TWEAKS}={value!r}: must be 0 (CPU tweaks off) or 1 (on)")
  return value != "0"


def cpu_backend_expected(environ) -> bool:
  """Whether JAX will start on its CPU backend, by environ's JAX_PLATFORMS and the
  installed accelerator plugins (module docstring); imports and starts nothing."""
  platforms = environ.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  if any(importlib.util.find_spec(name) for name in ("jax_plugins", "libtpu")):
    return False
  return not importlib.metadata.entry_points(group="jax_plugins")


def _starts_cpu(environ) -> bool:
  """Whether JAX will start its CPU backend (beside any other): JAX_PLATFORMS unset or
  naming cpu. A process without it may hold flags that only another backend's library
  knows, which the CPU client's check (xla_flags.refused) would refuse."""
  platforms = environ.get("JAX_PLATFORMS", "").strip()
  return not platforms or "cpu" in [p.strip() for p in platforms.split(",")]

"""core/xla_flags: the project's XLA options join the user's XLA_FLAGS, never override them,
and take XLA:CPU's convolutions off YNNPACK; main.py sets them before JAX's backend starts."""

import os
import re
import subprocess
import sys

from helpers import subprocess_env
import jax
from jax import lax
import jax.numpy as jnp
import pytest

from contrastive_jax.core import xla_flags

OPTION = "--xla_cpu_experimental_ynn_fusion_type"
OURS = f"{OPTION}=-individual_convolution"


def test_the_default_joins_the_users_flags_and_the_users_own_value_wins(monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  xla_flags.set_defaults()
  assert os.environ["XLA_FLAGS"] == OURS
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  xla_flags.set_defaults()
  assert os.environ["XLA_FLAGS"] == f"--xla_backend_optimization_level=0 {OURS}"
  # Passed on by a parent process that set the default: a caller's own value replaces it.
  xla_flags.set_defaults("-individual_convolution,-reduce")
  assert os.environ["XLA_FLAGS"] == f"--xla_backend_optimization_level=0 {OURS},-reduce"
  for users in (f"{OPTION}=-reduce", "/etc/xla_flags.txt"):  # A value, a file of flags.
    monkeypatch.setenv("XLA_FLAGS", users)
    xla_flags.set_defaults()
    assert os.environ["XLA_FLAGS"] == users


def _ynn_ops(hlo: str) -> set:
  """The ops inside the YNNPACK fusions of an optimised HLO module's text."""
  ops = set()
  for line in hlo.splitlines():
    if '"kind":"__ynn_fusion"' in line:
      called = re.search(r"calls=%([\w.\-]+)", line).group(1)
      body = re.search(r"\n%" + re.escape(called) + r" .*?\n}", hlo, re.S).group(0)
      ops |= set(re.findall(r"= \S+ (\w+)\(", body)) - {"parameter", "bitcast"}
  return ops


@pytest.mark.skipif(
  OURS not in os.environ["XLA_FLAGS"].split(), reason="XLA_FLAGS set the option themselves"
)
def test_convolutions_compile_to_xlas_own_and_dots_to_ynnpack():
  """The suite's process runs with the default (conftest.py), as every job does; with
  YNNPACK's convolutions added back, as in XLA's own default, it takes this one."""
  # A shape XLA's default hands to YNNPACK (more than 16 channels).
  x, w = jnp.zeros((8, 8, 8, 16)), jnp.zeros((3, 3, 16, 32))

  def step(x, w):
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.dot(y.reshape(-1, 32), w[0, 0].T)

  lowered = jax.jit(step).lower(x, w)
  ops = _ynn_ops(lowered.compile().as_text())
  assert "dot" in ops and "convolution" not in ops, ops
  kinds = ("INDIVIDUAL_CONVOLUTION", "INDIVIDUAL_DOT", "REDUCE")
  xla_default = {OPTION[2:]: ",".join(f"LIBRARY_FUSION_TYPE_{k}" for k in kinds)}
  assert "convolution" in _ynn_ops(lowered.compile(xla_default).as_text())


def test_main_sets_the_default_at_import_before_the_backend_starts():
  check = (
    "import os, jax; from jax._src import xla_bridge; import contrastive_jax.main; "
    "assert not xla_bridge.backends_are_initialized(); print(os.environ['XLA_FLAGS'])"
  )
  env = subprocess_env()
  env["XLA_FLAGS"] = " ".join(w for w in env.get("XLA_FLAGS", "").split() if OPTION not in w)
  out = subprocess.run(
    [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert OURS in out.stdout.split(), out.stdout

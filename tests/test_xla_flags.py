"""core/xla_flags: the project's XLA options join the user's XLA_FLAGS, never override them,
and take XLA:CPU's convolutions off YNNPACK; a user's flag that XLA refuses gets one line from
main.py."""

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


def test_the_default_joins_the_users_flags_and_the_users_own_value_wins():
  assert xla_flags.merged("") == OURS
  users = "--xla_backend_optimization_level=0"
  assert xla_flags.merged(users) == f"{users} {OURS}"
  # Passed on by a parent process that set the default: a caller's own value replaces it,
  # and no value (the CPU tweaks off) drops it.
  assert xla_flags.merged(f"{users} {OURS}", (), "-individual_convolution,-reduce") == (
    f"{users} {OURS},-reduce"
  )
  assert xla_flags.merged(f"{users} {OURS}", (), None) == users
  # More options, each once, before the default.
  assert xla_flags.merged(users, ("-a", users)) == f"{users} -a {OURS}"
  for users in (f"{OPTION}=-reduce", "/etc/xla_flags.txt"):  # A value, a file of flags.
    assert xla_flags.merged(users) == users


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


@pytest.mark.parametrize(
  "flags,named,reason",
  [
    (
      "--xla_force_host_platform_device_count=abc",
      "--xla_force_host_platform_device_count=abc",
      "Couldn't interpret value abc",
    ),
    (
      f"--xla_backend_optimization_level=0 {OPTION}=bogus",
      f"{OPTION}=bogus",
      "Illegal value for",
    ),
    ("--xla_no_such_flag=1", "--xla_no_such_flag=1", "Unknown flag in XLA_FLAGS"),
    ("xla_cpu_use_fusion_emitters=false", "xla_cpu_use_fusion_emitters=false", "Could not open"),
  ],
)
def test_main_names_the_users_flag_that_xla_refuses_in_one_line_before_any_compute(
  flags, named, reason, tmp_path
):
  """A bad value, a value outside the flag's set, an unknown flag, a flag without its
  dashes (XLA reads that as a file name)."""
  env = dict(subprocess_env(), XLA_FLAGS=flags)
  config = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "simclr_cifar10.py")
  out = subprocess.run(
    [sys.executable, "-m", "contrastive_jax.main", f"--config={config}", f"--workdir={tmp_path}"],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 1
  [line] = out.stderr.strip().splitlines()
  assert line.startswith(f"error: XLA_FLAGS: XLA refused {named!r} ("), line
  assert reason in line, line
  assert os.listdir(tmp_path) == []


def test_flags_xla_takes_pass_the_check():
  assert xla_flags.refused(f"--xla_cpu_use_fusion_emitters=false {OURS}") is None

"""core/xla_flags: the project's XLA options join the user's XLA_FLAGS, never override them,
and take XLA:CPU's convolutions off YNNPACK."""

import os
import re

import jax
from jax import lax
import jax.numpy as jnp

from contrastive_jax.core import xla_flags

OPTION = "--xla_cpu_experimental_ynn_fusion_type"


def test_the_default_joins_the_users_flags_and_the_users_own_value_wins(monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  xla_flags.set_defaults()
  assert os.environ["XLA_FLAGS"] == f"{OPTION}=-individual_convolution"
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  xla_flags.set_defaults("-individual_convolution,-reduce")
  assert os.environ["XLA_FLAGS"] == (
    f"--xla_backend_optimization_level=0 {OPTION}=-individual_convolution,-reduce"
  )
  monkeypatch.setenv("XLA_FLAGS", f"{OPTION}=-reduce")
  xla_flags.set_defaults()
  assert os.environ["XLA_FLAGS"] == f"{OPTION}=-reduce"


def _ynn_ops(hlo: str) -> set:
  """The ops inside the YNNPACK fusions of an optimised HLO module's text."""
  ops = set()
  for line in hlo.splitlines():
    if '"kind":"__ynn_fusion"' in line:
      called = re.search(r"calls=%([\w.\-]+)", line).group(1)
      body = re.search(r"\n%" + re.escape(called) + r" .*?\n}", hlo, re.S).group(0)
      ops |= set(re.findall(r"= \S+ (\w+)\(", body)) - {"parameter", "bitcast"}
  return ops


def test_convolutions_compile_to_xlas_own_and_dots_to_ynnpack():
  """The suite's process runs with the default (conftest.py), as every job does; with
  XLA's own default set YNNPACK takes the convolution too."""
  # A shape XLA's default hands to YNNPACK (it keeps some, such as 16 -> 16 channels).
  x, w = jnp.zeros((8, 8, 8, 16)), jnp.zeros((3, 3, 16, 32))

  def step(x, w):
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.dot(y.reshape(-1, 32), w[0, 0].T)

  lowered = jax.jit(step).lower(x, w)
  assert _ynn_ops(lowered.compile().as_text()) == {"dot"}
  kinds = "INDIVIDUAL_CONVOLUTION,INDIVIDUAL_DOT,REDUCE"
  xla_default = {OPTION[2:]: ",".join(f"LIBRARY_FUSION_TYPE_{k}" for k in kinds.split(","))}
  assert _ynn_ops(lowered.compile(xla_default).as_text()) == {"convolution", "dot"}

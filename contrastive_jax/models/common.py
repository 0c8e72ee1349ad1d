"""What every encoder family shares: compute dtypes and the input standardisation fields."""

import jax.numpy as jnp

from contrastive_jax.core.errors import ConfigError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def input_statistics(model_config):
  """(input_mean, input_std) of a model config: per-channel (R, G, B) tuples of floats
  subtracted from and divided into the [0, 1] input."""
  return tuple(tuple(model_config[field]) for field in ("input_mean", "input_std"))


def check_input_statistics(model_config):
  """Raises ConfigError unless input_mean and input_std hold 3 numbers, input_std's > 0."""
  for field in ("input_mean", "input_std"):
    value = model_config[field]
    if len(value) != 3 or (field == "input_std" and min(value) <= 0):
      raise ConfigError(
        f"model.{field}",
        tuple(value),
        "3 numbers (R, G, B)" + (", each > 0" if field == "input_std" else ""),
      )

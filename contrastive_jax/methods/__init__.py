"""Contrastive methods, one module each: loss, model and state update together."""
from contrastive_jax.errors import ConfigError
from contrastive_jax.methods import byol
from contrastive_jax.methods import moco
from contrastive_jax.methods import simclr

METHODS = {"byol": byol, "moco": moco, "simclr": simclr}


def get_method(name: str):
  """The method module for config.method.

  Raises:
    ConfigError: unknown method name.
  """
  if name not in METHODS:
    raise ConfigError("method", name, f"one of {sorted(METHODS)}")
  return METHODS[name]

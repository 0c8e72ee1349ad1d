"""Test setup: 8 simulated CPU devices, set before JAX starts."""
import importlib.util
import os

import jax

jax.config.update("jax_num_cpu_devices", 8)

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared")
TFDS_DIR = os.path.abspath(os.environ.get("TFDS_DATA_DIR", os.path.join(SHARED, "tensorflow_datasets")))

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")


def load_config(name: str, variant: str = ""):
  """configs/NAME.py's get_config(variant), as --config=configs/NAME.py:variant loads it."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(CONFIG_DIR, name + ".py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)

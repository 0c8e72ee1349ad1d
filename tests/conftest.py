"""Test setup: 8 simulated CPU devices, set before JAX starts, and a compilation cache.

Many tests run the same small programs again (a run, its killed twin, its resume;
the multi-host workers): JAX's persistent compilation cache, in a fresh directory
per session, compiles each of them once. The environment variables carry the
cache to the subprocesses the tests start.
"""
import os
import tempfile

import jax

_CACHE = tempfile.mkdtemp(prefix="contrastive_jax_test_cache_")
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

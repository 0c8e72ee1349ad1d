"""Test setup: 8 simulated CPU devices, set before JAX starts, and a compilation cache.

Many tests run the same small programs again (a run, its killed twin, its resume;
the multi-host workers): JAX's persistent compilation cache, in a fresh directory
per session, compiles each of them once. The environment variables carry the
cache to the subprocesses the tests start.

XLA's CPU backend compiles at optimisation level 0: the tests' programs are
small and compiled once each, so compilation, not running them, is most of
the suite's time; level 0 halves it (the contract test of BYOL: 136 s -> 68 s
on this 2-core machine). Every comparison in the tests is between programs
compiled alike or against tolerances that hold at any level.
"""
import os
import tempfile

os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                 "--xla_backend_optimization_level=0"]))
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

_CACHE = tempfile.mkdtemp(prefix="contrastive_jax_test_cache_")
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

"""Test setup: 8 simulated CPU devices, set before JAX starts."""
import jax

jax.config.update("jax_num_cpu_devices", 8)

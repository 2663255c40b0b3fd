"""Test setup: 8 simulated CPU devices, float32, a persistent compilation cache."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

# One persistent cache per user (not per checkout), so a fresh clone's test run reuses compiled
# programs; entries are keyed by program and compile options, so a stale entry is never used.
_cache = os.environ.get("SPLASH_TEST_COMPILE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "splash_jax", "xla-tests"))
jax.config.update("jax_compilation_cache_dir", _cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

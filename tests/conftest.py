"""Test setup: 8 simulated CPU devices, float32, a persistent compilation cache."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
# LLVM's backend optimizations off: XLA:CPU compiles a step program 2-3x faster and the tests'
# tiny models run about as fast (the whole suite on 2 cores: 1,115 s against 1,408 s), while the
# HLO passes, fusion decisions and buffer assignment the tests check are unchanged.
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402

# No persistent compilation cache by default: in some test orders XLA crashed (segfault) while
# serializing an executable into it (jax 0.12, CPU). SPLASH_TEST_COMPILE_CACHE=DIR turns it on.
_cache = os.environ.get("SPLASH_TEST_COMPILE_CACHE")
if _cache:
    jax.config.update("jax_compilation_cache_dir", _cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


import gc  # noqa: E402

import pytest  # noqa: E402

from splash_jax import executable_cache  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each module, drop its engines' executables: every XLA:CPU executable keeps a few
    memory mappings per kernel, and a whole suite in one process otherwise approaches the
    kernel's vm.max_map_count (65,530; LLVM then fails with "Unable to allocate section memory")."""
    yield
    executable_cache.clear()  # the engines' executables shared within the module
    gc.collect()
    jax.clear_caches()


@pytest.hookimpl(optionalhook=True)  # the hook exists only with pytest-xdist loaded (-p no:xdist runs serially)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject addopts): one test process per core, at most 4 and one per 4 GiB of
    memory (a process holds a module's engines and their compiled programs: 2-3 GiB seen)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = 8.0
    return max(1, min(cores, 4, int(mem_gib // 4)))



# The heaviest modules first (serial seconds on the 2-core CI host, 2026-12-03, docs/testing.md):
# files go to the test processes in collection order, and a heavy file collected last ran alone
# at the end of the run while the other process idled.
HEAVY_FIRST = ("test_switching.py", "test_notebook.py", "test_policy.py", "test_multihost.py", "test_tpu_aot.py",
               "test_expanded_prefill.py", "test_speculative_mtp.py", "test_fuzz_server.py", "test_engine.py",
               "test_layouts.py", "test_step_input.py", "test_padding.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's order kept

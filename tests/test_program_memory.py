"""Start-up reports what each step program needs beside the weights and the pool (XLA's
memory_analysis), and GPU step programs compile without XLA's rematerialization pass."""

from splash_jax.engine import Engine, EngineConfig
from splash_jax.engine.compile_options import NO_REMAT_GPU_OPTIONS, OPTIONAL_OPTIONS, step_compiler_options


def test_gpu_step_programs_compile_without_rematerialization_in_every_variant():
    for scan in (False, True):
        for expanded in (False, True):
            for unrolled in (False, True):
                options = step_compiler_options("gpu", scan, expanded, unrolled=unrolled)
                assert all(options[k] == v for k, v in NO_REMAT_GPU_OPTIONS.items())
    assert not set(NO_REMAT_GPU_OPTIONS) & set(step_compiler_options("cpu", True))
    assert set(NO_REMAT_GPU_OPTIONS) <= set(OPTIONAL_OPTIONS)  # an XLA that refuses it still compiles


def test_stats_report_every_step_programs_temporaries_and_the_largest():
    engine = Engine(EngineConfig(page_size=8, max_num_seqs=8, max_num_batched_tokens=32, max_pages=32,
                                 compile_cache_dir=None))
    mem = engine.stats()["program_memory"]
    steps = engine.executor._compiled
    assert mem["programs"] == len(steps) == len(mem["temp_bytes"])
    want = {f"{lay}/t{b.tokens}r{b.requests}/{'full' if full else 'greedy'}"
            for lay, b, moving, full, expanded, mode in steps if not moving and not expanded and mode is None}
    assert want <= set(mem["temp_bytes"])
    assert all(v >= 0 for v in mem["temp_bytes"].values())
    assert mem["max_temp_bytes"] == max(mem["temp_bytes"].values()) > 0
    assert mem["temp_bytes"][mem["max_temp_program"]] == mem["max_temp_bytes"]
    # the largest bucket's program needs at least what the smallest one does
    small = min(steps, key=lambda k: k[1].tokens)[1]
    large = max(steps, key=lambda k: k[1].tokens)[1]
    t = mem["temp_bytes"]
    assert t[f"{steps and next(iter(steps))[0]}/t{large.tokens}r{large.requests}/greedy"] >= \
        t[f"{next(iter(steps))[0]}/t{small.tokens}r{small.requests}/greedy"]

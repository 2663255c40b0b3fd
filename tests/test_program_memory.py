"""Start-up reports what each step program needs beside the weights and the pool (XLA's
memory_analysis), and GPU step programs compile without XLA's rematerialization pass."""

from splash_jax.engine import Engine, EngineConfig
from splash_jax.engine.executor import program_name, sampler_name
from splash_jax.mesh.layouts import LAYOUTS
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
    ex = engine.executor
    mem = engine.stats()["program_memory"]
    names = {program_name(LAYOUTS[lay], *rest): (lay, *rest) for lay, *rest in ex._compiled}
    samplers = {sampler_name(*key) for key in ex._samplers}
    assert mem["programs"] == len(ex._compiled) + len(ex._samplers)
    assert set(mem["temp_bytes"]) == set(names) | samplers
    assert mem["max_temp_bytes"] == max(mem["temp_bytes"].values()) > 0
    assert mem["temp_bytes"][mem["max_temp_program"]] == mem["max_temp_bytes"]
    # each recorded figure is what compiling that program on its own reports
    steps = {k: v for k, v in mem["temp_bytes"].items() if k in names}
    for name in (max(steps, key=steps.get), min(steps, key=steps.get)):
        lay, *rest = names[name]
        again = ex.lower(LAYOUTS[lay], *rest).compile().memory_analysis().temp_size_in_bytes
        assert mem["temp_bytes"][name] == again


def test_a_program_compiling_past_the_limit_is_named_in_the_log_while_it_compiles(caplog):
    import time

    from splash_jax.engine.program_memory import slow_compile_watch

    with caplog.at_level("WARNING", logger="splash_jax.engine.program_memory"):
        with slow_compile_watch("tp/t16r8/greedy", after_s=0.05):
            time.sleep(0.3)  # the warning comes while the block still runs
            assert "still compiling tp/t16r8/greedy after" in caplog.text
        with slow_compile_watch("tp/t32r8/greedy", after_s=5):
            pass
        time.sleep(0.1)
    assert "tp/t32r8" not in caplog.text  # a compile that ends in time says nothing

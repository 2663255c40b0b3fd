"""Start-up's memory plan (engine/pool_sizing.py): the pool is what remains after the weights and
the largest step program, measured before the pool exists; what cannot fit fails before compiling.
CPU devices report no memory, so these tests give the engine a device memory of a set size."""

import pytest

from splash_jax import executable_cache
from splash_jax.engine import Engine, EngineConfig
from splash_jax.engine import sampler_programs, step_compile
from splash_jax.engine import pool_sizing
from splash_jax.engine.executor import program_name, sampler_name
from splash_jax.engine.program_memory import probe_keys
from splash_jax.kv.capacity import GiB, StartupMemoryError, check_max_model_len, plan_pool
from splash_jax.mesh.layouts import LAYOUTS

MiB = 2**20
KW = dict(page_size=8, max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=8, compile_cache_dir=None)


def fake_memory(monkeypatch, limit: int, in_use: int):
    monkeypatch.setattr(pool_sizing, "device_memory", lambda device: (limit, in_use))


def test_plan_divides_the_device_and_names_the_flag_when_it_cannot():
    page = 1 * MiB
    plan = plan_pool(10 * GiB, 4 * GiB, 1 * GiB, "p", page, kv_memory_gb=None, kv_memory_fraction=0.9, extra_pages=100)
    assert plan.pages + plan.extra_pages == int(0.9 * 5 * GiB) // page and plan.extra_pages == 100
    assert plan.in_use + plan.reserve + plan.pool_bytes + plan.headroom == plan.limit and plan.headroom > 0
    assert plan_pool(10 * GiB, 4 * GiB, 1 * GiB, "p", page, kv_memory_gb=2, kv_memory_fraction=0.9).pages == 2 * 1024
    with pytest.raises(StartupMemoryError, match=r"--kv-memory-gb 6 does not fit.*at most 5\.00"):
        plan_pool(10 * GiB, 4 * GiB, 1 * GiB, "p", page, kv_memory_gb=6, kv_memory_fraction=0.9)
    with pytest.raises(StartupMemoryError, match=r"tp/t8192.*--max-num-batched-tokens 8192.*Lower --max-num-batched-tokens"):
        plan_pool(10 * GiB, 4 * GiB, 7 * GiB, "tp/t8192", page, kv_memory_gb=None, kv_memory_fraction=0.9,
                  max_num_batched_tokens=8192)
    with pytest.raises(StartupMemoryError, match="--max-model-len 4096 does not fit.*at most 2048"):
        check_max_model_len(4096, True, 2048)
    assert check_max_model_len(4096, False, 2048) == 2048 and check_max_model_len(1024, True, 2048) == 1024


def test_pool_is_sized_from_the_largest_program_on_an_8_device_mesh(monkeypatch):
    limit, in_use = 256 * MiB, 64 * MiB
    fake_memory(monkeypatch, limit, in_use)
    engine = Engine(EngineConfig(layout="tp", num_devices=8, **dict(KW, min_token_bucket=16)))  # 2 buckets
    plan, ex = engine.pool_plan, engine.executor
    assert engine.n == 8 and plan.limit == limit and plan.in_use == in_use
    # the rule: a fraction of what remains after weights and the largest program, extra segment included
    base_pages, extra = engine.allocator.pages_per_device, engine.allocator.extra_per_device
    assert base_pages + extra == int(0.9 * (limit - in_use - plan.reserve)) // engine.page_bytes
    assert in_use + plan.reserve + (base_pages + extra) * engine.page_bytes <= limit
    assert ex.pool.nbytes() == engine.n * (base_pages + extra) * engine.page_bytes
    # the probe (a one-page pool) measured the program the engine compiled with the real pool, and
    # no program the engine compiled needs more
    working = ex.program_memory.working_bytes
    assert working[plan.reserve_program] == plan.reserve == max(working.values())
    step = max(working[program_name(LAYOUTS[lay], *rest)] for lay, *rest in ex._compiled)
    assert step == max(working[program_name(*key)] for key in probe_keys(ex, [ex.layout]))


def test_a_configuration_that_cannot_fit_fails_before_compiling_its_programs(monkeypatch):
    compiles = []
    real = step_compile.compile_lowered
    for module in (step_compile, sampler_programs):
        monkeypatch.setattr(module, "compile_lowered", lambda *a: compiles.append(1) or real(*a))
    fake_memory(monkeypatch, 64 * MiB + 4096, 64 * MiB)  # 4 KiB beside the weights
    with pytest.raises(StartupMemoryError, match="Lower --max-num-batched-tokens"):
        Engine(EngineConfig(num_devices=2, **KW))
    assert len(compiles) == 1  # the probe only (its sampler program compiles outside the executor)
    fake_memory(monkeypatch, 256 * MiB, 64 * MiB)
    with pytest.raises(StartupMemoryError, match="--kv-memory-gb 1 does not fit"):
        Engine(EngineConfig(num_devices=2, kv_memory_gb=1, **KW))
    with pytest.raises(StartupMemoryError, match="--max-model-len 100000000 does not fit"):
        Engine(EngineConfig(num_devices=2, max_model_len=100_000_000, **KW))
    assert len(compiles) == 2  # a context no pool could hold fails before the probe


def test_start_up_with_several_buckets_compiles_each_program_once(monkeypatch):
    executable_cache.clear()
    hlos = []
    real = step_compile.compile_lowered
    for module in (step_compile, sampler_programs):  # step programs, sampler programs
        monkeypatch.setattr(module, "compile_lowered", lambda lowered, *a: hlos.append(lowered.as_text()) or real(lowered, *a))
    fake_memory(monkeypatch, 256 * MiB, 64 * MiB)
    engine = Engine(EngineConfig(num_devices=2, layout="tp", **KW))
    ex = engine.executor
    assert len(ex.buckets(ex.layout)) >= 3
    assert len(hlos) == len(set(hlos))  # no program compiled twice
    assert len(hlos) == 1 + len(ex._compiled) + len(ex._samplers)  # the probe, then every program once
    assert set(ex.program_memory.temp_bytes) == (
        {program_name(LAYOUTS[lay], *rest) for lay, *rest in ex._compiled} | {sampler_name(*k) for k in ex._samplers})


def test_where_temporaries_grow_with_the_pool_the_plan_follows_them(monkeypatch):
    """XLA:TPU's step temporaries grow with the pool (docs/tpu.md): the plan measures them on a second,
    smaller pool (retrying smaller when the compiler runs out of memory) and leaves room at its size."""
    page, limit, in_use = 1 * MiB, 1 * GiB, 256 * MiB
    tried = []

    def fake_measure(pages, layouts, threads):  # the probe "executor" is its page count here
        tried.append(pages)
        if pages > 100:
            raise RuntimeError("RESOURCE_EXHAUSTED: CompileTimeHbmOom: Ran out of memory on HBM")
        return {"step": 4 * MiB + pages * page // 4, "sampler": 20 * MiB}  # a quarter page per page

    monkeypatch.setattr(pool_sizing, "measure_programs", fake_measure)
    cfg = EngineConfig(kv_memory_fraction=0.9, max_num_batched_tokens=16, max_num_seqs=4)
    plan = pool_sizing.measure_and_plan(lambda pages: pages, [], 1, limit, in_use, page, cfg, 0, "tpu")
    assert tried[0] == 1 and tried[-1] <= 100 and len(tried) >= 3  # 1 page, then smaller until it compiles
    step_at_plan = 4 * MiB + plan.pages * page // 4
    assert plan.reserve >= step_at_plan and in_use + plan.reserve + plan.pool_bytes <= limit
    assert plan.pool_bytes == pytest.approx(0.9 * (limit - in_use - plan.reserve), abs=2 * page)
    flat = pool_sizing.measure_and_plan(lambda pages: pages, [], 1, limit, in_use, page, cfg, 0, "gpu")
    assert flat.reserve == 20 * MiB and flat.pages > plan.pages  # GPU: one probe, the sampler is the largest


def test_the_server_reports_a_configuration_that_cannot_fit_and_exits(monkeypatch, caplog):
    from serve import main as server_main

    # in-process (--no-engine-process), so the faked memory applies; a core process reports its start-up
    # error the same way (tests/test_core_process.py)
    fake_memory(monkeypatch, 256 * MiB, 64 * MiB)
    with caplog.at_level("ERROR", logger="serve"), pytest.raises(SystemExit) as exit_:
        server_main.main(["--no-engine-process", "--kv-memory-gb", "1", "--max-num-batched-tokens", "32", "--max-num-seqs", "4",
                          "--page-size", "8", "--compile-cache-dir", ""])
    assert exit_.value.code == 1
    assert "cannot start: --kv-memory-gb 1 does not fit" in caplog.text and "Lower --kv-memory-gb" in caplog.text

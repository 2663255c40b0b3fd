"""Start-up's memory plan: how many KV pages each device gets, decided before the pool is allocated
and before any step program is compiled for it (docs/startup.md, "Memory at start-up").

On a device that reports memory (GPU, TPU) the largest step program is compiled first against a
one-page abstract pool (engine/program_memory.measure_largest) and the pool is sized by
kv/capacity.plan_pool from what remains after the weights and that program's working memory, so
no program is later compiled for memory it will not have, and a configuration that cannot fit
fails in seconds with the flag to change. CPU devices report no memory: the pool is
`--kv-memory-gb`, else a small default.
"""

from __future__ import annotations

import logging

from jax.sharding import NamedSharding

from splash_jax.engine.executor import StepExecutor, auto_compile_threads
from splash_jax.engine.program_memory import measure_programs
from splash_jax.kv.capacity import (
    CPU_DEFAULT_KV_GB, GiB, PoolPlan, check_max_model_len, device_memory, pages_per_device, plan_pool,
)
from splash_jax.mesh.layouts import POOL_SPEC

log = logging.getLogger(__name__)


def plan_start_up_pool(config, model, mesh, layout, layouts, pool_config, dtype, page_bytes: int, extra_pages: int,
                       executor_args: dict, device) -> tuple[int, PoolPlan | None]:
    """(base pages per device, the plan or None without memory statistics). `extra_pages`: the
    extra segment per device under `layout` (0 unless head-sharded); `layouts`: those whose programs
    start-up compiles; `executor_args`: what the engine's StepExecutor gets besides model, pool,
    mesh and layout."""
    memory = device_memory(device)
    if memory is None:
        gb = config.kv_memory_gb if config.kv_memory_gb is not None else CPU_DEFAULT_KV_GB
        if config.kv_memory_gb is None:
            log.info("device %s reports no memory statistics; using %.2f GiB for the KV pool", device, gb)
        return pages_per_device(pool_config, config.page_size, dtype, int(gb * GiB), config.max_pages), None
    limit, in_use = memory
    if config.max_model_len is not None and config.max_pages is None:  # hopeless before any compile
        check_max_model_len(config.max_model_len, True, (limit - in_use) // page_bytes * config.page_size)
    n = mesh.devices.size

    def probe(pages):  # an executor that only compiles, over an abstract pool of `pages` base pages per device
        pool = model.new_cache(n * pages, config.page_size, NamedSharding(mesh, POOL_SPEC), abstract=True)
        return StepExecutor(model, pool, mesh, layout, **executor_args)  # extra segment: from executor_args

    plan = measure_and_plan(probe, layouts, config.compile_threads or auto_compile_threads(), limit, in_use,
                            page_bytes, config, extra_pages, device.platform)
    log.info("memory plan per device: %s", plan.describe())
    return plan.pages, plan


def temps_follow_pool(platform: str) -> bool:
    """Whether a step program's temporaries grow with the pool: on TPU they do (XLA:TPU holds a
    buffer for the scanned layer group's KV write of about one layer's share of the pool,
    docs/tpu.md); on GPU and CPU they do not (the probe's figure is the real program's:
    docs/startup.md, tests/test_pool_sizing.py)."""
    return platform == "tpu"


def measure_and_plan(make_probe, layouts, threads: int, limit: int, in_use: int, page_bytes: int, config,
                     extra_pages: int, platform: str) -> PoolPlan:
    """The pool plan from the largest programs compiled on `make_probe(1)` (a one-page pool); where
    temporaries follow the pool, once more on a quarter of the planned pool (the planned size itself
    can be past what the compiler accepts: XLA:TPU refuses a program whose arguments and
    temporaries exceed HBM), and the plan made again with the growth per page the two give."""
    kw = dict(kv_memory_gb=config.kv_memory_gb, kv_memory_fraction=config.kv_memory_fraction, extra_pages=extra_pages,
              max_pages=config.max_pages, max_num_batched_tokens=config.max_num_batched_tokens)
    one = measure_programs(make_probe(1), layouts, threads)
    name = max(one, key=one.get)
    plan = plan_pool(limit, in_use, one[name], name, page_bytes, **kw)
    pages = plan.pages // 4
    while temps_follow_pool(platform) and pages >= 2:
        try:
            at = measure_programs(make_probe(pages), layouts, threads)
        except Exception as e:  # noqa: BLE001 - only the compiler's out-of-memory is retried smaller
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            pages //= 4
            continue
        # a line a + c * pages above every program's two points
        per_page = max(0.0, *((at[p] - one[p]) / (pages - 1) for p in at))
        if per_page:
            name = max(at, key=lambda p: (at[p] - one[p]) / (pages - 1))
            fixed = max(one[p] - per_page for p in one)
            log.info("working memory grows with the pool: %s needs %.3f GiB at 1 page, %.3f GiB at %d pages per device",
                     name, one[name] / GiB, at[name] / GiB, pages)
            plan = plan_pool(limit, in_use, int(fixed), name, page_bytes, reserve_per_page=per_page, **kw)
        break
    return plan


def confirm_plan(plan: PoolPlan | None, summary: dict) -> None:
    """After start-up compiled everything: warn (naming the program) if a program needs more than
    the plan set aside and the difference does not fit in what the plan left free."""
    if plan is None or not summary.get("programs"):
        return
    need = summary["max_working_bytes"]
    if need > plan.reserve:
        log.log(logging.WARNING if need - plan.reserve > plan.headroom else logging.INFO,
                "%s needs %.3f GiB beside its inputs, more than the %.3f GiB start-up set aside for %s "
                "(%.2f GiB were left free)", summary["max_working_program"], need / GiB, plan.reserve / GiB,
                plan.reserve_program, plan.headroom / GiB)

"""What each compiled program needs beside the weights and the KV pool (XLA's memory_analysis),
the start-up probe that measures the largest step program before the pool takes the memory, and
the log line for a program that compiles for minutes.

Start-up sizes the pool as a fraction of what remains after the weights and the largest step
program's working memory (kv/capacity.plan_pool). That program is known without compiling them
all: working memory grows with the tokens a step holds, and the largest bucket's expanded prefill
variant (or its plain one where it has none) is the largest on every configuration measured
(docs/startup.md). The probe compiles it against a one-page pool: the pool is donated and
updated in place, so its size does not enter the temporaries (tests/test_program_memory.py
checks the figure against the program compiled with the real pool). Start-up then compiles every
program once with the real pool's shape and confirms the plan with what they report.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time

log = logging.getLogger(__name__)

SLOW_COMPILE_S = 60.0  # a program compiling longer than this is named in the log while it compiles


def working_bytes(mem) -> int:
    """Device memory a program takes while it runs beyond its inputs: temporaries plus the outputs
    not aliased to donated inputs (logits, sampled tokens)."""
    return int(mem.temp_size_in_bytes) + max(0, int(mem.output_size_in_bytes) - int(mem.alias_size_in_bytes))


class ProgramMemory:
    """Per program name: XLA's temporary bytes and working bytes (thread-safe: compiles run in a pool)."""

    def __init__(self):
        self.temp_bytes: dict[str, int] = {}
        self.working_bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, name: str, compiled) -> None:
        mem = compiled.memory_analysis()
        if mem is None:  # a backend without the analysis reports nothing
            return
        with self._lock:
            self.temp_bytes[name] = int(mem.temp_size_in_bytes)
            self.working_bytes[name] = working_bytes(mem)

    def summary(self) -> dict:
        """The largest temporaries (bytes and program), the largest working memory, every program's
        temporaries: what start-up must leave free beside the weights and the pool."""
        with self._lock:
            temp, work = dict(self.temp_bytes), dict(self.working_bytes)
        if not temp:
            return {"programs": 0, "max_temp_bytes": 0, "max_temp_program": None, "max_working_bytes": 0,
                    "max_working_program": None, "temp_bytes": {}}
        name, wname = max(temp, key=temp.get), max(work, key=work.get)
        return {"programs": len(temp), "max_temp_bytes": temp[name], "max_temp_program": name,
                "max_working_bytes": work[wname], "max_working_program": wname, "temp_bytes": temp}


@contextlib.contextmanager
def slow_compile_watch(name: str, after_s: float | None = None):
    """Log a warning naming `name` if the block (one program's compile) runs past `after_s`."""
    after_s = SLOW_COMPILE_S if after_s is None else after_s
    t0 = time.perf_counter()
    timer = threading.Timer(after_s, lambda: log.warning(
        "still compiling %s after %.0f s (XLA); docs/startup.md lists what makes a program slow to compile",
        name, time.perf_counter() - t0))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def probe_keys(executor, layouts) -> list[tuple]:
    """Program keys of the largest step program of each program layout: the largest bucket's
    greedy step, in its expanded variant where the bucket has one."""
    keys = []
    for layout in executor.program_layouts(layouts):
        bucket = executor.buckets(layout)[-1]
        keys.append((layout, bucket, False, False, executor.expands(layout, bucket), None))
    return keys


def measure_largest(executor, layouts, threads: int = 1) -> tuple[int, str | None]:
    """(working bytes, program name) of the largest of `measure_programs`."""
    sizes = measure_programs(executor, layouts, threads)
    name = max(sizes, key=sizes.get)
    return sizes[name], name


def measure_programs(executor, layouts, threads: int = 1) -> dict[str, int]:
    """Working bytes by program name of `probe_keys` and the sampler program at the most logits
    rows (its sort of the vocabulary can outgrow a small-budget step), each compiled (not kept) on
    `executor`, normally one over a one-page abstract pool. An expanded variant that does not build
    is measured in its plain form, which the engine will then run."""
    from splash_jax.engine.step_compile import COMPILE_THREAD_STACK
    from splash_jax.engine.step_programs import logits_key, program_name, sampler_name

    def lowered(key):
        try:
            return key, executor.lower(*key)
        except Exception:  # noqa: BLE001 - an expanded variant may fail; the plain one must not
            if not key[4]:
                raise
            key = key[:4] + (False, None)
            return key, executor.lower(*key)

    def compiled(key, low):
        try:
            program = executor._compile(low, key[4], executor.unrolled(key[1], logits_key(key)))
        except Exception:  # noqa: BLE001
            if not key[4]:
                raise
            key = key[:4] + (False, None)
            program = executor._compile(executor.lower(*key), False, executor.unrolled(key[1], logits_key(key)))
        mem = program.memory_analysis()
        return (working_bytes(mem) if mem is not None else 0), program_name(*key)

    def sampler(rows):  # the sampler program at the most logits rows, with every filter on
        from splash_jax.engine.sampler import FULL_MODE
        from splash_jax.executable_cache import compile_lowered

        program = compile_lowered(executor.lower_sampler(rows, FULL_MODE), None, executor.device_key)
        mem = program.memory_analysis()
        return (working_bytes(mem) if mem is not None else 0), sampler_name(rows, FULL_MODE)

    t0 = time.perf_counter()
    todo = [lowered(key) for key in probe_keys(executor, layouts)]  # tracing stays in this thread
    rows = max(executor.sampler_rows(executor.program_layouts(layouts)))
    previous = threading.stack_size(COMPILE_THREAD_STACK)  # XLA's compilers recurse deeply
    try:
        pool = concurrent.futures.ThreadPoolExecutor(max(1, min(threads, len(todo) + 1)))
        futures = [pool.submit(compiled, key, low) for key, low in todo] + [pool.submit(sampler, rows)]
    finally:
        threading.stack_size(previous)
    with pool:
        results = [f.result() for f in futures]
    best = max(results)
    log.info("largest program %s needs %.3f GiB beside its inputs (%d probe compiles in %.1fs)",
             best[1], best[0] / 2**30, len(results), time.perf_counter() - t0)
    return {name: size for size, name in results}

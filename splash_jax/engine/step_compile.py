"""Compiling a StepExecutor's step programs: which (layout, bucket, variant) programs a warm-up
builds (`program_keys`), compiling them in a thread pool as they are lowered (`compile_all`), one
on demand when an engine runs without warm-up (`compiled`), and an expanded-prefill variant that
does not build leaving its bucket to the absorbed form. `StepCompilation` is a part of
StepExecutor (engine/executor.py), which builds and lowers each program and owns the results."""

from __future__ import annotations

import concurrent.futures
import logging
import threading

from tqdm.auto import tqdm

from splash_jax.engine.compile_options import OPTIONAL_OPTIONS
from splash_jax.engine.program_memory import slow_compile_watch
from splash_jax.engine.sampler import SAMPLER_MODES, SamplerMode
from splash_jax.engine.step_programs import Bucket, auto_compile_threads, logits_key, program_name
from splash_jax.executable_cache import compile_lowered
from splash_jax.mesh.layouts import Layout

log = logging.getLogger(__name__)

# XLA's GPU compiler recurses deeply: a worker thread with the default stack crashed (segfault)
# on an H200, so compile threads get this stack (also splash_jax/aot.py, program_memory.py).
COMPILE_THREAD_STACK = 512 * 2**20


class StepCompilation:
    """Step-program compilation of StepExecutor (see the module docstring)."""

    def program_keys(self, layouts: list[Layout], moving: bool = False) -> list[tuple]:
        """(layout, bucket, moving, full, expanded, mode) of every step program `compile_all` builds
        for `layouts`: each bucket with both samplers (greedy, full), the `moving` variants when
        switching, the `expanded` variant (not moving) of the buckets that have one, and the fused
        variant per SamplerMode (mode not None) of the buckets that fuse."""
        variants = (False, True) if moving and self.move_pages else (False,)
        keys = [(lay, b, m, f, e, None) for lay in self.program_layouts(layouts) for b in self.buckets(lay)
                for m in variants for f in (False, True)
                for e in ((False, True) if self.expands(lay, b) and not m else (False,))]
        return keys + [(lay, b, False, True, False, mode) for lay in self.program_layouts(layouts)
                       for b in self.buckets(lay) if self.fuses(b) for mode in SAMPLER_MODES]

    def compile_all(
        self, layouts: list[Layout] | None = None, moving: bool = False, show_progress: bool = True, threads: int = 1,
    ) -> float:
        """Compile every (layout, bucket) program with both samplers (greedy, full) and, when
        switching, the `moving` variants, plus the `expanded` variants (not moving) of the buckets
        that have one (`expands`). threads > 1: lowering stays in this thread (tracing holds
        the GIL) and each lowered program is compiled in a pool as soon as it is lowered;
        threads 0: `auto_compile_threads()`."""
        layouts = self.program_layouts(layouts)
        todo = [key for key in self.program_keys(layouts, moving) if (key[0].name, *key[1:]) not in self._compiled]
        workers = max(1, min(len(todo), threads or auto_compile_threads()))
        with self.compile_stats.track("steps") as rec, tqdm(
            total=len(todo), desc="compiling steps", unit="program", disable=not show_progress, leave=False,
        ) as bar:
            if workers == 1:  # lower and compile one program at a time
                for key in todo:
                    program = self._build(key, lambda key=key: self._compile(self.lower(*key), key[4], self.unrolled(key[1], logits_key(key)),
                                                                                     program_name(*key)))
                    if program is not None:
                        self._compiled[(key[0].name, *key[1:])] = program
                    bar.update()
            else:
                # The pool starts its threads lazily in submit(), so the stack size stays set
                # until all are submitted.
                previous = threading.stack_size(COMPILE_THREAD_STACK)
                try:
                    pool = concurrent.futures.ThreadPoolExecutor(workers)
                    futures = {}
                    for key in todo:
                        lowered = self._build(key, lambda key=key: self.lower(*key))
                        if lowered is None:
                            bar.update()
                        else:
                            futures[pool.submit(self._compile, lowered, key[4], self.unrolled(key[1], logits_key(key)),
                                               program_name(*key))] = key
                finally:
                    threading.stack_size(previous)
                with pool:
                    for future in concurrent.futures.as_completed(futures):
                        key = futures[future]
                        program = self._build(key, future.result)
                        if program is not None:
                            self._compiled[(key[0].name, *key[1:])] = program
                        bar.update()
            built = sum(1 for lay, *key in todo if (lay.name, *key) in self._compiled)
            rec["programs"] = built
        self.num_compiled += built
        self.compile_seconds += rec["seconds"]
        samplers = self.compile_samplers(layouts)
        if not self.abstract:
            self.compile_page_copies(layouts)
        log.info(
            "compiled %d step programs (%s) in %.1fs with %d threads (%d from the persistent cache) and %d sampler programs",
            built, ",".join(l.name for l in layouts), rec["seconds"], workers, rec["cache_hits"], samplers,
        )
        mem = self.memory_summary()
        if mem["programs"]:
            log.info("largest step-program temporaries: %.3f GiB (%s)", mem["max_temp_bytes"] / 2**30, mem["max_temp_program"])
        return rec["seconds"]

    def compiled(self, layout: Layout, bucket: Bucket, moving: bool = False, full: bool = False, expanded: bool = False,
                 mode: SamplerMode | None = None):
        layout = self.program_layout(layout)
        key = (layout.name, bucket, moving, full, expanded, mode)
        program = self._compiled.get(key)
        if program is None:  # only without warm-up; compiles once per bucket
            try:
                program = self._compiled[key] = self._compile(self.lower(layout, bucket, moving, full, expanded, mode),
                                                                    expanded, self.unrolled(bucket, full and mode is None),
                                                                    program_name(layout, bucket, moving, full, expanded, mode))
            except Exception as e:
                if expanded:  # this step fails (the engine recovers); later ones pack absorbed
                    self._refuse_expanded(layout.name, bucket, e)
                raise
            self.num_compiled += 1
        return program

    def _compile(self, lowered, expanded: bool = False, unrolled: bool = False, name: str | None = None):
        """Compile with the step options (dropping any this XLA refuses); `name` (program_name):
        keep the program's memory for memory_summary, and name it in the log if it compiles slowly."""
        while True:
            options = self.compiler_options[(expanded, unrolled)]
            try:
                with slow_compile_watch(name or "a step program"):
                    compiled = compile_lowered(lowered, options, self.device_key)
                if name is not None:
                    self.program_memory.record(name, compiled)
                return compiled
            except Exception as e:  # an XLA that does not take an optional option: compile without it
                refused = [k for k in OPTIONAL_OPTIONS if k in options and k in str(e)]
                if not refused:
                    raise
                log.warning("XLA refused %s (%s); compiling without", refused, str(e).splitlines()[0][:200])
                self.compiler_options[(expanded, unrolled)] = {k: v for k, v in options.items() if k not in refused}

    def _build(self, key: tuple, build):
        """build() for the program key (layout, bucket, moving, full, expanded, mode): an expanded
        variant that fails (lowering or compile) is refused and gives None; any other failure raises."""
        try:
            return build()
        except Exception as e:  # noqa: BLE001 - only an expanded variant may fail softly
            if not key[4]:
                raise
            self._refuse_expanded(key[0].name, key[1], e)
            return None

    def _refuse_expanded(self, layout_name: str, bucket: Bucket, error: Exception) -> None:
        """An expanded program that does not build (say, a cuDNN that refuses the shapes) leaves its
        bucket to the absorbed form instead of failing the engine."""
        if (layout_name, bucket) in self._refused_expanded:
            return
        self._refused_expanded.add((layout_name, bucket))
        log.warning("the expanded-prefill program of %s %s did not build (%s: %s); that bucket prefills absorbed",
                    layout_name, bucket, type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "")

    def memory_summary(self) -> dict:
        """Temporaries of the compiled programs (engine/program_memory.py): the largest, by name."""
        return self.program_memory.summary()

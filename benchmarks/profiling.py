"""GPU busy time from a `jax.profiler` trace: the union of kernel intervals on the GPU streams.

Back-to-back wall timing cannot tell how long the device waited for the host; a trace can.
`device_busy(fn, steps)` runs `fn` `steps` times under the profiler and returns per-step busy
time, kernel count and the top kernels. On CPU (no GPU planes) it returns busy = None.
The profiler keeps a bounded number of kernel events (about 20,000 seen on an H200: 100 batch-1
V2-Lite steps of 855 kernels came back as 196 per step); a trace whose kernels span less than
TRUNCATED_SPAN of the profiled window is reported as truncated, busy = None, never as a smaller
busy time: profile fewer steps.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import logging
import shutil
import tempfile
import time

import jax

log = logging.getLogger(__name__)
TRUNCATED_SPAN = 0.7  # kernels' first-to-last span / profiled window below this: events were dropped


@dataclasses.dataclass
class BusyProfile:
    busy_ms: float | None  # per step: union of kernel intervals over all GPU streams
    kernels: float  # kernels per step
    window_ms: float  # wall time of the profiled window per step
    top: list[tuple[str, float, float]]  # (kernel name, us per step, launches per step)


def union_ns(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def timeline(fn, marks: str = "probe:") -> tuple[list[tuple[str, int, int]], list[tuple[int, int]]]:
    """Run fn() once under the profiler; return the host annotations whose names start with `marks`
    (name, start ns, end ns; `jax.profiler.TraceAnnotation`) and every GPU kernel (start ns, end ns),
    on the profiler's one clock, so host phases and device work can be set side by side."""
    jax.effects_barrier()
    folder = tempfile.mkdtemp(prefix="splash-prof-")
    try:
        with jax.profiler.trace(folder):
            fn()
            jax.effects_barrier()
        files = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(files[0])
        host, kernels = [], []
        for plane in data.planes:
            gpu = "gpu" in plane.name.lower()
            for line in plane.lines:
                if gpu and "stream" not in line.name.lower():
                    continue
                for ev in line.events:
                    start = int(ev.start_ns)
                    if gpu:
                        kernels.append((start, start + int(ev.duration_ns)))
                    elif ev.name.startswith(marks):
                        host.append((ev.name, start, start + int(ev.duration_ns)))
        return sorted(host, key=lambda e: e[1]), sorted(kernels)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def device_busy(fn, steps: int, sync=None, top: int = 8) -> BusyProfile:
    """Profile `steps` calls of fn(); `sync()` (default: jax.effects_barrier) waits for the device.
    `top`: how many kernel names (by GPU time) to report, with their launches per step."""
    sync = sync or jax.effects_barrier
    sync()
    folder = tempfile.mkdtemp(prefix="splash-prof-")
    try:
        with jax.profiler.trace(folder):
            t = time.perf_counter()
            for _ in range(steps):
                fn()
            sync()
            window = time.perf_counter() - t
        files = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(files[0])
        intervals, names, launches, count, found = [], collections.Counter(), collections.Counter(), 0, False
        for plane in data.planes:
            if "gpu" not in plane.name.lower():
                continue
            for line in plane.lines:
                if "stream" not in line.name.lower():
                    continue
                found = True
                for ev in line.events:
                    start = int(ev.start_ns)
                    intervals.append((start, start + int(ev.duration_ns)))
                    names[ev.name[:80]] += ev.duration_ns
                    launches[ev.name[:80]] += 1
                    count += 1
        busy = union_ns(intervals) / steps / 1e6 if found else None
        if intervals:
            span_s = (max(b for _, b in intervals) - min(a for a, _ in intervals)) / 1e9
            if span_s < TRUNCATED_SPAN * window:
                log.warning("profiler trace truncated: %d kernel events span %.1f of %.1f ms profiled; "
                            "GPU busy not reported (profile fewer than %d steps)", count, span_s * 1e3, window * 1e3, steps)
                busy = None
        ranked = [(k, v / steps / 1e3, launches[k] / steps) for k, v in names.most_common(top)]
        return BusyProfile(busy, count / steps, window / steps * 1e3, ranked)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

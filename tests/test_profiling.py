"""benchmarks/profiling.py: the trace readers benchmarks take GPU busy time and first-step timings from."""

import itertools

import jax
import jax.numpy as jnp

from benchmarks.profiling import timeline, union_ns


def test_union_of_kernel_intervals_counts_overlaps_once():
    intervals = [(0, 10), (5, 12), (20, 25), (21, 22), (30, 30), (12, 15)]
    covered = {t for a, b in intervals for t in range(a, b)}  # unit steps covered, counted by brute force
    assert union_ns(intervals) == len(covered) == 20
    for perm in itertools.islice(itertools.permutations(intervals), 50):  # order does not matter
        assert union_ns(list(perm)) == 20
    assert union_ns([]) == 0


def test_timeline_returns_the_marked_host_annotations_in_order_and_no_kernels_on_cpu():
    x = jnp.ones((64, 64))

    def work():
        with jax.profiler.TraceAnnotation("probe:first"):
            (x @ x).block_until_ready()
        with jax.profiler.TraceAnnotation("other:skipped"):
            (x + 1).block_until_ready()
        with jax.profiler.TraceAnnotation("probe:second"):
            (x * 2).block_until_ready()

    host, kernels = timeline(work)
    assert [name for name, _, _ in host] == ["probe:first", "probe:second"]
    assert all(start <= end for _, start, end in host)
    assert host[0][2] <= host[1][1]  # one clock: the first ended before the second began
    if jax.devices()[0].platform == "cpu":
        assert kernels == []

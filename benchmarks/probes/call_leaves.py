"""Probe: what each array argument adds to the host time of one call of a compiled program.

    python -m benchmarks.probes.call_leaves --leaves 34,56,400 --calls 500

A step program takes the model's parameters as a flat tuple of leaves (StepExecutor.params): the
bundled model has 34, with its MTP layer 56, V2-Lite 27 layers a few hundred. Whether handing a
program fewer leaves would shorten its call (docs/speculative.md, "MTP at level 0") is a question
of the per-leaf cost of jax's call path, which this answers in isolation: a program reading one
element of the first leaf, called with N small leaves, jitted and ahead-of-time compiled (the
engine's form: jit(...).lower(...).compile()), --calls calls back to back, then one wait. The
program's own work is the same for every N (jit drops unused arguments from the executable), so
the difference between rows is the call path's cost of the leaves. Run it on the machine whose
host you care about. Prints a table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import table, write_results

log = logging.getLogger("benchmarks.probes.call_leaves")


def time_calls(fn, args, calls: int, repeats: int) -> float:
    """Median over repeats of the mean us per call of `calls` calls queued back to back."""
    for _ in range(20):
        fn(*args).block_until_ready()
    means = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        out.block_until_ready()
        means.append((time.perf_counter() - t) / calls * 1e6)
    return float(np.median(means))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leaves", default="1,34,56,400", help="comma-separated leaf counts")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--leaf-size", type=int, default=8, help="elements per leaf (float32)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rows = []
    for n in [int(x) for x in args.leaves.split(",")]:
        leaves = tuple(jnp.full((args.leaf_size,), float(i)) for i in range(n))
        y = jnp.ones(())
        jitted = jax.jit(lambda xs, y: y + xs[0][0])
        compiled = jitted.lower(leaves, y).compile()
        row = {"leaves": n}
        for name, fn in (("compiled_us", compiled), ("jit_us", jitted)):
            row[name] = time_calls(fn, (leaves, y), args.calls, args.repeats)
        rows.append(row)
        log.info("%d leaves: %.1f us per compiled call", n, row["compiled_us"])
    base = rows[0]
    for r in rows:  # the cost per leaf beyond the first row's
        extra = r["leaves"] - base["leaves"]
        r["us_per_extra_leaf"] = (r["compiled_us"] - base["compiled_us"]) / extra if extra else None
    print(table(rows, ["leaves", "compiled_us", "jit_us", "us_per_extra_leaf"]))
    write_results("call_leaves", {"args": vars(args), "jax": jax.__version__, "backend": jax.default_backend(), "rows": rows})


if __name__ == "__main__":
    main()

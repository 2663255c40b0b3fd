"""The sampler's vocabulary-wide work at decode sizes: the top-k/top-p cut-off by a sort (the
sampler before `engine/order_stats.py`) against the threshold search, the top-n logprobs'
`lax.top_k`, the random draw, and the whole `sample()` (greedy and full), one GPU.

Each case is one jitted call on [rows, vocab] float32 logits, its GPU busy time per call from a
profiler trace. The search's masks are checked equal to the sort's on every case.

  PYTHONPATH=. python benchmarks/probes/sampler.py [--rows 1,8,128] [--vocab 102400,129280]
"""
import argparse
import logging

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import table, write_results
from benchmarks.profiling import device_busy
from splash_jax.engine import order_stats
from splash_jax.engine.request import MAX_LOGPROBS
from splash_jax.engine.sampler import SamplingInputs, _draw, sample

log = logging.getLogger("probe.sampler")


def sort_cutoff_mask(scaled, top_k, top_p):
    """The sampler's filter before the threshold search: one sort of each row."""
    vocab = scaled.shape[-1]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= jnp.maximum(kth, cutoff), scaled, -jnp.inf)


def search_mask(scaled, top_k, top_p, fanout):
    cut = order_stats.top_k_top_p_cutoff(scaled, top_k, top_p, fanout)
    return jnp.where(scaled >= cut[:, None], scaled, -jnp.inf)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,128")
    ap.add_argument("--vocab", default="102400,129280")
    ap.add_argument("--fanouts", default="8,16,32")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows_out = []
    for vocab in (int(v) for v in args.vocab.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            rng = np.random.default_rng(0)
            x = jnp.asarray(rng.normal(0, 2, (rows, vocab)).astype(np.float32))
            top_k = jnp.asarray(np.where(np.arange(rows) % 2, 50, 0).astype(np.int32))
            top_p = jnp.full((rows,), 0.95, jnp.float32)
            s = SamplingInputs.host(rows)
            s.temperature[:] = 0.8
            s.top_p[:] = 0.95
            s.top_k[:] = np.asarray(top_k)
            s = jax.tree.map(jnp.asarray, s)
            cases = {
                "sort cut-off": jax.jit(sort_cutoff_mask),
                **{f"search cut-off f{f}": jax.jit(lambda a, b, c, f=int(f): search_mask(a, b, c, f))
                   for f in args.fanouts.split(",")},
            }
            want = np.asarray(cases["sort cut-off"](x, top_k, top_p))
            for name, fn in cases.items():
                got = np.asarray(fn(x, top_k, top_p))
                prof = device_busy(lambda: fn(x, top_k, top_p), args.calls)
                rows_out.append({"vocab": vocab, "rows": rows, "case": name, "busy_us": prof.busy_ms * 1e3 if prof.busy_ms else None,
                                 "kernels": prof.kernels, "equal_to_sort": bool(np.array_equal(got, want)),
                                 "top": [(n[:50], round(us, 1)) for n, us, _ in prof.top[:4]]})
                log.info("%s", rows_out[-1])
            others = {
                f"lax.top_k {MAX_LOGPROBS} (logprobs)": jax.jit(lambda a: jax.lax.top_k(a, MAX_LOGPROBS)),
                "lax.top_k 16": jax.jit(lambda a: jax.lax.top_k(a, 16)),
                "log_softmax": jax.jit(lambda a: jax.nn.log_softmax(a, axis=-1)),
                "draw (filter + categorical)": jax.jit(lambda a: _draw(a, s)),
                "sample greedy": jax.jit(lambda a: sample(a, s, None, full=False)),
                "sample full": jax.jit(lambda a: sample(a, s, None, full=True)),
            }
            for name, fn in others.items():
                jax.block_until_ready(fn(x))
                prof = device_busy(lambda: fn(x), args.calls)
                rows_out.append({"vocab": vocab, "rows": rows, "case": name, "busy_us": prof.busy_ms * 1e3 if prof.busy_ms else None,
                                 "kernels": prof.kernels, "equal_to_sort": None,
                                 "top": [(n[:50], round(us, 1)) for n, us, _ in prof.top[:4]]})
                log.info("%s", rows_out[-1])
    print(table(rows_out, ["vocab", "rows", "case", "busy_us", "kernels", "equal_to_sort"]))
    for r in rows_out:
        print(r["vocab"], r["rows"], r["case"], r["top"])
    write_results("sampler", {"args": vars(args), "rows": rows_out})


if __name__ == "__main__":
    main()

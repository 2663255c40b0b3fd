"""The sampler's vocabulary-wide work at decode sizes, one GPU: the top-k/top-p cut-off by a sort
(what the sampler does) against an exact threshold search in XLA (below: the cut-off is the
smallest value v of a row whose higher entries count or weigh less than the limit, found over the
float32 bit patterns, `fanout` candidates per pass), the top-n logprobs' `lax.top_k`, the draw,
and the whole `sample()` per sampler mode.

Each case is one jitted call on [rows, vocab] float32 logits, its GPU busy time per call from a
profiler trace; the search's masks are compared with the sort's. Measured on an H200
(`sampler_gpu-nvidia-h200_20261201-190927.json`): the search is faster than the sort at 8 rows
(142 vs 224 us at 102K) and slower at 128 (1,283 vs 1,056 us): XLA emits the [rows, fanout,
vocab] compare-and-sum as one row reduction per candidate, re-reading the row `fanout` times.
So the sampler keeps the sort and runs it only in steps where a row filters (SamplerMode).

  PYTHONPATH=. python benchmarks/probes/sampler.py [--rows 1,8,128] [--vocab 102400,129280]
"""
import argparse
import math
import logging

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import table, write_results
from benchmarks.profiling import device_busy
from splash_jax.engine.request import MAX_LOGPROBS
from splash_jax.engine.sampler import SAMPLER_MODES, SamplingInputs, _draw, sample

log = logging.getLogger("probe.sampler")

FANOUT = 16  # candidates per pass: 8 passes over 32-bit keys


def order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys that order like the float32 values (-0.0 counts as +0.0; no NaNs expected)."""
    x = jnp.where(x == 0, jnp.zeros_like(x), x).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def key_values(keys: jax.Array) -> jax.Array:
    """The float32 values of order keys (the inverse of `order_keys`)."""
    negative = (keys >> 31) == 0
    bits = jnp.where(negative, ~keys, keys & jnp.uint32(0x7FFFFFFF))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def passes_for(fanout: int) -> int:
    """Passes that shrink any 32-bit interval to one key when each keeps 1/fanout of it."""
    return math.ceil(32 / math.log2(fanout))


def smallest_keys_below(keys: jax.Array, weights: tuple, limits: tuple, fanout: int = FANOUT,
                        candidates_minor: bool = False) -> tuple:
    """For each (weights, limit) pair and each row r: the smallest key K with
    sum(weights[r, keys[r] > K]) < limit[r] (weights None = 1 per entry, i.e. a count).

    keys [R, V] uint32; each weights [R, V] float32 or None; each limit [R] float32 > 0.
    All searches share each pass's read of the keys. Returns one uint32 [R] per pair; each is a
    key of its row, or 0 when even the row's smallest entry counts below the limit.
    """
    rows = keys.shape[0]
    top = jnp.max(keys, axis=-1)  # S(top) = 0 < limit: the answer is in [0, top]
    bounds = [(jnp.zeros(rows, jnp.uint32), top) for _ in limits]
    offsets = jnp.arange(fanout, dtype=jnp.uint32)
    for _ in range(passes_for(fanout)):
        new = []
        for (lo, hi), w, limit in zip(bounds, weights, limits):
            step = (hi - lo) // fanout + 1
            cand = jnp.minimum(lo[:, None] + offsets[None, :] * step[:, None], hi[:, None])  # [R, F], ascending
            if candidates_minor:  # [R, V, F]: a column reduction over V, F outputs per read key
                above = keys[:, :, None] > cand[:, None, :]
                mass = jnp.sum(above, axis=1, dtype=jnp.float32) if w is None else jnp.sum(
                    jnp.where(above, w[:, :, None], 0.0), axis=1)
            else:  # [R, F, V]: one row reduction per candidate
                above = keys[:, None, :] > cand[:, :, None]
                mass = jnp.sum(above, axis=-1, dtype=jnp.float32) if w is None else jnp.sum(
                    jnp.where(above, w[:, None, :], 0.0), axis=-1)
            below = mass < limit[:, None]  # False ... False True ... True along F
            first = fanout - jnp.sum(below, axis=-1)  # the first candidate below the limit (F: none)
            at = lambda i: jnp.take_along_axis(cand, jnp.clip(i, 0, fanout - 1)[:, None], axis=-1)[:, 0]
            new_hi = jnp.where(first < fanout, at(first), hi)
            new_lo = jnp.where(first == 0, lo, at(first - 1) + 1)
            new.append((new_lo, new_hi))
        bounds = new
    return tuple(hi for _, hi in bounds)


def top_k_top_p_cutoff(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, fanout: int = FANOUT,
                       candidates_minor: bool = False) -> jax.Array:
    """Per row, the value at and above which an entry survives top-k and top-p ([R] float32).

    top_k [R] int32 (0 = off), top_p [R] float32 (>= 1 = off); probabilities for top-p are the
    softmax of `scaled`. Equal to a sort: the k-th largest value, and the smallest value v whose
    higher entries hold less than top_p of the mass (ties at the cut-off are kept)."""
    vocab = scaled.shape[-1]
    keys = order_keys(scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab).astype(jnp.float32)
    p = jnp.where(top_p >= 1.0, jnp.inf, top_p).astype(jnp.float32)  # float32 mass can reach 1 early
    key_k, key_p = smallest_keys_below(keys, (None, probs), (k, p), fanout, candidates_minor)
    floor = order_keys(jnp.full((), -jnp.inf, jnp.float32))  # key 0 (keep all) would read as a NaN
    return key_values(jnp.maximum(jnp.maximum(key_k, key_p), floor))



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


def f64_mask(scaled: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """The filter in float64 numpy (the sort's definition): which entries survive."""
    x = scaled.astype(np.float64)
    order = np.argsort(-x, axis=-1, kind="stable")
    xs = np.take_along_axis(x, order, axis=-1)
    vocab = x.shape[-1]
    k = np.where(top_k > 0, np.minimum(top_k, vocab), vocab)
    kth = xs[np.arange(len(x)), k - 1]
    p = np.exp(xs - xs[:, :1])
    p /= p.sum(-1, keepdims=True)
    before = np.cumsum(p, -1) - p
    keep = (before < top_p[:, None]) | (top_p[:, None] >= 1)
    cutoff = np.where(keep, xs, np.inf).min(-1)
    return x >= np.maximum(kth, cutoff)[:, None]


def search_mask(scaled, top_k, top_p, fanout, candidates_minor=False):
    cut = top_k_top_p_cutoff(scaled, top_k, top_p, fanout, candidates_minor)
    return jnp.where(scaled >= cut[:, None], scaled, -jnp.inf)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,128")
    ap.add_argument("--vocab", default="102400,129280")
    ap.add_argument("--fanouts", default="8,16,32")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--xla-search", action=argparse.BooleanOptionalAction, default=True, help="time the XLA searches too")
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
                **{f"search cut-off f{f}{' VF' if vf else ''}": jax.jit(lambda a, b, c, f=int(f), vf=vf: search_mask(a, b, c, f, vf))
                   for f in (args.fanouts.split(",") if args.xla_search else []) for vf in (False, True)},
            }
            want = np.asarray(cases["sort cut-off"](x, top_k, top_p))
            exact = f64_mask(np.asarray(x), np.asarray(top_k), np.asarray(top_p))
            for name, fn in cases.items():
                got = np.asarray(fn(x, top_k, top_p))
                off = np.isfinite(got) != exact  # entries kept or dropped unlike the float64 filter
                prof = device_busy(lambda: fn(x, top_k, top_p), args.calls)
                rows_out.append({"vocab": vocab, "rows": rows, "case": name, "busy_us": prof.busy_ms * 1e3 if prof.busy_ms else None,
                                 "kernels": prof.kernels, "equal_to_sort": bool(np.array_equal(got, want)),
                                 "rows_off_f64": int(off.any(-1).sum()), "entries_off_f64": int(off.sum()),
                                 "top": [(n[:50], round(us, 1)) for n, us, _ in prof.top[:4]]})
                log.info("%s", rows_out[-1])
            others = {
                f"lax.top_k {MAX_LOGPROBS} (logprobs)": jax.jit(lambda a: jax.lax.top_k(a, MAX_LOGPROBS)),
                "lax.top_k 16": jax.jit(lambda a: jax.lax.top_k(a, 16)),
                "log_softmax": jax.jit(lambda a: jax.nn.log_softmax(a, axis=-1)),
                "draw (filter + categorical)": jax.jit(lambda a: _draw(a, s)),
                "sample greedy": jax.jit(lambda a: sample(a, s, None, full=False)),
                **{f"sample full, filter={m.filter} top_logprobs={m.top_logprobs}":
                   jax.jit(lambda a, m=m: sample(a, s, None, full=True, mode=m)) for m in SAMPLER_MODES},
            }
            for name, fn in others.items():
                jax.block_until_ready(fn(x))
                prof = device_busy(lambda: fn(x), args.calls)
                rows_out.append({"vocab": vocab, "rows": rows, "case": name, "busy_us": prof.busy_ms * 1e3 if prof.busy_ms else None,
                                 "kernels": prof.kernels, "equal_to_sort": None, "rows_off_f64": None, "entries_off_f64": None,
                                 "top": [(n[:50], round(us, 1)) for n, us, _ in prof.top[:4]]})
                log.info("%s", rows_out[-1])
    print(table(rows_out, ["vocab", "rows", "case", "busy_us", "kernels", "equal_to_sort", "rows_off_f64", "entries_off_f64"]))
    for r in rows_out:
        print(r["vocab"], r["rows"], r["case"], r["top"])
    write_results("sampler", {"args": vars(args), "rows": rows_out})


if __name__ == "__main__":
    main()

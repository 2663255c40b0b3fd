"""The routed-expert computation at decode batch sizes: which path reads how much.

    python -m benchmarks.moe_paths                # DeepSeek-V2-Lite MoE layer shapes, bf16

For T tokens routed top-k among E experts, compares per layer:
  gathered  w[ids] then einsum (reads the T*k chosen experts, if XLA keeps it a gather)
  sliced    one dynamic_slice per chosen expert (reads exactly the chosen experts)
  dense     every expert over every token with a sparse combine weight (reads all experts)
  ragged    grouped GEMM (jax.lax.ragged_dot) over (token, expert) pairs sorted by expert
  bucketed  per-expert buckets of capacity 2x the mean load (exact, overflow via dense)
and reports time, the bytes each path must read at least, and the large copies/transposes
found in the optimized HLO (a copy of the whole expert tensor means a layout change per step).
"""

from __future__ import annotations

import argparse
import logging
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import table, write_results

log = logging.getLogger("benchmarks.moe_paths")


# Expert weights in one of two layouts: "in_out" gate/up [E, D, I] (x @ W), or "out_in" gate/up
# [E, I, D] (HF's [out, in]); down is [E, I, D] in both.
LAYOUT = {"in_out": ("td,tkdi->tki", "td,edi->tei"), "out_in": ("td,tkid->tki", "td,eid->tei")}
CURRENT = ["in_out"]


def gathered(x, ids, w, gate, up, down):
    g, u, dn = gate[ids], up[ids], down[ids]
    spec = LAYOUT[CURRENT[0]][0]
    h = jax.nn.silu(jnp.einsum(spec, x, g)) * jnp.einsum(spec, x, u)
    return jnp.einsum("tki,tkid->td", h * w[..., None].astype(h.dtype), dn)


def sliced(x, ids, w, gate, up, down):
    t, k = ids.shape
    out = jnp.zeros_like(x)
    for a in range(t):
        for b in range(k):
            e = ids[a, b]
            g = jax.lax.dynamic_index_in_dim(gate, e, keepdims=False)
            u = jax.lax.dynamic_index_in_dim(up, e, keepdims=False)
            dn = jax.lax.dynamic_index_in_dim(down, e, keepdims=False)
            if CURRENT[0] == "in_out":
                h = jax.nn.silu(x[a] @ g) * (x[a] @ u)
            else:
                h = jax.nn.silu(g @ x[a]) * (u @ x[a])
            out = out.at[a].add((h * w[a, b].astype(h.dtype)) @ dn)
    return out


def dense(x, ids, w, gate, up, down, layout=None):
    combine = jnp.zeros((x.shape[0], gate.shape[0]), jnp.float32).at[jnp.arange(x.shape[0])[:, None], ids].add(w)
    spec = LAYOUT[layout or CURRENT[0]][1]
    h = jax.nn.silu(jnp.einsum(spec, x, gate)) * jnp.einsum(spec, x, up)
    return jnp.einsum("tei,eid->td", h * combine.astype(h.dtype)[..., None], down)


def ragged(x, ids, w, gate, up, down):
    """Grouped GEMM: (token, expert) pairs sorted by expert, one ragged_dot per projection."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat)
    tok = order // k
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    xs = x[tok]
    if CURRENT[0] == "in_out":
        g, u = jax.lax.ragged_dot(xs, gate, sizes), jax.lax.ragged_dot(xs, up, sizes)
    else:
        g = jax.lax.ragged_dot(xs, jnp.swapaxes(gate, 1, 2), sizes)
        u = jax.lax.ragged_dot(xs, jnp.swapaxes(up, 1, 2), sizes)
    h = jax.nn.silu(g) * u * w.reshape(-1)[order][:, None].astype(g.dtype)
    y = jax.lax.ragged_dot(h, down, sizes)
    return jnp.zeros_like(x).at[tok].add(y)


def bucketed(x, ids, w, gate, up, down):
    """Per-expert buckets of capacity twice the mean load, overflow through the dense path: exact.

    Tried as a model path and measured slower than `dense` on the H200 (the token gather and
    scatter-add cost more than the FLOPs they save), so it lives here only.
    """
    t, k = ids.shape
    e = gate.shape[0]
    mean = -(-t * k // e)
    capacity = max(8, -(-2 * mean // 8) * 8)
    if CURRENT[0] != "out_in":
        gate, up = jnp.swapaxes(gate, 1, 2), jnp.swapaxes(up, 1, 2)
    flat_e = ids.reshape(-1)
    rank = jnp.take_along_axis(jnp.cumsum(jax.nn.one_hot(flat_e, e, dtype=jnp.int32), axis=0) - 1, flat_e[:, None], 1)[:, 0]
    fits = rank < capacity
    slot = jnp.where(fits, flat_e * capacity + rank, e * capacity)
    bucket_token = jnp.zeros(e * capacity, jnp.int32).at[slot].set(jnp.repeat(jnp.arange(t), k), mode="drop")
    bucket_w = jnp.zeros(e * capacity, jnp.float32).at[slot].set(w.reshape(-1), mode="drop")
    xs = x[bucket_token].reshape(e, capacity, -1)
    h = jax.nn.silu(jnp.einsum("ecd,eid->eci", xs, gate)) * jnp.einsum("ecd,eid->eci", xs, up)
    y = jnp.einsum("eci,eid->ecd", h * bucket_w.reshape(e, capacity).astype(h.dtype)[..., None], down)
    out = jnp.zeros_like(x).at[bucket_token].add(y.reshape(e * capacity, -1).astype(x.dtype))
    spill = jnp.where(fits.reshape(t, k), 0.0, w)
    rest = jax.lax.cond(jnp.any(~fits), lambda: dense(x, ids, spill, gate, up, down, "out_in"), lambda: jnp.zeros_like(x))
    return out + rest


def big_copies(hlo: str, min_elems: int) -> int:
    n = 0
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]+)\]\{[^}]*\} (copy|transpose)\(", line)
        if m and np.prod([int(v) for v in m.group(1).split(",")]) >= min_elems:
            n += 1
    return n


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=1408)
    parser.add_argument("--tokens", default="1,8,32,128")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    e, k, d, i = args.experts, args.top_k, args.hidden, args.inter
    key = jax.random.key(0)
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    gate_io = (jax.random.normal(key, (e, d, i)) * 0.02).astype(dtype)
    up_io = (jax.random.normal(jax.random.fold_in(key, 1), (e, d, i)) * 0.02).astype(dtype)
    down = (jax.random.normal(jax.random.fold_in(key, 2), (e, i, d)) * 0.02).astype(dtype)
    expert_bytes = 3 * d * i * jnp.dtype(dtype).itemsize
    rows = []
    for layout, t in [(lay, int(v)) for lay in LAYOUT for v in args.tokens.split(",")]:
        CURRENT[0] = layout
        gate, up = (gate_io, up_io) if layout == "in_out" else (gate_io.transpose(0, 2, 1), up_io.transpose(0, 2, 1))
        x = jax.random.normal(jax.random.fold_in(key, 3), (t, d)).astype(dtype)
        ids = jax.random.randint(jax.random.fold_in(key, 4), (t, k), 0, e)
        w = jax.random.uniform(jax.random.fold_in(key, 5), (t, k))
        ref = None
        for name, fn in (("gathered", gathered), ("sliced", sliced), ("dense", dense), ("ragged", ragged), ("bucketed", bucketed)):
            if name == "sliced" and t * k > 64:
                continue  # one slice per chosen expert: only for small batches
            compiled = jax.jit(fn).lower(x, ids, w, gate, up, down).compile()
            out = compiled(x, ids, w, gate, up, down).block_until_ready()
            ref = out if ref is None else ref
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                compiled(x, ids, w, gate, up, down).block_until_ready()
                times.append(time.perf_counter() - t0)
            need = (e if name == "dense" else len(np.unique(np.asarray(ids)))) * expert_bytes
            ms = float(np.median(times)) * 1e3
            rows.append({
                "layout": layout, "tokens": t, "path": name, "ms": ms, "min_read_MB": need / 1e6, "GB_per_s": need / ms / 1e6,
                "big_copies": big_copies(compiled.as_text(), e * d * i // 2),
                "max_abs_diff": float(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)).max()),
            })
            log.info("%s", rows[-1])
    print(table(rows, ["layout", "tokens", "path", "ms", "min_read_MB", "GB_per_s", "big_copies", "max_abs_diff"]))
    write_results("moe_paths", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

"""Routed-expert paths per MoE layer on GPU: time against reading the routed experts once.

    PYTHONPATH=. python -m benchmarks.moe                 # V2-Lite and V3-width, 1..512 tokens
    PYTHONPATH=. python -m benchmarks.moe --shapes v2lite --tokens 1,8 --no-sharded

For each shape and token count: the paths of `splash_jax.moe` (xla = gathered/dense by token
count, pallas = the Triton grouped kernel, ragged = lax.ragged_dot_general, mgpu = jax's Mosaic
GPU ragged_dot_mgpu), on one GPU and with experts sharded over all GPUs (shard_map + psum, as the
model runs them). One layer is timed as `--iters` dependent calls inside one jitted loop (no
dispatch gaps), each call with its own random routing (so the L2 never holds the next layer's
experts); ideal = bytes of the distinct routed experts / read bandwidth measured in the same run.
Correctness: each path's first call against the xla path's (bf16), relative L2 error.
The shared experts (an XLA MLP in the model) are timed the same way against their bytes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.common import table, write_results
from splash_jax.moe import mgpu_routed, ragged_routed

log = logging.getLogger("benchmarks.moe")

SHAPES = {  # experts, hidden, moe_intermediate, top_k, shared intermediate
    "v2lite": (64, 2048, 1408, 6, 2816),
    "v3": (256, 7168, 2048, 8, 2048),
    "tiny": (8, 64, 32, 2, 64),  # CPU smoke test of the script
}


def xla_routed(x, ids, w, gate, up, down):
    from splash_jax.moe import resolve_moe_impl

    e = gate.shape[0]
    impl = resolve_moe_impl("xla", "gpu", x.shape[0], ids.shape[1], e, gate.shape[2], gate.shape[1])
    valid = (ids >= 0) & (ids < e)
    w = jnp.where(valid, w, 0.0)
    ids = jnp.clip(ids, 0, e - 1)
    if impl == "gathered":
        g, u, dn = gate[ids], up[ids], down[ids]
        h = jax.nn.silu(jnp.einsum("td,tkid->tki", x, g)) * jnp.einsum("td,tkid->tki", x, u)
        return jnp.einsum("tki,tkid->td", h * w.astype(h.dtype)[..., None], dn)
    combine = jnp.zeros((x.shape[0], e), jnp.float32).at[jnp.arange(x.shape[0])[:, None], ids].add(w)
    h = jax.nn.silu(jnp.einsum("td,eid->tei", x, gate)) * jnp.einsum("td,eid->tei", x, up)
    return jnp.einsum("tei,eid->td", h * combine.astype(h.dtype)[..., None], down)


def pallas_routed(config=None):
    from pallas_kernels.moe_grouped import routed_experts

    return lambda x, ids, w, g, u, d: routed_experts(x, ids, w, g, u, d, config=config)


def nothing(x, ids, w, gate, up, down):
    """The loop (and, sharded, the psum) alone: what every path pays per layer in this harness."""
    return jnp.zeros_like(x)


def paths(tokens: int):
    from pallas_kernels.moe_grouped import Config

    out = {"xla": xla_routed, "pallas": pallas_routed(), "ragged": ragged_routed, "mgpu": mgpu_routed,
           "loop_only": nothing}
    if tokens <= 32:  # small batches: more, smaller programs; and longer loads
        out["pallas_bi32"] = pallas_routed(Config(gu_block_i=32, dn_block_d=32))
        out["pallas_bd256"] = pallas_routed(Config(gu_block_d=256, dn_block_i=256, num_stages=4))
    return out


def looped(fn, sharded_mesh=None, unroll=False):
    """n dependent layers in one program: carry (x f32, acc f32); layer i uses routing i.
    unroll: n static and the loop unrolled (no while loop, whose predicate the host reads each
    iteration), to compare with the rolled loop a scan over layers produces."""

    def layer(x, ids, w, gate, up, down):
        if sharded_mesh is None:
            return fn(x, ids, w, gate, up, down).astype(jnp.float32)
        axis = sharded_mesh.axis_names[0]

        @functools.partial(jax.shard_map, mesh=sharded_mesh, in_specs=(P(), P(), P(), P(axis), P(axis), P(axis)),
                           out_specs=P(), check_vma=False)
        def part(x, ids, w, gate, up, down):
            local = ids - jax.lax.axis_index(axis) * gate.shape[0]
            return jax.lax.psum(fn(x, local, w, gate, up, down).astype(jnp.float32), axis)

        return part(x, ids, w, gate, up, down)

    @functools.partial(jax.jit, static_argnums=(0,) if unroll else ())
    def run(n, x, ids_all, w_all, gate, up, down):
        def body(i, carry):
            xc, acc = carry
            out = layer(xc.astype(gate.dtype), ids_all[i], w_all[i], gate, up, down)
            return xc + 1e-3 * out, acc + out

        return jax.lax.fori_loop(0, n, body, (x, jnp.zeros_like(x)), unroll=unroll)

    return run


def read_bandwidth() -> float:
    """Bytes/s of a read-only pass (a sum over 4 GB), as the roofline's bandwidth."""
    a = jnp.ones((1024, 1024, 2048), jnp.bfloat16)
    f = jax.jit(lambda a: a.sum(dtype=jnp.float32))
    f(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        r = f(a)
    r.block_until_ready()
    bw = 10 * a.nbytes / (time.perf_counter() - t0)
    del a
    return bw


@dataclasses.dataclass
class Case:
    shape: str
    devices: int
    tokens: int
    path: str
    run: object
    args: tuple
    iters: int
    ideal_bytes: float


def make_cases(args, key, mesh):
    cases, refs = [], {}
    for n_shape, shape in enumerate(args.shapes.split(",")):
        e, d, i, k, _ = SHAPES[shape]
        kw = jax.random.split(jax.random.fold_in(key, n_shape), 3)
        weights = [(jax.random.normal(kw[0], (e, i, d), jnp.float32) * d ** -0.5).astype(jnp.bfloat16),
                   (jax.random.normal(kw[1], (e, i, d), jnp.float32) * d ** -0.5).astype(jnp.bfloat16),
                   (jax.random.normal(kw[2], (e, i, d), jnp.float32) * i ** -0.5).astype(jnp.bfloat16)]
        expert_bytes = 3 * i * d * 2
        sharded = None
        if mesh is not None:
            sharded = [jax.device_put(wt, NamedSharding(mesh, P(mesh.axis_names[0]))) for wt in weights]
            replicated = NamedSharding(mesh, P())
        for t in map(int, args.tokens.split(",")):
            rng = np.random.default_rng(t)
            ideal_one = min(t * k, e) * expert_bytes  # upper bound for the iteration count guess
            iters = int(np.clip(args.target_ms * 1e-3 * 4e12 / ideal_one, 4, args.max_iters))
            scores = rng.random((iters, t, e))
            ids = np.argsort(-scores, axis=-1)[..., :k].astype(np.int32)
            w = rng.random((iters, t, k)).astype(np.float32)
            uniq = np.mean([len(np.unique(ids[n])) for n in range(iters)])
            x = jnp.asarray(rng.standard_normal((t, d)).astype(np.float32))
            data = (x, jnp.asarray(ids), jnp.asarray(w))
            for name, fn in paths(t).items():
                if args.paths and name not in args.paths.split(","):
                    continue
                cases.append(Case(shape, 1, t, name, looped(fn, unroll=args.unroll), (*data, *weights), iters,
                                  uniq * expert_bytes))
                if sharded is not None and args.sharded_paths and name in args.sharded_paths.split(","):
                    rep = [jax.device_put(a, replicated) for a in data]
                    cases.append(Case(shape, mesh.size, t, name, looped(fn, mesh, args.unroll), (*rep, *sharded), iters,
                                      uniq * expert_bytes / mesh.size))
    return cases, refs


def shared_cases(args):
    rows = []
    for shape in args.shapes.split(","):
        _, d, _, _, s = SHAPES[shape]
        gate = jnp.ones((d, s), jnp.bfloat16) * 0.01
        down = jnp.ones((s, d), jnp.bfloat16) * 0.01

        @jax.jit
        def run(n, x, gate, up, down):
            def body(_, x):
                xb = x.astype(jnp.bfloat16)
                return x + 1e-3 * ((jax.nn.silu(xb @ gate) * (xb @ up)) @ down).astype(jnp.float32)

            return jax.lax.fori_loop(0, n, body, x)

        for t in map(int, args.tokens.split(",")):
            x = jnp.ones((t, d), jnp.float32)
            run(2, x, gate, gate * 2, down).block_until_ready()
            t0 = time.perf_counter()
            run(200, x, gate, gate * 2, down).block_until_ready()
            ms = (time.perf_counter() - t0) / 200 * 1e3
            rows.append({"shape": shape, "tokens": t, "shared_ms": ms, "shared_MB": 3 * d * s * 2 / 1e6})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="v2lite,v3")
    parser.add_argument("--tokens", default="1,8,32,128,512")
    parser.add_argument("--paths", default="", help="comma list; empty: all")
    parser.add_argument("--no-sharded", action="store_true")
    parser.add_argument("--unroll", action="store_true", help="static, unrolled layer loop (no while loop)")
    parser.add_argument("--sharded-paths", default="xla,pallas,mgpu,loop_only")
    parser.add_argument("--profile", default="", help="cases to trace, e.g. v3:8:pallas:1,v3:8:pallas:2 "
                        "(shape:tokens:path:devices): GPU busy and top kernels per layer")
    parser.add_argument("--target-ms", type=float, default=20.0, help="aimed time per timed loop")
    parser.add_argument("--max-iters", type=int, default=200)
    parser.add_argument("--compile-threads", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop timing new cases after this")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    bw = read_bandwidth()
    log.info("read bandwidth %.0f GB/s", bw / 1e9)
    mesh = None
    if not args.no_sharded and len(jax.devices()) > 1:
        mesh = jax.make_mesh((len(jax.devices()),), ("e",), axis_types=(jax.sharding.AxisType.Explicit,))
    cases, _ = make_cases(args, jax.random.key(0), mesh)

    def compile_case(c):
        t0 = time.perf_counter()
        try:
            return c.run.lower(1, *c.args).compile(), time.perf_counter() - t0, None
        except Exception as exc:  # a path that does not lower here is reported, not fatal
            return None, time.perf_counter() - t0, f"{type(exc).__name__}: {str(exc)[:300]}"

    with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as pool:
        compiled = list(pool.map(compile_case, cases))
    log.info("compiled %d cases in %.1f s", len(cases), time.perf_counter() - start)

    rows, ref = [], {}
    for c, (exe, compile_s, err) in zip(cases, compiled):
        row = {"shape": c.shape, "devices": c.devices, "tokens": c.tokens, "path": c.path,
               "ideal_MB": c.ideal_bytes / 1e6, "ideal_ms": c.ideal_bytes / bw * 1e3, "compile_s": compile_s}
        if exe is None or time.perf_counter() - start > args.budget_s:
            row["error"] = err or "skipped: budget"
            rows.append(row)
            log.info("%s", row)
            continue
        try:
            call = (lambda e, n: e(*c.args)) if args.unroll else (lambda e, n: e(n, *c.args))  # noqa: E731
            _, first = call(exe, 1)
            first = np.asarray(first, np.float64)
            key = (c.shape, c.tokens)
            if c.path == "xla" and c.devices == 1:
                ref[key] = first
            if key in ref:
                row["rel_err"] = float(np.linalg.norm(first - ref[key]) / np.linalg.norm(ref[key]))
            row["finite"] = bool(np.isfinite(first).all())
            loop = c.run.lower(c.iters, *c.args).compile() if args.unroll else exe
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                jax.block_until_ready(call(loop, c.iters))
                times.append((time.perf_counter() - t0) / c.iters * 1e3)
            row["ms"] = float(np.median(times[1:] if len(times) > 1 else times))
            row["x_ideal"] = row["ms"] / row["ideal_ms"]
            row["GB_per_s"] = c.ideal_bytes / row["ms"] / 1e6
            if f"{c.shape}:{c.tokens}:{c.path}:{c.devices}" in args.profile.split(","):
                from benchmarks.profiling import device_busy

                prof = device_busy(lambda: jax.block_until_ready(call(loop, c.iters)), 1, sync=lambda: None)
                row["busy_ms"] = prof.busy_ms / c.iters if prof.busy_ms else None
                row["top_kernels_us"] = [(name[:60], us / c.iters) for name, us, _ in prof.top[:8]]
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        log.info("%s", row)
    shared = shared_cases(args) if time.perf_counter() - start < args.budget_s else []
    cols = ["shape", "devices", "tokens", "path", "ms", "ideal_ms", "x_ideal", "GB_per_s", "rel_err", "compile_s"]
    print(table(rows, cols))
    for r in rows:
        if "top_kernels_us" in r:
            print("PROFILE", r["shape"], r["devices"], r["tokens"], r["path"], "busy_ms", r["busy_ms"],
                  [(n, round(us, 1)) for n, us in r["top_kernels_us"]])
        if "error" in r:
            print("ERROR", r["shape"], r["devices"], r["tokens"], r["path"], r["error"])
    if shared:
        print(table(shared, ["shape", "tokens", "shared_ms", "shared_MB"]))
    write_results("moe", {"args": vars(args), "read_GB_per_s": bw / 1e9, "rows": rows, "shared": shared,
                          "wall_s": time.perf_counter() - start})


if __name__ == "__main__":
    main()

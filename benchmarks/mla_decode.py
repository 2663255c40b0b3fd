"""Paged MLA decode on the FlashMLA grid: the Pallas kernel next to the XLA reference path.

For each (heads, batch, context) it times both paths (bf16, page 64, every request at full
context) and reports time, GB/s and TFLOP/s by FlashMLA's formulas (DESIGN.md section 6):
  FLOPs = 2 * sum(s_k) * h_q * (576 + 512)
  bytes = 2 * (sum(s_k) * 576 + b * h_q * 576 + b * h_q * 512)
together with the machine's copy bandwidth and bf16 matmul rate measured in the same run, and
the relative error of the kernel against the XLA path. Timing: compile first (in parallel
threads), warm up, then the median over repetitions of a program of `--unroll` back-to-back
calls (so host dispatch does not pad small problems), rotating over copies of the KV pool
(>= 256 MB in all) so small problems are not timed out of L2.

  python3 benchmarks/mla_decode.py                       # the full grid, JSON + table + plot
  python3 benchmarks/mla_decode.py --sweep --heads 128 --candidates 'bh=32|64;splits=1|2|4'
      # time candidate kernel configs per shape; then
      # python -m pallas_kernels.tune_mla_decode <sweep json...> rewrites the tuned table
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import logging
import math
import os
import pathlib
import statistics
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from pallas_kernels.mla_decode import paged_mla_decode  # noqa: E402
from pallas_kernels.mla_decode_config import DecodeConfig, pick_config  # noqa: E402
from pallas_kernels.mla_decode_mgpu import CONFIG as MGPU_CONFIG, paged_mla_decode_mgpu  # noqa: E402
from splash_jax.attention.paged_reference import paged_mla_attention  # noqa: E402

log = logging.getLogger("mla_decode_bench")
L, R = 512, 64
ROTATE_BYTES = 256 << 20  # KV pool copies cycled per timing loop: several times the 60 MB L2
TARGET_REP_S = 0.02


def flashmla_flops_bytes(batch: int, context: int, heads: int) -> tuple[float, float]:
    sk = batch * context
    flops = 2.0 * sk * heads * (576 + 512)
    nbytes = 2.0 * (sk * 576 + batch * heads * 576 + batch * heads * 512)
    return flops, nbytes


@dataclasses.dataclass(frozen=True)
class Shape:
    heads: int
    batch: int
    context: int
    page: int = 64

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page)

    @property
    def kv_bytes(self) -> int:
        return self.batch * self.pages_per_seq * self.page * (L + R) * 2


def _median_time(fn, arg_sets, max_reps=5) -> float:
    """Median seconds per call over back-to-back calls rotating through `arg_sets`."""
    jax.block_until_ready(fn(*arg_sets[0]))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[-1]))
    single = time.perf_counter() - t0
    iters = int(min(200, max(len(arg_sets), 2, TARGET_REP_S / max(single, 1e-6))))
    reps = max_reps if single < 0.05 else 3
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(iters):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def measure_ceilings(copy_mib: int = 2048, n: int = 8192) -> dict:
    """Device copy bandwidth (bytes read + written; best of a bf16 and a uint32 elementwise
    pass), read-only bandwidth (a sum), and the bf16 matmul rate, all on random data."""
    key = jax.random.key(0)
    x = jax.random.normal(key, (copy_mib << 19,), jnp.bfloat16)
    t_bf16 = _median_time(jax.jit(lambda a: a * 2), [(x,)])
    t_read = _median_time(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), [(x,)])
    u = jax.lax.bitcast_convert_type(x.reshape(-1, 2), jnp.uint32)
    t_u32 = _median_time(jax.jit(lambda a: a ^ jnp.uint32(1)), [(u,)])
    copy_gbs = 2 * x.nbytes / min(t_bf16, t_u32) / 1e9
    read_gbs = x.nbytes / t_read / 1e9
    del x, u
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    t = _median_time(mm, [(a, b)])
    return {"copy_GBps": copy_gbs, "read_GBps": read_gbs, "matmul_bf16_TFLOPs": 2 * n**3 / t / 1e12}


def layout(shape: Shape, unroll: int) -> tuple[int, int]:
    """(pool copies per call, host-side groups): >= ROTATE_BYTES of distinct KV cycled per loop."""
    copies = max(1, min(64, math.ceil(ROTATE_BYTES / shape.kv_bytes)))
    per_call = min(copies, unroll)
    return per_call, -(-copies // per_call)


def make_inputs(shape: Shape, seed: int, unroll: int):
    """Argument groups for the unrolled program: `unroll` distinct queries (so no two calls in
    one program are identical and XLA cannot merge them), pool copies per call, and one page
    table (a random permutation of the pool's pages) with every request at full context."""
    rng = np.random.default_rng(seed)
    B, H, M, S = shape.batch, shape.heads, shape.pages_per_seq, shape.page
    P = B * M
    per_call, groups = layout(shape, unroll)
    table = jnp.asarray(rng.permutation(P).reshape(B, M).astype(np.int32))
    lens = jnp.full((B,), shape.context, jnp.int32)
    key = jax.random.key(seed)
    normal = lambda shp: jax.random.normal(jax.random.fold_in(key, next(counter)), shp, jnp.bfloat16)  # noqa: E731
    counter = iter(range(1 << 30))
    q_lat = tuple(normal((B, H, L)) for _ in range(unroll))
    q_rope = tuple(normal((B, H, R)) for _ in range(unroll))
    sets = []
    for _ in range(groups):
        lat = tuple(normal((P, S, L)) for _ in range(per_call))
        rope = tuple(normal((P, S, R)) for _ in range(per_call))
        sets.append((q_lat, q_rope, lat, rope, table, lens))
    return sets


def build(shape: Shape, impl: str, cfg: DecodeConfig | None = None, unroll: int = 8):
    """One program running `unroll` independent calls back to back (one launch per call inside
    XLA's executable, as in a model step), so host dispatch does not pad small problems."""
    scale = 1.0 / math.sqrt(L + R)
    if impl == "xla":
        one = lambda *a: paged_mla_attention(*a, scale)  # noqa: E731
    elif impl == "mgpu":
        one = lambda *a: paged_mla_decode_mgpu(*a, scale, config=cfg)  # noqa: E731
    else:
        one = lambda *a: paged_mla_decode(*a, scale, config=cfg)  # noqa: E731

    def many(q_lat, q_rope, lat, rope, table, lens):
        n = len(lat)
        return [one(q_lat[i], q_rope[i], lat[i % n], rope[i % n], table, lens) for i in range(len(q_lat))]

    B, H, M, S = shape.batch, shape.heads, shape.pages_per_seq, shape.page
    per_call, _ = layout(shape, unroll)
    sds = jax.ShapeDtypeStruct
    args = ((sds((B, H, L), jnp.bfloat16),) * unroll, (sds((B, H, R), jnp.bfloat16),) * unroll,
            (sds((B * M, S, L), jnp.bfloat16),) * per_call, (sds((B * M, S, R), jnp.bfloat16),) * per_call,
            sds((B, M), jnp.int32), sds((B,), jnp.int32))
    return jax.jit(many).lower(*args).compile()  # errors (e.g. shared memory) surface here


def compile_all(jobs: dict, workers: int) -> dict:
    """Compile every (key -> (shape, impl, cfg)) job in parallel threads; failures map to Exception."""
    out = {}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futs = {pool.submit(build, *job): key for key, job in jobs.items()}
        for f in concurrent.futures.as_completed(futs):
            key = futs[f]
            try:
                out[key] = f.result()
            except Exception as e:  # a config the compiler rejects (e.g. shared memory) is skipped
                out[key] = e
                log.warning("compile failed %s: %s", key, str(e).splitlines()[0][:300] if str(e) else repr(e))
    return out


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


_KEYS = {"bh": "block_h", "bk": "block_k", "w": "num_warps", "st": "num_stages", "splits": "num_splits",
         "cta": "ctas_per_sm", "mps": "min_pages_per_split", "ms": "max_splits", "comb": "combine", "ablate": "ablate"}


def parse_candidates(spec: str) -> list[DecodeConfig]:
    """'bh=16;bk=32|64;st=2|3 + bh=32;w=8' -> the cartesian product of each '+'-separated group."""
    out = []
    for group in filter(None, (g.strip() for g in spec.split("+"))):
        combos = [{}]
        for item in filter(None, (i.strip() for i in group.split(";"))):
            key, vals = item.split("=")
            conv = str if key in ("comb", "ablate") else int
            combos = [{**c, _KEYS[key]: conv(v)} for c in combos for v in vals.split("|")]
        out += [DecodeConfig(**c) for c in combos]
    return out


def sweep_candidates(heads: int) -> list[DecodeConfig]:
    if heads <= 32:
        return parse_candidates(f"bh={min(heads, 16)}|{heads};bk=32|64|128;w=4|8;st=2|3")
    return parse_candidates("bh=32|64;bk=32|64;w=4|8;st=2|3")


def run_grid(shapes, impls, workers, seed, sweep=False, candidates="", compile_only=False, unroll=8,
             sweep_impl="pallas") -> list[dict]:
    jobs = {}
    for s in shapes:
        if sweep:
            cands = parse_candidates(candidates) if candidates else sweep_candidates(s.heads)
            for i, cfg in enumerate(dict.fromkeys(cands)):
                if cfg.num_splits <= s.pages_per_seq:  # more splits than pages would repeat a config
                    jobs[(s, f"cfg{i}")] = (s, sweep_impl, cfg, unroll)
        for impl in impls:
            jobs[(s, impl)] = (s, impl, None, unroll)
    t0 = time.perf_counter()
    log.info("compiling %d programs on %d threads", len(jobs), workers)
    built = compile_all(jobs, workers)
    log.info("compiled in %.1f s", time.perf_counter() - t0)
    if compile_only:
        return []

    rows = []
    for s in shapes:
        sets = make_inputs(s, seed, unroll)
        flops, nbytes = flashmla_flops_bytes(s.batch, s.context, s.heads)
        ref = None
        if not isinstance(built.get((s, "xla")), (Exception, type(None))):
            ref = built[(s, "xla")](*sets[0])[0]
        keys = [k for k in built if k[0] == s]
        for key in keys:
            fn = built[key]
            if isinstance(fn, Exception):
                continue
            t = _median_time(fn, sets) / unroll
            row = {"heads": s.heads, "batch": s.batch, "context": s.context, "impl": key[1],
                   "time_us": t * 1e6, "GBps": nbytes / t / 1e9, "TFLOPs": flops / t / 1e12}
            if key[1] != "xla":
                cfg = jobs[key][2] or (MGPU_CONFIG if key[1] == "mgpu" else pick_config(s.heads, s.batch, s.pages_per_seq * s.page))
                row["config"] = dataclasses.asdict(cfg)
                if ref is not None:
                    got = fn(*sets[0])[0]
                    row["rel_err_vs_xla"] = rel_err(got[0], ref[0])
                    row["lse_max_abs_err_vs_xla"] = float(np.max(np.abs(np.asarray(got[1]) - np.asarray(ref[1]))))
            rows.append(row)
            log.info("%s", row)
        del sets, ref
    return rows


def table(rows, ceilings) -> str:
    by = {}
    for r in rows:
        by.setdefault((r["heads"], r["batch"], r["context"]), {})[r["impl"]] = r
    lines = [f"copy bandwidth {ceilings['copy_GBps']:.0f} GB/s (read-only {ceilings.get('read_GBps', 0):.0f}), "
             f"bf16 matmul {ceilings['matmul_bf16_TFLOPs']:.0f} TFLOP/s",
             f"{'H':>4} {'B':>4} {'ctx':>6} | {'pallas us':>10} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} | "
             f"{'xla us':>10} {'GB/s':>7} {'TFLOP/s':>8} | {'speedup':>7} {'relerr':>8}"]
    for (h, b, c), d in sorted(by.items()):
        p, x = d.get("pallas"), d.get("xla")
        ps = (f"{p['time_us']:10.1f} {p['GBps']:7.0f} {100 * p['GBps'] / ceilings['copy_GBps']:6.1f} "
              f"{p['TFLOPs']:8.1f}" if p else f"{'-':>10} {'-':>7} {'-':>6} {'-':>8}")
        xs = f"{x['time_us']:10.1f} {x['GBps']:7.0f} {x['TFLOPs']:8.1f}" if x else f"{'-':>10} {'-':>7} {'-':>8}"
        sp = f"{x['time_us'] / p['time_us']:7.2f}" if p and x else f"{'-':>7}"
        er = f"{p.get('rel_err_vs_xla', float('nan')):8.1e}" if p else f"{'-':>8}"
        lines.append(f"{h:4d} {b:4d} {c:6d} | {ps} | {xs} | {sp} {er}")
    return "\n".join(lines)


def sweep_table(rows) -> str:
    by = {}
    for r in rows:
        by.setdefault((r["heads"], r["batch"], r["context"]), []).append(r)
    lines = []
    for key, rs in sorted(by.items()):
        rs.sort(key=lambda r: r["time_us"])
        lines.append(f"H={key[0]} B={key[1]} ctx={key[2]}")
        for r in rs[:6]:
            c = r.get("config") or {}
            lines.append(f"   {r['impl']:>7} {r['time_us']:9.1f} us {r['GBps']:6.0f} GB/s {r['TFLOPs']:6.1f} TF "
                         f"bh={c.get('block_h')} bk={c.get('block_k')} w={c.get('num_warps')} "
                         f"st={c.get('num_stages')} splits={c.get('num_splits')} cta={c.get('ctas_per_sm')}")
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib missing; no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for impl, style in (("pallas", "-o"), ("xla", "--x")):
        rs = sorted((r for r in rows if r["impl"] == impl), key=lambda r: (r["heads"], r["context"], r["batch"]))
        labels = [f"h{r['heads']} c{r['context'] // 1024}k b{r['batch']}" for r in rs]
        axes[0].plot(range(len(rs)), [r["GBps"] for r in rs], style, label=impl, ms=3)
        axes[1].plot(range(len(rs)), [r["TFLOPs"] for r in rs], style, label=impl, ms=3)
    for ax, name in zip(axes, ("GB/s", "TFLOP/s")):
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=5)
        ax.set_ylabel(name)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--batches", type=ints, default=[1, 8, 32, 64, 128])
    ap.add_argument("--contexts", type=ints, default=[1024, 4096, 16384])
    ap.add_argument("--heads", type=ints, default=[16, 32, 64, 128])
    ap.add_argument("--shapes", default="", help="explicit HxBxCTX list, e.g. 16x64x4096,128x1x16384 (overrides the grid)")
    ap.add_argument("--impls", default="pallas,xla")
    ap.add_argument("--sweep", action="store_true", help="time every candidate kernel config too")
    ap.add_argument("--candidates", default="", help="sweep configs, e.g. 'bh=16;bk=32|64;st=2|3 + bh=32'")
    ap.add_argument("--sweep-impl", default="pallas", choices=("pallas", "mgpu"),
                    help="the kernel the sweep's configs drive (mgpu: only the split fields apply)")
    ap.add_argument("--skip-ceilings", action="store_true")
    ap.add_argument("--unroll", type=int, default=8, help="calls per timed program (amortises dispatch)")
    ap.add_argument("--compile-only", action="store_true", help="compile (e.g. with XLA_FLAGS dumps) and stop")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--machine", default=None)
    ap.add_argument("--out-dir", default=str(pathlib.Path(__file__).parent / "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--copy-mib", type=int, default=2048, help="buffer size for the copy-bandwidth ceiling")
    ap.add_argument("--matmul-n", type=int, default=8192, help="square bf16 matmul size for the rate ceiling")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    dev = jax.devices()[0]
    machine = args.machine or dev.device_kind.replace("NVIDIA ", "").replace(" ", "_").lower()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat()
    ceilings = measure_ceilings(args.copy_mib, args.matmul_n) if not args.skip_ceilings else {
        "copy_GBps": float("nan"), "matmul_bf16_TFLOPs": float("nan")}
    log.info("ceilings %s", ceilings)
    if args.shapes:
        shapes = [Shape(*map(int, t.split("x"))) for t in args.shapes.split(",")]
    else:
        shapes = [Shape(h, b, c) for h in args.heads for c in args.contexts for b in args.batches]
    impls = [i for i in args.impls.split(",") if i]
    rows = run_grid(shapes, impls, args.workers, args.seed, sweep=args.sweep, candidates=args.candidates,
                    compile_only=args.compile_only, unroll=args.unroll, sweep_impl=args.sweep_impl)

    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"mla_decode_{machine}{args.tag}"
    result = {
        "machine": machine, "device_kind": dev.device_kind, "jax": jax.__version__,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "started": started, "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "seed": args.seed, "ceilings": ceilings, "rows": rows,
        "timing": f"median over repetitions of a program of {args.unroll} back-to-back calls, per call; "
                  f"KV pool copies rotated so >= {ROTATE_BYTES >> 20} MiB of distinct KV per loop",
    }
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    if not args.sweep:
        plot(rows, out_dir / f"{stem}.png")
    print(sweep_table(rows) if args.sweep else table(rows, ceilings))
    return result


if __name__ == "__main__":
    main()

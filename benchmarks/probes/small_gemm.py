"""Decode-sized projections (8 token rows) read from scanned weight stacks: cuBLAS (what XLA runs
now, dynamic-slice fusion) against a Pallas Triton kernel that reads its layer's weight straight
from the stack, one GPU.

At batch-1 decode the V2-Lite step spends ~1.2 ms in ~160 cuBLAS GEMMs of 8 rows that move
~1.7 GB of weights (~1.9 TB/s, half of HBM). Each case runs the projection of every layer of a
27-layer stack inside one lax.scan (as the engine does) and reports GPU busy per layer from a
profiler trace, the weight read rate, and the max difference to cuBLAS's result.

  PYTHONPATH=. python benchmarks/probes/small_gemm.py [--rows 8] [--layers 26]
"""
import argparse
import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from benchmarks.common import table, write_results
from benchmarks.profiling import device_busy
from pallas_kernels import _compat
from splash_jax.engine.executor import SCANNED_GPU_OPTIONS

log = logging.getLogger("small_gemm")
# (name, K, N): V2-Lite's projections at 8 rows (o_proj as its [H*Dv, D] matrix).
SHAPES = [("q_proj", 2048, 3072), ("kv_a", 2048, 576), ("o_proj", 2048, 2048), ("shared_gate", 2048, 2816),
          ("shared_down", 2816, 2048), ("dense_gate", 2048, 10944)]


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, block_k, k_dim, splits):
    j, s = pl.program_id(0), pl.program_id(1)
    bn = o_ref.shape[-1]
    layer = layer_ref[0]
    cols = pl.ds(pl.multiple_of(j * bn, bn), bn)
    steps = k_dim // block_k // splits

    def body(i, acc):
        ks = pl.ds(pl.multiple_of((s * steps + i) * block_k, block_k), block_k)
        return acc + jnp.dot(x_ref[:, ks], w_ref[layer, ks, cols], preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def stacked_matmul(x, w, layer, *, block_n=32, block_k=256, splits=1, warps=4, stages=4):
    """x [M, K] @ w[layer] ([L, K, N] stack, read in place) -> [M, N] float32 (summed over splits)."""
    m, k = x.shape
    n = w.shape[-1]
    mp = max(16, -(-m // 16) * 16)
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    full = lambda a: pl.BlockSpec(a.shape, lambda j, s: (0,) * a.ndim)  # noqa: E731
    layer = jnp.reshape(layer, (1,)).astype(jnp.int32)
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, k_dim=k, splits=splits),
        grid=(n // block_n, splits),
        in_specs=[full(layer), full(xp), full(w)],
        out_specs=pl.BlockSpec((None, mp, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, mp, n), jnp.float32),
        compiler_params=_compat.triton_params(warps, stages),
        name=f"small_gemm_n{block_n}_k{block_k}_s{splits}",
    )(layer, xp, w)
    return out.sum(0)[:m]


def scan_program(impl, cfg):
    def run(x, w):
        def body(carry, layer):
            if impl == "cublas":
                y = (x @ lax.dynamic_index_in_dim(w, layer, keepdims=False)).astype(jnp.float32)
            else:
                y = stacked_matmul(x, w, layer, **cfg)
            return carry + y, None

        out, _ = lax.scan(body, jnp.zeros((x.shape[0], w.shape[-1]), jnp.float32), jnp.arange(w.shape[0]))
        return out

    return run, (SCANNED_GPU_OPTIONS if jax.default_backend() == "gpu" else {})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--configs", default="n16_k256_s1,n32_k256_s1,n64_k256_s1,n64_k256_s2,n64_k256_s4,n32_k512_s1")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    configs = {}
    for c in args.configs.split(","):
        n, k, s = c.split("_")
        configs[c] = dict(block_n=int(n[1:]), block_k=int(k[1:]), splits=int(s[1:]))
    rows = []
    key = jax.random.key(0)
    for name, k_dim, n_dim in SHAPES:
        w = jax.random.normal(key, (args.layers, k_dim, n_dim), jnp.bfloat16) * 0.02
        x = jax.random.normal(jax.random.fold_in(key, 1), (args.rows, k_dim), jnp.bfloat16)
        nbytes = k_dim * n_dim * 2
        ref = None
        for impl, cfg in [("cublas", None), *configs.items()]:
            if impl != "cublas" and (n_dim % cfg["block_n"] or k_dim % (cfg["block_k"] * cfg["splits"])):
                continue
            try:
                run, opts = scan_program("cublas" if impl == "cublas" else "pallas", cfg)
                fn = jax.jit(run).lower(x, w).compile(opts)
                out = jax.block_until_ready(fn(x, w))
                ref = out if ref is None else ref
                err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
                prof = device_busy(lambda: jax.block_until_ready(fn(x, w)), args.calls, top=3)
                us = prof.busy_ms * 1e3 / args.layers if prof.busy_ms else None
            except Exception as ex:  # noqa: BLE001 - a probe reports each failure and goes on
                log.warning("%s %s failed: %s", name, impl, (str(ex).splitlines() or [""])[0][:300])
                us, err, prof = None, None, None
            rows.append({"shape": name, "K": k_dim, "N": n_dim, "impl": impl, "us_per_layer": us,
                         "TB_s": nbytes / us / 1e6 if us else None, "rel_diff": err,
                         "top": prof.top if prof else []})
            log.info("%s", {k2: v for k2, v in rows[-1].items() if k2 != "top"})
    print(table(rows, ["shape", "K", "N", "impl", "us_per_layer", "TB_s", "rel_diff"]))
    write_results("small_gemm", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

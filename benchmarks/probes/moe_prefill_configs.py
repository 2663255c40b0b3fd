"""The routed-expert kernel at prefill sizes (thousands of tokens per step): block configs of
`pallas_kernels/moe_grouped.py` against each other and jax's Mosaic GPU `ragged_dot_mgpu`, one GPU.

At 4-16K tokens the MoE is compute-bound (V2-Lite: ~768 pairs per expert at 8K tokens), and the
decode-tuned config (block_m 64) ran at ~300 TFLOP/s inside the engine's prefill. "default" is
what `pick_config` picks now (block_m 128 from 128 pairs per expert on), "decode_m64" what it
picked for every size before. Each case: one
layer, bf16, uniform random top-k routing, GPU busy per call from a profiler trace; TFLOP/s counts
2 x pairs x 3 x D x I.

  PYTHONPATH=. python benchmarks/probes/moe_prefill_configs.py [--tokens 2048,8192] [--shapes v2lite,v3]
  # decode sizes, extra configs as block_m,gu_block_i,gu_block_d,dn_block_d,dn_block_i,warps,stages:
  PYTHONPATH=. python benchmarks/probes/moe_prefill_configs.py --tokens 1,8 --shapes v3 --configs default \
      --extra '16,128,128,64,128,4,3;16,64,256,128,128,4,4'
"""
import argparse
import logging

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import table, write_results
from benchmarks.profiling import device_busy
from pallas_kernels.moe_grouped import Config, pick_config, routed_experts

log = logging.getLogger("moe_prefill_configs")
SHAPES = {"v2lite": (64, 2048, 1408, 6), "v3": (256, 7168, 2048, 8)}  # experts, D, I, top-k
# (block_m, gu_block_i, gu_block_d, dn_block_d, dn_block_i, num_warps, num_stages)
CONFIGS = {
    "m128_i128_d64_w8_s3": Config(128, 128, 64, 128, 64, 8, 3),
    "m128_i128_d64_w8_s4": Config(128, 128, 64, 128, 64, 8, 4),
    "m128_i256_d64_w8_s3": Config(128, 256, 64, 256, 64, 8, 3),
    "decode_m64": Config(64, 64, 128, 64, 128, 8, 3),  # what pick_config chose for every size before
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--shapes", default="v2lite,v3")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--configs", default="", help="comma list of CONFIGS names (+ default, mgpu); empty: all")
    parser.add_argument("--extra", default="", help="more configs, ';'-separated Config field tuples (see the doc)")
    args = parser.parse_args()
    extra = {f"x{c.replace(',', '_')}": Config(*map(int, c.split(","))) for c in args.extra.split(";") if c}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rows = []
    for shape in args.shapes.split(","):
        e, d, i, k = SHAPES[shape]
        keys = jax.random.split(jax.random.key(0), 4)
        gate, up, down = (jax.random.normal(kk, (e, i, d), jnp.bfloat16) * 0.02 for kk in keys[:3])
        for t in (int(x) for x in args.tokens.split(",")):
            x = jax.random.normal(keys[3], (t, d), jnp.bfloat16)
            ids = jnp.asarray(np.argsort(np.random.default_rng(t).random((t, e)), axis=1)[:, :k], jnp.int32)
            w = jnp.full((t, k), 1.0 / k, jnp.float32)
            flops = 2.0 * t * k * 3 * d * i
            ref = None
            cases = {"default": None, **CONFIGS, "mgpu": "mgpu"}
            if args.configs:
                cases = {n: c for n, c in cases.items() if n in args.configs.split(",")}
            cases.update(extra)
            for name, cfg in cases.items():
                try:
                    if cfg == "mgpu":
                        from splash_jax.moe import mgpu_routed
                        fn = jax.jit(mgpu_routed)
                    else:
                        fn = jax.jit(lambda *a, cfg=cfg: routed_experts(*a, config=cfg))
                    call = lambda: fn(x, ids, w, gate, up, down)  # weights as arguments, not constants
                    out = jax.block_until_ready(call())
                    ref = out if ref is None else ref
                    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
                    prof = device_busy(lambda: jax.block_until_ready(call()), args.calls, top=3)
                    ms = prof.busy_ms
                except Exception as ex:  # noqa: BLE001 - a probe reports each failure and goes on
                    log.warning("%s %d %s failed: %s", shape, t, name, (str(ex).splitlines() or [""])[0][:200])
                    ms, err, prof = None, None, None
                used = pick_config(t * k, e, d, i) if cfg is None else cfg
                rows.append({"shape": shape, "tokens": t, "config": name, "ms": ms,
                             "tflop_s": flops / ms / 1e9 if ms else None, "max_diff": err,
                             "cfg": list(used) if isinstance(used, tuple) else used,
                             "top": prof.top if prof else []})
                log.info("%s", {k2: v for k2, v in rows[-1].items() if k2 != "top"})
    print(table(rows, ["shape", "tokens", "config", "ms", "tflop_s", "max_diff"]))
    write_results("moe_prefill_configs", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

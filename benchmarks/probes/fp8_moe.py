"""FP8 vs bf16 routed experts in the Pallas MoE kernel, V3 width (256 experts), one GPU.

Random e4m3 values and block scales; the bf16 run uses the same weights dequantized. Prints the
largest difference between the two kernels (bf16 rounding of the dequantized weights: ~1e-2) and
wall time per call of each (the FP8 kernel reads half the bytes; decode-sized MoE is read-bound).
Not yet run on a GPU (the session's device time ran out): run it before making FP8 experts the
GPU default.  PYTHONPATH=. python benchmarks/probes/fp8_moe.py   (FP8_SHAPE=E,I,D,K,B to resize)
"""
import time, jax, jax.numpy as jnp, numpy as np
from pallas_kernels.moe_grouped import routed_experts
import os
E, I, D, K, B = map(int, os.environ.get("FP8_SHAPE", "256,2048,7168,8,128").split(","))
INTERP = jax.default_backend() != "gpu"
key = jax.random.key(0)
def fp8_values(k):
    bits = jax.random.bits(k, (E, I, D), jnp.uint8) & jnp.uint8(0x77)  # no NaN codes, |v| <= 240
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)
ks = jax.random.split(key, 7)
vals = [jax.jit(fp8_values)(k) for k in ks[:3]]
scales = [jax.random.uniform(k, (E, I // B, D // B), jnp.float32, 1e-4, 2e-4) for k in ks[3:6]]
@jax.jit
def deq(v, s):
    return (v.astype(jnp.float32).reshape(E, I // B, B, D // B, B) * s[:, :, None, :, None]).reshape(E, I, D).astype(jnp.bfloat16)
bf = [deq(v, s) for v, s in zip(vals, scales)]
print("bytes per expert stack: bf16 %.1f GB, fp8 %.1f GB" % (bf[0].nbytes / 1e9, vals[0].nbytes / 1e9), flush=True)
f_bf = jax.jit(lambda x, ids, w: routed_experts(x, ids, w, *bf, interpret=INTERP))
f_8 = jax.jit(lambda x, ids, w: routed_experts(x, ids, w, *vals, None, tuple(scales), scale_block=B, interpret=INTERP))
for t in (1, 64):
    x = jax.random.normal(ks[6], (t, D), jnp.bfloat16)
    ids = jax.random.randint(jax.random.fold_in(key, t), (t, K), 0, E)
    w = jnp.full((t, K), 0.125, jnp.float32)
    a, b = f_bf(x, ids, w), f_8(x, ids, w)
    err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(a.astype(jnp.float32))))
    res = {}
    for name, f in (("bf16", f_bf), ("fp8", f_8)):
        for _ in range(3): f(x, ids, w).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(30): out = f(x, ids, w)
        out.block_until_ready(); res[name] = (time.perf_counter() - t0) / 30 * 1e3
    print(f"tokens {t}: max rel diff fp8 vs bf16 kernel {err:.2e}; wall ms/call bf16 {res['bf16']:.3f} fp8 {res['fp8']:.3f} ratio {res['fp8']/res['bf16']:.2f}", flush=True)

"""Prefill attention in the MHA form (the latent expanded per head, as vLLM and SGLang run MLA
prefill) against the absorbed form the engine runs today, one GPU.

A chunk of C query tokens after S context tokens, H heads (V2-Lite: 16), q/k head dim 192
(128 nope + 64 rope), v head dim 128, bf16. The MHA form does 2*C*S*H*(192+128) FLOPs; the absorbed
form 2*C*S*H*(576+512), 3.4x more. Candidates, each timed from a profiler trace (GPU busy per call):
  cudnn      jax's cuDNN fused attention (different q/v head dims need cuDNN >= 9.10, Hopper),
             with the log-sum-exp (to merge the prefix part with the causal chunk part)
  cudnn_pub  jax.nn.dot_product_attention(implementation="cudnn") (no log-sum-exp)
  mgpu       jax's Mosaic GPU flash attention (attention_mgpu), v padded to 192
  absorbed   the engine's Pallas decode kernel, one program per query token (today's prefill)
  expand     the per-layer cost of expanding S latents to per-head K and V (two GEMMs)
Outputs are checked against a float32 XLA reference at a small size first.

  PYTHONPATH=. python benchmarks/probes/mha_prefill.py [--chunk 8192] [--contexts 8192,32768,65536]
"""
import argparse
import logging
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import table, write_results
from benchmarks.profiling import device_busy

log = logging.getLogger("mha_prefill")
parser = argparse.ArgumentParser()
parser.add_argument("--chunk", type=int, default=8192)
parser.add_argument("--contexts", default="8192,32768,65536")
parser.add_argument("--heads", type=int, default=16)
parser.add_argument("--calls", type=int, default=5)
args = parser.parse_args()
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
H, DQK, DV, L, R, PAGE = args.heads, 192, 128, 512, 64, 64
SCALE = DQK ** -0.5


def first_line(e: Exception) -> str:
    return ((str(e).splitlines() or [""])[0] or type(e).__name__)[:300]


def cudnn_attention(q, k, v, q_len, kv_len, causal):
    from jax._src.cudnn import fused_attention_stablehlo as fa
    mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    out, lse = fa.dot_product_attention(
        q, k, v, q_seqlen=q_len, kv_seqlen=kv_len, scale=SCALE, mask_type=mask,
        qkv_layout="BTNH", return_residual=True,
    )
    return out, lse


def cudnn_public(q, k, v, causal):
    """The public API wants one head dim: v padded to 192 (no log-sum-exp either)."""
    vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, DQK - DV)))
    return jax.nn.dot_product_attention(q, k, vp, scale=SCALE, is_causal=causal, implementation="cudnn")[..., :DV]


def mgpu_attention(q, k, v, causal, block_kv=128):
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am
    vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, DQK - DV)))
    cfg = am.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=causal)
    out, (lse,) = am.attention(q * SCALE, k, vp, cfg, save_residuals=True)  # scale folded into q
    return out[..., :DV], lse


def reference(q, k, v, causal):
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * SCALE
    if causal:
        c, n = s.shape[-2:]
        s = jnp.where(jnp.arange(n)[None, :] <= jnp.arange(c)[:, None] + (n - c), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))


def make(c, s, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k[0], (1, c, H, DQK), jnp.bfloat16)
    kk = jax.random.normal(k[1], (1, s, H, DQK), jnp.bfloat16)
    v = jax.random.normal(k[2], (1, s, H, DV), jnp.bfloat16)
    return q, kk, v


def run(name, fn, *xs):
    try:
        f = jax.jit(fn)
        out = f(*xs)
        jax.block_until_ready(out)
        prof = device_busy(lambda: jax.block_until_ready(f(*xs)), args.calls, top=3)
        return prof.busy_ms, prof.top, out
    except Exception as e:  # noqa: BLE001 - a probe reports every failure and goes on
        log.warning("%s failed: %s", name, first_line(e))
        traceback.print_exc(limit=2)
        return None, [], None


def main():
    rows, checks = [], []
    # Correctness at a small size, against the float32 reference.
    q, k, v = make(256, 512, seed=1)
    i32 = lambda x: jnp.asarray([x], jnp.int32)
    for name, fn, causal in [
        ("cudnn", lambda q, k, v: cudnn_attention(q, k, v, i32(256), i32(512), False)[0], False),
        ("cudnn_causal", lambda q, k, v: cudnn_attention(q, k[:, :256], v[:, :256], i32(256), i32(256), True)[0], True),
        ("cudnn_pub", lambda q, k, v: cudnn_public(q, k, v, False), False),
        ("mgpu", lambda q, k, v: mgpu_attention(q, k, v, False)[0], False),
    ]:
        try:
            got = jax.jit(fn)(q, k, v)
            kk, vv = (k[:, :256], v[:, :256]) if name == "cudnn_causal" else (k, v)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - reference(q, kk, vv, causal))))
        except Exception as e:  # noqa: BLE001
            err = "failed: " + first_line(e)
        checks.append({"impl": name, "max_abs_err": err})
        log.info("check %s: %s", name, err)

    c = args.chunk
    for s in (int(x) for x in args.contexts.split(",")):
        q, k, v = make(c, s)
        mha_flops = 2.0 * c * s * H * (DQK + DV)
        cands = [
            ("cudnn", lambda q, k, v: cudnn_attention(q, k, v, i32(c), i32(s), False), mha_flops),
            ("cudnn_pub", lambda q, k, v: cudnn_public(q, k, v, False), mha_flops),
            ("mgpu", lambda q, k, v: mgpu_attention(q, k, v, False), mha_flops),
        ]
        for name, fn, flops in cands:
            ms, top, _ = run(name, fn, q, k, v)
            rows.append({"impl": name, "chunk": c, "context": s, "ms": ms,
                         "tflop_s": flops / ms / 1e9 if ms else None, "top": top})
        if s == c:  # the chunk's own causal part
            ms, top, _ = run("cudnn_causal", lambda q, k, v: cudnn_attention(q, k, v, i32(c), i32(c), True), q, k, v)
            rows.append({"impl": "cudnn_causal", "chunk": c, "context": s, "ms": ms,
                         "tflop_s": mha_flops / 2 / ms / 1e9 if ms else None, "top": top})
        # Expanding S latents to per-head K (nope) and V: the MHA form's extra work per layer.
        lat = jax.random.normal(jax.random.key(3), (s, L), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(4), (L, H * (DQK - R + DV)), jnp.bfloat16)
        ms, top, _ = run("expand", lambda a, b: a @ b, lat, w)
        rows.append({"impl": "expand", "chunk": c, "context": s, "ms": ms,
                     "tflop_s": 2.0 * s * L * w.shape[1] / ms / 1e9 if ms else None, "top": top})
        # Today's path: the absorbed-form decode kernel, one program per query token.
        try:
            from pallas_kernels.mla_decode import paged_mla_decode
            pages = -(-s // PAGE)
            kk = jax.random.split(jax.random.key(5), 4)
            pool_l = jax.random.normal(kk[0], (pages, PAGE, L), jnp.bfloat16)
            pool_r = jax.random.normal(kk[1], (pages, PAGE, R), jnp.bfloat16)
            ql = jax.random.normal(kk[2], (c, H, L), jnp.bfloat16)
            qr = jax.random.normal(kk[3], (c, H, R), jnp.bfloat16)
            tbl = jnp.broadcast_to(jnp.arange(pages, dtype=jnp.int32), (c, pages))
            lens = jnp.full((c,), s, jnp.int32)
            ms, top, _ = run("absorbed", lambda *a: paged_mla_decode(*a, 0.07), ql, qr, pool_l, pool_r, tbl, lens)
        except Exception as e:  # noqa: BLE001
            log.warning("absorbed failed: %s", e)
            ms, top = None, []
        rows.append({"impl": "absorbed", "chunk": c, "context": s, "ms": ms,
                     "tflop_s": 2.0 * c * s * H * (L + R + L) / ms / 1e9 if ms else None, "top": top})
        log.info("context %d done", s)

    print(table(rows, ["impl", "chunk", "context", "ms", "tflop_s"]))
    print(table(checks, ["impl", "max_abs_err"]))
    write_results("mha_prefill", {"args": vars(args), "rows": rows, "checks": checks})


if __name__ == "__main__":
    main()

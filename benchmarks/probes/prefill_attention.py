"""Chunked-prefill attention: the decode kernel (a program per token) vs the grouped kernel (a
chunk's queries in blocks of block_q: each page read once per block), one GPU.

One request's chunk of C tokens after a cached prefix of N tokens, 16 heads (V2-Lite / V3 under
TP on 8), latent 512 + rope 64, page 64, bf16. Prints, per (N, C): time per call of each kernel
(wall, jitted, 20 calls), the KV bytes each must read (decode: every token reads its own prefix;
grouped: once per block), and the largest difference between their outputs.

  PYTHONPATH=. python benchmarks/probes/prefill_attention.py [--prefixes 4096,16384,65536] [--chunk 512]
Not yet run on a GPU.
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mla_decode import paged_mla_decode
from pallas_kernels.mla_grouped import paged_mla_grouped

parser = argparse.ArgumentParser()
parser.add_argument("--prefixes", default="4096,16384,65536")
parser.add_argument("--chunk", type=int, default=512)
parser.add_argument("--heads", type=int, default=16)
parser.add_argument("--block-q", type=int, default=4)
parser.add_argument("--page", type=int, default=64)
args = parser.parse_args()
interpret = jax.default_backend() != "gpu"
H, L, R, S, C = args.heads, 512, 64, args.page, args.chunk
for n in (int(x) for x in args.prefixes.split(",")):
    pages = -(-(n + C) // S)
    key = jax.random.split(jax.random.key(n), 4)
    lat = jax.random.normal(key[0], (pages, S, L), jnp.bfloat16)
    rope = jax.random.normal(key[1], (pages, S, R), jnp.bfloat16)
    ql = jax.random.normal(key[2], (C, H, L), jnp.bfloat16)
    qr = jax.random.normal(key[3], (C, H, R), jnp.bfloat16)
    table = jnp.broadcast_to(jnp.arange(pages, dtype=jnp.int32), (C, pages))
    lens = n + 1 + jnp.arange(C, dtype=jnp.int32)
    dec = jax.jit(lambda *a: paged_mla_decode(*a, 0.07, interpret=interpret))
    grp = jax.jit(lambda *a: paged_mla_grouped(*a, 0.07, block_q=args.block_q, interpret=interpret))
    operands = (ql, qr, lat, rope, table, lens)
    a, b = dec(*operands), grp(*operands)
    diff = float(jnp.max(jnp.abs(a[0].astype(jnp.float32) - b[0].astype(jnp.float32))))
    times = {}
    for name, fn in (("decode", dec), ("grouped", grp)):
        jax.block_until_ready(fn(*operands))
        t0 = time.perf_counter()
        for _ in range(20):
            out = fn(*operands)
        jax.block_until_ready(out)
        times[name] = (time.perf_counter() - t0) / 20 * 1e3
    row_bytes = (L + R) * 2
    dec_bytes = float(np.sum(np.asarray(lens))) * row_bytes
    grp_bytes = dec_bytes / args.block_q
    print(f"prefix {n:6d} chunk {C}: decode {times['decode']:8.2f} ms ({dec_bytes / 1e9:6.2f} GB KV), grouped "
          f"{times['grouped']:8.2f} ms (~{grp_bytes / 1e9:6.2f} GB), x{times['decode'] / times['grouped']:.2f}; "
          f"max |diff| {diff:.3g}", flush=True)

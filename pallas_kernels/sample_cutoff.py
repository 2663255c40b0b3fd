"""Top-k / top-p cut-offs per row without sorting the vocabulary: a threshold search whose passes
are one Pallas (Triton) kernel each.

The sampler's filter keeps, per row, the entries at or above a cut-off: the k-th largest value
(top-k) and the smallest value v whose higher entries hold less than top_p of the probability
(top-p). Sorting every row for that took 0.6-1.1 ms at 128 x 102K on an H200
(`benchmarks/probes/sampler.py`). A cut-off is the smallest key K of the row with S(K) < limit,
where S(K) sums a weight (1, or the probability) over the entries above K; S only falls as K
rises, so a search over the 2^32 float32 bit patterns finds it exactly, ties kept as a sort
keeps them. Each pass tests FANOUT candidate keys of each search: this kernel reads a chunk of a
row once and sums, for every candidate, the counts and the probabilities above it (XLA emitted
that as one reduction per candidate, re-reading the row FANOUT times: slower than the sort at
128 rows); XLA then adds the chunks' partial sums and narrows each interval FANOUT-fold, so 8
passes find both cut-offs. The probabilities are summed in another order than a sort's cumsum:
where a row's mass lands within float32 rounding of top_p the two may keep one entry more or
less (so may the sort against float64).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat

FANOUT = 16  # candidates per search per pass: 4 bits, 8 passes
CHUNK = 4096  # entries of a row per program
BLOCK = 1024  # entries per loop step (a [BLOCK, FANOUT] compare in registers)
PASSES = math.ceil(32 / math.log2(FANOUT))
_SIGN = 0x80000000


def order_keys(x: jax.Array) -> jax.Array:
    """int32 keys that order (signed) like the float32 values; -0.0 counts as +0.0."""
    x = jnp.where(x == 0, jnp.zeros_like(x), x).astype(jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def key_values(keys: jax.Array) -> jax.Array:
    bits = jnp.where(keys < 0, keys ^ jnp.int32(0x7FFFFFFF), keys)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _to_unsigned(keys):  # signed order -> unsigned order (interval arithmetic without overflow)
    return lax.bitcast_convert_type(keys, jnp.uint32) ^ jnp.uint32(_SIGN)


def _to_signed(u):
    return lax.bitcast_convert_type(u ^ jnp.uint32(_SIGN), jnp.int32)


def _count_kernel(keys_ref, probs_ref, candk_ref, candp_ref, outk_ref, outp_ref, *, chunk, block):
    ck = candk_ref[0, :]
    cp = candp_ref[0, :]

    def body(i, acc):
        acc_k, acc_p = acc
        at = pl.ds(pl.multiple_of(i * block, block), block)
        k = keys_ref[0, at]
        p = probs_ref[0, at]
        acc_k += jnp.sum(jnp.where(k[:, None] > ck[None, :], 1.0, 0.0), axis=0)
        acc_p += jnp.sum(jnp.where(k[:, None] > cp[None, :], p[:, None], 0.0), axis=0)
        return acc_k, acc_p

    zero = jnp.zeros(ck.shape, jnp.float32)
    acc_k, acc_p = lax.fori_loop(0, chunk // block, body, (zero, zero))
    outk_ref[0, 0, :] = acc_k
    outp_ref[0, 0, :] = acc_p


def _counts(keys, probs, cand_k, cand_p, interpret: bool):
    """Per row and candidate: entries with keys above cand_k (a count) and the probability above
    cand_p ([R, F] float32 each). keys/probs [R, V] with V a multiple of CHUNK."""
    rows, vocab = keys.shape
    chunks, f = vocab // CHUNK, cand_k.shape[-1]
    row_chunk = pl.BlockSpec((1, CHUNK), lambda r, s: (r, s))
    cand = pl.BlockSpec((1, f), lambda r, s: (r, 0))
    part = pl.BlockSpec((1, 1, f), lambda r, s: (r, s, 0))
    out = jax.ShapeDtypeStruct((rows, chunks, f), jnp.float32)
    count, mass = pl.pallas_call(
        functools.partial(_count_kernel, chunk=CHUNK, block=BLOCK),
        grid=(rows, chunks), in_specs=[row_chunk, row_chunk, cand, cand], out_specs=[part, part],
        out_shape=[out, out], interpret=interpret,
        compiler_params=None if interpret else _compat.triton_params(num_warps=4, num_stages=2),
    )(keys, probs, cand_k, cand_p)
    return count.sum(axis=1), mass.sum(axis=1)


def _narrow(lo, hi, below, cand):
    """One pass's new [lo, hi] from which candidates fell below the limit (False..False True..True)."""
    first = FANOUT - jnp.sum(below, axis=-1)  # the first candidate below (FANOUT: none)
    at = lambda i: jnp.take_along_axis(cand, jnp.clip(i, 0, FANOUT - 1)[:, None], axis=-1)[:, 0]
    return jnp.where(first == 0, lo, at(first - 1) + 1), jnp.where(first < FANOUT, at(first), hi)


def _candidates(lo, hi):
    step = (hi - lo) // FANOUT + 1
    return jnp.minimum(lo[:, None] + jnp.arange(FANOUT, dtype=jnp.uint32)[None, :] * step[:, None], hi[:, None])


def top_k_top_p_cutoff(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, interpret: bool | None = None) -> jax.Array:
    """Per row, the value at and above which an entry survives top-k and top-p ([R] float32).

    scaled [R, V] float32 (after temperature and min_p; -inf allowed); top_k [R] int32 (0 = off);
    top_p [R] float32 (>= 1 = off); probabilities are softmax(scaled). interpret: Pallas
    interpret mode (default: off on GPUs)."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    rows, vocab = scaled.shape
    keys = order_keys(scaled)
    probs = jax.nn.softmax(scaled.astype(jnp.float32), axis=-1)
    pad = -vocab % CHUNK  # padding entries: the smallest key, weight 0 (above no candidate)
    keys_p = jnp.pad(keys, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).min)
    probs_p = jnp.pad(probs, ((0, 0), (0, pad)))
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab).astype(jnp.float32)
    p = jnp.where(top_p >= 1.0, jnp.inf, top_p).astype(jnp.float32)  # float32 mass can reach 1 early
    top = _to_unsigned(jnp.max(keys, axis=-1))  # S(top) = 0 < limit: each answer is in [0, top]
    (lo_k, hi_k), (lo_p, hi_p) = (jnp.zeros(rows, jnp.uint32), top), (jnp.zeros(rows, jnp.uint32), top)
    for _ in range(PASSES):
        cand_k, cand_p = _candidates(lo_k, hi_k), _candidates(lo_p, hi_p)
        count, mass = _counts(keys_p, probs_p, _to_signed(cand_k), _to_signed(cand_p), interpret)
        lo_k, hi_k = _narrow(lo_k, hi_k, count < k[:, None], cand_k)
        lo_p, hi_p = _narrow(lo_p, hi_p, mass < p[:, None], cand_p)
    floor = order_keys(jnp.full((), -jnp.inf, jnp.float32))  # key 0 would read as a NaN: keep all
    return key_values(jnp.maximum(jnp.maximum(_to_signed(hi_k), _to_signed(hi_p)), floor))

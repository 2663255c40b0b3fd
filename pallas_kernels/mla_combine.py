"""Split-K combine for the MLA decode kernel: exact log-sum-exp merge of normalised partials.

Inputs o_parts [T, K, H, L] float32 (each split's out, already divided by its own softmax
sum) and lse_parts [T, K, H] (-inf for an empty split). out = sum_k w_k o_k / sum_k w_k with
w_k = exp(lse_k - max lse); lse = max + log(sum w). Tokens with no KV get out 0, lse -inf.

Two implementations with the same result: a one-launch Pallas (Triton) kernel, and the XLA
expression (several fusions: on small problems its launches cost as much as the kernel).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat

COMBINE_BLOCK_H = 16  # heads per program
COMBINE_BLOCK_L = 128  # latent columns per program: a token with many splits still spreads over SMs


def combine_splits_xla(o_parts, lse_parts, out_dtype):
    lse_max = lse_parts.max(axis=1)
    base = jnp.where(jnp.isneginf(lse_max), 0.0, lse_max)
    w = jnp.exp(lse_parts - base[:, None])  # 0 for empty splits
    denom = w.sum(axis=1)
    has_kv = denom > 0.0
    denom_safe = jnp.where(has_kv, denom, 1.0)
    # Multiply-and-reduce (not einsum): XLA fuses it into one reduction instead of tiny batched GEMMs.
    out = (w[..., None] * o_parts.astype(jnp.float32)).sum(axis=1) / denom_safe[..., None]
    lse = jnp.where(has_kv, base + jnp.log(denom_safe), -jnp.inf)
    return out.astype(out_dtype), lse


def _combine_kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, splits):
    block_h, L = out_ref.shape

    def scan_lse(k, carry):  # the running max, and 1 + the last split holding KV
        m, end = carry
        lse = lse_ref[k, :]
        return jnp.maximum(m, lse), jnp.where(jnp.max(lse) > -jnp.inf, k + 1, end)

    m, end = lax.fori_loop(0, splits, scan_lse, (jnp.full((block_h,), -jnp.inf, jnp.float32), jnp.int32(0)))
    base = jnp.where(m == -jnp.inf, 0.0, m)

    def body(k, carry):
        acc, den = carry
        w = jnp.exp(lse_ref[k, :] - base)
        return acc + w[:, None] * o_ref[k, :, :], den + w

    # Partials past the last split with KV are not read: the decode kernels deal a token's pages
    # out from split 0 (split_range), so a short request in a long table, or a padding row of the
    # step's bucket, leaves the tail of the splits empty. (An empty split before it weighs 0.)
    acc, den = lax.fori_loop(0, end, body, (jnp.zeros((block_h, L), jnp.float32),
                                              jnp.zeros((block_h,), jnp.float32)))
    has_kv = den > 0.0
    den_safe = jnp.where(has_kv, den, 1.0)
    out_ref[...] = (acc / den_safe[:, None]).astype(out_ref.dtype)
    lse_out_ref[...] = jnp.where(has_kv, base + jnp.log(den_safe), -jnp.inf)


def combine_splits_pallas(o_parts, lse_parts, out_dtype, *, interpret=False, num_warps=4):
    """grid = (head blocks, column blocks, tokens); every column block recomputes the (cheap)
    weights and writes the same lse."""
    T, K, H, L = o_parts.shape
    block_h = min(COMBINE_BLOCK_H, H)
    block_l = min(COMBINE_BLOCK_L, L)
    assert H % block_h == 0 and L % block_l == 0, (H, L)
    return pl.pallas_call(
        functools.partial(_combine_kernel, splits=K),
        grid=(H // block_h, L // block_l, T),
        in_specs=[pl.BlockSpec((None, K, block_h, block_l), lambda h, c, t: (t, 0, h, c)),
                  pl.BlockSpec((None, K, block_h), lambda h, c, t: (t, 0, h))],
        out_specs=[pl.BlockSpec((None, block_h, block_l), lambda h, c, t: (t, h, c)),
                   pl.BlockSpec((None, block_h), lambda h, c, t: (t, h))],
        out_shape=[_compat.out_struct((T, H, L), out_dtype, o_parts),
                   _compat.out_struct((T, H), jnp.float32, o_parts)],
        compiler_params=_compat.triton_params(num_warps, 2),
        interpret=interpret,
        name=f"mla_decode_combine_k{K}",
    )(o_parts, lse_parts)


def combine_splits(o_parts, lse_parts, out_dtype, *, impl="pallas", interpret=False):
    if impl == "xla":
        return combine_splits_xla(o_parts, lse_parts, out_dtype)
    return combine_splits_pallas(o_parts, lse_parts, out_dtype, interpret=interpret)

"""Paged MLA attention with a chunk's queries grouped: each cached page is read once per block of
`block_q` query tokens of one request, not once per token (chunked prefill).

Same contract as `splash_jax.attention.paged_reference.paged_mla_attention` and the decode kernel
(`mla_decode.py`): q_latent [T,H,L], q_rope [T,H,R], latent [P,S,L], rope [P,S,R], page_table
[T,M], kv_lens [T], scale -> out [T,H,L], lse [T,H].

Why: the step packs each request's chunk as consecutive token rows with identical page-table
rows and increasing kv_lens (causal). The decode kernel runs one program per token, so a chunk of
C tokens over a prefix of N cached tokens reads C x N KV rows: a 512-token chunk of a 64K prompt
reads ~38 GB per layer. Here a program takes up to `block_q` consecutive tokens of one chunk and
all their heads in one tile of block_q * block_h rows, streams the chunk's pages once, and masks
each row at its own token's kv_len (causal inside the chunk). Reads fall by block_q.

Grouping is found on the device from the step's own fields: a token's offset in its run of
equal page-table rows (`run_offsets`). The grid has a program per token (x head blocks x KV
splits); programs whose token is not at a multiple of block_q in its run exit at once, the
others own the rows of their run's next block_q tokens and store them with a row mask. Decode
tokens are runs of one: one valid row, the same KV bytes as the decode kernel (the extra rows
cost tensor-core work, not bandwidth). Split-K and the exact log-sum-exp combine are the decode
kernel's (`mla_combine`).

Status: exact against the XLA reference in interpret mode (tests/test_pallas_mla_decode.py);
not yet compiled on a GPU. Opt-in as `--attention-impl pallas_grouped`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.mla_combine import combine_splits
from pallas_kernels.mla_decode import LN2, LOG2E, MIN_BLOCK_H, supports
from pallas_kernels.mla_decode_config import num_sms


def run_offsets(page_table: jax.Array, kv_lens: jax.Array) -> jax.Array:
    """[T] offset of each token in its run of consecutive tokens with the same page-table row
    (one request's chunk); -1 for tokens without KV (padding)."""
    t = page_table.shape[0]
    live = kv_lens > 0
    same = jnp.concatenate([jnp.zeros((1,), bool), jnp.all(page_table[1:] == page_table[:-1], axis=1) & live[1:] & live[:-1]])
    index = jnp.arange(t, dtype=jnp.int32)
    start = lax.cummax(jnp.where(same, 0, index), axis=0)
    return jnp.where(live, index - start, -1).astype(jnp.int32)


def _grouped_kernel(off_ref, pt_ref, lens_ref, ql_ref, qr_ref, lat_ref, rope_ref, o_ref, lse_ref, *,
                    scale, page_size, block_k, block_q, block_h, pages_per_split, num_pages, max_len):
    split, tok = pl.program_id(1), pl.program_id(2)
    L, R, S = ql_ref.shape[-1], qr_ref.shape[-1], page_size
    rows = block_q * block_h
    off = off_ref[tok]

    @pl.when((off >= 0) & (lax.rem(jnp.maximum(off, 0), block_q) == 0))
    def _():
        # Row r is (token tok + r // block_h, head r % block_h); a token belongs to this block
        # when it continues the run (its offset is off + k).
        k = lax.broadcasted_iota(jnp.int32, (rows,), 0) // block_h
        everywhere = jnp.ones((rows,), bool)
        # Per-row token fields gathered from memory (off/lens are padded by block_q: in bounds).
        offs = _compat.masked_load(off_ref, (tok + k,), mask=everywhere, other=-1)
        lens = _compat.masked_load(lens_ref, (tok + k,), mask=everywhere, other=0)
        row_len = jnp.where(offs == off + k, jnp.minimum(lens, max_len), 0)
        row_mine = row_len > 0
        kv_len = jnp.max(row_len)  # the run's last token in the block sees the most keys
        start = split * (pages_per_split * S)
        end = jnp.minimum(start + pages_per_split * S, kv_len)
        num_steps = lax.div(jnp.maximum(end - start, 0) + block_k - 1, block_k)

        q_rows = pl.ds(pl.multiple_of(tok * block_h, block_h), rows)
        q_lat = ql_ref[q_rows, :]
        q_rope = qr_ref[q_rows, :]
        qk_scale = scale * LOG2E

        def body(b, carry):
            m, l, acc = carry
            pos0 = start + b * block_k
            pos = pos0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            valid = pos < kv_len
            page = jnp.clip(pt_ref[tok, lax.div(pos0, S)], 0, num_pages - 1)
            kv_rows = pl.ds(pl.multiple_of(lax.rem(pos0, S), block_k), block_k)
            lat = _compat.masked_load(lat_ref, (page, kv_rows, slice(None)),
                                      mask=jnp.broadcast_to(valid[:, None], (block_k, L)), other=0)
            rope = _compat.masked_load(rope_ref, (page, kv_rows, slice(None)),
                                       mask=jnp.broadcast_to(valid[:, None], (block_k, R)), other=0)
            s = lax.dot_general(q_lat, lat, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s += lax.dot_general(q_rope, rope, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            causal = pos[None, :] < row_len[:, None]  # each row sees its own token's prefix
            s = jnp.where(causal, s * qk_scale, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet in this block
            alpha = jnp.exp2(m - m_safe)
            p = jnp.exp2(s - m_safe[:, None])
            l = l * alpha + p.sum(axis=1)
            pv = lax.dot_general(p.astype(lat.dtype), lat, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            return m_new, l, acc * alpha[:, None] + pv

        init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
                jnp.zeros((rows, L), jnp.float32))
        m, l, acc = lax.fori_loop(0, num_steps, body, init)
        has_kv = l > 0.0
        l_safe = jnp.where(has_kv, l, 1.0)
        out = (acc / l_safe[:, None]).astype(o_ref.dtype)
        lse = jnp.where(has_kv, m * LN2 + jnp.log(l_safe), -jnp.inf)
        _compat.masked_store(o_ref, (q_rows, slice(None)), out, mask=jnp.broadcast_to(row_mine[:, None], (rows, L)))
        _compat.masked_store(lse_ref, (q_rows,), lse, mask=row_mine)


SHARED_MEMORY_BYTES = 232448  # per block on H100/H200 (the limit Triton reported when block_q 8 exceeded it)
NUM_STAGES = 2


def _fitting_block_k(rows: int, width: int, page_size: int, itemsize: int) -> int:
    """The largest KV tile (<= 64 rows, dividing the page) whose pipelined copies fit in shared
    memory beside the query tile: rows x width for the queries + NUM_STAGES x block_k x width for
    the KV (block_q 8 with 16 heads at 512 + 64: 64 KV rows need 294,912 bytes, 32 fit)."""
    block_k = min(page_size, 64)
    while block_k > 16 and (rows + NUM_STAGES * block_k) * width * itemsize > SHARED_MEMORY_BYTES:
        block_k //= 2
    return block_k


@functools.partial(jax.jit, static_argnames=("scale", "block_tokens", "block_q", "block_k", "splits", "interpret"))
def paged_mla_grouped(q_latent, q_rope, latent, rope, page_table, kv_lens, scale: float, block_tokens: int | None = None,
                      *, block_q: int = 4, block_k: int | None = None, splits: int | None = None, interpret: bool = False):
    """Drop-in for `paged_mla_attention` (module doc). `block_tokens` is accepted and ignored."""
    del block_tokens
    T, H, L = q_latent.shape
    R = q_rope.shape[-1]
    P, S, _ = latent.shape
    M = page_table.shape[1]
    if T == 0:
        return jnp.zeros((0, H, L), q_latent.dtype), jnp.zeros((0, H), jnp.float32)
    if not interpret and not supports(q_latent.shape, q_rope.shape, latent.shape):
        raise ValueError(f"Pallas MLA needs power-of-two L, R >= 16 and page size; got {L=}, {R=}, {S=}")
    # 16 heads per tile (Triton's dot needs M >= 16; fewer heads are padded); interpret mode keeps
    # small test head counts unpadded.
    block_h = min(H, MIN_BLOCK_H) if interpret else MIN_BLOCK_H
    Hp = -(-H // block_h) * block_h
    hb = Hp // block_h
    block_k = block_k or _fitting_block_k(block_q * block_h, L + R, S, q_latent.dtype.itemsize)
    if S % block_k:
        block_k = S
    # Split-K over pages so few tokens with long contexts still fill the GPU.
    splits = splits or max(1, min(M, num_sms() // max(1, hb * -(-T // block_q))))
    splits = max(1, min(splits, M))
    pages_per_split = -(-M // splits)
    splits = -(-M // pages_per_split)

    # Token-major rows per head block ([HB, (T + bq) * block_h, .]) so a program's tile is contiguous.
    pad_t = T + block_q
    offsets = jnp.pad(run_offsets(page_table, kv_lens), (0, block_q), constant_values=-1)
    lens = jnp.pad(kv_lens.astype(jnp.int32), (0, block_q))
    table = jnp.pad(page_table.astype(jnp.int32), ((0, block_q), (0, 0)))

    def rows_of(q):
        q = jnp.pad(q, ((0, block_q), (0, Hp - H), (0, 0)))
        return q.reshape(pad_t, hb, block_h, q.shape[-1]).transpose(1, 0, 2, 3).reshape(hb, pad_t * block_h, q.shape[-1])

    part_dtype = q_latent.dtype if splits == 1 else jnp.float32
    kernel = functools.partial(
        _grouped_kernel, scale=float(scale), page_size=S, block_k=block_k, block_q=block_q, block_h=block_h,
        pages_per_split=pages_per_split, num_pages=P, max_len=M * S)
    full = lambda x: pl.BlockSpec(x.shape, lambda h, k, t: (0,) * x.ndim)  # noqa: E731
    ql, qr = rows_of(q_latent), rows_of(q_rope)
    o_parts, lse_parts = pl.pallas_call(
        kernel,
        grid=(hb, splits, T),
        in_specs=[
            full(offsets), full(table), full(lens),
            pl.BlockSpec((None, pad_t * block_h, L), lambda h, k, t: (h, 0, 0)),
            pl.BlockSpec((None, pad_t * block_h, R), lambda h, k, t: (h, 0, 0)),
            full(latent), full(rope),
        ],
        out_specs=[
            pl.BlockSpec((None, None, pad_t * block_h, L), lambda h, k, t: (k, h, 0, 0)),
            pl.BlockSpec((None, None, pad_t * block_h), lambda h, k, t: (k, h, 0)),
        ],
        out_shape=[
            _compat.out_struct((splits, hb, pad_t * block_h, L), part_dtype, q_latent),
            _compat.out_struct((splits, hb, pad_t * block_h), jnp.float32, q_latent),
        ],
        compiler_params=_compat.triton_params(4, NUM_STAGES),
        interpret=interpret,
        name=f"mla_grouped_q{block_q}_h{block_h}_k{block_k}_s{splits}",
    )(offsets, table, lens, ql, qr, latent, rope)
    # [K, HB, (T+bq)*bh, .] -> [T, K, Hp, .] (the decode kernel's partial layout), then combine.
    o_parts = o_parts.reshape(splits, hb, pad_t, block_h, L)[:, :, :T].transpose(2, 0, 1, 3, 4).reshape(T, splits, Hp, L)
    lse_parts = lse_parts.reshape(splits, hb, pad_t, block_h)[:, :, :T].transpose(2, 0, 1, 3).reshape(T, splits, Hp)
    if splits == 1:
        out, lse = o_parts[:, 0], lse_parts[:, 0]
    else:
        out, lse = combine_splits(o_parts, lse_parts, q_latent.dtype, interpret=interpret)
    live = offsets[:T] >= 0  # padding tokens' rows were never written: the contract's 0 / -inf
    out = jnp.where(live[:, None, None], out[:, :H], 0).astype(q_latent.dtype)
    return out, jnp.where(live[:, None], lse[:, :H], -jnp.inf)

"""Paged MLA decode attention in the absorbed form: a Pallas Mosaic TPU kernel.

Same contract as `splash_jax.attention.paged_reference.paged_mla_attention` (a drop-in):
  q_latent [T,H,L], q_rope [T,H,R], latent [P,S,L], rope [P,S,R], page_table [T,M] int32,
  kv_lens [T] int32, scale  ->  out [T,H,L] (q dtype), lse [T,H] float32 (natural log;
  -inf and out == 0 where kv_len == 0).

Design (TPU: one TensorCore runs the grid in order, VMEM is software-managed, scalars live in SMEM):
  grid = (tokens, splits). The page table (flattened) and the lengths are scalar-prefetched into
  SMEM, so a program reads its page ids as scalars and addresses the pool with them. The pool stays
  in HBM (`memory_space=ANY`: the model passes the whole flat [layers x pages] pool of a device);
  a program DMAs its token's pages a block of `pages_per_block` pages at a time into a
  double-buffered VMEM scratch, starting block b+1's copies before computing block b, and copies
  only pages below the token's length (a short request in a long table reads nothing more). Every
  head of the token shares the block (MLA's latent is one key/value for all heads): s = q_lat @
  lat^T + q_rope @ rope^T on the MXU with float32 accumulation, an online softmax, acc += p @ lat.
  Slots past the length are masked, and zeroed in the block before the products, so a stale or
  never-written slot (NaN) cannot leak into the result. With splits > 1 each split takes an even
  share of the token's own pages (by its real length) and writes a normalised partial out and
  lse; an exact log-sum-exp merge (XLA, `merge_partial_attention`) combines them. Splits fill both
  TensorCores of megacore chips (v4, v5p) and the two of a v7x; v5e and v6e have one.
SMEM holds 1 MiB on v5e/v6e; a step whose table does not fit is cut into token chunks, one
kernel call each (a chunk's table is re-read for its own tokens only).
Heads are padded to a multiple of 16 rows (bf16 sublane packing) for the MXU; the padding is zero
and sliced off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from splash_jax.attention.paged_reference import merge_partial_attention

BLOCK_TOKENS = 512  # KV positions per block: a DMA of 512 x 1152 B of latent per block (bf16)
SMEM_TABLE_BYTES = 256 * 1024  # page-table bytes per kernel call (SMEM is 1 MiB on v5e/v6e)
HEAD_MULTIPLE = 16
MIN_PROGRAMS = 2  # split a step of fewer tokens over the KV length (megacore chips run 2 programs at once)


def supports(q_latent_shape, q_rope_shape, latent_shape) -> bool:
    """Whether the compiled (non-interpret) kernel takes these shapes: lane-aligned latent width,
    and pages of whole sublane tiles (a page is DMA'd into rows of the block)."""
    L, S = q_latent_shape[-1], latent_shape[1]
    return L % 128 == 0 and S % 16 == 0


def split_pages(kv_len, split, splits: int, page_size: int, multiple: int):
    """[first, end) page indices of `split` for a token of kv_len: the token's pages dealt out
    evenly from split 0, a multiple of `multiple` pages each (used splits are a prefix)."""
    pages = lax.div(kv_len + page_size - 1, page_size)
    per = lax.div(pages + splits - 1, splits)
    per = jnp.maximum(lax.div(per + multiple - 1, multiple) * multiple, multiple)
    first = split * per
    return first, jnp.minimum(first + per, pages)


def _kernel(lens_ref, table_ref, ql_ref, qr_ref, lat_hbm, rope_hbm, o_ref, lse_ref,
            lat_buf, rope_buf, sems, m_ref, l_ref, acc_ref, *,
            scale: float, page_size: int, pages_per_block: int, splits: int, max_pages: int, num_pages: int):
    t, split = pl.program_id(0), pl.program_id(1)
    S, ppb = page_size, pages_per_block
    bk = S * ppb
    kv_len = jnp.minimum(lens_ref[t], max_pages * S)
    first, end = split_pages(kv_len, split, splits, S, ppb)
    num_blocks = lax.div(jnp.maximum(end - first, 0) + ppb - 1, ppb)
    row = t * max_pages

    def copies(block, slot):
        """The DMAs of one block's pages (those below the token's end), as (condition, copy) pairs."""
        out = []
        for i in range(ppb):
            index = first + block * ppb + i
            page = jnp.clip(table_ref[row + jnp.minimum(index, max_pages - 1)], 0, num_pages - 1)
            rows = pl.ds(i * S, S)
            out.append((index < end, pltpu.make_async_copy(lat_hbm.at[page], lat_buf.at[slot, rows], sems.at[0, slot])))
            out.append((index < end, pltpu.make_async_copy(rope_hbm.at[page], rope_buf.at[slot, rows], sems.at[1, slot])))
        return out

    def start(block, slot):
        for cond, copy in copies(block, slot):
            pl.when(cond)(copy.start)

    def wait(block, slot):
        for cond, copy in copies(block, slot):
            pl.when(cond)(copy.wait)

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(num_blocks > 0)
    def _():
        start(0, 0)

    q_lat = ql_ref[...]
    q_rope = qr_ref[...]

    def body(block, carry):
        slot = lax.rem(block, 2)

        @pl.when(block + 1 < num_blocks)
        def _():
            start(block + 1, 1 - slot)

        wait(block, slot)
        base = (first + block * ppb) * S
        valid_rows = base + lax.broadcasted_iota(jnp.int32, (bk, 1), 0) < end * S
        valid_rows &= base + lax.broadcasted_iota(jnp.int32, (bk, 1), 0) < kv_len
        lat = jnp.where(valid_rows, lat_buf[slot], 0).astype(q_lat.dtype)
        rope = jnp.where(valid_rows, rope_buf[slot], 0).astype(q_rope.dtype)
        s = lax.dot_general(q_lat, lat, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s += lax.dot_general(q_rope, rope, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        pos = base + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where((pos < end * S) & (pos < kv_len), s * scale, -jnp.inf)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))  # finite: a block holds a valid slot
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_ref[...] = l_ref[...] * alpha + p.sum(axis=1, keepdims=True)
        pv = lax.dot_general(p.astype(lat.dtype), lat, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        acc_ref[...] = acc_ref[...] * alpha + pv
        m_ref[...] = m_new
        return carry

    lax.fori_loop(0, num_blocks, body, 0)
    l = l_ref[...]
    has_kv = l > 0.0
    l_safe = jnp.where(has_kv, l, 1.0)
    o_ref[...] = (acc_ref[...] / l_safe).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has_kv, m_ref[...] + jnp.log(l_safe), -jnp.inf)


def _call(q_latent, q_rope, latent, rope, page_table, kv_lens, *, scale, pages_per_block, splits, interpret):
    T, Hp, L = q_latent.shape
    R = q_rope.shape[-1]
    P, S, _ = latent.shape
    M = page_table.shape[1]
    bk = S * pages_per_block
    part_dtype = q_latent.dtype if splits == 1 else jnp.float32
    kernel = functools.partial(_kernel, scale=float(scale), page_size=S, pages_per_block=pages_per_block,
                               splits=splits, max_pages=M, num_pages=P)
    q_spec = lambda width: pl.BlockSpec((None, Hp, width), lambda t, k, *_: (t, 0, 0))  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(T, splits),
        in_specs=[q_spec(L), q_spec(R), pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[
            pl.BlockSpec((None, None, Hp, L), lambda t, k, *_: (t, k, 0, 0)),
            pl.BlockSpec((None, None, Hp, 1), lambda t, k, *_: (t, k, 0, 0)),
        ],
        scratch_shapes=[
            pltpu.VMEM((2, bk, L), latent.dtype),
            pltpu.VMEM((2, bk, R), rope.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((Hp, 1), jnp.float32),
            pltpu.VMEM((Hp, 1), jnp.float32),
            pltpu.VMEM((Hp, L), jnp.float32),
        ],
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((T, splits, Hp, L), part_dtype),
                   jax.ShapeDtypeStruct((T, splits, Hp, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=f"mla_decode_tpu_b{bk}_s{splits}",
    )(kv_lens.astype(jnp.int32), page_table.astype(jnp.int32).reshape(-1), q_latent, q_rope, latent, rope)
    return out, lse[..., 0]


@functools.partial(jax.jit, static_argnames=("scale", "block_tokens", "pages_per_block", "splits", "interpret"))
def paged_mla_decode_tpu(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent: jax.Array,
    rope: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    scale: float,
    block_tokens: int | None = None,
    *,
    pages_per_block: int | None = None,
    splits: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Drop-in for `paged_mla_attention`. `block_tokens` (the reference's knob) sets the KV block
    unless `pages_per_block` does; `splits` overrides the split count; `interpret` runs the kernel
    in Pallas's TPU interpreter (CPU tests). `scale` must be a Python float."""
    T, H, L = q_latent.shape
    P, S, _ = latent.shape
    M = page_table.shape[1]
    if T == 0:
        return jnp.zeros((0, H, L), q_latent.dtype), jnp.zeros((0, H), jnp.float32)
    if not interpret and not supports(q_latent.shape, q_rope.shape, latent.shape):
        raise ValueError(f"Pallas TPU MLA decode needs L % 128 == 0 and pages of a multiple of 16 tokens; got {L=}, {S=}")
    ppb = pages_per_block or max(1, min(M, (block_tokens or BLOCK_TOKENS) // S))
    kv_blocks = -(-M // ppb)
    splits = max(1, min(splits or -(-MIN_PROGRAMS // T), kv_blocks))
    Hp = -(-H // HEAD_MULTIPLE) * HEAD_MULTIPLE
    if Hp != H:
        pad = ((0, 0), (0, Hp - H), (0, 0))
        q_latent, q_rope = jnp.pad(q_latent, pad), jnp.pad(q_rope, pad)
    chunk = max(1, SMEM_TABLE_BYTES // (4 * M))  # tokens whose page table fits one call's SMEM
    outs, lses = [], []
    for t0 in range(0, T, chunk):
        part = slice(t0, min(T, t0 + chunk))
        o, lse = _call(q_latent[part], q_rope[part], latent, rope, page_table[part], kv_lens[part], scale=scale,
                       pages_per_block=ppb, splits=splits, interpret=interpret)
        outs.append(o)
        lses.append(lse)
    out = jnp.concatenate(outs) if len(outs) > 1 else outs[0]
    lse = jnp.concatenate(lses) if len(lses) > 1 else lses[0]
    if splits == 1:
        out, lse = out[:, 0], lse[:, 0]
    else:  # [T, K, H, L] partials -> merged over the splits (axis 0 of the merge)
        out, lse = merge_partial_attention(jnp.moveaxis(out, 1, 0), jnp.moveaxis(lse, 1, 0))
        out = out.astype(q_latent.dtype)
    return out[:, :H], lse[:, :H]

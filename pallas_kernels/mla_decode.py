"""Paged MLA decode attention in the absorbed form: a Pallas (Triton backend) split-K kernel.

Same contract as `splash_jax.attention.paged_reference.paged_mla_attention` (a drop-in):
  q_latent [T,H,L], q_rope [T,H,R], latent [P,S,L], rope [P,S,R], page_table [T,M] int32,
  kv_lens [T] int32, scale  ->  out [T,H,L] (q dtype), lse [T,H] float32 (natural log;
  -inf and out == 0 where kv_len == 0).

Design (flash-decoding):
  grid = (head blocks, splits, tokens). A program takes `block_h` heads of one token and a
  contiguous range of that token's pages (its split), and streams them `block_k` tokens at a
  time: s = q_lat @ lat^T + q_rope @ rope^T (the 576-wide key read as 512 + 64, since Triton
  blocks are powers of two), an online softmax in base 2, acc += p @ lat (the latent is both
  key and value, read once per step). Accumulation is float32. Head blocks are the fastest
  grid axis so the programs that share one token's KV run together and hit L2.
  Page ids past ceil(kv_len / S) are never dereferenced unclamped: they are clipped into the
  pool and every slot at or past kv_len is masked out of the load itself (other=0), so garbage
  ids and never-written slots (even NaN) cannot leak into the result.
  With one split the kernel writes out/lse directly; otherwise each split writes its
  normalised partial out (f32) and lse, and an exact log-sum-exp combine (`mla_combine`, one
  Pallas launch) merges them.
The split count is chosen per static shape so the grid fills the GPU (`mla_decode_config`); each
token's own pages are then dealt out evenly over the splits at run time (`split_range`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.mla_combine import combine_splits
from pallas_kernels.mla_decode_config import DecodeConfig, num_sms, pick_config, plan_splits

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MIN_BLOCK_H = 16  # Triton dot needs M >= 16
SMEM_BYTES = 192 * 1024  # for the KV tiles, of the 227 KB a Hopper block may take: the rest holds the query tile


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports(q_latent_shape, q_rope_shape, latent_shape) -> bool:
    """Whether the compiled (non-interpret) kernel handles these shapes: Triton wants power-of-two
    blocks of at least 16 for both matmul widths and the KV step."""
    L, R, S = q_latent_shape[-1], q_rope_shape[-1], latent_shape[1]
    return _pow2(L) and _pow2(R) and L >= 16 and R >= 16 and _pow2(S)


def fit_shared_memory(block_k: int, stages: int, width: int, itemsize: int, page_size: int) -> tuple[int, int]:
    """(block_k, stages) whose pipelined KV tiles (stages x block_k x width) fit SMEM_BYTES: the
    tuned table is for 2-byte caches; a float32 cache at its 2-stage, 64-token step asked for 288 KB
    (H200: 227 KB per block) and failed to compile. Fewer stages first, then a shorter step.
    2-byte caches keep the measured tuned choice (Triton shares buffers the estimate counts twice)."""
    if itemsize <= 2:
        return block_k, stages
    while stages > 1 and stages * block_k * width * itemsize > SMEM_BYTES:
        stages -= 1
    while block_k > 16 and block_k * width * itemsize > SMEM_BYTES and (block_k // 2 >= page_size or page_size % (block_k // 2) == 0):
        block_k //= 2
    return block_k, stages


def split_range(kv_len, split, splits: int, page_size: int, page_multiple: int = 1):
    """[start, end) KV positions of `split` (of `splits`) for a token of kv_len: the token's own
    pages dealt out evenly from split 0, a multiple of `page_multiple` pages each (so a KV step
    never straddles two splits). The split count is static, sized for the table's capacity;
    sizing the splits by the real length keeps a short request in a long table spread over all
    of them instead of the first few (V2-Lite batch 1, 1K tokens in a 4K table: 4 of 14 splits
    busy before, each 4 pages in a row), and makes the used splits a prefix, which the combine
    relies on."""
    pages = lax.div(kv_len + page_size - 1, page_size)
    per = lax.div(pages + splits - 1, splits)
    per = jnp.maximum(lax.div(per + page_multiple - 1, page_multiple) * page_multiple, page_multiple)
    start = split * per * page_size
    return start, jnp.minimum(start + per * page_size, kv_len)


def _decode_kernel(pt_ref, lens_ref, ql_ref, qr_ref, lat_ref, rope_ref, o_ref, lse_ref, *,
                   scale, page_size, block_k, splits, num_pages, max_len, ablate=""):
    split, tok = pl.program_id(1), pl.program_id(2)
    block_h, L = ql_ref.shape
    R = qr_ref.shape[-1]
    S = page_size

    kv_len = jnp.minimum(lens_ref[tok], max_len)  # never past the page table's own capacity
    start, end = split_range(kv_len, split, splits, S, max(1, block_k // S))
    num_steps = lax.div(jnp.maximum(end - start, 0) + block_k - 1, block_k)

    q_lat = ql_ref[...]
    q_rope = qr_ref[...]
    qk_scale = scale * LOG2E  # softmax in base 2: exp2 is the native instruction

    def load_kv(pos0):
        pos = pos0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        valid = pos < kv_len
        if block_k <= S:  # one page, or a slice of one: plain strided rows
            page = jnp.clip(pt_ref[tok, lax.div(pos0, S)], 0, num_pages - 1)
            rows = pl.ds(pl.multiple_of(lax.rem(pos0, S), block_k), block_k)
            lat = _compat.masked_load(lat_ref, (page, rows, slice(None)),
                                      mask=jnp.broadcast_to(valid[:, None], (block_k, L)), other=0)
            rope = _compat.masked_load(rope_ref, (page, rows, slice(None)),
                                       mask=jnp.broadcast_to(valid[:, None], (block_k, R)), other=0)
            return lat, rope, valid
        # Several pages per step: a gather with fully broadcast integer indexers (it lowers to
        # one pointer tensor on Triton and to plain indexing in interpret mode).
        ppb = block_k // S
        pages = jnp.clip(pt_ref[tok, pl.ds(lax.div(pos0, S), ppb)], 0, num_pages - 1)
        valid3 = valid.reshape(ppb, S, 1)
        slot = lax.broadcasted_iota(jnp.int32, (1, S, 1), 1)
        pages3 = pages.reshape(ppb, 1, 1)

        def gather(ref, width):
            col = lax.broadcasted_iota(jnp.int32, (1, 1, width), 2)
            x = _compat.masked_load(ref, (pages3, slot, col),
                                    mask=jnp.broadcast_to(valid3, (ppb, S, width)), other=0)
            return x.reshape(block_k, width)

        return gather(lat_ref, L), gather(rope_ref, R), valid

    def body(b, carry):
        m, l, acc = carry
        lat, rope, valid = load_kv(start + b * block_k)
        if ablate == "no_qk":  # profiling variant: scores from the loaded tile, no QK matmul
            s = jnp.broadcast_to(rope.astype(jnp.float32).sum(axis=1)[None, :], (block_h, block_k))
        else:
            s = lax.dot_general(q_lat, lat, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s += lax.dot_general(q_rope, rope, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = jnp.where(valid[None, :], s * qk_scale, -jnp.inf)
        # Every processed block holds >= 1 valid slot, so m_new is finite and no NaN arises.
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + p.sum(axis=1)
        pv = lax.dot_general(p.astype(lat.dtype), lat, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
        return m_new, l, acc * alpha[:, None] + pv

    init = (jnp.full((block_h,), -jnp.inf, jnp.float32),
            jnp.zeros((block_h,), jnp.float32),
            jnp.zeros((block_h, L), jnp.float32))
    m, l, acc = lax.fori_loop(0, num_steps, body, init)

    has_kv = l > 0.0
    l_safe = jnp.where(has_kv, l, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has_kv, m * LN2 + jnp.log(l_safe), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("scale", "block_tokens", "config", "interpret"))
def paged_mla_decode(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent: jax.Array,
    rope: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    scale: float,
    block_tokens: int | None = None,
    *,
    config: DecodeConfig | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Drop-in for `paged_mla_attention`. `block_tokens` (the reference's memory knob) is
    accepted for signature compatibility and ignored: the tuned table picks the KV step.
    `config` overrides the table; `interpret` runs on CPU (tests). `scale` must be a Python
    float (it is baked into the kernel)."""
    del block_tokens
    T, H, L = q_latent.shape
    R = q_rope.shape[-1]
    P, S, _ = latent.shape
    M = page_table.shape[1]
    if T == 0:
        return jnp.zeros((0, H, L), q_latent.dtype), jnp.zeros((0, H), jnp.float32)
    cfg = config or pick_config(H, T, M * S)
    if not interpret and not supports(q_latent.shape, q_rope.shape, latent.shape):
        raise ValueError(f"Pallas MLA decode needs power-of-two L, R >= 16 and page size; got {L=}, {R=}, {S=}")

    # KV step: a power of two; a slice of a page, one page, or a gather of whole pages.
    block_k = 1 << (max(1, min(cfg.block_k, M * S)).bit_length() - 1)
    if block_k < S and S % block_k:
        block_k = S
    block_k, stages = fit_shared_memory(block_k, cfg.num_stages, L + R, jnp.dtype(latent.dtype).itemsize, S)
    ppb = max(1, block_k // S)  # pages per step (1 when the step is a page or less)
    block_h = max(MIN_BLOCK_H, min(cfg.block_h, 1 << max(0, (H - 1).bit_length())))
    Hp = -(-H // block_h) * block_h
    head_blocks = Hp // block_h

    kv_blocks = -(-M // ppb)  # in units of whole-page groups: a split boundary is a page boundary
    splits = plan_splits(cfg, T, head_blocks, M, num_sms())
    splits = min(splits, kv_blocks)
    pages_per_split = -(-kv_blocks // splits) * ppb
    splits = -(-M // pages_per_split)
    # split_range hands out whole page groups below ceil(kv_len / S) <= M, so reads stay inside the
    # table unless the last group is partial (M not a multiple of ppb): only then pad (the padding
    # is never dereferenced unclamped). One page per step (the common case) pads nothing: the pad
    # was one more kernel per layer.
    m_pad = kv_blocks * ppb
    if m_pad != M:
        page_table = jnp.pad(page_table, ((0, 0), (0, m_pad - M)))
    if Hp != H:
        q_latent = jnp.pad(q_latent, ((0, 0), (0, Hp - H), (0, 0)))
        q_rope = jnp.pad(q_rope, ((0, 0), (0, Hp - H), (0, 0)))

    part_dtype = q_latent.dtype if splits == 1 else jnp.float32
    kernel = functools.partial(
        _decode_kernel, scale=float(scale), page_size=S, block_k=block_k,
        splits=splits, num_pages=P, max_len=M * S, ablate=cfg.ablate)
    full = lambda x: pl.BlockSpec(x.shape, lambda h, k, t: (0,) * x.ndim)  # noqa: E731
    o_parts, lse_parts = pl.pallas_call(
        kernel,
        grid=(head_blocks, splits, T),
        in_specs=[
            full(page_table),
            full(kv_lens),
            pl.BlockSpec((None, block_h, L), lambda h, k, t: (t, h, 0)),
            pl.BlockSpec((None, block_h, R), lambda h, k, t: (t, h, 0)),
            full(latent),
            full(rope),
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_h, L), lambda h, k, t: (t, k, h, 0)),
            pl.BlockSpec((None, None, block_h), lambda h, k, t: (t, k, h)),
        ],
        out_shape=[  # varying like the queries under shard_map (every layout shards or replicates q)
            _compat.out_struct((T, splits, Hp, L), part_dtype, q_latent),
            _compat.out_struct((T, splits, Hp), jnp.float32, q_latent),
        ],
        compiler_params=_compat.triton_params(cfg.num_warps, stages),
        interpret=interpret,
        name=f"mla_decode_h{block_h}_k{block_k}_s{splits}",
    )(page_table.astype(jnp.int32), kv_lens.astype(jnp.int32), q_latent, q_rope, latent, rope)

    if splits == 1:
        out, lse = o_parts[:, 0], lse_parts[:, 0]
    else:
        out, lse = combine_splits(o_parts, lse_parts, q_latent.dtype, impl=cfg.combine, interpret=interpret)
    if Hp != H:
        out, lse = out[:, :H], lse[:, :H]
    return out, lse

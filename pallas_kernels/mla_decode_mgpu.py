"""Paged MLA decode for many heads per device: a Pallas Mosaic GPU kernel (Hopper wgmma + TMA).

Same contract as `pallas_kernels.mla_decode.paged_mla_decode` (and the XLA reference):
  q_latent [T,H,512], q_rope [T,H,64], latent [P,S,512], rope [P,S,64], page_table [T,M],
  kv_lens [T], scale  ->  out [T,H,512] (q dtype), lse [T,H] float32 (natural log).

Why a second kernel: at 128 heads per device (DeepSeek-V3 under DP) decode is compute-bound
(~1.9 x heads FLOP per KV byte) and the Triton kernel tops out near 260 TFLOP/s: its programs
hold at most 32 heads x 512 value columns of float32 accumulator, so the KV is read once per
32 heads and the matmuls are small. Here a program takes 64 heads of one token and splits the
512 value columns over two warpgroups, so each accumulator fits in registers:

  warpgroup 2 (producer): TMA-copies each 64-token KV block of the token's pages into a
      2-stage shared-memory ring (latent columns [0:256), [256:512) and the rope part);
  warpgroup 0: S = q @ k^T over all 576 columns (wgmma), online softmax in base 2, writes P
      (bf16) over the block's rope tile (dead once S is computed) and the row rescale factor
      to shared memory for warpgroup 1, then acc0 += P @ latent[:, 0:256];
  warpgroup 1: acc1 = acc1 * alpha + P @ latent[:, 256:512] with P read from shared memory.

The two accumulators are 64 x 256 float32 (128 registers per thread each). Shared memory:
q 72 KiB + 2 stages x 72 KiB (P reuses the rope tile, so it costs nothing). Head blocks are
the fastest grid axis, so the two programs of a 128-head token run together and the second
reads the KV from L2. Split-K over the token's pages (flash-decoding) fills the GPU when the
batch is small; partial outputs merge in `mla_combine` as for the Triton kernel.

Slots past kv_len: their scores are masked to -inf (P = 0), and in a request's last, partly
written block each warpgroup zeroes the rows past kv_len of its value columns in shared memory
before its P @ V (TMA copies whole blocks, and 0 x NaN is NaN: a recycled page may hold
anything). Limits: bf16, L = 512, R = 64, page size a multiple of 64. Under 64 heads the
Triton kernel is faster (memory-bound there).
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
from pallas_kernels.mla_decode import split_range
from pallas_kernels.mla_decode_config import DecodeConfig, num_sms, plan_splits

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
BLOCK_H = 64  # heads per program: one wgmma M
BLOCK_K = 64  # KV tokens per step: the wgmma K of P @ V with 128-byte swizzle
LATENT, ROPE = 512, 64
V_SPLIT = 256  # value columns of warpgroup 0 (the rest are warpgroup 1's): 64 x 256 f32 each, wgmma N <= 256
STAGES = 2  # KV ring depth (q + 2 stages = 216 KiB of the 227 KiB of shared memory)
# Split-K defaults: one 216 KiB program fits per SM.
CONFIG = DecodeConfig(block_h=BLOCK_H, block_k=BLOCK_K, ctas_per_sm=1, max_splits=32, min_pages_per_split=4)


def supports(q_latent_shape, q_rope_shape, latent_shape, dtype) -> bool:
    """Shapes this kernel takes: the DeepSeek latent (512 + 64), bf16, pages of a multiple of 64 tokens."""
    return (q_latent_shape[-1] == LATENT and q_rope_shape[-1] == ROPE and latent_shape[1] % BLOCK_K == 0
            and jnp.dtype(dtype) == jnp.bfloat16)


def _smem(shape, dtype=jnp.bfloat16):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def _zero_rows_from(tile_ref, n):
    """Rows >= n of a [BLOCK_K, C] shared-memory tile -> 0, visible to the next wgmma. In 64-column
    pieces (16 registers each: the accumulator already holds 128)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for c in range(0, tile_ref.shape[-1], 64):
        piece_ref = tile_ref.at[:, pl.ds(c, 64)]
        piece = piece_ref[...]
        row = plgpu.broadcasted_iota(jnp.int32, piece.shape, 0, layout=plgpu.Layout.WGMMA)
        piece_ref[...] = jnp.where(row < n, piece, jnp.zeros_like(piece))
    plgpu.commit_smem()


def _decode_body(pt_ref, lens_ref, ql_ref, qr_ref, lat_ref, rope_ref, o_ref, lse_ref, *,
                 scale, page_size, splits, num_pages, max_len):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    dtype = ql_ref.dtype
    v_split, v_rest = V_SPLIT, LATENT - V_SPLIT
    rows_layout = plgpu.Layout.WGMMA.reduce(1)

    def kernel(q_lo, q_hi, q_r, lat_lo, lat_hi, rope_s, alpha_s, l_s,
               q_bar, lo_bar, hi_bar, rope_bar, p_ready, consumed, l_ready):
        h, split, tok = lax.axis_index("h"), lax.axis_index("s"), lax.axis_index("t")
        wg = lax.axis_index("wg")
        heads = pl.ds(h * BLOCK_H, BLOCK_H)
        kv_len = jnp.minimum(lens_ref[tok], max_len)
        start, end = split_range(kv_len, split, splits, page_size)
        num_steps = lax.div(jnp.maximum(end - start, 0) + (BLOCK_K - 1), BLOCK_K)

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")

            def issue(step, slot):
                pos = start + step * BLOCK_K
                page = jnp.clip(pt_ref[tok, lax.div(pos, page_size)], 0, num_pages - 1)
                rows = pl.ds(lax.rem(pos, page_size), BLOCK_K)
                plgpu.copy_gmem_to_smem(lat_ref.at[page, rows, pl.ds(0, v_split)], lat_lo.at[slot], lo_bar.at[slot])
                plgpu.copy_gmem_to_smem(lat_ref.at[page, rows, pl.ds(v_split, v_rest)], lat_hi.at[slot],
                                        hi_bar.at[slot])
                plgpu.copy_gmem_to_smem(rope_ref.at[page, rows], rope_s.at[slot], rope_bar.at[slot])

            for i in range(STAGES):
                pl.when(i < num_steps)(functools.partial(issue, i, i))

            def refill(step, _):
                slot = lax.rem(step, STAGES)
                plgpu.barrier_wait(consumed.at[slot])  # both warpgroups are done with step - STAGES
                issue(step, slot)
                return ()

            lax.fori_loop(STAGES, num_steps, refill, ())

        @pl.when(wg == 0)
        def _scores_and_low_columns():
            plgpu.set_max_registers(232, action="increase")
            plgpu.copy_gmem_to_smem(ql_ref.at[tok, heads, pl.ds(0, v_split)], q_lo, q_bar.at[0])
            plgpu.copy_gmem_to_smem(ql_ref.at[tok, heads, pl.ds(v_split, v_rest)], q_hi, q_bar.at[1])
            plgpu.copy_gmem_to_smem(qr_ref.at[tok, heads], q_r, q_bar.at[2])
            for i in range(3):
                plgpu.barrier_wait(q_bar.at[i])
            qk_scale = scale * LOG2E

            def step_fn(step, carry, last=False):
                acc, m, l = carry
                slot = lax.rem(step, STAGES)
                plgpu.barrier_wait(lo_bar.at[slot])
                plgpu.barrier_wait(hi_bar.at[slot])
                plgpu.barrier_wait(rope_bar.at[slot])

                def qk(s_ref):
                    plgpu.wgmma(s_ref, q_lo, lat_lo.at[slot].transpose((1, 0)))
                    plgpu.wgmma(s_ref, q_hi, lat_hi.at[slot].transpose((1, 0)))
                    plgpu.wgmma(s_ref, q_r, rope_s.at[slot].transpose((1, 0)))
                    return s_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((BLOCK_H, BLOCK_K), jnp.float32))
                pos = start + step * BLOCK_K + plgpu.broadcasted_iota(
                    jnp.int32, (BLOCK_H, BLOCK_K), 1, layout=plgpu.Layout.WGMMA)
                s = jnp.where(pos < kv_len, s * qk_scale, -jnp.inf)
                # Every step holds >= 1 valid slot, so m_new is finite from the first step on.
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                rope_s[slot] = p16  # the rope tile is dead once S is computed: it carries P
                alpha_s[slot] = alpha
                plgpu.commit_smem()  # visible to warpgroup 1's wgmma (async proxy)
                plgpu.barrier_arrive(p_ready.at[slot])
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                if last:  # only a program's last block can run past kv_len
                    tail = kv_len - (start + step * BLOCK_K)
                    pl.when(tail < BLOCK_K)(lambda: _zero_rows_from(lat_lo.at[slot], tail))

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, lat_lo.at[slot])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(consumed.at[slot])
                return acc, m_new, l

            init = (
                plgpu.layout_cast(jnp.zeros((BLOCK_H, v_split), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((BLOCK_H,), -jnp.inf, jnp.float32), rows_layout),
                plgpu.layout_cast(jnp.zeros((BLOCK_H,), jnp.float32), rows_layout),
            )
            # The last step is peeled off so the tail handling does not cost the loop registers.
            carry = lax.fori_loop(0, jnp.maximum(num_steps - 1, 0), step_fn, init)
            acc, m, l = lax.fori_loop(jnp.maximum(num_steps - 1, 0), num_steps,
                                      functools.partial(step_fn, last=True), carry)
            l_s[...] = l
            plgpu.barrier_arrive(l_ready)
            has_kv = l > 0.0
            l_safe = jnp.where(has_kv, l, 1.0)
            o_ref.at[tok, split, heads, pl.ds(0, v_split)][...] = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
            lse_ref.at[tok, split, heads][...] = jnp.where(has_kv, m * LN2 + jnp.log(l_safe), -jnp.inf)

        @pl.when(wg == 1)
        def _high_columns():
            plgpu.set_max_registers(232, action="increase")

            def step_fn(step, acc, last=False):
                slot = lax.rem(step, STAGES)
                plgpu.barrier_wait(hi_bar.at[slot])
                plgpu.barrier_wait(p_ready.at[slot])
                alpha = plgpu.load(alpha_s.at[slot], layout=rows_layout, optimized=False)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                if last:
                    tail = kv_len - (start + step * BLOCK_K)
                    pl.when(tail < BLOCK_K)(lambda: _zero_rows_from(lat_hi.at[slot], tail))

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, rope_s.at[slot], lat_hi.at[slot])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(consumed.at[slot])
                return acc

            init = plgpu.layout_cast(jnp.zeros((BLOCK_H, v_rest), jnp.float32), plgpu.Layout.WGMMA)
            acc = lax.fori_loop(0, jnp.maximum(num_steps - 1, 0), step_fn, init)
            acc = lax.fori_loop(jnp.maximum(num_steps - 1, 0), num_steps, functools.partial(step_fn, last=True), acc)
            plgpu.barrier_wait(l_ready)
            l = plgpu.load(l_s, layout=rows_layout, optimized=False)
            l_safe = jnp.where(l > 0.0, l, 1.0)
            o_ref.at[tok, split, heads, pl.ds(v_split, v_rest)][...] = (
                acc / lax.broadcast_in_dim(l_safe, acc.shape, [0]))

    pl.run_scoped(
        kernel,
        _smem((BLOCK_H, v_split)), _smem((BLOCK_H, v_rest)), _smem((BLOCK_H, ROPE)),
        _smem((STAGES, BLOCK_K, v_split)), _smem((STAGES, BLOCK_K, v_rest)), _smem((STAGES, BLOCK_K, ROPE)),
        plgpu.SMEM((STAGES, BLOCK_H), jnp.float32), plgpu.SMEM((BLOCK_H,), jnp.float32),
        plgpu.Barrier(num_barriers=3),
        plgpu.Barrier(num_barriers=STAGES), plgpu.Barrier(num_barriers=STAGES), plgpu.Barrier(num_barriers=STAGES),
        plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),
        plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
        plgpu.Barrier(num_arrivals=1),
        collective_axes="wg",
    )


@functools.partial(jax.jit, static_argnames=("scale", "block_tokens", "config"))
def paged_mla_decode_mgpu(q_latent, q_rope, latent, rope, page_table, kv_lens, scale: float,
                          block_tokens: int | None = None, *, config: DecodeConfig | None = None):
    """Drop-in for `paged_mla_decode` on Hopper GPUs (shapes: `supports`). `config` sets the
    split-K policy (its block fields are fixed here)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    del block_tokens
    T, H, L = q_latent.shape
    P, S, _ = latent.shape
    M = page_table.shape[1]
    if not supports(q_latent.shape, q_rope.shape, latent.shape, q_latent.dtype):
        raise ValueError(f"Mosaic GPU MLA decode needs bf16, L={LATENT}, R={ROPE}, page size % {BLOCK_K} == 0; "
                         f"got {q_latent.shape=} {q_rope.shape=} {latent.shape=} {q_latent.dtype}")
    if T == 0:
        return jnp.zeros((0, H, L), q_latent.dtype), jnp.zeros((0, H), jnp.float32)
    cfg = config or CONFIG
    Hp = -(-H // BLOCK_H) * BLOCK_H
    head_blocks = Hp // BLOCK_H
    splits = min(plan_splits(cfg, T, head_blocks, M, num_sms()), M)
    splits = -(-M // -(-M // splits))  # no split left without a page of a full table
    # No page-table padding: split_range reads entries below ceil(kv_len / S) <= M only.
    if Hp != H:
        q_latent = jnp.pad(q_latent, ((0, 0), (0, Hp - H), (0, 0)))
        q_rope = jnp.pad(q_rope, ((0, 0), (0, Hp - H), (0, 0)))
    body = functools.partial(_decode_body, scale=float(scale), page_size=S, splits=splits,
                             num_pages=P, max_len=M * S)
    o_parts, lse_parts = plgpu.kernel(
        body,
        out_type=(_compat.out_struct((T, splits, Hp, L), jnp.float32, q_latent),  # varying like q in shard_map
                  _compat.out_struct((T, splits, Hp), jnp.float32, q_latent)),
        grid=(head_blocks, splits, T),
        grid_names=("h", "s", "t"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(page_table.astype(jnp.int32), kv_lens.astype(jnp.int32), q_latent, q_rope, latent, rope)
    if splits == 1:
        out, lse = o_parts[:, 0].astype(q_latent.dtype), lse_parts[:, 0]
    else:
        out, lse = combine_splits(o_parts, lse_parts, q_latent.dtype, impl=cfg.combine)
    return out[:, :H], lse[:, :H]

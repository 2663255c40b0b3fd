"""Routed experts as a tiled grouped GEMM (Pallas, Triton backend) that reads each routed expert once.

Decode-sized MoE is bound by reading expert weights (V3 width: 88 MB per expert, bf16), so the
only goal is to read each routed expert's weights once, at HBM bandwidth, and touch no other
expert. The work is laid out by `plan_tiles` (XLA, tiny: T*k pairs):

  (token, k) pairs of this device's experts are ranked within their expert and placed in
  expert-contiguous *tiles* of `block_m` rows (an expert with n pairs gets ceil(n / block_m)
  tiles; its last tile is padded with weight-0 rows). Pairs routed to other devices' experts are
  in no tile and cost nothing. Tiles past the live ones are skipped inside the kernel.

Two kernels then run over grid (column blocks, tiles), the expert id read inside the kernel
from the tile table (Triton has no scalar prefetch; the weight refs are whole-array pointers),
x's rows gathered inside gate_up by the tile's token ids (no [rows, D] copy of x per layer):
  gate_up: h[rows] = silu(x @ gate[e]^T) * (x @ up[e]^T) * w   (one pass over gate/up tiles,
           SiLU and the combine weight fused; h in the weight dtype)
  down:    y[pair of each row] = h @ down[e]   (rows stored in pair order, token-major)
and XLA sums each token's k rows of y (contiguous).

Steps of at most 16 tokens (decode at small batch) skip the plan: *pair tiles*. Tile j belongs to
pair j = (token, choice) and is live only when its expert is local and no earlier pair chose it, so
every routed expert has one live tile whose rows are all of the step's tokens (weight 0 for those
that did not pick it). Each program finds this from the flat ids itself (O(pairs) compares), and
down stores each token's row at its pair's row of a [pairs, D] output. The plan's XLA ops were 8
kernels per layer (~9 us at batch 1 on an H200); pair tiles need none.

Column blocks are the fastest grid axis, so the tiles of
one expert (several only when it has > block_m pairs) run in the same wave and share its weights
through L2. Accumulation is float32. With 1 token there are k live tiles: the kernel reads exactly
the k routed experts' gate/up/down (the XLA gather path read them ~11x slower, DESIGN section 3).

The weights may be one layer's [E, I, D] or a scanned layer group's stacked [L, E, I, D] with the
layer index given: the kernel then reads its layer's experts straight from the stack. (A per-layer
slice of a stack handed to a custom call is first copied whole by XLA: 0.57 ms per V2-Lite layer
on an H200, more than the kernel itself.)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat


class TilePlan(NamedTuple):
    slot_token: jax.Array  # [R] token of each tile row (0 for padding rows)
    slot_pair: jax.Array  # [R] pair (token * k + choice) of each tile row (T * k for padding rows)
    slot_weight: jax.Array  # [R] f32 combine weight (0 for padding rows)
    tile_expert: jax.Array  # [NT] local expert of each tile
    tile_live: jax.Array  # [NT] int32, 1 if the tile holds >= 1 pair
    pair_slot: jax.Array  # [T, k] row of each pair (R, i.e. out of range, when not local)


def num_tiles(num_pairs: int, num_local: int, block_m: int) -> int:
    """Static bound on tiles: every expert's last tile may be partial."""
    return -(-num_pairs // block_m) + min(num_local, num_pairs)


# Up to this many pairs the plan ranks by compare-and-sum (one fused reduction) instead of a sort:
# decode batches up to 128 tokens x top-8. V2-Lite batch 128 x 1K on an H200 (768 pairs): the sort
# path's kernels took 2.1% of the decode step; with the compare, GPU busy 12.81 -> 12.62 ms and
# 1,374 -> 1,244 kernels per step (decode_roofline --top-kernels 60).
SMALL_PAIRS = 1024
# Up to this many pairs (decode steps of <= 8-10 tokens) the plan also avoids XLA scatters and the
# cumulative sum: each row finds its pair by compare-and-sum (one [rows, P] reduction) and the tile
# offsets are a masked sum; scatters and reduce-window are separate kernels of 1-3 us each,
# per layer.
TINY_PAIRS = 64
# Steps of at most this many tokens (and at most block_m) use pair tiles (`_pair_tile`): no plan is
# computed at all; each kernel program finds its expert from the flat ids itself (O(pairs) work).
# V2-Lite batch-1 decode on an H200: the plan's XLA kernels were ~9 us per layer (8 fusions).
PAIR_TILE_TOKENS = 16


def plan_tiles(ids: jax.Array, weights: jax.Array, num_local: int, block_m: int) -> TilePlan:
    """ids [T,k] local expert ids (-1 or >= num_local: another device's), weights [T,k].

    A handful of small fused XLA ops; no while loop (jnp.searchsorted's default is one, and a
    GPU while loop waits on the host every iteration: measured ~0.15 ms per layer)."""
    t, k = ids.shape
    p = t * k
    nt = num_tiles(p, num_local, block_m)
    rows = nt * block_m
    flat = ids.reshape(-1).astype(jnp.int32)
    valid = (flat >= 0) & (flat < num_local)
    key = jnp.where(valid, flat, num_local)
    pair = jnp.arange(p, dtype=jnp.int32)
    if p <= SMALL_PAIRS:  # rank = earlier pairs of the same expert; one P x P compare
        same = key[None, :] == key[:, None]
        rank = jnp.sum(same & (pair[None, :] < pair[:, None]), axis=1, dtype=jnp.int32)
        counts = jnp.sum(key[None, :] == jnp.arange(num_local, dtype=jnp.int32)[:, None], axis=1, dtype=jnp.int32)
    else:
        order = jnp.argsort(key, stable=True)
        counts_all = jnp.zeros(num_local + 1, jnp.int32).at[key].add(1)
        group_start = jnp.cumsum(counts_all) - counts_all
        rank = jnp.zeros(p, jnp.int32).at[order].set(pair - group_start[key[order]])
        counts = counts_all[:num_local]
    tiles = -(-counts // block_m)
    experts = jnp.arange(num_local, dtype=jnp.int32)
    tiny = p <= TINY_PAIRS
    if tiny:  # inclusive prefix sum as a masked sum (no reduce-window kernel)
        tile_end = jnp.sum(jnp.where(experts[None, :] <= experts[:, None], tiles[None, :], 0), axis=1, dtype=jnp.int32)
    else:
        tile_end = jnp.cumsum(tiles)
    tile_off = tile_end - tiles
    slot = jnp.where(valid, tile_off[jnp.clip(key, 0, num_local - 1)] * block_m + rank, rows)
    flat_w = weights.reshape(-1).astype(jnp.float32)
    if tiny:  # each row's pair by compare (at most one matches), instead of two scatters
        hit = slot[None, :] == jnp.arange(rows, dtype=jnp.int32)[:, None]
        slot_pair = jnp.where(jnp.any(hit, axis=1), jnp.sum(jnp.where(hit, pair[None, :], 0), axis=1, dtype=jnp.int32), p)
        slot_weight = jnp.sum(jnp.where(hit, flat_w[None, :], 0.0), axis=1)
    else:
        slot_pair = jnp.full(rows, p, jnp.int32).at[slot].set(pair, mode="drop")
        slot_weight = jnp.zeros(rows, jnp.float32).at[slot].set(flat_w, mode="drop")
    slot_token = jnp.where(slot_pair < p, slot_pair // k, 0)
    j = jnp.arange(nt, dtype=jnp.int32)
    tile_expert = jnp.sum(tile_end[None, :] <= j[:, None], axis=1, dtype=jnp.int32)
    tile_expert = jnp.minimum(tile_expert, num_local - 1)
    tile_live = (j < tile_end[-1]).astype(jnp.int32)
    return TilePlan(slot_token, slot_pair, slot_weight, tile_expert, tile_live, slot.reshape(t, k))


def _pair_tile(ids_ref, j, *, pairs, top_k, num_local, block_m):
    """Pair tiles (steps of <= block_m tokens): tile j belongs to pair j's expert e and is live
    when e is local and no earlier pair chose it, so each routed expert has exactly one live tile;
    its rows are the step's tokens. Returns e, live, and match [block_m, PP]: row t's pairs of e
    (one, from a router; ids given by hand may repeat), with the pair index p of each column."""
    pp = 1 << max(0, pairs - 1).bit_length()
    p = lax.broadcasted_iota(jnp.int32, (pp,), 0)
    ids = _compat.masked_load(ids_ref, (p,), mask=p < pairs, other=-1)
    e = ids_ref[j]
    earlier = jnp.sum(((p < j) & (ids == e)).astype(jnp.int32))
    live = (e >= 0) & (e < num_local) & (earlier == 0)
    row = lax.broadcasted_iota(jnp.int32, (block_m, pp), 0)
    col = lax.broadcasted_iota(jnp.int32, (block_m, pp), 1)
    match = (col // top_k == row) & (ids[None, :] == e) & (col < pairs)
    return e, live, match, col


def _gate_up_kernel(*refs, block_i, block_d, dim, scale_block, compute, pairs=0, top_k=0, tokens=0,
                    num_local=0, block_m=0):
    """pairs > 0: pair tiles (_pair_tile; refs carry the flat ids and weights instead of a plan)."""
    if pairs:
        layer_ref, ids_ref, wts_ref, x_ref, gate_ref, up_ref, *rest = refs
    else:
        layer_ref, te_ref, tl_ref, tok_ref, x_ref, w_ref, gate_ref, up_ref, *rest = refs
    gs_ref, us_ref, o_ref = rest if scale_block else (None, None, *rest)
    i, j = pl.program_id(0), pl.program_id(1)
    if pairs:
        e, live, match, col_p = _pair_tile(ids_ref, j, pairs=pairs, top_k=top_k, num_local=num_local, block_m=block_m)
        pp = col_p.shape[1]
        p = lax.broadcasted_iota(jnp.int32, (pp,), 0)
        wts = _compat.masked_load(wts_ref, (p,), mask=p < pairs, other=0.0)
        row_weight = jnp.sum(jnp.where(match, wts[None, :], 0.0), axis=1)
        tok = lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)  # row t is token t
        row_ok = tok < tokens
    else:
        e, live = te_ref[j], tl_ref[j] > 0
        tok = tok_ref[...][:, None]  # the tile's rows of x (padding rows read token 0, weight 0)
        block_m = tok.shape[0]
        row_ok = jnp.ones((block_m, 1), jnp.bool_)

    @pl.when(live)
    def _():
        layer = layer_ref[0]
        cols = pl.ds(pl.multiple_of(i * block_i, block_i), block_i)
        every = row_ok & jnp.ones((block_m, block_d), jnp.bool_)

        def body(d, carry):
            g_acc, u_acc = carry
            ds = pl.ds(pl.multiple_of(d * block_d, block_d), block_d)
            col = d * block_d + lax.broadcasted_iota(jnp.int32, (1, block_d), 1)
            xt = _compat.masked_load(x_ref, (tok, col), mask=every, other=0).astype(compute)
            nt = (((1,), (1,)), ((), ()))
            gw, uw = gate_ref[layer, e, cols, ds], up_ref[layer, e, cols, ds]
            if scale_block:  # FP8 tile -> activation dtype (exact), its block's scale on the product
                gw, uw = gw.astype(xt.dtype), uw.astype(xt.dtype)
            g = lax.dot_general(xt, gw, nt, preferred_element_type=jnp.float32)
            u = lax.dot_general(xt, uw, nt, preferred_element_type=jnp.float32)
            if scale_block:
                si, sd = (i * block_i) // scale_block, (d * block_d) // scale_block
                g, u = g * gs_ref[layer, e, si, sd], u * us_ref[layer, e, si, sd]
            return g_acc + g, u_acc + u

        zero = jnp.zeros((block_m, block_i), jnp.float32)
        g, u = lax.fori_loop(0, dim // block_d, body, (zero, zero))
        weight = row_weight if pairs else w_ref[...]
        h = g * jax.nn.sigmoid(g) * u * weight[:, None]
        o_ref[...] = h.astype(o_ref.dtype)


def _down_kernel(*refs, block_i, block_d, inter, scale_block, pairs=0, top_k=0, num_local=0):
    """pairs > 0: pair tiles; each token's row is stored at its pair's row of the [pairs, D]
    output (written by exactly one program per column block: no atomics, deterministic)."""
    if pairs:
        layer_ref, ids_ref, h_ref, down_ref, *rest = refs
    else:
        layer_ref, te_ref, tl_ref, sp_ref, h_ref, down_ref, *rest = refs
    ds_ref, o_ref = rest if scale_block else (None, *rest)
    d, j = pl.program_id(0), pl.program_id(1)
    if pairs:
        e, live, match, col_p = _pair_tile(ids_ref, j, pairs=pairs, top_k=top_k, num_local=num_local,
                                           block_m=h_ref.shape[0])
    else:
        e, live = te_ref[j], tl_ref[j] > 0

    @pl.when(live)
    def _():
        layer = layer_ref[0]
        cols = pl.ds(pl.multiple_of(d * block_d, block_d), block_d)

        def body(i, acc):
            rs = pl.ds(pl.multiple_of(i * block_i, block_i), block_i)
            ht, w = h_ref[:, rs], down_ref[layer, e, rs, cols]
            if scale_block:
                w = w.astype(ht.dtype)
            part = lax.dot_general(ht, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            if scale_block:
                part = part * ds_ref[layer, e, (i * block_i) // scale_block, (d * block_d) // scale_block]
            return acc + part

        acc = lax.fori_loop(0, inter // block_i, body, jnp.zeros((h_ref.shape[0], block_d), jnp.float32))
        if pairs:
            dest = jnp.min(jnp.where(match, col_p, pairs), axis=1)  # row t's (first) pair of e
            has = jnp.max(match.astype(jnp.int32), axis=1) > 0
        else:
            dest = sp_ref[...]  # the tile rows' pairs (padding rows: out of range, not stored)
            has = dest < o_ref.shape[0]
        c = d * block_d + lax.broadcasted_iota(jnp.int32, (1, block_d), 1)
        _compat.masked_store(o_ref, (dest[:, None], c), acc.astype(o_ref.dtype),
                             mask=has[:, None] & jnp.ones((1, block_d), jnp.bool_))


class Config(NamedTuple):
    block_m: int = 16
    gu_block_i: int = 64  # gate/up: output columns per program
    gu_block_d: int = 128  # gate/up: reduction step over D
    dn_block_d: int = 64  # down: output columns per program
    dn_block_i: int = 128  # down: reduction step over I
    num_warps: int = 4
    num_stages: int = 3


def _largest_pow2_divisor(n: int, cap: int) -> int:
    b = cap
    while b > 16 and n % b:
        b //= 2
    return b


def fit_config(cfg: Config, dim: int, inter: int, scale_block: int = 0) -> Config:
    """Shrink each block to a power of two dividing its axis (a block that does not divide it
    would drop the remainder of the reduction or the output); with FP8 weights, to at most the
    scale block, so every tile lies inside one scale block."""
    cap = (lambda b: min(b, scale_block)) if scale_block else (lambda b: b)  # noqa: E731
    return cfg._replace(
        gu_block_i=_largest_pow2_divisor(inter, cap(cfg.gu_block_i)),
        gu_block_d=_largest_pow2_divisor(dim, cap(cfg.gu_block_d)),
        dn_block_d=_largest_pow2_divisor(dim, cap(cfg.dn_block_d)),
        dn_block_i=_largest_pow2_divisor(inter, cap(cfg.dn_block_i)),
    )


# Prefill-sized steps (>= 128 pairs per expert: compute-bound): 128-row tiles, 128 gate/up columns,
# 64-wide reduction steps, 8 warps. One H200, V2-Lite layer (64 x 2048 x 1408, top-6), bf16:
# 2048 tokens 0.97 -> 0.71 ms, 8192 tokens 3.21 -> 2.02 ms (265 -> 420 TFLOP/s) against the
# decode config below (benchmarks/probes/moe_prefill_configs.py).
PREFILL_CONFIG = Config(block_m=128, gu_block_i=128, gu_block_d=64, dn_block_d=128, dn_block_i=64, num_warps=8, num_stages=3)


def pick_config(num_pairs: int, num_local: int, dim: int, inter: int) -> Config:
    """block_m from the mean rows per expert (16..64; 128-row prefill tiles from 128 on); column
    blocks that divide D and I."""
    mean = -(-num_pairs // max(1, min(num_local, num_pairs)))
    if mean >= 128:
        return fit_config(PREFILL_CONFIG, dim, inter)
    block_m = 16 if mean <= 16 else 32 if mean <= 32 else 64
    return Config(
        block_m=block_m,
        gu_block_i=_largest_pow2_divisor(inter, 64),
        gu_block_d=_largest_pow2_divisor(dim, 128),
        dn_block_d=_largest_pow2_divisor(dim, 64),
        dn_block_i=_largest_pow2_divisor(inter, 128),
        num_warps=4 if block_m <= 32 else 8,
    )


def supports(dim: int, inter: int, scale_block: int = 0) -> bool:
    """Compiled kernels need power-of-two blocks of >= 16 dividing D and I (and, with FP8 weights,
    dividing the scale block, a power of two)."""
    ok = dim % 16 == 0 and inter % 16 == 0
    return ok and (not scale_block or (scale_block >= 16 and scale_block & (scale_block - 1) == 0))


@functools.partial(jax.jit, static_argnames=("config", "interpret", "scale_block", "pair_tiles"))
def routed_experts(x, ids, weights, gate, up, down, layer=None, scales=None, *, scale_block: int = 0,
                   config: Config | None = None, interpret: bool = False, pair_tiles: bool | None = None):
    """sum_k weights[t,k] * down[e]^T (silu(gate[e] x_t) * up[e] x_t) with e = ids[t,k].

    x [T,D]; ids [T,k] local expert ids (others' experts: < 0 or >= E, contribute 0); weights
    [T,k]; gate/up/down [E,I,D] (HF [out,in] for gate/up), or stacked [L,E,I,D] with `layer` (an
    int32 scalar, may be traced) picking the layer. Returns [T,D] in x.dtype.

    FP8 weights: gate/up/down in float8_e4m3fn and `scales` = their float32 block scales
    ([L,] E, ceil(I/b), ceil(D/b)) for square blocks of `scale_block` (DeepSeek's 128): weight
    (i, d) = value * scale[i // b, d // b]. Tiles are converted to x's dtype in the kernel (exact)
    and each block's partial product is scaled, so HBM holds and the kernel reads 1 byte per weight.

    pair_tiles: None picks pair tiles for steps of <= min(block_m, PAIR_TILE_TOKENS) tokens (they
    need every token in one tile); False always plans tiles; True requires pair tiles.
    """
    fp8 = scales is not None
    if fp8 != bool(scale_block):
        raise ValueError("FP8 expert weights need both `scales` and `scale_block`")
    if gate.ndim == 3:  # one layer: a leading axis of 1 is a free reshape
        if layer is not None:
            raise ValueError("layer is given but the expert weights are not stacked [L, E, I, D]")
        gate, up, down = gate[None], up[None], down[None]
        scales = tuple(sc[None] for sc in scales) if fp8 else None
        layer = 0
    elif layer is None:
        raise ValueError(f"stacked expert weights {gate.shape} need the layer index")
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    t, d = x.shape
    _, e_local, inter, _ = gate.shape
    k = ids.shape[1]
    if fp8:
        want = (gate.shape[0], e_local, -(-inter // scale_block), -(-d // scale_block))
        if any(sc.shape != want for sc in scales):
            raise ValueError(f"FP8 scales {[sc.shape for sc in scales]} do not match {want} for {scale_block}-blocks")
    cfg = fit_config(config or pick_config(t * k, e_local, d, inter), d, inter, scale_block)
    if inter % cfg.gu_block_i or inter % cfg.dn_block_i or d % cfg.gu_block_d or d % cfg.dn_block_d:
        raise ValueError(f"MoE kernel blocks must divide D={d} and I={inter}: {cfg}")
    compute = x.dtype if fp8 else gate.dtype  # the dtype the tiles are multiplied in
    full = lambda a: pl.BlockSpec(a.shape, lambda c, j: (0,) * a.ndim)  # noqa: E731
    params = _compat.triton_params(cfg.num_warps, cfg.num_stages)
    gate_scales = (scales[0], scales[1]) if fp8 else ()
    down_scales = (scales[2],) if fp8 else ()
    out_dtype = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    fits = t <= cfg.block_m
    if pair_tiles and not fits:
        raise ValueError(f"pair tiles hold every token in one tile: {t} tokens > block_m={cfg.block_m}")
    if pair_tiles or (pair_tiles is None and fits and t <= PAIR_TILE_TOKENS):  # no plan at all (module doc)
        pairs = t * k
        flat_ids, flat_w = ids.reshape(-1).astype(jnp.int32), weights.reshape(-1).astype(jnp.float32)
        pair = dict(pairs=pairs, top_k=k, num_local=e_local)
        h = pl.pallas_call(
            functools.partial(_gate_up_kernel, block_i=cfg.gu_block_i, block_d=cfg.gu_block_d, dim=d,
                              scale_block=scale_block, compute=compute, tokens=t, block_m=cfg.block_m, **pair),
            grid=(inter // cfg.gu_block_i, pairs),
            in_specs=[full(layer), full(flat_ids), full(flat_w), full(x), full(gate), full(up), *map(full, gate_scales)],
            out_specs=pl.BlockSpec((cfg.block_m, cfg.gu_block_i), lambda c, j: (j, c)),
            out_shape=_compat.out_struct((pairs * cfg.block_m, inter), compute, x),
            compiler_params=params,
            interpret=interpret,
            name="moe_gate_up",
        )(layer, flat_ids, flat_w, x, gate, up, *gate_scales)
        y = pl.pallas_call(
            functools.partial(_down_kernel, block_i=cfg.dn_block_i, block_d=cfg.dn_block_d, inter=inter,
                              scale_block=scale_block, **pair),
            grid=(d // cfg.dn_block_d, pairs),
            in_specs=[full(layer), full(flat_ids), pl.BlockSpec((cfg.block_m, inter), lambda c, j: (j, 0)),
                      full(down), *map(full, down_scales)],
            out_specs=pl.BlockSpec((pairs, d), lambda c, j: (0, 0)),
            out_shape=_compat.out_struct((pairs, d), out_dtype, x),
            compiler_params=params,
            interpret=interpret,
            name="moe_down",
        )(layer, flat_ids, h, down, *down_scales)
        # Rows written: a token's first pair of each local expert (its row weight sums the token's
        # pairs of that expert: ids may repeat an expert). Other rows may hold anything: masked.
        kk = jnp.arange(k)
        repeat = jnp.any((ids[:, :, None] == ids[:, None, :]) & (kk[None, :] < kk[:, None])[None], axis=2)
        local = (ids >= 0) & (ids < e_local) & ~repeat
        picked = y.reshape(t, k, d).astype(jnp.float32)
        return jnp.where(local[..., None], picked, 0.0).sum(1).astype(x.dtype)
    plan = plan_tiles(ids, weights, e_local, cfg.block_m)
    nt = plan.tile_expert.shape[0]
    rows = nt * cfg.block_m
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, block_i=cfg.gu_block_i, block_d=cfg.gu_block_d, dim=d,
                          scale_block=scale_block, compute=compute),
        grid=(inter // cfg.gu_block_i, nt),
        in_specs=[
            full(layer), full(plan.tile_expert), full(plan.tile_live),
            pl.BlockSpec((cfg.block_m,), lambda c, j: (j,)),  # rows of x, gathered in the kernel
            full(x),
            pl.BlockSpec((cfg.block_m,), lambda c, j: (j,)),
            full(gate), full(up), *map(full, gate_scales),
        ],
        out_specs=pl.BlockSpec((cfg.block_m, cfg.gu_block_i), lambda c, j: (j, c)),
        out_shape=_compat.out_struct((rows, inter), compute, x),
        compiler_params=params,
        interpret=interpret,
        name="moe_gate_up",
    )(layer, plan.tile_expert, plan.tile_live, plan.slot_token, x, plan.slot_weight, gate, up, *gate_scales)
    y = pl.pallas_call(
        functools.partial(_down_kernel, block_i=cfg.dn_block_i, block_d=cfg.dn_block_d, inter=inter,
                          scale_block=scale_block),
        grid=(d // cfg.dn_block_d, nt),
        in_specs=[
            full(layer), full(plan.tile_expert), full(plan.tile_live),
            pl.BlockSpec((cfg.block_m,), lambda c, j: (j,)),
            pl.BlockSpec((cfg.block_m, inter), lambda c, j: (j, 0)),
            full(down), *map(full, down_scales),
        ],
        out_specs=pl.BlockSpec((t * k, d), lambda c, j: (0, 0)),
        out_shape=_compat.out_struct((t * k, d), out_dtype, x),
        compiler_params=params,
        interpret=interpret,
        name="moe_down",
    )(layer, plan.tile_expert, plan.tile_live, plan.slot_pair, h, down, *down_scales)
    # y holds each local pair's row in pair order (token-major), so the combine is a contiguous sum
    # over k; rows of other devices' pairs are never written: masked (they may hold anything).
    # (Gathering tile rows back by pair took 162 us per V2-Lite layer at 4K prefill tokens on an H200.)
    local = (ids >= 0) & (ids < e_local)
    return jnp.where(local[..., None], y.reshape(t, k, d).astype(jnp.float32), 0.0).sum(1).astype(x.dtype)

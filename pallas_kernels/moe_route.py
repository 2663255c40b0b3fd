"""The MoE router's selection as one Pallas (Triton) kernel: scores, group limit, top-k, weights.

`splash_jax.moe.route` in XLA is four kernels per layer on a GPU at decode sizes (softmax, a sort
for lax.top_k, a copy of its result, the local-id select: ~6 us per V2-Lite layer on an H200,
the sort alone > 2% of a batch-1 step). Here one program takes 16 tokens' logits [16, E] and does
it all in registers: k rounds of "largest score, lowest id on ties" (lax.top_k's order), each
round masking out the expert it took. Same contract as `route` followed by the caller's
`ids - offset` and padding-row mask, so the MoE kernels read its output directly.

Exact to `route` up to the last bit of the float32 score arithmetic (softmax / sigmoid, the
same formulas): a near-tie between two experts' scores could in principle pick the other one,
as it could between XLA versions. Tests compare against `route` on CPU (interpret mode) and GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat

BLOCK_T = 16  # tokens per program (fewer when the step has fewer)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _argmax_rows(x, cols, width):
    """Per row: (max value, lowest column holding it)."""
    m = jnp.max(x, axis=1)
    idx = jnp.min(jnp.where(x == m[:, None], cols, width), axis=1)
    return m, idx


def _route_kernel(*refs, tokens, num_experts, top_k, sigmoid, v3, n_group, topk_group, norm, scale, block_t, ep):
    if v3:
        logits_ref, bias_ref, valid_ref, offset_ref, ids_ref, w_ref = refs
    else:
        logits_ref, valid_ref, offset_ref, ids_ref, w_ref = refs
    BLOCK_T = block_t  # noqa: N806
    i = pl.program_id(0)
    kp = _pow2(top_k)
    rows = i * BLOCK_T + lax.broadcasted_iota(jnp.int32, (BLOCK_T, 1), 0)
    cols = lax.broadcasted_iota(jnp.int32, (1, ep), 1)  # ep: experts padded to a power of two
    real = cols < num_experts
    x = _compat.masked_load(logits_ref, (rows, cols), mask=(rows < tokens) & real, other=0.0).astype(jnp.float32)
    if sigmoid:
        scores = 1.0 / (1.0 + jnp.exp(-x))
    else:
        z = jnp.where(real, x, -jnp.inf)
        e = jnp.exp(z - jnp.max(z, axis=1, keepdims=True))
        scores = e / jnp.sum(e, axis=1, keepdims=True)
    if v3:
        e1 = lax.broadcasted_iota(jnp.int32, (ep,), 0)
        choice = scores + _compat.masked_load(bias_ref, (e1,), mask=e1 < num_experts, other=0.0)[None, :]
    else:
        choice = scores
    choice = jnp.where(real, choice, -jnp.inf)  # padded experts are never picked
    if n_group > 1:  # keep the topk_group best groups (V3: by their top-2 sum; V2: by their best)
        size = num_experts // n_group
        gp = _pow2(n_group)
        gcols = lax.broadcasted_iota(jnp.int32, (1, gp), 1)
        group_score = jnp.full((BLOCK_T, gp), -jnp.inf, jnp.float32)
        for g in range(n_group):
            v = jnp.where((cols // size == g) & real, choice, -jnp.inf)
            m1, i1 = _argmax_rows(v, cols, ep)
            s = m1 + jnp.max(jnp.where(cols == i1[:, None], -jnp.inf, v), axis=1) if v3 else m1
            group_score = jnp.where(gcols == g, s[:, None], group_score)
        keep = jnp.zeros((BLOCK_T, ep), jnp.bool_)
        for _ in range(topk_group):
            _, gi = _argmax_rows(group_score, gcols, gp)
            keep = keep | (cols // size == gi[:, None])
            group_score = jnp.where(gcols == gi[:, None], -jnp.inf, group_score)
        choice = jnp.where(keep & real, choice, -jnp.inf if v3 else 0.0)
        choice = jnp.where(real, choice, -jnp.inf)
    source = scores if v3 else choice  # the weights: V3 unbiased scores, V2 the (masked) choice
    kcols = lax.broadcasted_iota(jnp.int32, (1, kp), 1)
    ids = jnp.zeros((BLOCK_T, kp), jnp.int32)
    wts = jnp.zeros((BLOCK_T, kp), jnp.float32)
    for k in range(top_k):
        _, idx = _argmax_rows(choice, cols, ep)
        hit = cols == idx[:, None]
        w = jnp.sum(jnp.where(hit, source, 0.0), axis=1)
        ids = jnp.where(kcols == k, idx[:, None], ids)
        wts = jnp.where(kcols == k, w[:, None], wts)
        choice = jnp.where(hit, -jnp.inf, choice)
    if norm:
        wts = wts / (jnp.sum(wts, axis=1, keepdims=True) + 1e-20)
    wts = wts * scale
    r1 = i * BLOCK_T + lax.broadcasted_iota(jnp.int32, (BLOCK_T,), 0)
    valid = _compat.masked_load(valid_ref, (r1,), mask=r1 < tokens, other=0) > 0
    local = jnp.where(valid[:, None], ids - offset_ref[0], -1)
    out = (rows < tokens) & (kcols < top_k)
    _compat.masked_store(ids_ref, (rows, kcols), local, mask=out)
    _compat.masked_store(w_ref, (rows, kcols), wts, mask=out)


@functools.partial(jax.jit, static_argnames=("top_k", "sigmoid", "v3", "n_group", "topk_group", "norm", "scale",
                                             "interpret"))
def route_local(logits, bias, valid, offset, *, top_k: int, sigmoid: bool, v3: bool, n_group: int,
                topk_group: int, norm: bool, scale: float, interpret: bool = False):
    """logits [T, E] (float32) -> (local ids [T, k] int32, weights [T, k] float32).

    ids are `route`'s expert ids minus `offset` (int32 scalar, may be traced), and -1 on rows
    where `valid` [T] is False. `bias` [E] or None (V3's e_score_correction_bias)."""
    t, e = logits.shape
    v3_bias = () if bias is None else (bias.astype(jnp.float32),)
    if v3 != bool(v3_bias):
        raise ValueError("the V3 router (noaux_tc) takes its bias; the others take none")
    valid = jnp.ones((t,), jnp.int32) if valid is None else valid.astype(jnp.int32)
    offset = jnp.asarray(offset, jnp.int32).reshape(1)
    block_t = min(BLOCK_T, _pow2(t))
    kernel = functools.partial(_route_kernel, tokens=t, num_experts=e, top_k=top_k, sigmoid=sigmoid, v3=v3,
                               n_group=n_group, topk_group=topk_group, norm=norm, scale=float(scale),
                               block_t=block_t, ep=_pow2(max(e, 16)))
    full = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)  # noqa: E731
    inputs = (logits.astype(jnp.float32), *v3_bias, valid, offset)
    ids, weights = pl.pallas_call(
        kernel,
        grid=(-(-t // block_t),),
        in_specs=[full(a) for a in inputs],
        out_specs=[pl.BlockSpec((t, top_k), lambda i: (0, 0)), pl.BlockSpec((t, top_k), lambda i: (0, 0))],
        out_shape=[_compat.out_struct((t, top_k), jnp.int32, logits),
                   _compat.out_struct((t, top_k), jnp.float32, logits)],
        # 4 warps: 4.7 us per V2-Lite layer at 8 tokens on an H200; one warp took 7.1 us.
        compiler_params=_compat.triton_params(4, 1),
        interpret=interpret,
        name="moe_route",
    )(*inputs)
    return ids, weights


def route_local_for(cfg, logits, bias, valid, offset, interpret: bool = False):
    """`route_local` with the model config's router settings (splash_jax.moe.route's contract)."""
    return route_local(
        logits, bias if cfg.topk_method == "noaux_tc" else None, valid, offset, top_k=cfg.num_experts_per_tok,
        sigmoid=cfg.scoring_func == "sigmoid", v3=cfg.topk_method == "noaux_tc",
        n_group=cfg.n_group if cfg.topk_method != "greedy" else 1, topk_group=cfg.topk_group,
        norm=bool(cfg.norm_topk_prob), scale=float(cfg.routed_scaling_factor), interpret=interpret)

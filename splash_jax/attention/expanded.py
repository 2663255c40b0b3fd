"""Prefill attention in the expanded (MHA) form: cached latents expanded to per-head keys and values.

The absorbed form (the decode path) costs 2 * (L + R + L) = 2,176 FLOPs per head per (query, key)
pair (L = 512 latent, R = 64 rope); expanding each key's latent once to per-head keys
(Dn + R = 192) and values (Dv = 128) makes a pair cost 2 * (192 + 128) = 640, 3.4x fewer, for
2 * L * (Dn + Dv) FLOPs per key and head to expand. A long chunk pays the expansion once per key
and the pairs once per query token, so it wins (vLLM and SGLang run MLA prefill this way). One
H200 (`benchmarks/probes/mha_prefill.py`): cuDNN's fused attention runs an 8K chunk over 64K keys in
the expanded form in 9.2 ms (598 TFLOP/s); the absorbed Pallas kernel takes 97 ms for the same chunk.

Up to S chunks per device per step (StepInput.prefill_span [S, 2]: each chunk's first token slot
and length, longest first, unused rows of length 0; S = EngineConfig.expanded_prefill_spans).
A chunk's keys:
  - the request's cached prefix: compact slots [0, prefix) of each pool segment on this device,
    read in blocks of `block_tokens` by a loop whose trip count follows the prefix length;
  - the chunk's own latents, computed this step, causal.
Keys may be visited in any order (the rope part of a cached key already carries its position),
so a segment's compact slots need no positions. Partial results merge exactly by log-sum-exp.
Needs every head it computes and every page of the request on the device: tp and dp
(`Layout.expanded_prefill`).

Several spans (`spans_attention`): the step's own latents are expanded once for all T slots; span
row i gathers at most ceil(T / (i + 1)) query rows (the i-th longest of disjoint chunks in T slots
cannot be longer), so S spans cost about T * (1 + 1/2 + ... + 1/S) rows of gathers and masked
attention (2.08 T for S = 4), an unused span a zero-trip prefix loop and one masked attention
call of its padded rows; no conditionals (DESIGN.md: a cond stalls the host on GPUs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_BLOCK_TOKENS = 4096
DEFAULT_SPANS = 4  # EngineConfig.expanded_prefill_spans


def attend(q, k, v, q_len, kv_len, causal: bool, scale: float, impl: str):
    """Softmax attention of q [T, H, Dk] over k [S, H, Dk], v [S, H, Dv].

    Query rows >= q_len and keys >= kv_len are masked (traced scalars); causal: query i sees keys
    j <= i (T == S). Returns (out [T, H, Dv] float32, lse [T, H] float32, natural log, -inf for a
    row that sees no key). impl: "cudnn" (jax's cuDNN fused attention; GPU, bf16/f16) or "xla".
    """
    if impl == "cudnn":
        from jax._src.cudnn import fused_attention_stablehlo as fa

        mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
        lens = lambda n: jnp.reshape(jnp.maximum(n, 1), (1,)).astype(jnp.int32)  # empty: masked below
        out, lse = fa.dot_product_attention(
            q[None], k[None], v[None], q_seqlen=lens(q_len), kv_seqlen=lens(kv_len), scale=scale,
            mask_type=mask, qkv_layout="BTNH", return_residual=True,
        )
        lse = lse[0].T  # [N, T] -> [T, N]
        rows = (jnp.arange(q.shape[0]) < q_len)[:, None] & (kv_len > 0)
        return jnp.where(rows[..., None], out[0].astype(jnp.float32), 0.0), jnp.where(rows, lse, -jnp.inf)
    s = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    t, n = jnp.arange(q.shape[0]), jnp.arange(k.shape[0])
    visible = (n[None, :] < kv_len) & (t[:, None] < q_len)
    if causal:
        visible &= n[None, :] <= t[:, None]
    s = jnp.where(visible[None], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m_safe[..., None])
    l = p.sum(axis=-1)
    seen = l > 0
    out = jnp.einsum("hts,shd->thd", p, v.astype(jnp.float32)) / jnp.where(seen, l, 1.0).T[..., None]
    lse = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    return out, lse.T


def merge(o1, lse1, o2, lse2):
    """Exact merge of two partial attentions over disjoint key sets ([T, H, D], [T, H])."""
    lse = jnp.logaddexp(lse1, lse2)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    w1, w2 = jnp.exp(lse1 - safe), jnp.exp(lse2 - safe)
    return o1 * w1[..., None] + o2 * w2[..., None], lse


def expand(latent, rope_key, w_uk, w_uv):
    """Latents [S, L] and roped keys [S, R] -> per-head keys [S, H, Dn + R] and values [S, H, Dv]."""
    k_nope = jnp.einsum("sl,lhn->shn", latent, w_uk)
    k_rope = jnp.broadcast_to(rope_key[:, None, :].astype(k_nope.dtype), k_nope.shape[:2] + rope_key.shape[-1:])
    return jnp.concatenate([k_nope, k_rope], axis=-1), jnp.einsum("sl,lhv->shv", latent, w_uv)


def chunk_attention(
    q_nope, q_pe, latent, rope_key, pools, page_rows, prefix_lens, span_len, w_uk, w_uv, scale: float,
    impl: str, block_tokens: int | None = None,
):
    """Attention of one chunk's queries over its cached prefix and itself, in the expanded form.

    q_nope [T, H, Dn], q_pe [T, H, R] (roped): the chunk's queries in order from row 0 (rows >=
    span_len are padding); latent [T, L], rope_key [T, R] (roped): the chunk's own keys, same rows;
    pools: per segment (latent [P, S, L], rope [P, S, R]) of this layer; page_rows: per segment the
    request's compact page ids [M]; prefix_lens: per segment the prefix's slots in it (scalars).
    Returns the per-head values [T, H, Dv] (float32; zero past span_len). block_tokens: prefix
    keys expanded per loop iteration (default DEFAULT_BLOCK_TOKENS).
    """
    q = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], axis=-1)
    k, v = expand(latent.astype(q.dtype), rope_key, w_uk, w_uv)
    return _chunk(q, k, v, pools, page_rows, prefix_lens, span_len, w_uk, w_uv, scale, impl, block_tokens)


def _chunk(q, k, v, pools, page_rows, prefix_lens, span_len, w_uk, w_uv, scale, impl, block_tokens):
    """chunk_attention with the chunk's queries q [T, H, Dn + R] and own keys and values expanded."""
    block_tokens = block_tokens or DEFAULT_BLOCK_TOKENS
    out, lse = attend(q, k, v, span_len, span_len, True, scale, impl)
    for (lat_pool, rope_pool), row, prefix in zip(pools, page_rows, prefix_lens):
        page = lat_pool.shape[1]
        per_block = max(1, min(block_tokens, row.shape[0] * page) // page)
        blocks = -(-row.shape[0] // per_block)
        row = jnp.pad(row, (0, blocks * per_block - row.shape[0]))

        def body(b, carry, lat_pool=lat_pool, rope_pool=rope_pool, row=row, prefix=prefix, per_block=per_block):
            o, l = carry
            pages = jax.lax.dynamic_slice_in_dim(row, b * per_block, per_block)
            pages = jnp.clip(pages, 0, lat_pool.shape[0] - 1)
            size = per_block * page
            kb, vb = expand(lat_pool[pages].reshape(size, -1).astype(q.dtype), rope_pool[pages].reshape(size, -1), w_uk, w_uv)
            ob, lb = attend(q, kb, vb, span_len, jnp.clip(prefix - b * size, 0, size), False, scale, impl)
            return merge(o, l, ob, lb)

        num = jnp.minimum((prefix + per_block * page - 1) // (per_block * page), blocks)
        out, lse = jax.lax.fori_loop(0, num, body, (out, lse))
    return out


def span_capacities(num_tokens: int, spans: int) -> tuple[int, ...]:
    """Query rows of each span row of a step with num_tokens slots: the i-th longest of disjoint
    chunks has at most ceil(num_tokens / (i + 1)) tokens (rounded up to a multiple of 8)."""
    ceil = lambda a, b: -(-a // b)  # noqa: E731
    return tuple(min(num_tokens, ceil(ceil(num_tokens, i + 1), 8) * 8) for i in range(spans))


def span_index(spans, num_tokens: int):
    """Each of a step's T slots' row in the spans' concatenated query rows (spans_attention), -1
    for a slot in no span. spans [S, 2] (first slot, length); a span longer than its row's
    capacity (span_capacities) is cut there: its last slots stay absorbed (the packer orders spans
    longest first, so that never happens)."""
    t = jnp.arange(num_tokens)
    index, at = jnp.full(num_tokens, -1, jnp.int32), 0
    for i, cap in enumerate(span_capacities(num_tokens, spans.shape[0])):
        start, length = spans[i, 0], jnp.minimum(spans[i, 1], cap)
        index = jnp.where((t >= start) & (t < start + length), at + t - start, index)
        at += cap
    return index


def spans_attention(
    q_nope, q_pe, latent, rope_key, pools, page_rows, prefix_lens, spans, w_uk, w_uv, scale: float,
    impl: str, block_tokens: int | None = None,
):
    """chunk_attention for up to S chunks among a step's T slots, each over its own prefix and itself.

    q_nope, q_pe, latent, rope_key: every slot's rows ([T, ...], as chunk_attention); spans [S, 2]
    (first slot, length; length 0: unused); page_rows: per segment [S, M] each span's compact page
    ids; prefix_lens: per segment [S]. Returns the per-head values [T, H, Dv] (float32) of the
    slots `span_index` puts in a span (zero elsewhere)."""
    num_tokens = q_nope.shape[0]
    q = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], axis=-1)
    k, v = expand(latent.astype(q.dtype), rope_key, w_uk, w_uv)  # every slot's own key, once
    outs = []
    for i, cap in enumerate(span_capacities(num_tokens, spans.shape[0])):
        rows = jnp.clip(spans[i, 0] + jnp.arange(cap), 0, num_tokens - 1)
        outs.append(_chunk(q[rows], k[rows], v[rows], pools, [r[i] for r in page_rows], [p[i] for p in prefix_lens],
                           jnp.minimum(spans[i, 1], cap), w_uk, w_uv, scale, impl, block_tokens))
    index = span_index(spans, num_tokens)
    out = jnp.concatenate(outs)[jnp.maximum(index, 0)]
    return jnp.where((index >= 0)[:, None, None], out, 0.0)


def min_chunk_tokens(min_tokens: int) -> int:
    """The fewest tokens a chunk needs to run expanded (and the smallest bucket with such programs)."""
    return max(1, min_tokens // 4)


def worth_expanding(num_tokens, context, min_tokens: int):
    """Whether a chunk of num_tokens queries over `context` keys (its prefix and itself) runs in the
    expanded form: at least min_tokens / 4 tokens and at least the query-key pairs of a one-chunk
    prompt of min_tokens (num_tokens * context >= min_tokens**2). The expanded form costs a fixed
    amount per layer and saves in proportion to the pairs: one H200, V2-Lite, one-chunk prompts of
    512 tokens ran 10% slower expanded, 1024 4% faster; a 512-token chunk after a 16K prefix saves
    far more than that. Works on numpy arrays and Python ints; 0 disables."""
    return (min_tokens > 0) & (num_tokens >= min_chunk_tokens(min_tokens)) & (num_tokens * context >= min_tokens * min_tokens)


def default_impl(dtype) -> str:
    """cuDNN's fused attention on GPUs for 16-bit inputs (what it takes), XLA otherwise."""
    return "cudnn" if jax.default_backend() == "gpu" and jnp.dtype(dtype).itemsize == 2 else "xla"

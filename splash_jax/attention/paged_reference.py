"""Paged MLA attention in the absorbed form, in plain XLA (the reference path).

Every query token carries its own row of page ids and its own KV length, so one function
serves decode (one token per request) and chunked prefill (many tokens of one request, each
seeing a longer prefix) alike. This is also the contract of the Pallas decode kernel in
`pallas_kernels/`, which must return the same (out, lse).

Shapes (T tokens, H heads, P pages of S slots, L = kv_lora_rank, R = rope dim):
  q_latent   [T, H, L]   query with W_UK folded in
  q_rope     [T, H, R]   roped query part
  latent     [P, S, L]   one layer's latent pool
  rope       [P, S, R]   one layer's rope-key pool
  page_table [T, M]      page ids of each token's request, in order (entries past the length are ignored)
  kv_lens    [T]         number of cached positions the token attends to (0 = padding token)
Returns out [T, H, L] (q dtype) and lse [T, H] (float32, natural log, -inf for kv_len 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_BLOCK_TOKENS = 128


def paged_mla_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent: jax.Array,
    rope: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    scale: float,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> tuple[jax.Array, jax.Array]:
    """Online-softmax attention over blocks of pages (flash-decoding style, one pass)."""
    num_tokens, num_heads, _ = q_latent.shape
    page_size = latent.shape[1]
    max_pages = page_table.shape[1]
    pages_per_block = max(1, min(max_pages, block_tokens // page_size))
    num_blocks = -(-max_pages // pages_per_block)
    pad = num_blocks * pages_per_block - max_pages
    if pad:
        page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
    # Pages past a request's length may hold garbage ids; clamp so the gather stays in range.
    page_table = jnp.clip(page_table, 0, latent.shape[0] - 1)

    qf_lat = q_latent.astype(jnp.float32)
    qf_rope = q_rope.astype(jnp.float32)
    block_len = pages_per_block * page_size

    def body(b, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(page_table, b * pages_per_block, pages_per_block, axis=1)
        kv_lat = latent[pages].reshape(num_tokens, block_len, -1).astype(jnp.float32)
        kv_rope = rope[pages].reshape(num_tokens, block_len, -1).astype(jnp.float32)
        s = jnp.einsum("thd,tkd->thk", qf_lat, kv_lat) + jnp.einsum("thd,tkd->thk", qf_rope, kv_rope)
        s = s * scale
        pos = b * block_len + jnp.arange(block_len)
        valid = pos[None, :] < kv_lens[:, None]
        s = jnp.where(valid[:, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = l * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("thk,tkd->thd", p, kv_lat)
        return m_new, l, acc

    init = (
        jnp.full((num_tokens, num_heads), -jnp.inf, jnp.float32),
        jnp.zeros((num_tokens, num_heads), jnp.float32),
        jnp.zeros((num_tokens, num_heads, latent.shape[-1]), jnp.float32),
    )
    # Visit only blocks some token needs: the trip count follows the longest context in the step.
    needed = jnp.minimum((jnp.max(kv_lens) + block_len - 1) // block_len, num_blocks)
    m, l, acc = jax.lax.fori_loop(0, needed, body, init)
    has_kv = l > 0
    out = jnp.where(has_kv[..., None], acc / jnp.where(has_kv, l, 1.0)[..., None], 0.0)
    lse = jnp.where(has_kv, m + jnp.log(jnp.where(has_kv, l, 1.0)), -jnp.inf)
    return out.astype(q_latent.dtype), lse


def merge_partial_attention(
    outs: jax.Array, lses: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Exact merge of partial results over disjoint KV sets (axis 0): the CP / split-K combine."""
    lse = jax.nn.logsumexp(lses, axis=0)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    weights = jnp.exp(lses - safe[None])
    out = (weights[..., None] * outs.astype(jnp.float32)).sum(axis=0)
    return out.astype(outs.dtype), lse

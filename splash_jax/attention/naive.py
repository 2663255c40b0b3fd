"""Non-absorbed MLA attention: expand keys and values per head from the cached latent.

Kept only as a check on the absorbed path (same cache, same page tables): it recomputes
K_nope = c W_UK and V = c W_UV for every context token, which serving never does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def naive_mla_attention(q_nope, q_rope, latent, rope, page_table, kv_lens, w_uk, w_uv, scale):
    """q_nope [T,H,Dn], q_rope [T,H,R]; w_uk [L,H,Dn], w_uv [L,H,Dv] -> [T,H,Dv]."""
    num_tokens = q_nope.shape[0]
    page_size = latent.shape[1]
    table = jnp.clip(page_table, 0, latent.shape[0] - 1)
    c = latent[table].reshape(num_tokens, -1, latent.shape[-1]).astype(jnp.float32)
    k_pe = rope[table].reshape(num_tokens, -1, rope.shape[-1]).astype(jnp.float32)
    k_nope = jnp.einsum("tcl,lhn->tchn", c, w_uk.astype(jnp.float32))
    v = jnp.einsum("tcl,lhv->tchv", c, w_uv.astype(jnp.float32))
    s = jnp.einsum("thn,tchn->thc", q_nope.astype(jnp.float32), k_nope)
    s = s + jnp.einsum("thr,tcr->thc", q_rope.astype(jnp.float32), k_pe)
    s = s * scale
    valid = jnp.arange(table.shape[1] * page_size)[None, :] < kv_lens[:, None]
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    p = jax.nn.softmax(jnp.where(valid.any(-1)[:, None, None], s, 0.0), axis=-1)
    out = jnp.einsum("thc,tchv->thv", p, v)
    return jnp.where((kv_lens > 0)[:, None, None], out, 0.0).astype(q_nope.dtype)

"""MLA attention per layout, inside `jax.shard_map` (per-device view, explicit collectives).

The residual stream is replicated: every device holds x [T, D] for all T token slots (the FFN
runs tensor/expert-parallel on all tokens). For owner layouts (dp, dop) token slots are laid
out device-major: device d's requests fill segment d of T/N slots. The per-device step fields
(token_request, kv_lens, write_page, write_offset, page_table) arrive already local: page ids
are local to the device's pool shard, rows index the device's own query tokens.

Collectives per layer (N = devices):
  tp : psum of the o_proj output.
  dp : none inside attention; all_gather of owner rows to rebuild the replicated stream.
  dop: all_gather of q_lora rows; all_to_all q (head shards -> owners); all_to_all of the
       latent output back; psum_scatter of o_proj to owner rows, all_gather to the stream.
  cp : all_gather of q heads; local partial attention with log-sum-exp; all_to_all of the
       partials to head shards; exact merge; psum of o_proj.

tp and dp (a device holds every head it computes and every page of its rows' requests) run the
chunks of a step's prefill_span ([S, 2] per device), if the program has one, in the expanded form
(attention/expanded.py) with no extra collective; the step's other tokens and every dop/cp step
use the absorbed form.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from splash_jax.attention import dispatch, expanded
from splash_jax.attention.paged_reference import merge_partial_attention
from splash_jax.kv.cache import store_latent
from splash_jax.layers import LATENT_NORM_EPS, logits_dot, rms_norm
from splash_jax.mesh.layouts import AXIS, Layout
from splash_jax.rope import apply_rope


class ShardedContext:
    """The parallel parts of one forward step for `layout`, over mesh axis AXIS of size n."""

    def __init__(self, layout: Layout, n: int, impl: str):
        self.layout = layout
        self.n = n
        self.impl = impl

    # --- FFN, embedding, LM head (fixed placement) ------------------------------------------
    def reduce(self, x):
        return jax.lax.psum(x, AXIS)

    def expert_offset(self, num_local: int):
        return jax.lax.axis_index(AXIS) * num_local

    def embed(self, table, tokens):
        """Vocab-sharded lookup: each device contributes the rows it owns."""
        rows = table.shape[0]
        local = tokens - jax.lax.axis_index(AXIS) * rows
        hit = (local >= 0) & (local < rows)
        x = jnp.where(hit[:, None], table[jnp.clip(local, 0, rows - 1)], 0)
        return jax.lax.psum(x, AXIS)

    def logits(self, h, head):
        local = logits_dot(h, head)
        return jax.lax.all_gather(local, AXIS, axis=1, tiled=True)

    # --- attention --------------------------------------------------------------------------
    def attention(self, attn, x, cos_sin, pools, batch):
        if batch.prefill_span is not None and not self.layout.expanded_prefill:
            raise ValueError(f"layout {self.layout.name} cannot run a prefill chunk in the expanded form")
        return getattr(self, "_" + self.layout.name)(attn, x, cos_sin, pools, batch)

    def _attend(self, attn, q_latent, q_pe, pools, batch):
        """Attention over every pool segment of this device, merged exactly by log-sum-exp."""
        parts = [
            dispatch.paged_attention(
                q_latent, q_pe, *pool, batch.page_table[g][batch.token_request], batch.kv_lens[g],
                attn.cfg.softmax_scale, impl=self.impl,
            )
            for g, pool in enumerate(pools)
        ]
        if len(parts) == 1:
            return parts[0]
        return merge_partial_attention(jnp.stack([o for o, _ in parts]), jnp.stack([l for _, l in parts]))

    def write_latents(self, attn, x, cos_sin, pools, batch):
        """Only the cache write of attention (no queries, no read): each token's latent where this
        layout's forward pass writes it: owner-row layouts (dp, dop) their own rows, tp and cp every
        token (cp's write pages keep only its stripe). The MTP latents of a step whose drafts are
        not wanted (engine/mtp_draft.py)."""
        if self.layout.owner_rows:
            x, cos_sin = self._segment(x), self._segment(cos_sin)
        return self._write(attn, x, cos_sin, pools, batch)

    def _write(self, attn, x, cos_sin, pools, batch):
        return self._store(*attn.roped_latent(x, cos_sin), pools, batch)

    def _store(self, c, k_pe, pools, batch):
        return tuple(store_latent(pool, c, k_pe, batch.write_page[g], batch.write_offset) for g, pool in enumerate(pools))

    def _values(self, attn, q_nope, q_pe, c, k_pe, pools, batch):
        """Per-head attention values [T, H_local, Dv] of this device's query rows (every head of
        them local, every page of their requests on this device: tp, dp). A step with a
        prefill_span [S, 2] runs those chunks in the expanded form and the other tokens absorbed."""
        if batch.prefill_span is None:
            o_latent, _ = self._attend(attn, attn.absorb(q_nope), q_pe, pools, batch)
            return attn.values(o_latent)
        num_tokens, spans = q_nope.shape[0], batch.prefill_span
        in_span = expanded.span_index(spans, num_tokens) >= 0
        absorbed = dataclasses.replace(batch, kv_lens=jnp.where(in_span[None], 0, batch.kv_lens))
        o_latent, _ = self._attend(attn, attn.absorb(q_nope), q_pe, pools, absorbed)
        # Each chunk's prefix in each segment: the slots before its first token's own slot.
        first = jnp.clip(spans[:, 0], 0, num_tokens - 1)
        prefix, rows = [], []
        for g, (lat_pool, _) in enumerate(pools):
            page = batch.write_page[g][first]
            held = ((page >= 0) & (page < lat_pool.shape[0])).astype(jnp.int32)
            prefix.append(jnp.where(spans[:, 1] > 0, batch.kv_lens[g][first] - held, 0))
            rows.append(batch.page_table[g][batch.token_request[first]])
        chunks = expanded.spans_attention(
            q_nope, q_pe, c, k_pe, pools, rows, prefix, spans,
            attn.w_uk[...], attn.w_uv[...], attn.cfg.softmax_scale, expanded.default_impl(q_nope.dtype),
        )
        o = attn.values(o_latent)
        return jnp.where(in_span[:, None, None], chunks.astype(o.dtype), o)

    def _segment(self, a):
        """This device's owner rows of a replicated [T, ...] array."""
        size = a.shape[0] // self.n
        return jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(AXIS) * size, size, axis=0)

    def _tp(self, attn, x, cos_sin, pools, batch):
        q_nope, q_pe = attn.queries(x)  # local heads, all tokens
        q_pe = apply_rope(q_pe, cos_sin, attn.cfg.rope.interleaved)
        c, k_pe = attn.roped_latent(x, cos_sin)
        pools = self._store(c, k_pe, pools, batch)  # my replica
        o = self._values(attn, q_nope, q_pe, c, k_pe, pools, batch)
        return jax.lax.psum(attn.project(o), AXIS), pools

    def _dp(self, attn, x, cos_sin, pools, batch):
        xs, cs = self._segment(x), self._segment(cos_sin)
        q_nope, q_pe = attn.queries(xs)  # all heads (replicated weights), my rows
        q_pe = apply_rope(q_pe, cs, attn.cfg.rope.interleaved)
        c, k_pe = attn.roped_latent(xs, cs)
        pools = self._store(c, k_pe, pools, batch)
        o = self._values(attn, q_nope, q_pe, c, k_pe, pools, batch)
        return jax.lax.all_gather(attn.project(o), AXIS, axis=0, tiled=True), pools

    def _dop(self, attn, x, cos_sin, pools, batch):
        cfg = attn.cfg
        xs, cs = self._segment(x), self._segment(cos_sin)
        if cfg.q_lora_rank is None:
            q = jnp.einsum("td,dhk->thk", x, attn.q_proj[...])
        else:
            qa = rms_norm(xs @ attn.q_a[...], attn.q_a_norm[...], LATENT_NORM_EPS)
            qa = jax.lax.all_gather(qa, AXIS, axis=0, tiled=True)  # q_lora rows of every owner
            q = jnp.einsum("tq,qhk->thk", qa, attn.q_b[...])  # local heads, all tokens
        q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
        q_pe = apply_rope(q_pe, cos_sin, cfg.rope.interleaved)
        q_all = jnp.concatenate([attn.absorb(q_nope), q_pe], axis=-1)
        # Head shards -> owners: my rows with every head.
        q_mine = jax.lax.all_to_all(q_all, AXIS, split_axis=0, concat_axis=1, tiled=True)
        pools = self._write(attn, xs, cs, pools, batch)
        o_latent, _ = self._attend(attn, q_mine[..., : cfg.kv_lora_rank], q_mine[..., cfg.kv_lora_rank :], pools, batch)
        # Owners -> head shards: every row, my heads.
        o_heads = jax.lax.all_to_all(o_latent, AXIS, split_axis=1, concat_axis=0, tiled=True)
        rows = jax.lax.psum_scatter(attn.output(o_heads), AXIS, scatter_dimension=0, tiled=True)
        return jax.lax.all_gather(rows, AXIS, axis=0, tiled=True), pools

    def _cp(self, attn, x, cos_sin, pools, batch):
        cfg = attn.cfg
        q_nope, q_pe = attn.queries(x)
        q_pe = apply_rope(q_pe, cos_sin, cfg.rope.interleaved)
        q_all = jnp.concatenate([attn.absorb(q_nope), q_pe], axis=-1)
        q_full = jax.lax.all_gather(q_all, AXIS, axis=1, tiled=True)  # every head, every token
        pools = self._write(attn, x, cos_sin, pools, batch)  # my stripe
        o_part, lse = self._attend(attn, q_full[..., : cfg.kv_lora_rank], q_full[..., cfg.kv_lora_rank :], pools, batch)
        t, h, l = o_part.shape
        # Partials over my pages -> the devices owning each head shard, source device on axis 1.
        o_part = jax.lax.all_to_all(o_part.reshape(t, self.n, h // self.n, l), AXIS, 1, 1, tiled=True)
        lse = jax.lax.all_to_all(lse.reshape(t, self.n, h // self.n), AXIS, 1, 1, tiled=True)
        o_latent, _ = merge_partial_attention(jnp.moveaxis(o_part, 1, 0), jnp.moveaxis(lse, 1, 0))
        return jax.lax.psum(attn.output(o_latent), AXIS), pools

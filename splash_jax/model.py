"""DeepSeek-V2/V3 family decoder in Flax NNX, serving over the paged latent cache.

Parameter layout puts the head axis explicit in every head-sharded attention weight
(q_b [q_lora, H, Dqk], w_uk [L, H, Dn], w_uv [L, H, Dv], o_proj [H, Dv, D]) so a layout's
sharding rule is "shard axis `heads`", never a reshape. Linear weights are stored [in, out].

Attention runs in the absorbed form (W_UK folded into the query, W_UV applied after attention
over the latent); `attention_impl="naive"` selects the non-absorbed form, kept as a check.

Decoder layers run under `lax.scan` by default (`RuntimeOptions.scan_layers`): one stacked module
per layer group (splash_jax/layer_groups.py), so compile time does not grow with depth. The
unrolled form (one module per layer, a Python loop) stays available for comparison. Both read
and write the stacked KV pool the same way (kv/cache.py: flat views, per-layer page offsets).

With `RuntimeOptions.mtp` the checkpoint's multi-token-prediction layers (splash_jax/mtp.py) are
built too: `mtp_forward` runs one draft step on the main model's `return_hidden` output, its latents
in pool layers num_layers.. (same pages, same page tables as the main layers).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from splash_jax.attention import dispatch
from splash_jax.attention.naive import naive_mla_attention
from splash_jax.kv.cache import KVCache, StepInput, layer_batch, store_latent
from splash_jax.layer_groups import layer_groups
from splash_jax.model_config import ModelConfig
from splash_jax.layers import LATENT_NORM_EPS, MLP, RMSNorm, init_param, logits_dot, rms_norm
from splash_jax.moe import MoE
from splash_jax.rope import apply_rope, inverse_frequencies



@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    """How the model computes (not what it is): dtype and attention implementation."""

    dtype: str = "float32"
    attention_impl: str = "auto"  # auto | xla | pallas | naive
    scan_layers: bool = True  # layers stacked per group under lax.scan (False: one module per layer, unrolled)
    expert_format: str = "model"  # routed experts: "model" (the dtype above) | "fp8" (e4m3 + block scales in HBM)
    moe_impl: str = "auto"  # routed experts' path (moe.MOE_IMPLS): auto = the Pallas kernel on GPUs, XLA elsewhere
    mtp: bool = False  # build the checkpoint's multi-token-prediction layers (splash_jax/mtp.py), the MTP draft


class MLAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs):
        d, h = cfg.hidden_size, cfg.arrays.num_heads  # padded heads (if any) have all-zero weights
        self.cfg = cfg
        if cfg.q_lora_rank is None:
            self.q_proj = init_param(rngs, (d, h, cfg.qk_head_dim), dtype)
        else:
            self.q_a = init_param(rngs, (d, cfg.q_lora_rank), dtype)
            self.q_a_norm = init_param(rngs, (cfg.q_lora_rank,), dtype, ones=True)
            self.q_b = init_param(rngs, (cfg.q_lora_rank, h, cfg.qk_head_dim), dtype)
        self.kv_a = init_param(rngs, (d, cfg.latent_dim), dtype)
        self.kv_a_norm = init_param(rngs, (cfg.kv_lora_rank,), dtype, ones=True)
        self.w_uk = init_param(rngs, (cfg.kv_lora_rank, h, cfg.qk_nope_head_dim), dtype)
        self.w_uv = init_param(rngs, (cfg.kv_lora_rank, h, cfg.v_head_dim), dtype)
        self.o_proj = init_param(rngs, (h, cfg.v_head_dim, d), dtype)

    def queries(self, x):
        """[T, D] -> q_nope [T, H, Dn], q_pe [T, H, R] (before rope)."""
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            q = jnp.einsum("td,dhk->thk", x, self.q_proj[...])
        else:
            qa = rms_norm(x @ self.q_a[...], self.q_a_norm[...], LATENT_NORM_EPS)
            q = jnp.einsum("tq,qhk->thk", qa, self.q_b[...])
        return q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]

    def latent(self, x):
        """[T, D] -> normalized latent [T, L], rope key [T, R] (before rope)."""
        kv = x @ self.kv_a[...]
        c = rms_norm(kv[:, : self.cfg.kv_lora_rank], self.kv_a_norm[...], LATENT_NORM_EPS)
        return c, kv[:, self.cfg.kv_lora_rank :]

    def absorb(self, q_nope):
        """Fold W_UK into the query: [T, H, Dn] -> [T, H, L] (over whichever heads are local)."""
        return jnp.einsum("thn,lhn->thl", q_nope, self.w_uk[...])

    def values(self, o_latent):
        """W_UV: attention output over latents [T, H, L] -> per-head values [T, H, Dv]."""
        return jnp.einsum("thl,lhv->thv", o_latent, self.w_uv[...])

    def project(self, o):
        """o_proj: per-head values [T, H, Dv] -> [T, D] (a partial sum when heads are sharded)."""
        w = self.o_proj[...]
        return jnp.einsum("thv,hvd->td", o.astype(w.dtype), w)

    def output(self, o_latent):
        """W_UV then o_proj: [T, H, L] -> [T, D] (a partial sum when heads are sharded)."""
        return self.project(self.values(o_latent))

    def roped_latent(self, x, cos_sin):
        """[T, D] -> the latent [T, L] and roped key [T, R] the cache stores for x's tokens."""
        c, k_pe = self.latent(x)
        return c, apply_rope(k_pe, cos_sin, self.cfg.rope.interleaved)

    def write_latent(self, x, cos_sin, pools, write_page, write_offset):
        """Compute the latent + roped key of x's tokens and scatter them into the pools."""
        return store_latent(pools, *self.roped_latent(x, cos_sin), write_page, write_offset)

    def __call__(self, x, cos_sin, pools, batch: StepInput, impl: str):
        """Single-device attention: every head, every token, one pool."""
        cfg = self.cfg
        q_nope, q_pe = self.queries(x)
        q_pe = apply_rope(q_pe, cos_sin, cfg.rope.interleaved)
        pools = self.write_latent(x, cos_sin, pools, batch.write_page, batch.write_offset)
        page_table = batch.page_table[batch.token_request]
        if impl == "naive":
            o = naive_mla_attention(
                q_nope, q_pe, *pools, page_table, batch.kv_lens,
                self.w_uk[...], self.w_uv[...], cfg.softmax_scale,
            )
            return jnp.einsum("thv,hvd->td", o, self.o_proj[...]), pools
        o_latent, _ = dispatch.paged_attention(
            self.absorb(q_nope), q_pe, *pools, page_table, batch.kv_lens, cfg.softmax_scale, impl=impl
        )
        return self.output(o_latent), pools


class LocalContext:
    """No mesh: the plain single-device computation (the reference every layout must match)."""

    def __init__(self, impl: str):
        self.impl = impl

    def attention(self, attn, x, cos_sin, pools, batch):
        out, pool = attn(x, cos_sin, pools[0], batch, self.impl)  # one device: one pool segment
        return out, (pool,)

    def reduce(self, x):
        return x

    def expert_offset(self, num_local: int):
        return 0

    def embed(self, table, tokens):
        return table[tokens]

    def logits(self, h, head):
        return logits_dot(h, head)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs, expert_format: str = "model", moe_impl: str = "auto"):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.attn = MLAttention(cfg, dtype, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, dtype, rngs, expert_format, moe_impl)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.arrays.intermediate_size, dtype, rngs)

    def __call__(self, x, cos_sin, pools, batch, ctx, stack_index=None):
        """stack_index: under scan, this layer's index in its group (the expert weights stay stacked)."""
        a, pools = ctx.attention(self.attn, self.input_norm(x), cos_sin, pools, batch)
        x = x + a
        h = self.post_attn_norm(x)
        if isinstance(self.mlp, MoE):
            mlp = self.mlp(h, ctx.expert_offset, layer=stack_index, valid=batch.valid)
        else:
            mlp = self.mlp(h)
        return x + ctx.reduce(mlp), pools


class DeepseekForCausalLM(nnx.Module):
    """Embeddings, decoder layers, final norm and LM head over the paged latent cache."""

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions = RuntimeOptions(), rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        dtype = jnp.dtype(options.dtype)
        self.cfg = cfg
        self.options = options
        vocab = cfg.arrays.vocab_size
        self.embed = init_param(rngs, (vocab, cfg.hidden_size), dtype, std=1.0)
        layers = [DecoderLayer(cfg, i, dtype, rngs, options.expert_format, options.moe_impl) for i in range(cfg.num_layers)]  # same init either way
        if options.scan_layers:
            for name, indices in layer_groups(cfg).items():
                setattr(self, name, stack_layers([layers[i] for i in indices]))
        else:
            self.layers = nnx.List(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = init_param(rngs, (cfg.hidden_size, vocab), dtype)
        if options.mtp and cfg.num_mtp_layers:  # built last: the main model's initialization is unchanged
            from splash_jax.mtp import build_mtp_layers

            self.mtp = build_mtp_layers(cfg, dtype, rngs, options.expert_format, options.moe_impl)

    @property
    def num_mtp_layers(self) -> int:
        """MTP layers this model holds (0 unless built with RuntimeOptions.mtp from a checkpoint with them)."""
        return len(self.mtp) if hasattr(self, "mtp") else 0

    def rope_cos_sin(self, positions):
        """[T, R] cos|sin rows computed on device (a table for 160K positions would be a 40 MB constant)."""
        inv_freq, factor = inverse_frequencies(self.cfg.rope, self.cfg.qk_rope_head_dim)
        freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
        return jnp.concatenate([jnp.cos(freqs), jnp.sin(freqs)], axis=-1) * factor

    def __call__(self, kv: KVCache, batch: StepInput, attention_impl: str | None = None, ctx=None,
                 return_hidden: bool | str = False):
        """One forward step: writes this step's latents, returns float32 logits [N, V] and the cache.

        `ctx` supplies the parallel parts (attention layout, reductions, vocab/expert shards);
        None runs everything on one device. `return_hidden` returns (logits, hidden, kv) instead:
        True gives the final hidden state (after the final norm: the LM head's input, what MTP
        consumes) of the rows at batch.logits_index [N, D]; "all" gives it for every token slot
        [T, D] (a prefill chunk's MTP step needs every position's, not only the rows with logits).
        """
        ctx = ctx or LocalContext(attention_impl or self.options.attention_impl)
        x = ctx.embed(self.embed[...], batch.tokens)
        cos_sin = self.rope_cos_sin(batch.positions)
        pools, pages, num_layers = kv.flat(), kv.pages_per_segment(), kv.num_layers

        def run_layer(layer, index, x, pools, stack_index=None):
            return layer(x, cos_sin, pools, layer_batch(batch, index, pages, num_layers), ctx, stack_index)

        if self.options.scan_layers:
            for name, indices in layer_groups(self.cfg).items():
                # Routed-expert tensors are not scanned over: the layer reads its slice of the
                # stack by index (a scanned slice is copied whole before a kernel reads it).
                graphdef, experts, state = nnx.split(getattr(self, name), _is_routed_expert, ...)

                def body(carry, xs, graphdef=graphdef, experts=experts, start=indices.start):
                    layer_state, index = xs
                    layer = nnx.merge(graphdef, layer_state, experts)
                    return run_layer(layer, index, *carry, stack_index=index - start), None

                index = jnp.arange(indices.start, indices.stop, dtype=jnp.int32)
                (x, pools), _ = jax.lax.scan(body, (x, pools), (state, index))
        else:
            for i, layer in enumerate(self.layers):
                x, pools = run_layer(layer, i, x, pools)
        if return_hidden == "all":
            hidden = self.norm(x)
            h = hidden[batch.logits_index]
        else:
            h = self.norm(x[batch.logits_index])
            hidden = h
        logits = self._logits(h, ctx)
        if return_hidden:
            return logits, hidden, kv.unflat(pools)
        return logits, kv.unflat(pools)

    def _logits(self, h, ctx):
        head = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        logits = ctx.logits(h, head)
        if logits.shape[-1] != self.cfg.vocab_size:  # padded vocabulary rows are never sampled
            logits = logits[:, : self.cfg.vocab_size]
        return logits

    def mtp_forward(self, kv: KVCache, batch: StepInput, hidden, ctx=None, attention_impl: str | None = None,
                    mtp_layer: int = 0):
        """One MTP draft step (splash_jax/mtp.py): -> (float32 logits [N, V] of the rows at
        batch.logits_index, their output hidden state [N, D] (the next draft's `hidden`), kv).

        batch.tokens hold the token at t+1 for each slot at position t (its prediction is token
        t+2); `hidden` [T, D] is the previous depth's hidden state of each token slot (the main
        model's `return_hidden` output for the first draft). Latents go to pool layer
        num_layers + mtp_layer, addressed by the same page tables as the main layers, so a
        request's MTP cache lives in its own pages and moves with them. `ctx` as in __call__.
        """
        cfg = self.cfg
        if not self.num_mtp_layers:
            raise ValueError("this model has no MTP layers: load a checkpoint with num_nextn_predict_layers > 0 "
                             "with RuntimeOptions(mtp=True)")
        if kv.num_layers != cfg.num_layers + self.num_mtp_layers:
            raise ValueError(f"the KV pool has {kv.num_layers} layers, the model with MTP needs "
                             f"{cfg.num_layers + self.num_mtp_layers} (make it with this model's new_cache)")
        ctx = ctx or LocalContext(attention_impl or self.options.attention_impl)
        embedded = ctx.embed(self.embed[...], batch.tokens)
        cos_sin = self.rope_cos_sin(batch.positions)
        layer = self.mtp[mtp_layer]
        step = layer_batch(batch, cfg.num_layers + mtp_layer, kv.pages_per_segment(), kv.num_layers)
        x, pools = layer(embedded, hidden, cos_sin, kv.flat(), step, ctx)
        out = layer.norm(x[batch.logits_index])
        return self._logits(out, ctx), out, kv.unflat(pools)

    def layer(self, i: int) -> DecoderLayer:
        """Layer i as a module (a view of its slice of the stacked weights when scanned): for checks."""
        if not self.options.scan_layers:
            return self.layers[i]
        for name, indices in layer_groups(self.cfg).items():
            if i in indices:
                graphdef, state = nnx.split(getattr(self, name))
                return nnx.merge(graphdef, jax.tree.map(lambda x: x[i - indices.start], state))
        raise IndexError(f"layer {i} of a {self.cfg.num_layers}-layer model")

    def new_cache(self, num_pages: int, page_size: int, sharding=None, extra_pages: int = 0,
                  abstract: bool = False) -> KVCache:
        """sharding: of the whole [L, P, S, D] pool arrays (mesh/layouts.POOL_SPEC on a mesh).
        With MTP layers the pool has num_layers + num_mtp_layers layers, MTP layer j's at num_layers + j.
        abstract: shapes only (KVCache.abstract), nothing allocated."""
        cfg = self.cfg
        return (KVCache.abstract if abstract else KVCache.zeros)(
            cfg.num_layers + self.num_mtp_layers, num_pages, page_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
            jnp.dtype(self.options.dtype), sharding, extra_pages,
        )


ROUTED_EXPERT_PARAMS = ("experts_gate", "experts_up", "experts_down",
                        "experts_gate_scale", "experts_up_scale", "experts_down_scale")


def _is_routed_expert(path, _value) -> bool:
    return bool(path) and path[-1] in ROUTED_EXPERT_PARAMS


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """One module whose parameters stack the given layers' (same structure) on a leading axis."""
    graphdef, _ = nnx.split(layers[0])
    states = [nnx.split(layer)[1] for layer in layers]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))

"""DeepSeek-V3's multi-token-prediction (MTP) layer, the draft model of MTP speculative decoding.

A checkpoint with `num_nextn_predict_layers` = n stores n extra layers at indices num_layers..
(`model.layers.61.*` in DeepSeek-V3/R1): a full decoder layer (MLA + MoE, as `is_moe_layer(61)`
says) plus `enorm`, `hnorm` (RMSNorms), `eh_proj` (Linear 2D -> D) and `shared_head.norm`.
A step at position t takes token_{t+1} and hidden_t and predicts token_{t+2}:

    x      = eh_proj(concat(enorm(embed(token_{t+1})), hnorm(hidden_t)))   # embedding half first
    x      = decoder layer(x)          # its own latent KV cache: pool layer num_layers + j
    hidden = shared_head.norm(x)       # this step's output hidden state
    logits = head(hidden)              # the main model's LM head

hidden_t of the first draft is the main model's final hidden state at t AFTER its final norm (the
LM head's input), as vLLM (deepseek_mtp.py) and SGLang (deepseek_nextn.py) feed it; the concat
order is theirs too. The next draft runs at position t+1 on the draft token and this step's output
hidden (SGLang chains its one MTP layer so for K > 1 drafts). With n MTP layers, draft k uses
layer j = (k - 1) % n (as vLLM cycles them); DeepSeek-V3/R1 have n = 1: every draft uses layer 0
and its cache.

The embedding and LM head are the main model's: the checkpoint's copies (`embed_tokens`,
`shared_head.head`, equal to them in DeepSeek's releases) are not loaded and not checked
(reading two vocab x hidden tensors to compare them would cost seconds of start-up for V3), and
the export does not write them unless asked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from splash_jax.kv.cache import layer_batch
from splash_jax.layers import RMSNorm, init_param, logits_dot
from splash_jax.model_config import ModelConfig


class MTPLayer(nnx.Module):
    """enorm, hnorm, eh_proj, one decoder layer and the shared-head norm (parameters only; the
    model's `mtp_forward` supplies the embedding, the head, the pool and the parallel context)."""

    def __init__(self, cfg: ModelConfig, index: int, dtype, rngs, expert_format: str = "model", moe_impl: str = "auto"):
        from splash_jax.model import DecoderLayer  # model.py imports this module lazily too

        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps, dtype, rngs)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps, dtype, rngs)
        self.eh_proj = init_param(rngs, (2 * d, d), dtype)  # [in, out]: rows :d multiply the embedding
        # `index` is the checkpoint's layer index (num_layers + depth - 1): MoE or dense as it says.
        self.decoder = DecoderLayer(cfg, index, dtype, rngs, expert_format, moe_impl)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype, rngs)  # shared_head.norm

    def __call__(self, embedded, hidden, cos_sin, pools, batch, ctx):
        """embedded [T, D] (embed(token_{t+k})), hidden [T, D] -> pre-norm output [T, D], pools.
        `batch` already addresses this layer's pool layer (kv/cache.layer_batch)."""
        return self.decoder(self.inputs(embedded, hidden), cos_sin, pools, batch, ctx)

    def inputs(self, embedded, hidden):
        """The decoder layer's input [T, D]: eh_proj of the normed embedding and hidden state."""
        e = self.enorm(embedded)
        h = self.hnorm(hidden.astype(e.dtype))
        return jnp.concatenate([e, h], axis=-1) @ self.eh_proj[...]


def build_mtp_layers(cfg: ModelConfig, dtype, rngs, expert_format: str, moe_impl: str) -> nnx.List:
    """One MTPLayer per checkpoint MTP layer (DeepSeek-V3/R1: one, at index num_layers)."""
    return nnx.List([
        MTPLayer(cfg, cfg.num_layers + j, dtype, rngs, expert_format, moe_impl) for j in range(cfg.num_mtp_layers)
    ])


# --- the pieces of `DeepseekForCausalLM.mtp_forward` the draft program (engine/mtp_draft.py) runs ---
def mtp_layer_output(model, kv, batch, hidden, ctx, embedded=None, cos_sin=None, mtp_layer: int = 0):
    """mtp_forward without its head: the layer's pre-norm output [T, D] at every token slot and the
    pool with its latents written. `embedded` / `cos_sin` may come precomputed (the draft chain
    computes every chain step's rope rows at once); by default as mtp_forward computes them."""
    cfg = model.cfg
    if embedded is None:
        embedded = ctx.embed(model.embed[...], batch.tokens)
    if cos_sin is None:
        cos_sin = model.rope_cos_sin(batch.positions)
    step = layer_batch(batch, cfg.num_layers + mtp_layer, kv.pages_per_segment(), kv.num_layers)
    x, pools = model.mtp[mtp_layer](embedded, hidden, cos_sin, kv.flat(), step, ctx)
    return x, kv.unflat(pools)


def mtp_latents(model, kv, batch, hidden, ctx, mtp_layer: int = 0):
    """What mtp_layer_output writes to the pool, and nothing else: the MTP layer's latent at every
    token slot (its input projection, the attention norm and the latent projection; no attention
    read, no MoE, no head). Drafting later attends over them as if the whole layer had run."""
    cfg = model.cfg
    layer = model.mtp[mtp_layer]
    x = layer.inputs(ctx.embed(model.embed[...], batch.tokens), hidden)
    step = layer_batch(batch, cfg.num_layers + mtp_layer, kv.pages_per_segment(), kv.num_layers)
    pools = ctx.write_latents(layer.decoder.attn, layer.decoder.input_norm(x), model.rope_cos_sin(batch.positions),
                              kv.flat(), step)
    return kv.unflat(pools)


def lm_head(model):
    """The LM head [D, V] the MTP layer shares with the main model (inside shard_map: this device's columns)."""
    return model.embed[...].T if model.cfg.tie_word_embeddings else model.lm_head[...]


def greedy_tokens(h, head, vocab_size: int, axis: str | None = None):
    """argmax over the vocabulary of the logits h [C, D] (normed) @ head: int32 [C], equal to
    jnp.argmax of model._logits (first index on ties; padded columns >= vocab_size never win).
    Inside shard_map over `axis` the head is vocab-sharded: each device takes the argmax of its
    own logits columns and only (max, index) pairs are gathered, not the float32 [C, V] logits
    (13 MB per device at 32 rows of V2-Lite's 102,400-token vocabulary); the first shard that
    holds the maximum wins, as in one argmax over the gathered logits."""
    width = head.shape[1]
    first = jax.lax.axis_index(axis) * width if axis is not None else 0
    local = logits_dot(h, head)  # [C, width]: this device's columns of the logits ctx.logits gathers
    column = first + jnp.arange(width, dtype=jnp.int32)
    local = jnp.where(column[None] < vocab_size, local, -jnp.inf)  # fused into the argmax's reduction
    index = jnp.argmax(local, axis=-1).astype(jnp.int32)
    if axis is None:
        return index
    best = jnp.take_along_axis(local, index[:, None], axis=-1)[:, 0]
    # one collective: token ids < 2^24 are exact in float32
    pairs = jax.lax.all_gather(jnp.stack([best, (index + first).astype(jnp.float32)]), axis)  # [N, 2, C]
    win = jnp.argmax(pairs[:, 0], axis=0)
    return jnp.take_along_axis(pairs[:, 1], win[None], axis=0)[0].astype(jnp.int32)

"""DeepSeek mixture-of-experts: the router (V2 softmax / V3 sigmoid with bias) and the experts.

Experts are stacked [E, ...] so one sharding rule ("shard the expert axis") places them.
Experts may be sharded over devices (each holds a contiguous range); ids outside the local
range get weight 0 and the caller sums the partial results.
Two exact expert paths, picked statically by the step's token count: with very few tokens
(4 * tokens * top_k <= experts) only the chosen experts' weights are gathered and read; otherwise
every expert runs over every token with a sparse combine weight, which is what a
weight-read-bound step pays anyway once the batch touches most experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from splash_jax.layers import MLP, init_param
from splash_jax.model_config import ModelConfig


def route(cfg: ModelConfig, logits: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] (float32) -> (top-k expert ids [T, k], combine weights [T, k]).

    Exactly transformers' two routers (the parity reference):
    - DeepseekV2 (softmax; greedy or group_limited_greedy): groups scored by their best expert,
      the other groups' scores set to 0.0, weights read from those masked scores, never renormalized;
    - DeepseekV3 (sigmoid; noaux_tc): choice = score + e_score_correction_bias, groups scored by the
      sum of their top-2 choices, the other groups set to -inf (transformers >= 5 and DeepSeek's own
      inference code; older transformers and the hub's remote code used 0.0), weights from the
      unbiased scores, renormalized when norm_topk_prob.
    Ties break toward the lower expert id in both (lax.top_k and torch.topk on CPU).
    """
    num_tokens, num_experts = logits.shape
    k = cfg.num_experts_per_tok
    v3 = cfg.topk_method == "noaux_tc"
    scores = jax.nn.sigmoid(logits) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores + bias if (v3 and bias is not None) else scores
    if cfg.topk_method != "greedy" and cfg.n_group > 1:
        grouped = choice.reshape(num_tokens, cfg.n_group, num_experts // cfg.n_group)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1) if v3 else grouped.max(-1)
        _, top_groups = jax.lax.top_k(group_score, cfg.topk_group)
        keep = jnp.zeros((num_tokens, cfg.n_group), bool).at[jnp.arange(num_tokens)[:, None], top_groups].set(True)
        keep = jnp.repeat(keep, num_experts // cfg.n_group, axis=1)
        choice = jnp.where(keep, choice, -jnp.inf if v3 else 0.0)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores if v3 else choice, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs):
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        # The router scores only the real experts, so padded experts (array rows >= e) are never routed.
        self.router = init_param(rngs, (d, e), jnp.float32, std=d ** -0.5)
        if cfg.topk_method == "noaux_tc":
            self.router_bias = init_param(rngs, (e,), jnp.float32, std=0.0)
        e = cfg.arrays.n_routed_experts
        # All three [E, I, D] (gate/up as HF's [out, in]): on GPU the dense path then needs no
        # per-step relayout of the expert tensors (benchmarks/moe_paths.py measured 2x).
        self.experts_gate = init_param(rngs, (e, i, d), dtype)
        self.experts_up = init_param(rngs, (e, i, d), dtype)
        self.experts_down = init_param(rngs, (e, i, d), dtype)
        if cfg.n_shared_experts:
            self.shared = MLP(d, cfg.arrays.shared_intermediate_size, dtype, rngs)

    def __call__(self, x, expert_offset=None):
        """Routed + shared experts. With experts sharded, `expert_offset(num_local)` gives this
        device's first expert id and the result is this device's partial sum."""
        cfg = self.cfg
        num_local = self.experts_gate.shape[0]
        offset = expert_offset(num_local) if expert_offset else 0
        logits = jnp.dot(x.astype(jnp.float32), self.router[...])
        bias = self.router_bias[...] if cfg.topk_method == "noaux_tc" else None
        ids, weights = route(cfg, logits, bias)
        local = ids - offset
        weights = jnp.where((local >= 0) & (local < num_local), weights, 0.0)
        local = jnp.clip(local, 0, num_local - 1)
        if 4 * x.shape[0] * cfg.num_experts_per_tok <= num_local:
            out = self._gathered(x, local, weights)
        else:
            out = self._dense(x, local, weights)
        if cfg.n_shared_experts:
            out = out + self.shared(x)
        return out

    def _gathered(self, x, ids, weights):
        """Few tokens: read only the chosen experts' weights (decode at small batch is weight-read bound)."""
        gate, up, down = self.experts_gate[...][ids], self.experts_up[...][ids], self.experts_down[...][ids]
        h = jax.nn.silu(jnp.einsum("td,tkid->tki", x, gate)) * jnp.einsum("td,tkid->tki", x, up)
        h = h * weights.astype(h.dtype)[..., None]
        return jnp.einsum("tki,tkid->td", h, down)

    def _dense(self, x, ids, weights):
        """Many tokens: every expert over every token with a sparse combine weight (exact)."""
        combine = jnp.zeros((x.shape[0], self.experts_gate.shape[0]), jnp.float32)
        combine = combine.at[jnp.arange(x.shape[0])[:, None], ids].add(weights)
        h = jax.nn.silu(jnp.einsum("td,eid->tei", x, self.experts_gate[...]))
        h = h * jnp.einsum("td,eid->tei", x, self.experts_up[...])
        h = h * combine.astype(h.dtype)[..., None]
        return jnp.einsum("tei,eid->td", h, self.experts_down[...])

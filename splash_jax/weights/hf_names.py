"""The one table from HuggingFace DeepSeek tensor names to this model's parameter paths.

Each entry says which checkpoint tensors feed a parameter, the shape each must have, and how
to turn them into the parameter's layout ([in, out] linears, explicit head axis, stacked experts).
Expert parameters read only the experts a device asks for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from splash_jax.model_config import ModelConfig

Path = tuple


@dataclasses.dataclass
class ParamSource:
    """How to produce one parameter (or a slice of its leading expert axis) from the checkpoint."""

    names: list[str]  # checkpoint tensors used (for validation and errors)
    shapes: list[tuple[int, ...]]  # their expected shapes
    build: Callable[[Callable[[str], np.ndarray], slice], np.ndarray]  # (read, expert_slice) -> array
    per_expert: bool = False
    fp8_part: str | None = None  # FP8 experts: "values" or "scales" of each tensor (read = its part)


def _single(name: str, shape: tuple[int, ...], fn=lambda w: w) -> ParamSource:
    return ParamSource([name], [shape], lambda read, _: fn(read(name)))


def _t(w):
    return w.T


def param_sources(cfg: ModelConfig, fp8_experts: bool = False) -> dict[Path, ParamSource]:
    """fp8_experts: routed experts as FP8 values (`experts_*`) + block scales (`experts_*_scale`)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out: dict[Path, ParamSource] = {
        ("embed",): _single("model.embed_tokens.weight", (v, d)),
        ("norm", "weight"): _single("model.norm.weight", (d,)),
    }
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = _single("lm_head.weight", (v, d), _t)
    for layer in range(cfg.num_layers):
        out.update(_decoder_sources(cfg, layer, ("layers", layer), fp8_experts))
    for j in range(cfg.num_mtp_layers):
        out.update(mtp_sources(cfg, j, fp8_experts))
    return out


def _decoder_sources(cfg: ModelConfig, layer: int, L: tuple, fp8_experts: bool) -> dict[Path, ParamSource]:
    """Checkpoint layer `layer`'s decoder tensors (attention, norms, MLP or MoE) under parameter path `L`."""
    d, h = cfg.hidden_size, cfg.num_heads
    n, r, vd, lat = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    qk = n + r
    out: dict[Path, ParamSource] = {}
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    out[L + ("input_norm", "weight")] = _single(p + "input_layernorm.weight", (d,))
    out[L + ("post_attn_norm", "weight")] = _single(p + "post_attention_layernorm.weight", (d,))
    if cfg.q_lora_rank is None:
        out[L + ("attn", "q_proj")] = _single(a + "q_proj.weight", (h * qk, d), lambda w: w.T.reshape(d, h, qk))
    else:
        q = cfg.q_lora_rank
        out[L + ("attn", "q_a")] = _single(a + "q_a_proj.weight", (q, d), _t)
        out[L + ("attn", "q_a_norm")] = _single(a + "q_a_layernorm.weight", (q,))
        out[L + ("attn", "q_b")] = _single(a + "q_b_proj.weight", (h * qk, q), lambda w, q=q: w.T.reshape(q, h, qk))
    out[L + ("attn", "kv_a")] = _single(a + "kv_a_proj_with_mqa.weight", (lat + r, d), _t)
    out[L + ("attn", "kv_a_norm")] = _single(a + "kv_a_layernorm.weight", (lat,))
    kv_b_shape = (h * (n + vd), lat)
    out[L + ("attn", "w_uk")] = _single(
        a + "kv_b_proj.weight", kv_b_shape, lambda w: w.reshape(h, n + vd, lat)[:, :n].transpose(2, 0, 1)
    )
    out[L + ("attn", "w_uv")] = _single(
        a + "kv_b_proj.weight", kv_b_shape, lambda w: w.reshape(h, n + vd, lat)[:, n:].transpose(2, 0, 1)
    )
    out[L + ("attn", "o_proj")] = _single(a + "o_proj.weight", (d, h * vd), lambda w: w.T.reshape(h, vd, d))
    m = p + "mlp."
    if cfg.is_moe_layer(layer):
        e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
        out[L + ("mlp", "router")] = _single(m + "gate.weight", (e, d), _t)
        if cfg.topk_method == "noaux_tc":
            out[L + ("mlp", "router_bias")] = _single(m + "gate.e_score_correction_bias", (e,))
        for ours, theirs, shape in (("gate", "gate_proj", (i, d)), ("up", "up_proj", (i, d)), ("down", "down_proj", (d, i))):
            if fp8_experts:
                out[L + ("mlp", f"experts_{ours}")] = _experts(m, theirs, shape, e, "values")
                out[L + ("mlp", f"experts_{ours}_scale")] = _experts(m, theirs, shape, e, "scales")
            else:
                out[L + ("mlp", f"experts_{ours}")] = _experts(m, theirs, shape, e)
        if cfg.n_shared_experts:
            si = i * cfg.n_shared_experts
            out[L + ("mlp", "shared", "gate")] = _single(m + "shared_experts.gate_proj.weight", (si, d), _t)
            out[L + ("mlp", "shared", "up")] = _single(m + "shared_experts.up_proj.weight", (si, d), _t)
            out[L + ("mlp", "shared", "down")] = _single(m + "shared_experts.down_proj.weight", (d, si), _t)
    else:
        di = cfg.intermediate_size
        out[L + ("mlp", "gate")] = _single(m + "gate_proj.weight", (di, d), _t)
        out[L + ("mlp", "up")] = _single(m + "up_proj.weight", (di, d), _t)
        out[L + ("mlp", "down")] = _single(m + "down_proj.weight", (d, di), _t)
    return out


def mtp_layer_index(cfg: ModelConfig, j: int) -> int:
    """The checkpoint layer index of MTP layer j (DeepSeek-V3: 61, after the 61 decoder layers)."""
    return cfg.num_layers + j


def mtp_sources(cfg: ModelConfig, j: int, fp8_experts: bool = False) -> dict[Path, ParamSource]:
    """MTP layer j (splash_jax/mtp.py): its decoder layer plus enorm, hnorm, eh_proj and
    shared_head.norm. Its `embed_tokens` and `shared_head.head` copies are not read (the model
    uses the main embedding and LM head)."""
    d = cfg.hidden_size
    layer = mtp_layer_index(cfg, j)
    p, path = f"model.layers.{layer}.", ("mtp", j)
    out = _decoder_sources(cfg, layer, path + ("decoder",), fp8_experts)
    out[path + ("enorm", "weight")] = _single(p + "enorm.weight", (d,))
    out[path + ("hnorm", "weight")] = _single(p + "hnorm.weight", (d,))
    out[path + ("eh_proj",)] = _single(p + "eh_proj.weight", (d, 2 * d), _t)
    out[path + ("norm", "weight")] = _single(p + "shared_head.norm.weight", (d,))
    return out


def _experts(prefix: str, proj: str, shape: tuple[int, int], num_experts: int, fp8_part: str | None = None) -> ParamSource:
    """Experts saved one per expert ([out, in] each), stacked as [E, I, D]: gate/up keep HF's
    [out, in] = [I, D]; down ([D, I] in HF) is transposed to [I, D] (FP8 block scales likewise:
    [I/b, D/b])."""
    names = [f"{prefix}experts.{e}.{proj}.weight" for e in range(num_experts)]
    transpose = proj == "down_proj"

    def build(read, experts: slice):
        ids = range(num_experts)[experts]
        if not ids:  # a device holding only padded experts reads nothing (shape: the caller pads)
            return np.zeros((0, 0, 0), np.float32)
        return np.stack([read(names[e]).T if transpose else read(names[e]) for e in ids])

    return ParamSource(names, [shape] * num_experts, build, per_expert=True, fp8_part=fp8_part)

"""Generate the tiny DeepSeek reference fixtures that the JAX tests compare against.

Why this exists
---------------
splash-jax reimplements DeepSeek MLA models (V2 / V2-Lite / V3) in JAX.  To test that
reimplementation bit-for-bit-ish without downloading real checkpoints, and WITHOUT the JAX
tests ever importing torch, we build two tiny randomly-initialised models with the
HuggingFace `transformers` reference implementation, save them in the original
DeepSeek / HF-hub checkpoint layout, and record reference outputs in `reference.npz`:

    tests/fixtures/v3_tiny/      DeepseekV3ForCausalLM  (q_lora, sigmoid + noaux_tc group routing,
                                 e_score_correction_bias, rope_interleave, no rope scaling),
                                 weights sharded into 2 safetensors files + model.safetensors.index.json
    tests/fixtures/v2lite_tiny/  DeepseekV2ForCausalLM  (q_proj, softmax greedy routing,
                                 YaRN rope scaling with mscale), single model.safetensors
    tests/fixtures/v3_groupmask_tiny/  DeepseekV3ForCausalLM, 16 experts in 4 groups, top-4 of the 2 kept
                                 groups, negative e_score_correction_bias: many tokens have fewer than 4
                                 kept experts with a positive choice score, the case where masking the
                                 other groups with -inf (transformers >= 5) and with 0.0 (older
                                 transformers, the hub's remote code) route differently
    tests/fixtures/v2_group_tiny/  DeepseekV2ForCausalLM, q_lora, softmax group_limited_greedy (4 groups,
                                 2 kept), norm_topk_prob=true in config.json (transformers' V2 ignores it)
    tests/fixtures/v3_fp8_tiny/  DeepseekV3ForCausalLM stored like DeepSeek-V3's release: every linear of
                                 the decoder layers as float8_e4m3fn with a 128x128-block weight_scale_inv
                                 (partial edge blocks: 576-row kv_a, 96-wide experts) and a
                                 quantization_config; the reference runs transformers on the dequantized
                                 weights (value * scale_inv of its block), so the fixture checks loading
                                 and dequantization, not FP8 rounding

Each folder holds: config.json (HF format + the original DeepSeek fields), safetensors
weights (original tensor names, routed experts saved one-per-expert), and reference.npz with

    prompt_ids       int32   [P]            P = 23 seeded random ids
    prefill_logits   float32 [P, V]         single forward over the prompt
    greedy_ids       int32   [16]           greedy_ids[0] = argmax(prefill_logits[-1]),
                                            greedy_ids[i+1] = argmax(decode_logits[i])
    decode_logits    float32 [16, V]        logits after feeding greedy_ids[i] (position P+i) with the HF cache
    cache_latent     float32 [L, P+16, kv_lora_rank]   HF cache: kv_a_layernorm(compressed kv) (not roped)
    cache_rope       float32 [L, P+16, qk_rope_head_dim] HF cache: roped k_pe
    cache_rope_order str     0-d            "split" (V3: [even-pair results..., odd-pair results...])
                                            or "interleaved" (V2: complex pairs (x0,x1),(x2,x3)... in place)
    full_logits      float32 [P+16, V]      one non-cached forward over prompt + greedy_ids
    rope_inv_freq    float32 [rope/2]       (extra) inverse frequencies actually used (YaRN-adjusted for V2)
    rope_attention_scaling float32 0-d      (extra) factor HF multiplies into cos/sin
    softmax_scale    float32 0-d            (extra) attention softmax scale (includes YaRN mscale^2)
    group_mask_cases int32   0-d            (extra) routed token-layers where a 0.0 group mask would
                                            choose other experts than transformers' mask

Everything is float32 with attn_implementation="eager" and experts_implementation="eager".
The script tries N_SEEDS seeds and keeps the one whose routing decisions (expert top-k and V3 group
top-k) and greedy argmaxes are farthest from ties (must be > 1e-3 everywhere), and checks that
reloading the folder with `from_pretrained` reproduces the logits exactly.

How to run (from the repo root; needs only torch, transformers, safetensors, numpy):

    python -m venv .venv-ref && .venv-ref/bin/pip install torch==2.13.0 transformers safetensors numpy
    .venv-ref/bin/python scripts/make_reference_fixtures.py            # both fixtures
    .venv-ref/bin/python scripts/make_reference_fixtures.py v3_tiny    # just one

Generated with transformers 5.24.0 / torch 2.13.0 (CPU).  Output is deterministic for a given
library version.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"

PROMPT_LEN = 23
N_DECODE = 16
MARGIN = 1e-3  # minimum gap for every discrete decision (routing, group choice, greedy argmax)
MIN_DISTINCT_GREEDY = 10
N_SEEDS = 32  # seeds tried per fixture (base_seed .. base_seed + N_SEEDS - 1)
ROUTER_STD_TIMES_SQRT_H = 2.0
LM_HEAD_STD = 0.25

# --------------------------------------------------------------------------------------
# Model specs
# --------------------------------------------------------------------------------------

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
    initializer_range=0.02,
)

V3_HF = dict(
    COMMON,
    q_lora_rank=48,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_interleave=True,
    num_mtp_layers=0,
    bos_token_id=0,
    eos_token_id=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
# Fields of the original DeepSeek-V3 config.json that HF's DeepseekV3Config does not keep.
V3_EXTRA = dict(
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    moe_layer_freq=1,
    rope_theta=10000.0,
    rope_scaling=None,
    num_nextn_predict_layers=0,
    ep_size=1,
)

V2_YARN = {
    "type": "yarn",
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
V2_HF = dict(
    COMMON,
    q_lora_rank=None,
    kv_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_shared_experts=2,
    n_group=1,
    topk_group=1,
    topk_method="greedy",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    bos_token_id=0,  # real V2-Lite uses 100000/100001, which do not fit the tiny vocab
    eos_token_id=1,
    rope_parameters=dict(V2_YARN, rope_theta=10000.0),
)
V2_EXTRA = dict(
    scoring_func="softmax",
    moe_layer_freq=1,
    rope_theta=10000.0,
    rope_scaling=dict(V2_YARN),
    aux_loss_alpha=0.001,
    seq_aux=True,
)

V3_GROUPMASK_HF = dict(V3_HF, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
V2_GROUP_HF = dict(
    V2_HF,
    q_lora_rank=48,
    n_routed_experts=16,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    topk_method="group_limited_greedy",
    norm_topk_prob=True,  # kept in config.json on purpose: transformers' DeepseekV2 ignores it
    routed_scaling_factor=16.0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
V2_GROUP_EXTRA = dict(V2_EXTRA, rope_scaling=None)

V3_FP8_HF = dict(
    V3_HF, hidden_size=256, intermediate_size=384, moe_intermediate_size=96, q_lora_rank=192,
    qk_nope_head_dim=64, v_head_dim=64,
)
FP8_BLOCK = (128, 128)
V3_FP8_EXTRA = dict(
    V3_EXTRA,
    quantization_config={
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(FP8_BLOCK),
    },
)

SPECS = {
    "v3_tiny": dict(
        arch="DeepseekV3ForCausalLM",
        model_cls=DeepseekV3ForCausalLM,
        config_cls=DeepseekV3Config,
        hf=V3_HF,
        extra=V3_EXTRA,
        n_shards=2,
        base_seed=3000,
        rope_order="split",
    ),
    "v2lite_tiny": dict(
        arch="DeepseekV2ForCausalLM",
        model_cls=DeepseekV2ForCausalLM,
        config_cls=DeepseekV2Config,
        hf=V2_HF,
        extra=V2_EXTRA,
        n_shards=1,
        base_seed=2000,
        rope_order="interleaved",
    ),
    "v3_groupmask_tiny": dict(
        arch="DeepseekV3ForCausalLM",
        model_cls=DeepseekV3ForCausalLM,
        config_cls=DeepseekV3Config,
        hf=V3_GROUPMASK_HF,
        extra=V3_EXTRA,
        n_shards=1,
        base_seed=4000,
        rope_order="split",
        bias_range=(-0.8, -0.3),  # sigmoid + bias < 0 for many experts: the mask value matters
        min_group_mask_cases=8,
    ),
    "v2_group_tiny": dict(
        arch="DeepseekV2ForCausalLM",
        model_cls=DeepseekV2ForCausalLM,
        config_cls=DeepseekV2Config,
        hf=V2_GROUP_HF,
        extra=V2_GROUP_EXTRA,
        n_shards=1,
        base_seed=5000,
        rope_order="interleaved",
        router_std=4.0,  # wider softmax: group and expert choices far from ties
    ),
    "v3_fp8_tiny": dict(
        arch="DeepseekV3ForCausalLM",
        model_cls=DeepseekV3ForCausalLM,
        config_cls=DeepseekV3Config,
        hf=V3_FP8_HF,
        extra=V3_FP8_EXTRA,
        n_shards=2,
        base_seed=6000,
        rope_order="split",
        fp8=True,
    ),
}


# --------------------------------------------------------------------------------------
# FP8 block quantization (the recipe of DeepSeek-V3's release and transformers' FineGrainedFP8)
# --------------------------------------------------------------------------------------

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def is_fp8_linear(name: str) -> bool:
    """Which tensors DeepSeek-V3 ships in FP8: every linear inside the decoder layers except the router."""
    return name.startswith("model.layers.") and name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")


def quantize_block_fp8(w: torch.Tensor, block=FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (possibly partial) block: scale = 448 / amax, q = e4m3(clamp(w * scale)), scale_inv = 1 / scale."""
    rows, cols = w.shape
    bm, bn = block
    gr, gc = -(-rows // bm), -(-cols // bn)
    padded = torch.zeros(gr * bm, gc * bn, dtype=torch.float32)
    padded[:rows, :cols] = w
    tiles = padded.reshape(gr, bm, gc, bn)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.ones_like(amax))
    q = torch.clamp(tiles * scale[:, None, :, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(gr * bm, gc * bn)[:rows, :cols].contiguous(), (1.0 / scale).to(torch.float32)


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block=FP8_BLOCK) -> torch.Tensor:
    rows, cols = q.shape
    s = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return q.to(torch.float32) * s


def fp8_checkpoint(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint as stored: FP8 linears with their `weight_scale_inv`, the rest unchanged."""
    out = {}
    for name, t in ckpt.items():
        if is_fp8_linear(name):
            out[name], out[name + "_scale_inv"] = quantize_block_fp8(t)
        else:
            out[name] = t
    return out


def dequantized(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a loader must reconstruct from the stored FP8 checkpoint (the reference's weights)."""
    return {
        name: dequantize_block_fp8(t, stored[name + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
        for name, t in stored.items()
        if not name.endswith("_scale_inv")
    }


def check_fp8_recipe_against_transformers(stored: dict[str, torch.Tensor], ckpt: dict[str, torch.Tensor]):
    """Our block quantizer equals transformers' FineGrainedFP8 one, and our dequantization equals
    transformers' Fp8Dequantize, on every tensor whose shape is a whole number of blocks (the only
    ones transformers handles: it derives the block from the scale grid)."""
    from types import SimpleNamespace

    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    quantizer = SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=FP8_BLOCK))
    checked = 0
    for name, q in stored.items():
        if q.dtype != torch.float8_e4m3fn or q.shape[0] % FP8_BLOCK[0] or q.shape[1] % FP8_BLOCK[1]:
            continue
        theirs = Fp8Quantize(quantizer)._quantize_one(name, ckpt[name])
        assert torch.equal(theirs[name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(theirs[name + "_scale_inv"], stored[name + "_scale_inv"]), name
        deq = Fp8Dequantize(quantizer)._dequantize_one(q, stored[name + "_scale_inv"], torch.float32)
        assert torch.equal(deq, dequantize_block_fp8(q, stored[name + "_scale_inv"])), name
        checked += 1
    assert checked > 0
    return checked

# Keys of the original DeepSeek config.json files, in the order they appear there.
DEEPSEEK_KEYS = [
    "architectures", "attention_bias", "attention_dropout", "aux_loss_alpha", "bos_token_id",
    "eos_token_id", "ep_size", "first_k_dense_replace", "hidden_act", "hidden_size",
    "initializer_range", "intermediate_size", "kv_lora_rank", "max_position_embeddings",
    "model_type", "moe_intermediate_size", "moe_layer_freq", "n_group", "n_routed_experts",
    "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok",
    "num_hidden_layers", "num_key_value_heads", "num_nextn_predict_layers", "pretraining_tp",
    "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "rope_scaling",
    "rope_theta", "routed_scaling_factor", "scoring_func", "seq_aux", "tie_word_embeddings",
    "topk_group", "topk_method", "torch_dtype", "use_cache", "v_head_dim", "vocab_size",
]


def make_config(spec):
    cfg = spec["config_cls"](**spec["hf"], dtype=torch.float32)
    cfg.architectures = [spec["arch"]]
    return cfg


def config_json(spec, cfg) -> dict:
    """HF's own config.json for `cfg`, plus the original DeepSeek fields made explicit."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        hf = json.loads((Path(tmp) / "config.json").read_text())
    hf.update(spec["extra"])
    hf["torch_dtype"] = "float32"
    hf["dtype"] = "float32"
    hf["architectures"] = [spec["arch"]]
    missing = [k for k in DEEPSEEK_KEYS if k not in hf]
    allowed_missing = {"aux_loss_alpha", "seq_aux", "ep_size", "num_nextn_predict_layers"}
    assert not (set(missing) - allowed_missing), missing
    # DeepSeek keys first (like the real files), then the HF-only ones.
    ordered = {k: hf[k] for k in DEEPSEEK_KEYS if k in hf}
    ordered.update({k: v for k, v in sorted(hf.items()) if k not in ordered})
    return ordered


# --------------------------------------------------------------------------------------
# Random weights in the ORIGINAL DeepSeek checkpoint layout (experts one per expert)
# --------------------------------------------------------------------------------------


def checkpoint_shapes(cfg) -> dict[str, tuple[int, ...]]:
    H, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    nh = cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for l in range(L):
        p = f"model.layers.{l}."
        a = p + "self_attn."
        if cfg.q_lora_rank is None:
            shapes[a + "q_proj.weight"] = (nh * qk, H)
        else:
            shapes[a + "q_a_proj.weight"] = (cfg.q_lora_rank, H)
            shapes[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            shapes[a + "q_b_proj.weight"] = (nh * qk, cfg.q_lora_rank)
        shapes[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
        shapes[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        shapes[a + "kv_b_proj.weight"] = (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        shapes[a + "o_proj.weight"] = (H, nh * cfg.v_head_dim)
        m = p + "mlp."
        if l < cfg.first_k_dense_replace:
            I = cfg.intermediate_size
            shapes[m + "gate_proj.weight"] = (I, H)
            shapes[m + "up_proj.weight"] = (I, H)
            shapes[m + "down_proj.weight"] = (H, I)
        else:
            I = cfg.moe_intermediate_size
            E = cfg.n_routed_experts
            shapes[m + "gate.weight"] = (E, H)
            if isinstance(cfg, DeepseekV3Config):
                shapes[m + "gate.e_score_correction_bias"] = (E,)
            for e in range(E):
                shapes[m + f"experts.{e}.gate_proj.weight"] = (I, H)
                shapes[m + f"experts.{e}.up_proj.weight"] = (I, H)
                shapes[m + f"experts.{e}.down_proj.weight"] = (H, I)
            Is = I * cfg.n_shared_experts
            shapes[m + "shared_experts.gate_proj.weight"] = (Is, H)
            shapes[m + "shared_experts.up_proj.weight"] = (Is, H)
            shapes[m + "shared_experts.down_proj.weight"] = (H, Is)
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
    shapes["model.norm.weight"] = (H,)
    shapes["lm_head.weight"] = (V, H)
    return shapes


def random_checkpoint(cfg, seed: int, bias_range=(0.0, 0.1), router_std=ROUTER_STD_TIMES_SQRT_H) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    H = cfg.hidden_size

    def randn(shape, std):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    out = {}
    for name, shape in checkpoint_shapes(cfg).items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            t = 1.0 + 0.2 * randn(shape, 1.0)
        elif name.endswith("e_score_correction_bias"):
            lo, hi = bias_range
            t = lo + torch.rand(shape, generator=gen, dtype=torch.float32) * (hi - lo)
        elif name.endswith("mlp.gate.weight"):  # router
            t = randn(shape, router_std / math.sqrt(H))
        elif name == "model.embed_tokens.weight":
            t = randn(shape, 1.0)
        elif name == "lm_head.weight":
            t = randn(shape, LM_HEAD_STD)
        elif name.endswith("kv_b_proj.weight"):
            t = randn(shape, 0.05)
        else:
            t = randn(shape, 0.08)
        out[name] = t.contiguous()
    return out


def to_hf_state_dict(ckpt: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Original per-expert layout -> transformers 5 fused layout.

    HF keeps routed experts as experts.gate_up_proj [E, 2I, H] (rows [:I] = gate_proj, rows [I:] = up_proj,
    forward does `gate, up = linear(x, gate_up_proj[e]).chunk(2, -1)`) and experts.down_proj [E, H, I].
    """
    sd = {}
    for name, t in ckpt.items():
        if ".mlp.experts." not in name:
            sd[name] = t
    for l in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        m = f"model.layers.{l}.mlp.experts."
        E = cfg.n_routed_experts
        sd[m + "gate_up_proj"] = torch.stack(
            [torch.cat([ckpt[m + f"{e}.gate_proj.weight"], ckpt[m + f"{e}.up_proj.weight"]], 0) for e in range(E)]
        )
        sd[m + "down_proj"] = torch.stack([ckpt[m + f"{e}.down_proj.weight"] for e in range(E)])
    return sd


def build_model(spec, cfg, ckpt):
    model = spec["model_cls"]._from_config(
        cfg, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )
    sd = to_hf_state_dict(ckpt, cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    # Buffers too (e_score_correction_bias is a persistent buffer; load_state_dict handles it).
    model.eval()
    return model


# --------------------------------------------------------------------------------------
# Routing introspection (re-derives HF's router semantics; cross-checked against HF output)
# --------------------------------------------------------------------------------------


def route(cfg, gate_w, bias, h):
    """Returns (topk_idx, topk_weight, min_margin, group_mask_cases) for router input h [T, H]
    (re-implementation of HF; cross-checked against HF's MoE output in make_fixture)."""
    logits = h.float() @ gate_w.float().T
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    margins = []
    mask_cases = 0
    if isinstance(cfg, DeepseekV3Config):  # sigmoid + noaux_tc
        scores = logits.sigmoid()
        choice = scores + bias
        G = cfg.n_group
        gs = choice.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)  # group score = sum of top-2
        gsorted = gs.sort(-1, descending=True).values
        if cfg.topk_group < G:
            margins.append(gsorted[:, cfg.topk_group - 1] - gsorted[:, cfg.topk_group])
        gidx = gs.topk(cfg.topk_group, dim=-1).indices
        gmask = torch.zeros_like(gs).scatter_(1, gidx, 1.0).repeat_interleave(E // G, dim=1).bool()
        masked = choice.masked_fill(~gmask, float("-inf"))
        zero_filled = choice.masked_fill(~gmask, 0.0)
        mask_cases = int((masked.topk(k, dim=-1).indices.sort(-1).values
                          != zero_filled.topk(k, dim=-1).indices.sort(-1).values).any(-1).sum())
        ms = masked.sort(-1, descending=True).values
        margins.append(ms[:, k - 1] - ms[:, k])
        idx = masked.topk(k, dim=-1).indices
        w = scores.gather(1, idx)  # weights come from the UNbiased sigmoid scores
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * cfg.routed_scaling_factor
    else:  # softmax, greedy or group_limited_greedy
        scores = logits.softmax(-1)
        if cfg.topk_method == "group_limited_greedy":
            # Margins in log space here: 16 softmax probabilities are small, so absolute gaps are
            # tiny even when the decisions are far from ties relative to f32 rounding.
            G = cfg.n_group
            gs = scores.view(-1, G, E // G).max(-1).values  # group score = its best expert
            gsorted = gs.log().sort(-1, descending=True).values
            if cfg.topk_group < G:
                margins.append(gsorted[:, cfg.topk_group - 1] - gsorted[:, cfg.topk_group])
            gidx = gs.topk(cfg.topk_group, dim=-1).indices
            gmask = torch.zeros_like(gs).scatter_(1, gidx, 1.0).repeat_interleave(E // G, dim=1).bool()
            scores = scores.masked_fill(~gmask, 0.0)
            ss = scores.log().sort(-1, descending=True).values
        else:
            ss = scores.sort(-1, descending=True).values
        margins.append(ss[:, k - 1] - ss[:, k])
        w, idx = scores.topk(k, dim=-1)
        w = w * cfg.routed_scaling_factor  # HF V2 ignores norm_topk_prob
    return idx, w, torch.stack(margins, 0).min(0).values, mask_cases


def moe_manual(cfg, ckpt, l, x):
    """Per-expert (original layout) MoE forward for layer l, for cross-checking HF's fused experts."""
    m = f"model.layers.{l}.mlp."
    bias = ckpt.get(m + "gate.e_score_correction_bias")
    idx, w, _, _ = route(cfg, ckpt[m + "gate.weight"], bias, x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            g = x[t] @ ckpt[m + f"experts.{e}.gate_proj.weight"].T
            u = x[t] @ ckpt[m + f"experts.{e}.up_proj.weight"].T
            out[t] += w[t, j] * ((F.silu(g) * u) @ ckpt[m + f"experts.{e}.down_proj.weight"].T)
    s = m + "shared_experts."
    out += (F.silu(x @ ckpt[s + "gate_proj.weight"].T) * (x @ ckpt[s + "up_proj.weight"].T)) @ ckpt[
        s + "down_proj.weight"
    ].T
    return out


class RouterRecorder:
    """Records router inputs and MoE outputs of every forward so margins cover every routed token."""

    def __init__(self, model, cfg):
        self.cfg = cfg
        self.records = []  # (layer, moe_input [T,H], moe_output [T,H])
        self.handles = []
        for l, layer in enumerate(model.model.layers):
            if l >= cfg.first_k_dense_replace:
                self.handles.append(layer.mlp.register_forward_hook(self._hook(l)))

    def _hook(self, l):
        def fn(mod, args, out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).clone()
            self.records.append((l, x, out.detach().reshape(-1, out.shape[-1]).clone()))

        return fn

    def remove(self):
        for h in self.handles:
            h.remove()


# --------------------------------------------------------------------------------------
# RoPE / YaRN checks
# --------------------------------------------------------------------------------------


def yarn_get_mscale(scale=1.0, mscale=1.0):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def expected_rope(cfg, extra):
    """Independent (DeepSeek-original formula) inv_freq, cos/sin factor and softmax scale."""
    dim = cfg.qk_rope_head_dim
    base = extra["rope_theta"]
    qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    rs = extra["rope_scaling"]
    inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if rs is None:
        return inv, 1.0, qk_head_dim**-0.5
    factor, orig = rs["factor"], rs["original_max_position_embeddings"]

    def corr_dim(n_rot):
        return (dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(rs["beta_fast"])), 0)
    high = min(math.ceil(corr_dim(rs["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    inv_mask = 1.0 - ramp  # 1 -> keep original frequency (extrapolation), 0 -> interpolate by factor
    inv = (inv / factor) * (1 - inv_mask) + inv * inv_mask
    attn_factor = yarn_get_mscale(factor, rs["mscale"]) / yarn_get_mscale(factor, rs["mscale_all_dim"])
    m = yarn_get_mscale(factor, rs["mscale_all_dim"])
    return inv, attn_factor, qk_head_dim**-0.5 * m * m


def rope_pairs(x, pos, inv_freq, att):
    """DeepSeek rope on interleaved pairs (x[2i], x[2i+1]); returns (evens_out, odds_out)."""
    ang = pos[:, None] * inv_freq[None, :]
    c, s = np.cos(ang) * att, np.sin(ang) * att
    xe, xo = x[:, 0::2], x[:, 1::2]
    return xe * c - xo * s, xo * c + xe * s


# --------------------------------------------------------------------------------------
# Reference run
# --------------------------------------------------------------------------------------


@torch.no_grad()
def reference_run(model, cfg, prompt):
    P = len(prompt)
    ids = torch.tensor(prompt, dtype=torch.long)[None]
    out = model(ids, use_cache=True)
    prefill_logits = out.logits[0].float()
    cache = out.cache
    greedy, decode_logits = [], []
    nxt = int(prefill_logits[-1].argmax())
    for i in range(N_DECODE):
        greedy.append(nxt)
        o = model(torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache = o.cache
        lg = o.logits[0, -1].float()
        decode_logits.append(lg)
        nxt = int(lg.argmax())
    decode_logits = torch.stack(decode_logits)
    L = cfg.num_hidden_layers
    latent = torch.stack([cache.layers[l].keys[0, 0] for l in range(L)])
    rope = torch.stack([cache.layers[l].values[0, 0] for l in range(L)])
    assert latent.shape == (L, P + N_DECODE, cfg.kv_lora_rank), latent.shape
    assert rope.shape == (L, P + N_DECODE, cfg.qk_rope_head_dim), rope.shape
    full = model(torch.tensor([list(prompt) + greedy]), use_cache=False).logits[0].float()
    return dict(
        prompt_ids=np.asarray(prompt, np.int32),
        prefill_logits=prefill_logits.numpy().astype(np.float32),
        greedy_ids=np.asarray(greedy, np.int32),
        decode_logits=decode_logits.numpy().astype(np.float32),
        cache_latent=latent.numpy().astype(np.float32),
        cache_rope=rope.numpy().astype(np.float32),
        full_logits=full.numpy().astype(np.float32),
    )


def top2_margin(logits):
    s = np.sort(logits, axis=-1)
    return s[..., -1] - s[..., -2]


def check_cache_semantics(model, cfg, spec, ckpt, ref):
    """Re-derive the cache contents from the weights: latent = kv_a_layernorm(kv_a[:r]),
    rope = rope(kv_a[r:]) in the documented order."""
    captured = {}
    hooks = []
    for l, layer in enumerate(model.model.layers):
        def mk(l):
            def fn(mod, args, out):
                captured[l] = out.detach()[0].clone()
            return fn
        hooks.append(layer.self_attn.kv_a_proj_with_mqa.register_forward_hook(mk(l)))
    ids = torch.tensor([list(ref["prompt_ids"]) + list(ref["greedy_ids"])])
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    r = cfg.kv_lora_rank
    inv = model.model.rotary_emb.inv_freq.double().numpy()
    att = float(model.model.rotary_emb.attention_scaling)
    pos = np.arange(ids.shape[1], dtype=np.float64)
    for l in range(cfg.num_hidden_layers):
        kv = captured[l].double().numpy()
        lat = kv[:, :r]
        w = ckpt[f"model.layers.{l}.self_attn.kv_a_layernorm.weight"].double().numpy()
        lat = lat / np.sqrt((lat**2).mean(-1, keepdims=True) + 1e-6) * w
        np.testing.assert_allclose(ref["cache_latent"][l], lat, atol=2e-5, rtol=1e-4)
        ev, od = rope_pairs(kv[:, r:], pos, inv, att)
        if spec["rope_order"] == "split":
            expect = np.concatenate([ev, od], -1)
        else:
            expect = np.stack([ev, od], -1).reshape(ev.shape[0], -1)
        np.testing.assert_allclose(ref["cache_rope"][l], expect, atol=2e-5, rtol=1e-4)


def check_rope_config(model, cfg, spec):
    inv_exp, att_exp, scale_exp = expected_rope(cfg, spec["extra"])
    rot = model.model.rotary_emb
    np.testing.assert_allclose(rot.inv_freq.double().numpy(), inv_exp, rtol=1e-6)
    assert abs(float(rot.attention_scaling) - att_exp) < 1e-9, (rot.attention_scaling, att_exp)
    for layer in model.model.layers:
        assert abs(layer.self_attn.scaling - scale_exp) < 1e-9, (layer.self_attn.scaling, scale_exp)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    dim = cfg.qk_rope_head_dim
    default_inv = 1.0 / (spec["extra"]["rope_theta"] ** (np.arange(0, dim, 2) / dim))
    if spec["extra"]["rope_scaling"] is not None:
        assert model.config.rope_parameters["rope_type"] == "yarn"
        # YaRN really in effect: interpolated frequencies and the mscale^2 in the softmax scale.
        assert not np.allclose(inv_exp, default_inv), "YaRN did not change inv_freq"
        assert abs(scale_exp - qk**-0.5) > 1e-3, "softmax scale lacks the YaRN mscale"
        # NOTE: with mscale == mscale_all_dim (as in DeepSeek-V2-Lite / V3) the cos/sin factor
        # mscale(f, mscale) / mscale(f, mscale_all_dim) is exactly 1.0; all the YaRN magnitude
        # correction lives in the softmax scale.
    else:
        assert model.config.rope_parameters["rope_type"] == "default"
        np.testing.assert_allclose(inv_exp, default_inv)
        assert float(rot.attention_scaling) == 1.0 and abs(scale_exp - qk**-0.5) < 1e-12
    return inv_exp, att_exp, scale_exp


def write_fixture(out_dir: Path, spec, cfg, ckpt):
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(config_json(spec, cfg), indent=2) + "\n")
    names = list(ckpt)  # natural order: embed, layers 0..L-1, norm, lm_head
    meta = {"format": "pt"}
    if spec["n_shards"] == 1:
        save_file({k: ckpt[k] for k in names}, str(out_dir / "model.safetensors"), metadata=meta)
        return
    n = spec["n_shards"]
    total = sum(ckpt[k].numel() * ckpt[k].element_size() for k in names)
    shards, cur, cur_bytes = [], [], 0
    for k in names:  # greedy split by size; a shard boundary may fall inside a layer (as in real ckpts)
        b = ckpt[k].numel() * ckpt[k].element_size()
        if cur and len(shards) < n - 1 and cur_bytes + b > total / n:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(k)
        cur_bytes += b
    shards.append(cur)
    assert len(shards) == n, len(shards)
    weight_map = {}
    for i, keys in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: ckpt[k] for k in keys}, str(out_dir / fname), metadata=meta)
        weight_map.update({k: fname for k in keys})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def load_checkpoint_folder(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def trial(spec, cfg, seed):
    """Build the model for `seed`, run the reference and measure the decision margins."""
    ckpt = random_checkpoint(
        cfg, seed, spec.get("bias_range", (0.0, 0.1)), spec.get("router_std", ROUTER_STD_TIMES_SQRT_H)
    )
    if spec.get("fp8"):  # the reference runs on exactly what the FP8 file encodes
        ckpt = dequantized(fp8_checkpoint(ckpt))
    prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, PROMPT_LEN).tolist()
    model = build_model(spec, cfg, ckpt)
    rec = RouterRecorder(model, cfg)
    ref = reference_run(model, cfg, prompt)
    rec.remove()
    # routing margins over every routed token (prompt, each decode step, and the full forward)
    routes = [
        route(cfg, ckpt[f"model.layers.{l}.mlp.gate.weight"], ckpt.get(f"model.layers.{l}.mlp.gate.e_score_correction_bias"), x)
        for l, x, _ in rec.records
    ]
    route_margin = min(float(r[2].min()) for r in routes)
    ref["group_mask_cases"] = np.array(sum(r[3] for r in routes), np.int32)
    # greedy argmax margins at every step (prefill last position, each decode, and the full forward)
    greedy_margin = float(
        min(top2_margin(ref["prefill_logits"][-1]), top2_margin(ref["decode_logits"]).min(),
            top2_margin(ref["full_logits"][PROMPT_LEN - 1:]).min())
    )
    return ckpt, model, rec, ref, route_margin, greedy_margin


def make_fixture(name: str):
    spec = SPECS[name]
    cfg = make_config(spec)
    # Deterministic seed search: take the seed (out of N_SEEDS) whose smallest discrete-decision
    # margin is largest, so the fixture tolerates small numerical differences in reimplementations.
    # Seeds whose greedy continuation is a short cycle are de-prioritised (weaker decode test).
    scores = []
    for seed in range(spec["base_seed"], spec["base_seed"] + N_SEEDS):
        _, _, _, ref, rm, gm = trial(spec, cfg, seed)
        varied = len(set(ref["greedy_ids"].tolist())) >= MIN_DISTINCT_GREEDY
        mask_ok = int(ref["group_mask_cases"]) >= spec.get("min_group_mask_cases", 0)
        scores.append((mask_ok, varied, min(rm, gm), seed))
    mask_ok, _, best_margin, seed = max(scores)
    if not mask_ok:
        raise RuntimeError(f"no seed of {name} exercises the group-mask case {spec['min_group_mask_cases']} times")
    if best_margin <= MARGIN:
        raise RuntimeError(f"no seed with margins > {MARGIN} for {name}")
    ckpt, model, rec, ref, route_margin, greedy_margin = trial(spec, cfg, seed)
    assert route_margin > MARGIN and greedy_margin > MARGIN

    # --- HF's fused experts == per-expert original layout (also validates gate/up halves)
    moe_err = 0.0
    for l, x, y in rec.records:
        moe_err = max(moe_err, float((moe_manual(cfg, ckpt, l, x) - y).abs().max()))
    assert moe_err < 1e-4, moe_err

    # --- cached decode == full forward
    full = ref["full_logits"]
    err_prefill = np.abs(full[:PROMPT_LEN] - ref["prefill_logits"]).max()
    err_decode = np.abs(full[PROMPT_LEN - 1:-1] - np.concatenate([ref["prefill_logits"][-1:],
                                                                  ref["decode_logits"][:-1]])).max()
    err_decode = max(err_decode, np.abs(full[PROMPT_LEN:] - ref["decode_logits"]).max())
    assert err_prefill < 1e-4 and err_decode < 1e-4, (err_prefill, err_decode)
    assert (full[PROMPT_LEN - 1:-1].argmax(-1) == ref["greedy_ids"]).all()

    inv_freq, att, softmax_scale = check_rope_config(model, cfg, spec)
    check_cache_semantics(model, cfg, spec, ckpt, ref)

    ref["cache_rope_order"] = np.array(spec["rope_order"])
    ref["rope_inv_freq"] = model.model.rotary_emb.inv_freq.numpy().astype(np.float32)
    ref["rope_attention_scaling"] = np.array(att, np.float32)
    ref["softmax_scale"] = np.array(softmax_scale, np.float32)

    out_dir = FIXTURES / name
    stored = ckpt
    if spec.get("fp8"):
        original = random_checkpoint(
            cfg, seed, spec.get("bias_range", (0.0, 0.1)), spec.get("router_std", ROUTER_STD_TIMES_SQRT_H)
        )
        stored = fp8_checkpoint(original)
        n_checked = check_fp8_recipe_against_transformers(stored, original)
        assert all(torch.equal(v, ckpt[k]) for k, v in dequantized(stored).items())
        err = max(float((dequantized(stored)[k] - original[k]).abs().max() / original[k].abs().max())
                  for k in stored if stored[k].dtype == torch.float8_e4m3fn)
        print(f"[{name}] FP8: {sum(v.dtype == torch.float8_e4m3fn for v in stored.values())} tensors, "
              f"{n_checked} checked against transformers' FineGrainedFP8; max quantization error {err:.3f} of amax")
    write_fixture(out_dir, spec, cfg, stored)
    np.savez(out_dir / "reference.npz", **ref)

    # --- the folder round-trips: tensors, and from_pretrained (HF's own per-expert -> fused conversion)
    reloaded_ckpt = load_checkpoint_folder(out_dir)
    assert set(reloaded_ckpt) == set(stored)
    assert all(torch.equal(reloaded_ckpt[k].view(torch.uint8), stored[k].view(torch.uint8)) for k in stored)
    if spec.get("fp8"):
        # transformers' FP8 loader derives the block from the scale grid, so it cannot read the
        # partial edge blocks every DeepSeek-V3 checkpoint has (576-row kv_a_proj); the model it
        # would build is `model` above, whose weights are the dequantized tensors.
        return _summary(name, seed, ckpt, out_dir, rec, route_margin, greedy_margin, err_prefill, err_decode,
                        moe_err, att, softmax_scale, cfg, spec, ref)
    m2 = spec["model_cls"].from_pretrained(
        out_dir, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    ).eval()
    assert m2.config.rope_parameters["rope_type"] == cfg.rope_parameters["rope_type"]
    assert m2.model.rotary_emb.attention_scaling == model.model.rotary_emb.attention_scaling
    assert torch.equal(m2.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    with torch.no_grad():
        ids = torch.tensor([list(ref["prompt_ids"]) + list(ref["greedy_ids"])])
        lg2 = m2(ids, use_cache=False).logits[0].numpy()
    reload_err = float(np.abs(lg2 - full).max())
    assert np.array_equal(lg2, full), reload_err
    sd2 = m2.state_dict()
    for k, v in to_hf_state_dict(ckpt, cfg).items():
        assert torch.equal(sd2[k], v), k

    _summary(name, seed, ckpt, out_dir, rec, route_margin, greedy_margin, err_prefill, err_decode,
             moe_err, att, softmax_scale, cfg, spec, ref)


def _summary(name, seed, ckpt, out_dir, rec, route_margin, greedy_margin, err_prefill, err_decode,
             moe_err, att, softmax_scale, cfg, spec, ref):
    n_params = sum(t.numel() for t in ckpt.values())
    files = sorted(out_dir.iterdir())
    sizes = {f.name: f.stat().st_size for f in files}
    print(f"[{name}] seed={seed} (best of {N_SEEDS}) params={n_params:,} ({n_params * 4 / 1e6:.2f} MB fp32) "
          f"folder={sum(sizes.values()) / 1e6:.2f} MB")
    for f, s in sizes.items():
        print(f"    {f:40s} {s:>10,d} B")
    print(f"    min routing margin {route_margin:.3e} over {sum(x.shape[0] for _, x, _ in rec.records)} "
          f"routed token-layers; min greedy top1-top2 margin {greedy_margin:.3e}; "
          f"group-mask cases {int(ref['group_mask_cases'])}")
    print(f"    cached-vs-full max |dlogit| prefill {err_prefill:.2e} decode {err_decode:.2e}; "
          f"fused-vs-per-expert MoE max err {moe_err:.2e}; reload logits identical")
    print(f"    rope attention_scaling={att:.6f} softmax_scale={softmax_scale:.6f} "
          f"(qk_head_dim^-0.5={(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5:.6f}); "
          f"cache_rope_order={spec['rope_order']}")
    print(f"    greedy_ids={ref['greedy_ids'].tolist()}")
    print(f"    logits std {ref['prefill_logits'].std():.3f}")


def main(argv):
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    names = argv or list(SPECS)
    for n in names:
        make_fixture(n)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Write a model's parameters as a HuggingFace DeepSeek checkpoint folder (the inverse of hf_names).

The training script saves what it trains in the same format every DeepSeek checkpoint uses, so
the engine (and transformers) load it like any other model; tests use it to make checkpoints of
arbitrary shapes from random parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from splash_jax.layer_groups import is_stacked, layer_groups, unstack_path
from splash_jax.model_config import ModelConfig

SAFETENSORS_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def hf_tensors(model, dtype: str = "bfloat16", mtp_copies: bool = False) -> dict[str, np.ndarray]:
    """HF tensor name -> array for every parameter of an unpadded model (its MTP layers at indices
    num_layers.., when it holds them; `mtp_copies` adds their embed_tokens / shared_head.head copies)."""
    cfg: ModelConfig = model.cfg
    if cfg.padding is not None:
        raise ValueError("export an unpadded model (load it without a device-count padding)")
    if model.options.expert_format != "model":
        raise ValueError("export a model loaded with --expert-weights model (its experts are FP8 + block scales here)")
    params = per_layer_params(cfg, {tuple(str(k) for k in path): np.asarray(v[...], np.float32)
                                    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))})
    out: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": params[("embed",)],
        "model.norm.weight": params[("norm", "weight")],
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = params[("lm_head",)].T
    for layer in range(cfg.num_layers):
        out |= _decoder_tensors(cfg, layer, params, ("layers", str(layer)))
    for j in range(model.num_mtp_layers):
        layer = cfg.num_layers + j
        p, path = f"model.layers.{layer}.", ("mtp", str(j))
        out |= _decoder_tensors(cfg, layer, params, path + ("decoder",))
        out[p + "enorm.weight"] = params[path + ("enorm", "weight")]
        out[p + "hnorm.weight"] = params[path + ("hnorm", "weight")]
        out[p + "eh_proj.weight"] = params[path + ("eh_proj",)].T
        out[p + "shared_head.norm.weight"] = params[path + ("norm", "weight")]
        if mtp_copies:  # as DeepSeek's releases store them (the loader reads the main model's)
            out[p + "embed_tokens.weight"] = out["model.embed_tokens.weight"]
            out[p + "shared_head.head.weight"] = out.get("lm_head.weight", out["model.embed_tokens.weight"])
    np_dtype = SAFETENSORS_DTYPES[dtype]
    # The router stays float32 (the model keeps it in f32 whatever the weight dtype).
    keep_f32 = ("mlp.gate.weight", "e_score_correction_bias")
    return {
        k: np.ascontiguousarray(v.astype(np.float32 if k.endswith(keep_f32) else np_dtype)) for k, v in out.items()
    }


def _decoder_tensors(cfg: ModelConfig, layer: int, params: dict, path: tuple) -> dict[str, np.ndarray]:
    """Checkpoint layer `layer`'s HF tensors from the parameters under `path` (a decoder layer)."""
    p, a, m = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
    out: dict[str, np.ndarray] = {}

    def get(*names):
        return params[path + names]

    out[p + "input_layernorm.weight"] = get("input_norm", "weight")
    out[p + "post_attention_layernorm.weight"] = get("post_attn_norm", "weight")
    if cfg.q_lora_rank is None:
        q = get("attn", "q_proj")
        out[a + "q_proj.weight"] = q.reshape(q.shape[0], -1).T
    else:
        q = get("attn", "q_b")
        out[a + "q_a_proj.weight"] = get("attn", "q_a").T
        out[a + "q_a_layernorm.weight"] = get("attn", "q_a_norm")
        out[a + "q_b_proj.weight"] = q.reshape(q.shape[0], -1).T
    out[a + "kv_a_proj_with_mqa.weight"] = get("attn", "kv_a").T
    out[a + "kv_a_layernorm.weight"] = get("attn", "kv_a_norm")
    kv_b = np.concatenate([get("attn", "w_uk").transpose(1, 2, 0), get("attn", "w_uv").transpose(1, 2, 0)], axis=1)
    out[a + "kv_b_proj.weight"] = kv_b.reshape(-1, cfg.kv_lora_rank)
    o = get("attn", "o_proj")
    out[a + "o_proj.weight"] = o.reshape(-1, o.shape[-1]).T
    if cfg.is_moe_layer(layer):
        out[m + "gate.weight"] = get("mlp", "router").T
        if cfg.topk_method == "noaux_tc":
            out[m + "gate.e_score_correction_bias"] = get("mlp", "router_bias")
        for e in range(cfg.n_routed_experts):
            out[m + f"experts.{e}.gate_proj.weight"] = get("mlp", "experts_gate")[e]
            out[m + f"experts.{e}.up_proj.weight"] = get("mlp", "experts_up")[e]
            out[m + f"experts.{e}.down_proj.weight"] = get("mlp", "experts_down")[e].T
        if cfg.n_shared_experts:
            for proj in ("gate", "up", "down"):
                out[m + f"shared_experts.{proj}_proj.weight"] = get("mlp", "shared", proj).T
    else:
        for proj in ("gate", "up", "down"):
            out[m + f"{proj}_proj.weight"] = get("mlp", proj).T
    return out


def per_layer_params(cfg: ModelConfig, params: dict[tuple, np.ndarray]) -> dict[tuple, np.ndarray]:
    """Stacked layer-group leaves split into per-layer ("layers", "i", ...) entries (others unchanged)."""
    if not any(is_stacked(path) for path in params):
        return params
    groups = layer_groups(cfg)
    out = {}
    for path, value in params.items():
        if is_stacked(path):
            for j, (_, layer_path) in enumerate(unstack_path(path, groups)):
                out[layer_path] = value[j]
        else:
            out[path] = value
    return out


def save_hf_folder(model, folder: str | Path, dtype: str = "bfloat16", extra_config: dict | None = None) -> Path:
    """config.json + model.safetensors for `model` under `folder` (tokenizer files are the caller's)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.cfg.to_hf_dict() | {"torch_dtype": dtype}
    config.pop("num_nextn_predict_layers", None)  # what this model holds (built without MTP: none)
    config |= ({"num_nextn_predict_layers": model.num_mtp_layers} if model.num_mtp_layers else {}) | (extra_config or {})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(hf_tensors(model, dtype), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder

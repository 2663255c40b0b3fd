"""Small random-weight DeepSeek checkpoints of any shape, written in the HF format the loader reads.

Norms, routers and router biases are randomized (not left at init) so routing is far from ties
and a wrong padded head, expert or group changes the logits visibly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from splash_jax.model import DeepseekForCausalLM, RuntimeOptions
from splash_jax.model_config import ModelConfig, RopeConfig
from splash_jax.weights.export import hf_tensors

BASE = ModelConfig(
    vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, q_lora_rank=32, kv_lora_rank=64,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, intermediate_size=96,
    moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
    routed_scaling_factor=2.0, first_k_dense_replace=1, moe_layer_freq=1, rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=512, rope=RopeConfig(),
)


def tiny_config(**changes) -> ModelConfig:
    return dataclasses.replace(BASE, **changes)


def write_random_checkpoint(folder: Path, cfg: ModelConfig, seed: int = 0) -> Path:
    """config.json + model.safetensors of a random model with architecture `cfg` (float32)."""
    import json

    model = DeepseekForCausalLM(cfg, RuntimeOptions(dtype="float32"), nnx.Rngs(seed))
    tensors = hf_tensors(model, "float32")
    rng = np.random.default_rng(seed)
    for name, t in tensors.items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            tensors[name] = (1.0 + 0.2 * rng.standard_normal(t.shape)).astype(np.float32)
        elif name.endswith("mlp.gate.weight"):
            tensors[name] = (rng.standard_normal(t.shape) * 2.0 / np.sqrt(cfg.hidden_size)).astype(np.float32)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = (rng.random(t.shape) * 0.1).astype(np.float32)
        elif name == "lm_head.weight":
            tensors[name] = (rng.standard_normal(t.shape) * 0.25).astype(np.float32)
        elif name != "model.embed_tokens.weight":
            tensors[name] = (rng.standard_normal(t.shape) * 0.08).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder

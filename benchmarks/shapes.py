"""HF config.json contents of real model shapes, for dummy-weight benchmarks."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1,
    "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "bos_token_id": 100000, "eos_token_id": 100001,
}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 1,
}

SHAPES = {"v2-lite": DEEPSEEK_V2_LITE, "v3": DEEPSEEK_V3}


def shape_folder(name: str, **overrides) -> Path:
    """A temporary model folder holding only config.json (use with --load-format dummy)."""
    cfg = dict(SHAPES[name], **overrides)
    folder = Path(tempfile.mkdtemp(prefix=f"splash-{name}-"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def shape_with_tokenizer(name: str, tokenizer: str | Path | None, **overrides) -> Path:
    """shape_folder plus a real tokenizer's files, the vocabulary resized to the tokenizer's (so
    text, stop strings and grammars work on a real-size model with dummy weights)."""
    if tokenizer:
        vocab = json.loads((Path(tokenizer) / "tokenizer.json").read_text())
        size = max([*vocab["model"]["vocab"].values(), *(t["id"] for t in vocab.get("added_tokens", []))]) + 1
        overrides.update(vocab_size=size, bos_token_id=0, eos_token_id=1)
    folder = shape_folder(name, **overrides)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        if tokenizer and (Path(tokenizer) / file).exists():
            shutil.copy(Path(tokenizer) / file, folder / file)
    return folder

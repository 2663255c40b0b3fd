"""Build the bundled default model `models/splash-tiny/` (committed; no network needed to run).

A DeepSeek-V3-shaped model at the real MLA widths (kv_lora_rank 512, rope 64, so the kernels
and layouts see real latent rows) but tiny elsewhere, with seeded random bf16 weights, and a
byte-level BPE tokenizer trained on the text of this repository's docs. Its output is
gibberish: it exists so the server, the engine and the layouts run on any machine.

Run: .venv/bin/python scripts/make_default_model.py
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "models" / "splash-tiny"
SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB = 1024
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": VOCAB, "hidden_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 8, "num_key_value_heads": 8,
    "q_lora_rank": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
    "intermediate_size": 256, "moe_intermediate_size": 64,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "max_position_embeddings": 4096, "rope_theta": 10000.0, "rope_scaling": None, "hidden_act": "silu",
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}


def train_tokenizer() -> Tokenizer:
    texts = [p.read_text() for p in sorted(ROOT.glob("*.md")) + sorted((ROOT / "docs").glob("*.md")) if p.exists()]
    texts += [p.read_text() for p in sorted((ROOT / "splash_jax").rglob("*.py"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def random_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, h, v = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    lat, r = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w = {}

    def lin(name, out_dim, in_dim):
        w[name] = rng.standard_normal((out_dim, in_dim)) * in_dim ** -0.5

    def norm(name, dim):
        w[name] = 1.0 + 0.1 * rng.standard_normal(dim)

    w["model.embed_tokens.weight"] = rng.standard_normal((v, d))
    norm("model.norm.weight", d)
    lin("lm_head.weight", v, d)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        norm(p + "input_layernorm.weight", d)
        norm(p + "post_attention_layernorm.weight", d)
        lin(p + "self_attn.q_a_proj.weight", cfg["q_lora_rank"], d)
        norm(p + "self_attn.q_a_layernorm.weight", cfg["q_lora_rank"])
        lin(p + "self_attn.q_b_proj.weight", h * qk, cfg["q_lora_rank"])
        lin(p + "self_attn.kv_a_proj_with_mqa.weight", lat + r, d)
        norm(p + "self_attn.kv_a_layernorm.weight", lat)
        lin(p + "self_attn.kv_b_proj.weight", h * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), lat)
        lin(p + "self_attn.o_proj.weight", d, h * cfg["v_head_dim"])
        if layer < cfg["first_k_dense_replace"]:
            lin(p + "mlp.gate_proj.weight", cfg["intermediate_size"], d)
            lin(p + "mlp.up_proj.weight", cfg["intermediate_size"], d)
            lin(p + "mlp.down_proj.weight", d, cfg["intermediate_size"])
            continue
        i, e = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
        lin(p + "mlp.gate.weight", e, d)
        w[p + "mlp.gate.e_score_correction_bias"] = rng.uniform(0, 0.1, e)
        for x in range(e):
            lin(p + f"mlp.experts.{x}.gate_proj.weight", i, d)
            lin(p + f"mlp.experts.{x}.up_proj.weight", i, d)
            lin(p + f"mlp.experts.{x}.down_proj.weight", d, i)
        si = i * cfg["n_shared_experts"]
        lin(p + "mlp.shared_experts.gate_proj.weight", si, d)
        lin(p + "mlp.shared_experts.up_proj.weight", si, d)
        lin(p + "mlp.shared_experts.down_proj.weight", d, si)
    # The router and its bias stay float32, as in DeepSeek's checkpoints.
    return {
        k: a.astype(np.float32 if ".mlp.gate." in k else ml_dtypes.bfloat16) for k, a in w.items()
    }


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    OUT.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    for i, s in enumerate(SPECIAL):
        assert tok.token_to_id(s) == i, s
    tok.save(str(OUT / "tokenizer.json"))
    (OUT / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": CONFIG["max_position_embeddings"],
    }, indent=2))
    (OUT / "config.json").write_text(json.dumps(CONFIG, indent=2))
    weights = random_weights(CONFIG)
    save_file(weights, str(OUT / "model.safetensors"), metadata={"format": "pt"})
    size = sum(p.stat().st_size for p in OUT.iterdir())
    logging.info("wrote %s: %d tensors, %.1f MB", OUT, len(weights), size / 2**20)


if __name__ == "__main__":
    main()

"""Write a DeepSeek-V3-width FP8 checkpoint slice, load it, decode, and report weight bytes.

No real V3 checkpoint is reachable from the GPU machines, so this writes one in exactly the
release format (every decoder-layer linear as float8_e4m3fn with 128x128-block
`weight_scale_inv`, partial edge blocks included; embeddings, norms, router and LM head bf16;
`quantization_config`) at V3's real widths (hidden 7168, 128 heads, q_lora 1536, kv_lora 512,
rope 64, experts 2048 wide, vocab 129280) with fewer layers and experts, from seeded random
weights. Then it loads the slice with the engine's loader once per --expert-weights format (model: routed
experts dequantized to bf16 on load; fp8: kept as e4m3 + block scales in HBM), runs a greedy
decode with each, and prints weight bytes per device, load and decode times, and how often the
two formats' greedy tokens agree.

    python scripts/fp8_slice.py --out /tmp/v3-fp8-slice --layers 2 --experts 32 --decode 32
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ from a checkout
from benchmarks.shapes import DEEPSEEK_V3  # noqa: E402
from splash_jax.model_config import ModelConfig  # noqa: E402
from splash_jax.weights.fp8 import quantize  # noqa: E402

log = logging.getLogger("fp8_slice")
SMALL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=192, vocab_size=1024,
             intermediate_size=384, moe_intermediate_size=128)  # --small: a CPU smoke test of the script
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def slice_config(layers: int, experts: int, small: bool = False) -> dict:
    cfg = dict(DEEPSEEK_V3, num_hidden_layers=layers, n_routed_experts=experts, first_k_dense_replace=1,
               max_position_embeddings=4096, quantization_config=FP8_CONFIG, torch_dtype="bfloat16")
    if small:
        cfg.update(SMALL)
    cfg["n_group"] = min(cfg["n_group"], experts // 2)
    cfg["topk_group"] = min(cfg["topk_group"], cfg["n_group"])
    return cfg


def layer_tensors(cfg: ModelConfig, layer: int, rng: np.random.Generator) -> dict[str, tuple[tuple, str]]:
    """name -> (HF shape, kind) for one decoder layer; kind is fp8, bf16 or f32."""
    d, h = cfg.hidden_size, cfg.num_heads
    p, a, m = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
    out = {
        p + "input_layernorm.weight": ((d,), "bf16"), p + "post_attention_layernorm.weight": ((d,), "bf16"),
        a + "q_a_proj.weight": ((cfg.q_lora_rank, d), "fp8"), a + "q_a_layernorm.weight": ((cfg.q_lora_rank,), "bf16"),
        a + "q_b_proj.weight": ((h * cfg.qk_head_dim, cfg.q_lora_rank), "fp8"),
        a + "kv_a_proj_with_mqa.weight": ((cfg.latent_dim, d), "fp8"),
        a + "kv_a_layernorm.weight": ((cfg.kv_lora_rank,), "bf16"),
        a + "kv_b_proj.weight": ((h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "fp8"),
        a + "o_proj.weight": ((d, h * cfg.v_head_dim), "fp8"),
    }
    if cfg.is_moe_layer(layer):
        i, e = cfg.moe_intermediate_size, cfg.n_routed_experts
        out[m + "gate.weight"] = ((e, d), "f32")
        out[m + "gate.e_score_correction_bias"] = ((e,), "f32")
        for x in range(e):
            for proj, shape in (("gate_proj", (i, d)), ("up_proj", (i, d)), ("down_proj", (d, i))):
                out[m + f"experts.{x}.{proj}.weight"] = (shape, "fp8")
        si = i * cfg.n_shared_experts
        for proj, shape in (("gate_proj", (si, d)), ("up_proj", (si, d)), ("down_proj", (d, si))):
            out[m + f"shared_experts.{proj}.weight"] = (shape, "fp8")
    else:
        di = cfg.intermediate_size
        for proj, shape in (("gate_proj", (di, d)), ("up_proj", (di, d)), ("down_proj", (d, di))):
            out[m + f"{proj}.weight"] = (shape, "fp8")
    return out


def make_tensor(name: str, shape: tuple, kind: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    if name.endswith("norm.weight"):
        return {name: np.ones(shape, ml_dtypes.bfloat16)}
    if name.endswith("e_score_correction_bias"):
        return {name: np.zeros(shape, np.float32)}
    std = 1.0 if name == "model.embed_tokens.weight" else (shape[-1] ** -0.5)
    w = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    if kind == "fp8":
        q, scale_inv = quantize(w)
        return {name: q, name + "_scale_inv": scale_inv}
    return {name: w.astype(ml_dtypes.bfloat16 if kind == "bf16" else np.float32)}


def write_slice(out: Path, raw_cfg: dict, seed: int) -> dict[str, int]:
    """One safetensors shard per layer (plus one for embeddings/head); returns bytes by stored dtype."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw_cfg, indent=2))
    cfg = ModelConfig.from_hf_dict(raw_cfg)
    rng = np.random.default_rng(seed)
    groups = [{"model.embed_tokens.weight": ((cfg.vocab_size, cfg.hidden_size), "bf16"),
               "model.norm.weight": ((cfg.hidden_size,), "bf16"),
               "lm_head.weight": ((cfg.vocab_size, cfg.hidden_size), "bf16")}]
    groups += [layer_tensors(cfg, layer, rng) for layer in range(cfg.num_layers)]
    weight_map, stored = {}, {"fp8": 0, "scales": 0, "bf16/f32": 0}
    for g, group in enumerate(groups):
        tensors = {}
        for name, (shape, kind) in group.items():
            tensors.update(make_tensor(name, shape, kind, rng))
        fname = f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            key = "fp8" if t.dtype == ml_dtypes.float8_e4m3fn else ("scales" if name.endswith("_scale_inv") else "bf16/f32")
            stored[key] += t.nbytes
        log.info("wrote %s (%d tensors)", fname, len(tensors))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return stored


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--expert-weights", default="model,fp8",
                        help="routed-expert formats to load and decode, comma-separated: model (dequantized to bf16), fp8 (kept)")
    parser.add_argument("--small", action="store_true", help="narrow widths: a CPU smoke test of this script")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import jax

    from splash_jax.model import RuntimeOptions
    from splash_jax.simple_generate import SingleRequestRunner
    from splash_jax.weights.loader import load_model

    t0 = time.perf_counter()
    stored = write_slice(args.out, slice_config(args.layers, args.experts, args.small), args.seed)
    log.info("slice written in %.0fs: %s", time.perf_counter() - t0, {k: f"{v / 2**30:.2f} GiB" for k, v in stored.items()})
    from flax import nnx

    dev = jax.devices()[0]
    prompt = list(range(2, 18))
    fp8_hbm = stored["fp8"] + stored["scales"] + stored["bf16/f32"]
    result = {"device": str(dev), "layers": args.layers, "routed_experts": args.experts, "decode_tokens": args.decode,
              "file_bytes_fp8": stored["fp8"], "file_bytes_scales": stored["scales"],
              "file_bytes_bf16_f32": stored["bf16/f32"], "file_bytes_total": fp8_hbm}
    for fmt in args.expert_weights.split(","):
        t0 = time.perf_counter()
        model = load_model(args.out, RuntimeOptions(dtype="bfloat16", attention_impl="auto", expert_format=fmt))
        loaded = sum(s.data.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))
                     for s in x.addressable_shards if s.device == dev)
        load_s = time.perf_counter() - t0
        runner = SingleRequestRunner(model, page_size=64, max_len=256)
        runner.greedy(prompt, 2)  # compile
        t0 = time.perf_counter()
        ids = runner.greedy(prompt, args.decode)
        dt = time.perf_counter() - t0
        log.info("routed experts as %s: %.2f GiB of weights on %s, loaded in %.0fs, %.1f ms/token", fmt,
                 loaded / 2**30, dev, load_s, 1000 * dt / args.decode)
        result[fmt] = {"weights_bytes_per_device": loaded, "load_s": load_s, "decode_s": dt,
                       "ms_per_token_single_request_incl_prefill": 1000 * dt / args.decode, "greedy_ids": ids}
        del runner, model
    if "model" in result and "fp8" in result:
        a, b = result["model"]["greedy_ids"], result["fp8"]["greedy_ids"]
        result["weights_ratio_model_over_fp8"] = result["model"]["weights_bytes_per_device"] / result["fp8"]["weights_bytes_per_device"]
        result["greedy_agreement"] = sum(x == y for x, y in zip(a, b)) / max(1, len(a))
    print(json.dumps(result, indent=2))
    if not args.small:
        from benchmarks.common import write_results

        write_results("fp8_slice", result)


if __name__ == "__main__":
    main()

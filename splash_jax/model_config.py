"""Model configuration read from a HuggingFace DeepSeek-V2 / V2-Lite / V3 `config.json`.

One frozen dataclass holds every architectural number the model, the KV pool and the
weight loader need. Unsupported architectures or fields fail here, at load, with a message
naming them, instead of deep inside a traced function.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splash_jax.weights.fp8 import BlockFp8

SUPPORTED_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
SUPPORTED_ROPE_TYPES = ("default", "yarn")
SUPPORTED_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SUPPORTED_SCORING = ("softmax", "sigmoid")


class ConfigError(ValueError):
    """A config.json that this engine cannot serve; the message names the field."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of the 64-wide decoupled key; YaRN fields only matter for `yarn`."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    interleaved: bool = True  # DeepSeek rotates interleaved pairs (x0,x1),(x2,x3),...


@dataclasses.dataclass(frozen=True)
class ArraySizes:
    """Parameter-array sizes of the axes that layouts shard over devices.

    They equal the architecture's numbers unless the loader zero-padded them to a multiple of the
    device count (`ModelConfig.padded_to`; `splash_jax/weights/padding.py` says why that is exact).
    """

    num_heads: int
    n_routed_experts: int
    intermediate_size: int
    shared_intermediate_size: int
    vocab_size: int


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of one DeepSeek-family MLA model."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeConfig
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "DeepseekV3ForCausalLM"
    # Array sizes when the loader padded for a device count; None = the architecture's sizes.
    # Every other field keeps the real architecture (what config.json says).
    padding: ArraySizes | None = None
    # FP8 block scheme of the checkpoint's weights (dequantized on load); None = float checkpoint.
    weight_quant: "BlockFp8 | None" = None
    # Multi-token-prediction layers (HF `num_nextn_predict_layers`: DeepSeek-V3/R1 ship 1) stored as
    # layers num_layers.. of the checkpoint; the model builds them only when asked (RuntimeOptions.mtp).
    num_mtp_layers: int = 0
    # FP8 scheme of the MTP layers: weight_quant, or set alone when quantization_config's
    # modules_to_not_convert leaves the whole main model unquantized (the bundled model: a float
    # main model with a block-FP8 MTP layer, so the engine treats it as the float checkpoint it is).
    mtp_weight_quant: "BlockFp8 | None" = None

    # --- derived numbers ------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: the compressed latent plus the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (as DeepSeek)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope.type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def arrays(self) -> ArraySizes:
        """Sizes the parameter arrays have (padded or not); the model is built from these."""
        if self.padding is not None:
            return self.padding
        return ArraySizes(
            num_heads=self.num_heads,
            n_routed_experts=self.n_routed_experts,
            intermediate_size=self.intermediate_size,
            shared_intermediate_size=self.moe_intermediate_size * self.n_shared_experts,
            vocab_size=self.vocab_size,
        )

    def padded_to(self, multiple: int) -> "ModelConfig":
        """This architecture with every device-sharded axis zero-padded to a multiple of `multiple`.

        Heads, routed experts, dense and shared-expert FFN widths and the vocabulary are the axes
        some layout shards; padding them (instead of refusing the shape) lets any model run on
        any device count. The real numbers stay in the other fields.
        """
        if multiple < 1:
            raise ValueError(f"padding multiple must be >= 1, got {multiple}")
        real = dataclasses.replace(self, padding=None).arrays
        sizes = ArraySizes(**{f.name: _round_up(getattr(real, f.name), multiple) for f in dataclasses.fields(real)})
        return dataclasses.replace(self, padding=None if sizes == real else sizes)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"no config.json at {path}") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_hf_dict(raw)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            if archs:
                raise ConfigError(
                    f"unsupported architecture {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
                )
            if model_type not in SUPPORTED_MODEL_TYPES:
                raise ConfigError(
                    f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
                )
            arch = "DeepseekV2ForCausalLM" if model_type == "deepseek_v2" else "DeepseekV3ForCausalLM"
        is_v3 = arch == "DeepseekV3ForCausalLM"

        def need(key: str) -> Any:
            if raw.get(key) is None:
                raise ConfigError(f"config.json is missing required field {key!r}")
            return raw[key]

        def get(key: str, default: Any) -> Any:
            value = raw.get(key)
            return default if value is None else value

        hidden_act = get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ConfigError(f"unsupported hidden_act {hidden_act!r}; supported: 'silu'")
        if raw.get("attention_bias"):
            raise ConfigError("unsupported field attention_bias=true (DeepSeek MLA has no attention bias)")
        n_heads = int(need("num_attention_heads"))
        n_kv = raw.get("num_key_value_heads")
        if n_kv is not None and int(n_kv) != n_heads:
            raise ConfigError(f"num_key_value_heads={n_kv} must equal num_attention_heads={n_heads} for MLA")

        if raw.get("mlp_bias"):
            raise ConfigError("unsupported field mlp_bias=true (the MLP and experts have no bias tensors here)")
        if int(get("moe_layer_freq", 1)) != 1:
            raise ConfigError(
                f"unsupported moe_layer_freq={raw['moe_layer_freq']} (transformers' DeepSeek models make every "
                "layer from first_k_dense_replace on an MoE layer; only 1 matches them)"
            )
        n_routed = int(get("n_routed_experts", 0))
        scoring = get("scoring_func", "sigmoid" if is_v3 else "softmax")
        if scoring not in SUPPORTED_SCORING:
            raise ConfigError(f"unsupported scoring_func {scoring!r}; supported: {SUPPORTED_SCORING}")
        topk_method = get("topk_method", "noaux_tc" if is_v3 else "greedy")
        if topk_method not in SUPPORTED_TOPK_METHODS:
            raise ConfigError(f"unsupported topk_method {topk_method!r}; supported: {SUPPORTED_TOPK_METHODS}")
        _check_routing(arch, scoring, topk_method)
        n_group = int(get("n_group", 1))
        topk_group = int(get("topk_group", 1))
        top_k = int(get("num_experts_per_tok", 0))
        if n_routed:
            if n_routed % n_group:
                raise ConfigError(f"n_routed_experts={n_routed} is not divisible by n_group={n_group}")
            if not 1 <= topk_group <= n_group:
                raise ConfigError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
            if not 1 <= top_k <= n_routed:
                raise ConfigError(f"num_experts_per_tok={top_k} must be in [1, n_routed_experts={n_routed}]")
            if topk_method == "noaux_tc" and n_group > 1 and n_routed // n_group < 2:
                raise ConfigError("topk_method 'noaux_tc' scores a group by its top-2 experts: needs >= 2 experts per group")
        # transformers' DeepseekV2 never renormalizes the top-k weights, whatever the config says.
        norm_topk_prob = bool(get("norm_topk_prob", False)) and is_v3

        from splash_jax.weights.fp8 import parse_quantization_config

        try:
            weight_quant = parse_quantization_config(raw.get("quantization_config"))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        num_layers = int(need("num_hidden_layers"))
        num_mtp = int(get("num_nextn_predict_layers", 0))
        if num_mtp < 0:
            raise ConfigError(f"num_nextn_predict_layers={num_mtp} must be >= 0")
        skipped = tuple((raw.get("quantization_config") or {}).get("modules_to_not_convert") or ())
        mtp_quant = None if _covers(skipped, f"model.layers.{num_layers}") else weight_quant
        if weight_quant is not None and all(_covers(skipped, f"model.layers.{i}") for i in range(num_layers)):
            weight_quant = None  # only the MTP layers are FP8
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_layers=num_layers,
            num_heads=n_heads,
            q_lora_rank=None if raw.get("q_lora_rank") is None else int(raw["q_lora_rank"]),
            kv_lora_rank=int(need("kv_lora_rank")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            intermediate_size=int(need("intermediate_size")),
            moe_intermediate_size=int(get("moe_intermediate_size", 0)),
            n_routed_experts=n_routed,
            n_shared_experts=int(get("n_shared_experts", 0)),
            num_experts_per_tok=top_k,
            n_group=n_group,
            topk_group=topk_group,
            topk_method=topk_method,
            scoring_func=scoring,
            norm_topk_prob=norm_topk_prob,
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(get("first_k_dense_replace", 0)),
            moe_layer_freq=int(get("moe_layer_freq", 1)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            max_position_embeddings=int(get("max_position_embeddings", 4096)),
            rope=_rope_from_hf(raw),
            hidden_act=hidden_act,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            weight_quant=weight_quant,
            num_mtp_layers=num_mtp,
            mtp_weight_quant=mtp_quant,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that reads back into this config (used for bundled / dummy models)."""
        rope_scaling = None
        if self.rope.type == "yarn":
            rope_scaling = {
                "type": "yarn", "rope_type": "yarn", "factor": self.rope.factor,
                "original_max_position_embeddings": self.rope.original_max_position_embeddings,
                "beta_fast": self.rope.beta_fast, "beta_slow": self.rope.beta_slow,
                "mscale": self.rope.mscale, "mscale_all_dim": self.rope.mscale_all_dim,
            }
        mtp = {"num_nextn_predict_layers": self.num_mtp_layers} if self.num_mtp_layers else {}
        return {
            "architectures": [self.architecture],
            "model_type": "deepseek_v3" if self.architecture == "DeepseekV3ForCausalLM" else "deepseek_v2",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads, "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_routed_experts": self.n_routed_experts, "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "n_group": self.n_group,
            "topk_group": self.topk_group, "topk_method": self.topk_method,
            "scoring_func": self.scoring_func, "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq, "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope.theta, "rope_scaling": rope_scaling,
            "rope_interleave": self.rope.interleaved, "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        } | mtp


def _covers(modules: tuple[str, ...], name: str) -> bool:
    """Is module `name` (or a module containing it) in a modules_to_not_convert list?"""
    return any(name == m or name.startswith(m + ".") for m in modules)


def _check_routing(arch: str, scoring: str, topk_method: str) -> None:
    """Only the routing each transformers class implements: DeepseekV2 always softmax with greedy or
    group_limited_greedy; DeepseekV3 always sigmoid + e_score_correction_bias with noaux_tc. Any
    other combination would be silently run differently by the reference, so it is refused."""
    if arch == "DeepseekV2ForCausalLM":
        if scoring != "softmax":
            raise ConfigError(f"unsupported scoring_func {scoring!r} for DeepseekV2ForCausalLM; supported: 'softmax'")
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(
                f"unsupported topk_method {topk_method!r} for DeepseekV2ForCausalLM; supported: 'greedy', 'group_limited_greedy'"
            )
    else:
        if scoring != "sigmoid":
            raise ConfigError(f"unsupported scoring_func {scoring!r} for DeepseekV3ForCausalLM; supported: 'sigmoid'")
        if topk_method != "noaux_tc":
            raise ConfigError(f"unsupported topk_method {topk_method!r} for DeepseekV3ForCausalLM; supported: 'noaux_tc'")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_from_hf(raw: dict[str, Any]) -> RopeConfig:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta") or scaling.get("rope_theta") or 10000.0)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"unsupported rope_scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    interleaved = bool(raw.get("rope_interleave", True))
    if rope_type == "default":
        return RopeConfig(theta=theta, interleaved=interleaved)
    if scaling.get("factor") is None:
        raise ConfigError("rope_scaling of type 'yarn' is missing required field 'factor'")
    return RopeConfig(
        theta=theta,
        type="yarn",
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings") or 4096),
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        mscale=float(scaling.get("mscale") or 1.0),
        mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
        truncate=bool(scaling.get("truncate", True)),
        interleaved=interleaved,
    )

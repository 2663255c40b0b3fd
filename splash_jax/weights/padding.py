"""Zero padding of device-sharded axes, so any head / expert count runs on any device count.

A layout shards attention heads, routed experts, the dense and shared-expert FFN width and the
vocabulary over N devices; a model whose counts N does not divide is served by appending zero
slices along those axes at load time. Every padded slice is exactly inert:

- a padded head has zero q_b / q_proj, W_UK, W_UV and o_proj slices: its attention output is a
  mean of latents times a zero W_UV, and its o_proj rows are zero, so it adds exactly 0;
- a padded expert is never routed: the router (and its bias) keeps the real expert count, so
  ids never reach the padded rows; its weights are zero, so the dense path adds 0 * 0;
- a padded FFN column has zero gate and up columns (silu(0) * 0 = 0) and a zero down row;
- a padded vocabulary row is never looked up, and the model drops the padded logit columns.

The cost is memory and FLOPs proportional to the padding; `padding_report` states it at start-up.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from splash_jax.model_config import ModelConfig


def zero_pad_to(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`array` with zeros appended at the end of every axis that is shorter than `shape`."""
    if array.shape == tuple(shape):
        return array
    if array.ndim != len(shape) or any(a > s for a, s in zip(array.shape, shape)):
        raise ValueError(f"cannot pad an array of shape {array.shape} to {tuple(shape)}")
    return np.pad(array, [(0, s - a) for a, s in zip(array.shape, shape)])


@dataclasses.dataclass(frozen=True)
class PaddingCost:
    """What padding adds for one model, in parameters and as a share of the real model."""

    axis: str
    real: int
    padded: int
    added_params: int  # over the whole model (before sharding)
    compute_share: float  # extra FLOPs of the part that runs the padded axis, relative to it


def padding_costs(cfg: ModelConfig) -> list[PaddingCost]:
    """One entry per padded axis (empty when nothing is padded)."""
    if cfg.padding is None:
        return []
    real = dataclasses.replace(cfg, padding=None).arrays
    pad = cfg.padding
    d = cfg.hidden_size
    layers = range(cfg.num_layers)
    moe_layers = sum(cfg.is_moe_layer(i) for i in layers)
    dense_layers = cfg.num_layers - moe_layers
    q_in = cfg.q_lora_rank if cfg.q_lora_rank is not None else d
    per_head = q_in * cfg.qk_head_dim + cfg.kv_lora_rank * (cfg.qk_nope_head_dim + cfg.v_head_dim) + cfg.v_head_dim * d
    per_expert = 3 * d * cfg.moe_intermediate_size
    vocab_params = d * (1 if cfg.tie_word_embeddings else 2)
    rows = [
        ("num_heads", real.num_heads, pad.num_heads, per_head * cfg.num_layers),
        ("n_routed_experts", real.n_routed_experts, pad.n_routed_experts, per_expert * moe_layers),
        ("intermediate_size", real.intermediate_size, pad.intermediate_size, 3 * d * dense_layers),
        ("shared_intermediate_size", real.shared_intermediate_size, pad.shared_intermediate_size, 3 * d * moe_layers),
        ("vocab_size", real.vocab_size, pad.vocab_size, vocab_params),
    ]
    return [
        PaddingCost(axis, r, p, (p - r) * unit, (p - r) / r if r else 0.0)
        for axis, r, p, unit in rows
        if p != r
    ]


def padding_report(cfg: ModelConfig, multiple: int, bytes_per_param: float) -> list[str]:
    """Human-readable lines for the start-up log: what was padded and what it costs."""
    lines = []
    for c in padding_costs(cfg):
        what = {
            "num_heads": "attention FLOPs of head-sharded layouts and DP (padded heads are computed)",
            "n_routed_experts": "expert FLOPs on the dense all-expert path only (padded experts are never routed)",
            "intermediate_size": "dense-MLP FLOPs",
            "shared_intermediate_size": "shared-expert FLOPs",
            "vocab_size": "LM-head FLOPs",
        }[c.axis]
        lines.append(
            f"{c.axis} {c.real} -> {c.padded} (multiple of {multiple} devices): "
            f"+{c.added_params / 1e6:.2f} M zero parameters (+{c.added_params * bytes_per_param / 2**20:.1f} MiB "
            f"before sharding), +{100 * c.compute_share:.0f}% {what}"
        )
    return lines


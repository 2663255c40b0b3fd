"""Which decoder layers run as one scanned stack, and how stacked parameter paths map to layers.

With `scan_layers` the model keeps one module per layer group whose parameters carry a leading
layer axis: the dense prefix ("dense_layers") and the MoE layers ("moe_layers"). Each group runs
under one `lax.scan`, so a program's compile time does not grow with depth. DeepSeek-V2/V3 and
GLM place every dense layer before every MoE layer (`moe_layer_freq` 1); a model interleaving the
two kinds is served unrolled (`--no-scan-layers`).
"""

from __future__ import annotations

from splash_jax.model_config import ModelConfig

DENSE, MOE = "dense_layers", "moe_layers"
GROUPS = (DENSE, MOE)


def layer_groups(cfg: ModelConfig) -> dict[str, range]:
    """Group name -> its (contiguous) global layer indices, in execution order; empty groups are left out."""
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    num_dense = cfg.num_layers - len(moe)
    if moe != list(range(num_dense, cfg.num_layers)):
        raise ValueError(
            "scanned layers need every dense layer before every MoE layer (moe_layer_freq 1); "
            "serve this model with --no-scan-layers"
        )
    groups = {DENSE: range(0, num_dense), MOE: range(num_dense, cfg.num_layers)}
    return {name: layers for name, layers in groups.items() if len(layers)}


def is_stacked(path: tuple) -> bool:
    """A parameter path of a stacked group (leading layer axis)."""
    return bool(path) and str(path[0]) in GROUPS


def unstack_path(path: tuple, groups: dict[str, range]) -> list[tuple[int, tuple]]:
    """(global layer, per-layer path ("layers", str(layer), ...)) for each slice of a stacked path."""
    return [(layer, ("layers", str(layer)) + tuple(path[1:])) for layer in groups[str(path[0])]]

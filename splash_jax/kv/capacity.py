"""Sizing the KV pool from a memory budget, and what a page costs."""

from __future__ import annotations

import logging

import numpy as np

from splash_jax.model_config import ModelConfig

log = logging.getLogger(__name__)
CPU_DEFAULT_KV_GB = 0.25  # CPU devices report no memory stats; a small pool keeps tests light


def bytes_per_page(cfg: ModelConfig, page_size: int, dtype) -> int:
    """Latent + rope key of `page_size` tokens in every layer."""
    return cfg.num_layers * page_size * cfg.latent_dim * np.dtype(dtype).itemsize


def kv_budget_bytes(device, kv_memory_gb: float | None, kv_memory_fraction: float) -> int:
    """Per-device KV budget: an explicit size, else a fraction of the device's free memory."""
    if kv_memory_gb is not None:
        return int(kv_memory_gb * 2**30)
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        log.info("device %s reports no memory stats; using %.2f GB for the KV pool", device, CPU_DEFAULT_KV_GB)
        return int(CPU_DEFAULT_KV_GB * 2**30)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return int(free * kv_memory_fraction)


def pages_per_device(cfg: ModelConfig, page_size: int, dtype, budget_bytes: int, max_pages: int | None = None) -> int:
    n = budget_bytes // bytes_per_page(cfg, page_size, dtype)
    if max_pages is not None:
        n = min(n, max_pages)
    if n < 1:
        raise MemoryError(
            f"a KV budget of {budget_bytes / 2**20:.1f} MiB holds no page of "
            f"{bytes_per_page(cfg, page_size, dtype) / 2**20:.2f} MiB; raise --kv-memory-gb"
        )
    return int(n)


def head_sharded_weight_bytes(model_or_abstract_state) -> int:
    """Bytes of the attention weights that layouts shard by head (q_b/q_proj, w_uk, w_uv, o_proj)."""
    from flax import nnx

    from splash_jax.mesh.layouts import HEAD_SHARDED

    state = model_or_abstract_state
    if isinstance(state, nnx.Module):
        state = nnx.state(state, nnx.Param)
    total = 0
    for path, var in nnx.to_flat_state(state):
        if str(path[-1]) in HEAD_SHARDED:
            total += int(np.prod(var.shape)) * np.dtype(var.dtype).itemsize
    return total


def extra_pages_per_device(head_sharded_bytes: int, n: int, page_bytes: int) -> int:
    """Pages made of the weight memory a device frees when attention weights go from replicated to 1/N."""
    if n <= 1:
        return 0
    return int(head_sharded_bytes * (n - 1) // n // page_bytes)


def layout_token_capacity(kv_placement, n: int, base_pages: int, extra_pages: int, page_size: int) -> int:
    """Tokens of distinct requests the pool holds under a placement (replicas count once)."""
    return n * (base_pages + extra_pages) * page_size // kv_placement.distinct_copies(n)


def layout_capacities(cfg: ModelConfig, n: int, page_size: int, dtype, base_pages: int, head_sharded_bytes: int) -> dict:
    """Per layout: pages per device (base, extra) and token capacity, from the engine's accounting."""
    from splash_jax.mesh.layouts import LAYOUTS

    page_bytes = bytes_per_page(cfg, page_size, dtype)
    extra = extra_pages_per_device(head_sharded_bytes, n, page_bytes)
    out = {}
    for name, layout in LAYOUTS.items():
        e = extra if layout.heads_sharded else 0
        out[name] = {
            "base_pages_per_device": base_pages,
            "extra_pages_per_device": e,
            "tokens": layout_token_capacity(layout.kv_placement, n, base_pages, e, page_size),
        }
    return out

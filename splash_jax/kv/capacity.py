"""Sizing the KV pool from a memory budget, and what a page costs."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from splash_jax.model_config import ModelConfig

log = logging.getLogger(__name__)
CPU_DEFAULT_KV_GB = 0.25  # CPU devices report no memory stats; a small pool keeps tests light


def bytes_per_page(cfg: ModelConfig, page_size: int, dtype) -> int:
    """Latent + rope key of `page_size` tokens in every layer."""
    return cfg.num_layers * page_size * cfg.latent_dim * np.dtype(dtype).itemsize


def device_memory(device) -> tuple[int, int] | None:
    """(bytes XLA may use on the device, bytes in use now), or None where the device reports no
    statistics (CPU). The one place start-up reads device memory (tests replace it)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


class StartupMemoryError(MemoryError):
    """A configuration whose weights, step programs and KV pool cannot fit a device: raised before
    the pool is allocated and before the step programs are compiled, naming the flag to change."""


GiB = 2**30


def _gib(b: int) -> str:
    return f"{b / GiB:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """How one device's memory is divided at start-up: `limit` (what XLA may use) holds what is in
    use before the pool (`in_use`: the weights), the largest step program's working memory
    (`reserve`: its temporaries and outputs not aliased to its donated inputs, from XLA's
    memory_analysis), and the pool (`pages` base + `extra_pages` extra, `page_bytes` each)."""

    limit: int
    in_use: int
    reserve: int
    reserve_program: str | None
    pages: int
    extra_pages: int
    page_bytes: int

    @property
    def pool_bytes(self) -> int:
        return (self.pages + self.extra_pages) * self.page_bytes

    @property
    def headroom(self) -> int:
        """What stays free while the largest program runs (never negative in a plan that was made)."""
        return self.limit - self.in_use - self.reserve - self.pool_bytes

    def describe(self) -> str:
        return (f"{_gib(self.limit)} usable: weights {_gib(self.in_use)}, largest step program {_gib(self.reserve)}"
                f" ({self.reserve_program}), KV pool {_gib(self.pool_bytes)}, {_gib(self.headroom)} left")


def plan_pool(limit: int, in_use: int, reserve: int, reserve_program: str | None, page_bytes: int, *,
              kv_memory_gb: float | None, kv_memory_fraction: float, extra_pages: int = 0,
              max_pages: int | None = None, max_num_batched_tokens: int | None = None,
              reserve_per_page: float = 0.0) -> PoolPlan:
    """The pool of one device: `kv_memory_gb`, else `kv_memory_fraction` of what remains after what
    is in use (weights) and the largest program's working memory; the extra segment (head-sharded
    layouts, made of the attention weights they do not hold) comes out of the same remainder.
    `reserve_per_page`: working memory that grows with the pool (XLA:TPU, engine/pool_sizing.py),
    on top of `reserve`. Raises StartupMemoryError naming the numbers and the flag when that
    cannot fit."""
    remain = limit - in_use - reserve
    mbt = f" (--max-num-batched-tokens {max_num_batched_tokens})" if max_num_batched_tokens else ""
    if remain < page_bytes * (1 + extra_pages) + reserve_per_page:
        raise StartupMemoryError(
            f"no room for a KV pool: the device has {_gib(limit)} usable, {_gib(in_use)} are in use (weights) "
            f"and the largest step program ({reserve_program}) needs {_gib(reserve)} of working memory{mbt}. "
            "Lower --max-num-batched-tokens, or spread the weights over more devices (--num-devices)")
    if kv_memory_gb is not None:
        pages = int(kv_memory_gb * GiB) // page_bytes
        fits = int((remain - extra_pages * page_bytes) // (page_bytes + reserve_per_page))
        if pages > fits:
            raise StartupMemoryError(
                f"--kv-memory-gb {kv_memory_gb:g} does not fit: the device has {_gib(limit)} usable, weights take "
                f"{_gib(in_use)}, the largest step program ({reserve_program}) needs "
                f"{_gib(int(reserve + reserve_per_page * fits))}{mbt}"
                + (f" and the extra segment {_gib(extra_pages * page_bytes)}" if extra_pages else "")
                + f", which leaves {_gib(fits * page_bytes)} for the pool. Lower --kv-memory-gb to at most "
                f"{fits * page_bytes / GiB:.2f} (or leave it unset for --kv-memory-fraction), or lower --max-num-batched-tokens")
    else:  # (pages + extra) * page_bytes = fraction * (remain - reserve_per_page * pages)
        f = kv_memory_fraction
        pages = int((f * remain - extra_pages * page_bytes) // (page_bytes + f * reserve_per_page))
    if max_pages is not None:
        pages = min(pages, max_pages)
    if pages < 1:
        raise StartupMemoryError(
            f"the KV pool gets no page of {page_bytes / 2**20:.2f} MiB: {_gib(remain)} remain after weights "
            f"({_gib(in_use)}) and the largest step program ({_gib(reserve)}{mbt}); raise --kv-memory-fraction "
            "or --kv-memory-gb, or lower --max-num-batched-tokens")
    return PoolPlan(limit, in_use, int(reserve + reserve_per_page * pages), reserve_program, int(pages), extra_pages,
                    page_bytes)


def check_max_model_len(max_model_len: int, explicit: bool, pool_tokens: int) -> int:
    """The longest request the pool can hold: a --max-model-len the pool cannot hold is an error
    (what fits and the flags to change); the model's own maximum is capped to the pool."""
    if max_model_len <= pool_tokens:
        return max_model_len
    if explicit:
        raise StartupMemoryError(
            f"--max-model-len {max_model_len} does not fit: the KV pool holds {pool_tokens} tokens per device. "
            f"Lower --max-model-len to at most {pool_tokens}, or raise --kv-memory-gb / --kv-memory-fraction")
    log.warning("the model's maximum length %d exceeds the KV pool (%d tokens); max_model_len is %d",
                max_model_len, pool_tokens, pool_tokens)
    return pool_tokens


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

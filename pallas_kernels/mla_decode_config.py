"""Block sizes and split-K choice for the paged MLA decode kernel, from a tuned table.

The table (`tuned_mla_decode.json`, next to this file) is a list of rules, first match wins:
  {"max_heads": 16, "max_tokens": 8, "max_context": 4096, "config": {...DecodeConfig fields...}}
Missing bounds match anything. `python -m pallas_kernels.tune_mla_decode` writes it from H200
sweeps (`benchmarks/mla_decode.py --sweep`) as one block config per heads bucket; the split
count is left to `plan_splits`. Shapes outside the table get the defaults below.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib

TUNED_TABLE = pathlib.Path(__file__).with_name("tuned_mla_decode.json")
DEFAULT_NUM_SMS = 132  # H200 / H100 SXM


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """One kernel variant. `block_k` is KV tokens per inner step: a slice of a page, one page,
    or several pages gathered. The split fields drive `plan_splits`."""

    block_h: int = 16  # query heads per program (the M of both matmuls); power of two >= 16
    block_k: int = 64  # KV tokens per inner step; power of two
    num_warps: int = 4
    num_stages: int = 2  # Triton software-pipelining depth of the KV loads
    num_splits: int = 0  # split-K partitions of each token's pages; 0 = chosen by `plan_splits`
    ctas_per_sm: int = 2  # programs the grid should hold per SM (the H200 sweep's optimum)
    max_splits: int = 32  # more partials than this cost more in the combine than they win
    min_pages_per_split: int = 4  # a program streams at least this many pages
    combine: str = "pallas"  # split-K merge: "pallas" (one launch) or "xla" (a few fusions)
    ablate: str = ""  # profiling only: "no_qk" drops the QK matmul (wrong results, for timing)

    def replace(self, **kw) -> "DecodeConfig":
        return dataclasses.replace(self, **kw)


@functools.lru_cache(maxsize=1)
def _load_table() -> tuple[dict, ...]:
    if not TUNED_TABLE.exists():
        return ()
    rules = json.loads(TUNED_TABLE.read_text()).get("rules", [])
    return tuple(rules)


def _matches(rule: dict, heads: int, tokens: int, context: int) -> bool:
    return (
        heads <= rule.get("max_heads", math.inf)
        and heads >= rule.get("min_heads", 0)
        and tokens <= rule.get("max_tokens", math.inf)
        and context <= rule.get("max_context", math.inf)
    )


def pick_config(heads: int, tokens: int, context: int) -> DecodeConfig:
    """Tuned config for (heads, tokens in the call, page-table capacity in tokens)."""
    for rule in _load_table():
        if _matches(rule, heads, tokens, context):
            return DecodeConfig(**rule["config"])
    return DecodeConfig()


def num_sms() -> int:
    """Multiprocessor count of the default device (the split-K target); 132 if unknown."""
    try:
        import jax

        return int(getattr(jax.devices()[0], "core_count", 0)) or DEFAULT_NUM_SMS
    except Exception:  # pragma: no cover - no backend
        return DEFAULT_NUM_SMS


def plan_splits(cfg: DecodeConfig, tokens: int, head_blocks: int, num_pages: int, sms: int) -> int:
    """Split-K count: about `ctas_per_sm` programs per SM in all (one wave of two programs per SM
    was the fastest point of every shape swept on the H200), capped so that the combine stays
    cheap and every program streams enough pages to amortise its start and its partial write.
    Fitted on the H200 sweeps in benchmarks/results/mla_decode_h200_*sweep*.json."""
    if cfg.num_splits > 0:
        return max(1, min(cfg.num_splits, num_pages))
    n = max(1, tokens * head_blocks)
    s = min((sms * cfg.ctas_per_sm) // n, cfg.max_splits, num_pages // cfg.min_pages_per_split)
    return max(1, s)

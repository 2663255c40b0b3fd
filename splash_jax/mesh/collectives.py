"""The collectives in a compiled program's HLO, and the checks each layout's attention must pass.

The checks are tests/test_layouts.py's (`test_attention_collectives`), as a function, so the same
rules run on the HLO of any backend: the CPU mesh there, a TPU topology in tests/test_tpu_aot.py.
Async forms (`all-reduce-start`, ...) count once, as their op. A collective counts once:
the TPU compiler splits one collective of the program into several instructions of the same
channel and source op (a cp attention block's all_gather of q became three all-gather
instructions, channel 1, one stack frame, for v5e), XLA:CPU keeps one.
"""

from __future__ import annotations

import re

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")


def hlo_ops(hlo: str, op: str) -> list[str]:
    """Result types of every `op` collective (async -start forms included), one per collective of
    the program: instructions of one channel and one source op (metadata) are pieces of it."""
    found, seen = [], set()
    for line in hlo.splitlines():
        if " = " not in line:
            continue
        rhs = line.split(" = ", 1)[1]
        if re.search(rf"(^|\s){op}(-start)?\(", rhs):
            channel = re.search(r"channel_id=(\d+)", rhs)
            source = re.search(r'op_name="[^"]*"[^}]*?stack_frame_id=\d+', rhs)
            if channel is not None and source is not None:
                key = (channel.group(1), source.group(0))
                if key in seen:
                    continue
                seen.add(key)
            found.append(rhs.split(" ")[0])
    return found


def collective_counts(hlo: str) -> dict[str, int]:
    """{collective: instructions} of the compiled HLO, the absent ones left out."""
    counts = {op: len(hlo_ops(hlo, op)) for op in COLLECTIVES}
    return {op: c for op, c in counts.items() if c}


def attention_collective_problems(layout: str, hlo: str, cfg, dtype: str = "f32") -> list[str]:
    """What is wrong with one layer's attention block of `layout` (DESIGN.md §2's collectives per
    layout; none gathers a head-sharded weight back to full size). Empty: it passes."""
    gathers, a2a = hlo_ops(hlo, "all-gather"), hlo_ops(hlo, "all-to-all")
    reduces, scatters = hlo_ops(hlo, "all-reduce"), hlo_ops(hlo, "reduce-scatter")
    counts = dict(all_gather=len(gathers), all_to_all=len(a2a), all_reduce=len(reduces), reduce_scatter=len(scatters))
    want = {
        "tp": a2a == [] and gathers == [] and scatters == [] and len(reduces) == 1,
        "dp": a2a == [] and reduces == [] and scatters == [] and len(gathers) == 1,
        "dop": len(a2a) == 2 and len(reduces) + len(scatters) == 1,
        "cp": len(a2a) == 2 and len(reduces) == 1 and len(gathers) == 1,
    }[layout]
    problems = [] if want else [f"{layout}: unexpected collectives {counts}"]
    full_weights = {
        f"{dtype}[{','.join(map(str, s))}]"
        for s in [(cfg.q_lora_rank, cfg.num_heads, cfg.qk_head_dim), (cfg.kv_lora_rank, cfg.num_heads, cfg.qk_nope_head_dim),
                  (cfg.kv_lora_rank, cfg.num_heads, cfg.v_head_dim), (cfg.num_heads, cfg.v_head_dim, cfg.hidden_size)]
    }
    gathered = [g for g in gathers if g.split("{")[0] in full_weights]
    if gathered:
        problems.append(f"{layout}: a head-sharded weight is gathered to full size: {gathered}")
    return problems

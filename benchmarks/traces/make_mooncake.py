"""Write a seeded synthetic trace in Mooncake's format (benchmarks/traces/mooncake_synthetic.jsonl).

    .venv/bin/python -m benchmarks.traces.make_mooncake            # rewrites the shipped file
    .venv/bin/python -m benchmarks.traces.make_mooncake --sessions 400 --duration-s 600 --out big.jsonl

The public Mooncake traces (kvcache-ai/Mooncake, FAST25-release/traces: conversation, tool&agent,
synthetic) cannot be downloaded on this machine, so this makes one with the same fields and the
same kinds of reuse. One JSON object per line: timestamp (ms since the first request),
input_length, output_length, hash_ids (one per block of --block-size tokens, the last block
partial; equal ids = equal block contents, ids counted up from 0 as Mooncake's are).
  sessions     arrive as a Poisson process; each has 1 + geometric(--mean-turns - 1) turns, the
               next turn --think-s (exponential mean) after the previous one;
  system       --system-prompts shared system prompts of 2..--system-blocks blocks, picked with
               Zipf-like popularity; a fraction --no-system of sessions has none (unique documents);
  turns        the first turn is system + a new user input; turn k+1 repeats turn k's full blocks
               (its partial last block is rewritten, as a new block) and appends the previous
               answer and a new user input as new blocks: the hash list extends the earlier one;
  lengths      user inputs lognormal (median --user-median tokens, sigma --user-sigma, at least
               --min-user), answers lognormal (median --output-median), prompts capped at
               --max-blocks blocks (a session ends there);
  window       --window-s > 0 keeps only the rows arriving within that many seconds of the first.
benchmarks/traces/mooncake_ttft.jsonl (benchmarks/ttft_trace.py) is made with other settings.
The shipped file (defaults, seed 0): 51 requests over 35 s, 15.4 blocks (~7.5K tokens) per prompt
on average; 64% of all blocks repeat an earlier row's (the public traces reuse 37% (conversation)
and 64% (synthetic) of their blocks: DESIGN.md section 6).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

import numpy as np

log = logging.getLogger("benchmarks.traces.make_mooncake")
OUT = Path(__file__).resolve().parent / "mooncake_synthetic.jsonl"


def generate(sessions: int = 16, duration_s: float = 20.0, mean_turns: float = 2.7, think_s: float = 4.0,
             system_prompts: int = 3, system_blocks: int = 8, no_system: float = 0.2, user_median: int = 1500,
             output_median: int = 250, max_blocks: int = 32, block_size: int = 512, seed: int = 0,
             user_sigma: float = 0.8, min_user: int = 16, window_s: float = 0.0) -> list[dict]:
    rng = np.random.default_rng(seed)
    next_id = 0

    def new_ids(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    systems = [new_ids(int(rng.integers(2, system_blocks + 1))) for _ in range(system_prompts)]
    popularity = 1.0 / np.arange(1, system_prompts + 1)
    popularity /= popularity.sum()
    rows = []
    starts = np.sort(rng.uniform(0, duration_s, sessions))
    for start in starts:
        turns = int(rng.geometric(1.0 / mean_turns)) if mean_turns > 1 else 1
        if rng.random() < no_system:
            full, tail = [], 0  # full blocks so far, tokens of the partial block after them
        else:
            full, tail = list(systems[int(rng.choice(system_prompts, p=popularity))]), 0
        t, answer = start, 0
        for k in range(turns):
            user = max(min_user, int(rng.lognormal(math.log(user_median), user_sigma)))
            new = tail + answer + user  # the rewritten partial block, the previous answer, the new input
            length = len(full) * block_size + new
            if math.ceil(length / block_size) > max_blocks:
                break
            hashes = full + new_ids(math.ceil(new / block_size))
            answer = int(np.clip(rng.lognormal(math.log(output_median), 0.7), 8, 2048))
            rows.append({"timestamp": int(round(t * 1000)), "input_length": length, "output_length": answer,
                         "hash_ids": hashes})
            full, tail = hashes[: length // block_size], length % block_size
            t += rng.exponential(think_s)
    rows.sort(key=lambda r: r["timestamp"])
    if window_s > 0:  # only what arrives within the window (a session's later turns may fall outside)
        rows = [r for r in rows if r["timestamp"] - rows[0]["timestamp"] <= window_s * 1000]
    first, order = (rows[0]["timestamp"] if rows else 0), {}
    for r in rows:  # as Mooncake's: ids counted up in order of first appearance, times from the first
        r["timestamp"] -= first
        r["hash_ids"] = [order.setdefault(h, len(order)) for h in r["hash_ids"]]
    return rows


def reuse(rows: list[dict]) -> float:
    """Fraction of all blocks whose hash id an earlier row had."""
    seen, total, hit = set(), 0, 0
    for r in rows:
        for h in r["hash_ids"]:
            total += 1
            hit += h in seen
            seen.add(h)
    return hit / total if total else 0.0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = generate.__defaults__
    names = generate.__code__.co_varnames[: generate.__code__.co_argcount]
    for name, default in zip(names, defaults):
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    p.add_argument("--out", default=str(OUT))
    args = vars(p.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(args.pop("out"))
    rows = generate(**args)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    blocks = sum(len(r["hash_ids"]) for r in rows)
    log.info("wrote %s: %d requests over %.1f s, %.1f blocks per prompt, %.0f%% of blocks reused", out, len(rows),
             rows[-1]["timestamp"] / 1000 if rows else 0, blocks / max(1, len(rows)), 100 * reuse(rows))
    return out


if __name__ == "__main__":
    main()

"""Writes `tuned_mla_decode.json` from sweep results of `benchmarks/mla_decode.py --sweep`.

Per heads bucket, among the block configs (block_h, block_k, num_warps, num_stages) swept on
the most shapes, it keeps the one with the best geometric-mean slowdown against the fastest config of each swept shape (each block
config at its best split count). The split count itself is left to `plan_splits`, whose
rule was fitted on the same sweeps, so the table generalises to batches and contexts that
were not swept.

  python -m pallas_kernels.tune_mla_decode benchmarks/results/mla_decode_h200_sweep*.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math

from pallas_kernels.mla_decode_config import TUNED_TABLE, DecodeConfig

log = logging.getLogger(__name__)
BLOCK_FIELDS = ("block_h", "block_k", "num_warps", "num_stages")


def best_block_configs(rows: list[dict]) -> list[dict]:
    per: dict[int, dict[tuple, dict[tuple, float]]] = {}  # heads -> block cfg -> shape -> best time
    for r in rows:
        if "config" not in r or r["config"].get("combine", "pallas") != "pallas":
            continue
        block = tuple(r["config"][k] for k in BLOCK_FIELDS)
        shape = (r["batch"], r["context"])
        times = per.setdefault(r["heads"], {}).setdefault(block, {})
        times[shape] = min(times.get(shape, math.inf), r["time_us"])
    rules = []
    for heads in sorted(per):
        blocks = per[heads]
        fastest: dict[tuple, float] = {}
        for times in blocks.values():
            for s, t in times.items():
                fastest[s] = min(fastest.get(s, math.inf), t)

        def score(block):
            t = blocks[block]
            return math.exp(sum(math.log(t[s] / fastest[s]) for s in t) / len(t))

        # The configs measured on the most shapes compete (a one-shape win proves little).
        most = max(len(t) for t in blocks.values())
        block = min((b for b in blocks if len(blocks[b]) == most), key=score)
        shapes = blocks[block]
        cfg = dict(zip(BLOCK_FIELDS, block))
        cfg = {k: v for k, v in cfg.items() if v != getattr(DecodeConfig(), k)}
        rules.append({"max_heads": heads, "config": cfg, "geomean_slowdown": round(score(block), 4),
                      "shapes_swept": len(shapes)})
    return rules


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweeps", nargs="+")
    ap.add_argument("--out", default=str(TUNED_TABLE))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    rows, sources = [], []
    for path in args.sweeps:
        data = json.loads(open(path).read())
        rows += data["rows"]
        sources.append({"file": path.split("/")[-1], "machine": data.get("machine"), "jax": data.get("jax"),
                        "started": data.get("started")})
    rules = best_block_configs(rows)
    with open(args.out, "w") as f:
        json.dump({"sources": sources, "rules": rules}, f, indent=1)
    log.info("wrote %d rules to %s", len(rules), args.out)


if __name__ == "__main__":
    main()

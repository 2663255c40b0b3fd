"""Plots from benchmark result files (no device needed): decode roofline, switching, prefill.

    python -m benchmarks.plot_results benchmarks/results/decode_roofline_gpu-*.json benchmarks/results/switching_*.json
    python -m benchmarks.plot_results benchmarks/results/prefill_gpu-*.json

Writes a PNG next to each JSON.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

log = logging.getLogger("benchmarks.plot_results")


def _finish_log_log(fig, ax, out: Path, xlabel: str, ylabel: str, title: str) -> None:
    """Log2 x, log y, labels, legend; write the PNG."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def plot_decode(data: dict, out: Path) -> None:
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for ctx in sorted({r["context"] for r in rows}):
        for overlap in sorted({r.get("overlap", True) for r in rows}, reverse=True):  # overlapped (default), sync
            sel = sorted((r for r in rows if r["context"] == ctx and r.get("overlap", True) == overlap),
                         key=lambda r: r["batch"])
            mode = "" if overlap else " (sync loop)"
            ax.plot([r["batch"] for r in sel], [r["tokens_per_s"] for r in sel], "o-" if overlap else "x:",
                    label=f"engine{mode}, context {ctx}")
        sel = sorted({r["batch"]: r for r in rows if r["context"] == ctx}.values(), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in sel], [r["batch"] / r["roofline_ms"] * 1e3 for r in sel], "--", alpha=0.6,
                label=f"roofline, context {ctx}")
    _finish_log_log(fig, ax, out, "batch (decoding requests)", "tokens / s",
                    f"decode vs roofline ({data['machine']['device_kind']}, {data['args']['shape']})")


def plot_switching(data: dict, out: Path) -> None:
    rows = data["rows"]
    pairs = [r["pair"] for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    a.bar(pairs, [r["cache_MB"] + r["weights_MB"] for r in rows], color="tab:blue")
    a.set_ylabel("MB moved")
    b.bar(pairs, [100 * (r["overhead_median"] or 0) for r in rows], color="tab:orange")
    b.set_ylabel("median step overhead %")
    b.tick_params(axis="x", rotation=45)
    a.set_title(f"layout switches ({data['machine']['device_kind']}, {data['machine']['device_count']} devices)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def plot_prefill(data: dict, out: Path) -> None:
    """Prefill time per prompt length for each (attention impl, prefill form), against the roofline."""
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in dict.fromkeys((r["impl"], r.get("prefill", "absorbed")) for r in rows):
        sel = sorted((r for r in rows if (r["impl"], r.get("prefill", "absorbed")) == key), key=lambda r: r["tokens"])
        ax.plot([r["tokens"] for r in sel], [r["prefill_s"] for r in sel], "o-", label=f"{key[1]} ({key[0]})")
    sel = sorted({r["tokens"]: r for r in rows}.values(), key=lambda r: r["tokens"])
    ax.plot([r["tokens"] for r in sel], [r["roofline_s"] for r in sel], "k--", alpha=0.6, label="FLOP roofline")
    ax.plot([r["tokens"] for r in sel], [2 * r["roofline_s"] for r in sel], "k:", alpha=0.4, label="2x roofline")
    _finish_log_log(fig, ax, out, "prompt tokens", "prefill seconds",
                    f"prefill ({data['machine']['device_kind']}, {data['args'].get('shape') or 'bundled'})")


def main(paths: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for p in map(Path, paths):
        data = json.loads(p.read_text())
        name = p.name.split("_")[0]
        plotter = {"decode": plot_decode, "switching": plot_switching, "prefill": plot_prefill}.get(name)
        if plotter is None:
            log.info("no plot for %s", p)
            continue
        plotter(data, p.with_suffix(".png"))
        log.info("wrote %s", p.with_suffix(".png"))


if __name__ == "__main__":
    main(sys.argv[1:])

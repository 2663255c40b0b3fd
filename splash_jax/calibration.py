"""Measured costs the layout policy ranks layouts by, instead of roofline constants.

A calibration file (written by `python -m benchmarks.calibrate`) holds, for one machine, one
model and one device count:
  - decode step seconds per layout over a grid of (running requests, context tokens per request),
    measured with the engine's own step programs;
  - prefill step seconds per layout as intercept + seconds per prompt token + seconds per attended
    key (a chunk's tokens attend to the cached prefix and to the chunk up to themselves);
  - the link bandwidth (all_to_all) and the measured cost of each switch pair (fixed handoff
    seconds plus bytes moved over the measured copy rate).
`StepTable.seconds` interpolates the grid (bilinear in log2(requests) and context, where the
four surrounding cells were measured); outside it, or next to a cell that did not fit, it uses a
per-layout least-squares fit t = a + b*requests + c*kv_tokens_read_by_the_busiest_device, whose
coefficients are measured too. Which of the two answered is reported with every estimate.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from splash_jax.mesh.layouts import LAYOUTS


@dataclasses.dataclass
class SwitchCost:
    fixed_s: float  # measured switch time not explained by bytes moved (plan, handoff, weights)
    bytes_per_s: float | None  # measured copy rate of the cache it moves (None: nothing moved)


@dataclasses.dataclass
class Calibration:
    machine: str
    devices: int
    model: dict  # name, layers, heads, hidden (what the table is valid for)
    page_size: int
    requests: list[int]  # grid axis: running requests
    contexts: list[int]  # grid axis: cached tokens per request
    step_s: dict[str, list[list[float | None]]]  # layout -> [requests index][context index]; None: did not fit
    prefill_s: dict[str, list[float]]  # layout -> [intercept s, s per prompt token(, s per attended key)] of a prefill step
    link_bytes_per_s: float | None
    switch: dict[str, SwitchCost]  # "src->dst"

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        raw = json.loads(Path(path).read_text())
        raw = raw.get("calibration", raw)  # a benchmark result file wraps it
        raw["switch"] = {k: SwitchCost(**v) for k, v in raw["switch"].items()}
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in fields})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path


def attended_keys(prefix: int, tokens: int) -> float:
    """Keys a prompt chunk's tokens attend to: each sees the cached prefix and the chunk up to itself."""
    return tokens * prefix + tokens * (tokens + 1) / 2


def first_chunk_keys(tokens: int) -> float:
    """What the per-token slope already includes: the same tokens as a chunk from position 0."""
    return attended_keys(0, tokens)


def busiest_kv_tokens(layout_name: str, requests: float, context: float, n: int) -> float:
    """Cached tokens the busiest device reads per decode step (the placement's own rule)."""
    return LAYOUTS[layout_name].kv_placement.cached_bytes_read(requests * context, max(int(math.ceil(requests)), 1), n)


class StepTable:
    """Step seconds per layout from a calibration: decode by grid interpolation, else the fit;
    prefill tokens add their measured per-token slope (a step of prefill alone its intercept too)."""

    def __init__(self, cal: Calibration, devices: int | None = None, scale: float = 1.0):
        """`devices` other than the calibration's projects the fit to that many devices (the grid,
        measured on the calibration's devices, is not used then); `scale` multiplies every time
        (e.g. layers of the target model over layers calibrated)."""
        self.cal = cal
        self.devices = devices or cal.devices
        self.scale = scale
        self.use_grid = self.devices == cal.devices
        self.fit = {name: self._fit(name) for name in cal.step_s}

    def _features(self, name: str, requests: float, context: float, devices: int | None = None) -> list[float]:
        return [1.0, requests, busiest_kv_tokens(name, requests, context, devices or self.cal.devices)]

    def _fit(self, name: str) -> list[float] | None:
        from scipy.optimize import nnls  # costs only grow with load: non-negative coefficients

        rows, ys = [], []
        for i, r in enumerate(self.cal.requests):
            for j, c in enumerate(self.cal.contexts):
                t = self.cal.step_s[name][i][j]
                if t is not None:
                    rows.append(self._features(name, r, c))
                    ys.append(t)
        if len(ys) < 3:
            return None
        coef, _ = nnls(np.asarray(rows), np.asarray(ys))
        return coef.tolist()

    def seconds(self, name: str, requests: float, context: float) -> tuple[float, str]:
        """(step seconds, "grid" | "fit") for `requests` decoding at `context` cached tokens each."""
        if requests <= 0:
            return 0.0, "grid"
        t = self._grid(name, requests, context) if self.use_grid else None
        if t is not None:
            return t * self.scale, "grid"
        coef = self.fit.get(name)
        if coef is None:
            raise ValueError(f"the calibration has fewer than 3 measured cells for layout {name}")
        return float(np.dot(coef, self._features(name, requests, context, self.devices))) * self.scale, "fit"

    def step(self, name: str, decoding: int, context: float, prefill_tokens: int, prefill_keys: float = 0.0) -> float:
        """A mixed step: `decoding` requests at `context` tokens each plus `prefill_tokens` prompt
        tokens attending to `prefill_keys` keys in all (calibration.attended_keys per chunk).
        A file without the per-key term (older calibrations) prices every chunk like a first one."""
        a, b, *rest = (x * self.scale for x in self.cal.prefill_s[name])
        per_key = rest[0] if rest else 0.0
        decode = self.seconds(name, decoding, context)[0] if decoding else a
        return decode + b * prefill_tokens + per_key * max(0.0, prefill_keys - first_chunk_keys(prefill_tokens))

    def prefill_seconds(self, name: str, prompts, budget: int) -> float:
        """Prefill steps computing prompts [(tokens done, tokens left), ...] at `budget` tokens per
        step: the measured intercept per step, slope per token, and per attended key beyond what a
        first chunk attends to (each prompt's chunks start deeper in it)."""
        a, b, *rest = (x * self.scale for x in self.cal.prefill_s[name])
        per_key, budget = (rest[0] if rest else 0.0), max(budget, 1)
        tokens = sum(left for _, left in prompts)
        deeper = sum(min(budget, done + left - start) * start  # attended_keys(start, n) - first_chunk_keys(n)
                     for done, left in prompts for start in range(done, done + left, budget))
        return math.ceil(tokens / budget) * a + b * tokens + per_key * deeper

    def _grid(self, name: str, requests: float, context: float) -> float | None:
        rs, cs, table = self.cal.requests, self.cal.contexts, self.cal.step_s[name]
        i, wi = _bracket([math.log2(r) for r in rs], math.log2(requests))
        j, wj = _bracket(cs, context)
        if i is None or j is None:
            return None
        corners = [table[i][j], table[i][j + 1], table[i + 1][j], table[i + 1][j + 1]]
        if any(t is None for t in corners):
            return None
        a, b, c, d = corners
        return (1 - wi) * ((1 - wj) * a + wj * b) + wi * ((1 - wj) * c + wj * d)


def _bracket(axis: list[float], x: float) -> tuple[int | None, float]:
    """Index i and weight w with x = (1-w)*axis[i] + w*axis[i+1], or (None, 0) outside the axis."""
    if len(axis) == 1:
        return (None, 0.0)
    if x < axis[0] or x > axis[-1]:
        return None, 0.0
    for i in range(len(axis) - 1):
        if axis[i] <= x <= axis[i + 1]:
            return i, (x - axis[i]) / (axis[i + 1] - axis[i])
    return None, 0.0

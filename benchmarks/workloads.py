"""Seeded request workloads for the dynamic benchmark and the simulator: what arrives, and when.

A workload is a list of `Arrival(t, prompt_len, output_len)`, sorted by t (seconds from the start
of the run). Every request runs greedy with ignore_eos to exactly `output_len` tokens, so every
layout does the same work and outputs can be compared.
  rollout   all requests at t=0 with long-tailed output lengths: the batch starts full and ends
            as a few long requests (RL rollout, reasoning);
  agentic   short chats at a steady rate plus bursts of long-context prompts;
  pressure  more long-context requests at once than TP's replicated pool holds (admission is
            decided by the layout's capacity);
  trace     a CSV replay (arrival_s, prompt_len, output_len); benchmarks/traces/sample.csv ships.
Times are multiplied by `time_scale`: CPU-mesh steps are ~100x slower than an H200's, so the
same shape of load needs a slower clock there.
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import numpy as np

TRACES = Path(__file__).resolve().parent / "traces"
WORKLOADS = ("rollout", "agentic", "pressure", "trace")


@dataclasses.dataclass(frozen=True)
class Arrival:
    t: float  # seconds after the start
    prompt_len: int
    output_len: int


@dataclasses.dataclass
class WorkloadConfig:
    """Sizes of every workload (each field a CLI flag); defaults fit the CPU mesh and bundled model."""

    workload_seed: int = 0
    time_scale: float = 1.0  # multiplies every arrival time
    rollout_requests: int = 16
    rollout_prompt: int = 32
    rollout_output_min: int = 4
    rollout_output_max: int = 96
    rollout_tail: float = 4.0  # output = min + (max - min) * u**tail, u uniform: larger = fewer long ones
    agentic_duration_s: float = 12.0
    agentic_rate: float = 1.0  # chats per second (Poisson)
    chat_prompt: int = 48
    chat_output: int = 12
    burst_every_s: float = 6.0
    burst_size: int = 2
    burst_prompt: int = 384
    burst_output: int = 8
    pressure_requests: int = 20
    pressure_prompt: int = 256
    pressure_output: int = 24
    trace: str = str(TRACES / "sample.csv")


def rollout(c: WorkloadConfig, rng: np.random.Generator) -> list[Arrival]:
    u = rng.random(c.rollout_requests)
    outs = c.rollout_output_min + np.floor((c.rollout_output_max - c.rollout_output_min) * u**c.rollout_tail)
    return [Arrival(0.0, c.rollout_prompt, int(o)) for o in outs]


def agentic(c: WorkloadConfig, rng: np.random.Generator) -> list[Arrival]:
    out, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / c.agentic_rate)
        if t >= c.agentic_duration_s:
            break
        out.append(Arrival(t * c.time_scale, c.chat_prompt, c.chat_output))
    b = c.burst_every_s / 2
    while b < c.agentic_duration_s:
        out += [Arrival(b * c.time_scale, c.burst_prompt, c.burst_output)] * c.burst_size
        b += c.burst_every_s
    return sorted(out, key=lambda a: a.t)


def pressure(c: WorkloadConfig, rng: np.random.Generator) -> list[Arrival]:
    return [Arrival(0.0, c.pressure_prompt, c.pressure_output) for _ in range(c.pressure_requests)]


def read_trace(path: str | Path, time_scale: float = 1.0) -> list[Arrival]:
    with open(path, newline="") as f:
        rows = [Arrival(float(r["arrival_s"]) * time_scale, int(r["prompt_len"]), int(r["output_len"]))
                for r in csv.DictReader(f)]
    bad = [a for a in rows if a.prompt_len < 1 or a.output_len < 1 or a.t < 0]
    if bad:
        raise ValueError(f"{path}: rows need arrival_s >= 0 and lengths >= 1, got {bad[0]}")
    return sorted(rows, key=lambda a: a.t)


def make(name: str, c: WorkloadConfig) -> list[Arrival]:
    rng = np.random.default_rng([c.workload_seed, WORKLOADS.index(name)])
    if name == "trace":
        return read_trace(c.trace, c.time_scale)
    return {"rollout": rollout, "agentic": agentic, "pressure": pressure}[name](c, rng)


def prompt_ids(i: int, length: int, vocab: int, seed: int) -> list[int]:
    """Token ids of request i's prompt (ids 2.. to stay clear of BOS/EOS)."""
    return np.random.default_rng([seed, 1_000_003, i]).integers(2, vocab, length).tolist()

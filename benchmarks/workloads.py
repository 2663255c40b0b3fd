"""Seeded request workloads for the dynamic benchmark and the simulator: what arrives, and when.

A workload is a list of `Arrival`s, sorted by t (seconds from the start of the run). Requests run
greedy (or seeded sampling where the workload says so) with ignore_eos to exactly `output_len`
tokens, so every layout does the same work and outputs can be compared.
  rollout    all requests at t=0 with long-tailed output lengths: the batch starts full and ends
             as a few long requests (RL rollout, reasoning);
  agentic    short chats at a steady rate plus bursts of long-context prompts;
  pressure   more long-context requests at once than TP's replicated pool holds (admission is
             decided by the layout's capacity);
  trace      a CSV replay (arrival_s, prompt_len, output_len); benchmarks/traces/sample.csv ships.
Workloads with shared prefixes (prompt contents matter: they name their token blocks):
  multiturn  agent conversations, closed loop: every conversation starts with the same system
             prompt; each turn appends a tool result; a conversation's next turn is submitted
             when its previous answer finished, its prompt = the previous prompt + the previous
             answer's generated tokens + the next tool result;
  grouped    G prompts each sampled K times (temperature > 0, seeded), all at t=0 (GRPO-style);
  mooncake   a replay of a Mooncake-format trace (JSONL: timestamp ms, input_length,
             output_length, hash_ids, one hash id per block of `mooncake_block_size` tokens):
             equal hash ids become equal token blocks (each block's tokens drawn from its hash id
             by a seeded rng), so the trace's sharing is reproduced; the last block is partial
             when input_length is not a multiple. The public traces (kvcache-ai/Mooncake,
             FAST25-release) cannot be downloaded here: benchmarks/traces/mooncake_synthetic.jsonl
             is a seeded synthetic trace in their format (benchmarks/traces/make_mooncake.py).
             `--mooncake-tokens-per-block` replays each block as fewer tokens (lengths scaled by
             the same ratio), keeping the sharing, for small engines.
Times are multiplied by `time_scale`: CPU-mesh steps are ~100x slower than an H200's, so the
same shape of load needs a slower clock there. The simulator replays open-loop workloads only
(it ignores `follows`): use it with the first four and mooncake.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
from pathlib import Path

import numpy as np

log = logging.getLogger("benchmarks.workloads")
TRACES = Path(__file__).resolve().parent / "traces"
WORKLOADS = ("rollout", "agentic", "pressure", "trace")  # open loop, random prompts (the simulator's)
PREFIX_WORKLOADS = ("multiturn", "grouped", "mooncake")  # shared prefixes
ALL_WORKLOADS = WORKLOADS + PREFIX_WORKLOADS
# Content-key ranges of the workloads' blocks (mooncake uses the trace's hash ids, below 2**40),
# so two workloads never share a block by accident.
_MULTITURN_KEYS, _GROUPED_KEYS, _UNIQUE_KEYS = 1 << 40, 2 << 40, 3 << 40


@dataclasses.dataclass(frozen=True)
class Arrival:
    """One request. Without `blocks` its prompt is `prompt_len` random ids of its own (the open-loop
    workloads). With `blocks`, its own prompt part is those content blocks, (key, tokens) each:
    equal keys are equal tokens, and a shorter block of a key is a prefix of a longer one. With
    `follows` >= 0 it is a closed-loop follow-up: submitted `t` seconds after arrival `follows`
    finished (t is a delay then, not a time), its prompt = that request's prompt + its generated
    tokens + its own blocks; prompt_len counts all of it."""

    t: float  # seconds after the start (a follow-up: after the request it follows finished)
    prompt_len: int
    output_len: int
    blocks: tuple[tuple[int, int], ...] = ()
    follows: int = -1
    temperature: float = 0.0  # 0 = greedy; else seeded per request (sampling_seed)
    session: int = -1  # the conversation or group it belongs to (reports), -1 = none
    turn: int = 0  # its turn in the conversation (or its sample in the group)

    def __post_init__(self):  # JSON gives lists back: keep the blocks hashable
        object.__setattr__(self, "blocks", tuple((int(k), int(n)) for k, n in self.blocks))


@dataclasses.dataclass
class WorkloadConfig:
    """Sizes of every workload (each field a CLI flag); defaults fit the CPU mesh and bundled model."""

    workload_seed: int = 0  # seeds arrivals, prompt tokens and sampling
    time_scale: float = 1.0  # multiplies every arrival time
    rollout_requests: int = 16  # rollout: requests, all at t=0
    rollout_prompt: int = 32  # rollout: prompt tokens
    rollout_output_min: int = 4  # rollout: shortest output
    rollout_output_max: int = 96  # rollout: longest output
    rollout_tail: float = 4.0  # output = min + (max - min) * u**tail, u uniform: larger = fewer long ones
    agentic_duration_s: float = 12.0  # agentic: seconds of arrivals
    agentic_rate: float = 1.0  # chats per second (Poisson)
    chat_prompt: int = 48  # agentic: a chat's prompt tokens
    chat_output: int = 12  # agentic: a chat's output tokens
    burst_every_s: float = 6.0  # agentic: seconds between bursts of long prompts
    burst_size: int = 2  # agentic: long prompts per burst
    burst_prompt: int = 384  # agentic: a long prompt's tokens
    burst_output: int = 8  # agentic: a long prompt's output tokens
    pressure_requests: int = 20  # pressure: requests, all at t=0
    pressure_prompt: int = 256  # pressure: prompt tokens
    pressure_output: int = 24  # pressure: output tokens
    trace: str = str(TRACES / "sample.csv")  # trace: CSV with arrival_s, prompt_len, output_len
    multiturn_conversations: int = 4  # multiturn: conversations, each starting at t=0
    multiturn_turns: int = 3  # multiturn: turns per conversation
    multiturn_system: int = 64  # multiturn: system-prompt tokens (the same in every conversation)
    multiturn_tool: int = 16  # multiturn: tokens of the tool result each turn appends
    multiturn_answer: int = 8  # multiturn: tokens of each answer (greedy, exactly this many)
    multiturn_think_s: float = 0.0  # multiturn: seconds between an answer and the next turn
    grouped_prompts: int = 4  # grouped: distinct prompts
    grouped_samples: int = 4  # grouped: samples of each prompt
    grouped_prompt: int = 64  # grouped: prompt tokens
    grouped_output: int = 8  # grouped: output tokens of each sample
    grouped_temperature: float = 1.0  # grouped: sampling temperature (seeded per request)
    mooncake_trace: str = str(TRACES / "mooncake_synthetic.jsonl")  # mooncake: the JSONL trace
    mooncake_block_size: int = 512  # mooncake: tokens per hash id in the trace (Mooncake's: 512)
    mooncake_tokens_per_block: int = 8  # mooncake: tokens per block in the replay (0 = the block size: unscaled)
    mooncake_requests: int = 0  # mooncake: replay the first N rows (0 = all)


# --- open loop, random prompts -----------------------------------------------------------------
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


# --- shared prefixes ---------------------------------------------------------------------------
def multiturn(c: WorkloadConfig, rng: np.random.Generator) -> list[Arrival]:
    """Conversation-major: arrival index = conversation * turns + turn (turn k follows turn k-1)."""
    C, T, S, U, A = c.multiturn_conversations, c.multiturn_turns, c.multiturn_system, c.multiturn_tool, c.multiturn_answer
    out = []
    for conv in range(C):
        for k in range(T):
            tool = (_MULTITURN_KEYS + 1 + conv * T + k, U)
            if k == 0:
                out.append(Arrival(0.0, S + U, A, ((_MULTITURN_KEYS, S), tool), session=conv, turn=0))
            else:
                out.append(Arrival(c.multiturn_think_s * c.time_scale, S + (k + 1) * U + k * A, A, (tool,),
                                   follows=len(out) - 1, session=conv, turn=k))
    return out


def grouped(c: WorkloadConfig, rng: np.random.Generator) -> list[Arrival]:
    return [Arrival(0.0, c.grouped_prompt, c.grouped_output, ((_GROUPED_KEYS + g, c.grouped_prompt),),
                    temperature=c.grouped_temperature, session=g, turn=k)
            for g in range(c.grouped_prompts) for k in range(c.grouped_samples)]


def read_mooncake(path: str | Path, block_size: int = 512, tokens_per_block: int = 0, time_scale: float = 1.0,
                  max_rows: int = 0) -> list[Arrival]:
    """A Mooncake-format trace as arrivals whose blocks are the rows' hash ids.

    Row r's prompt is its hash ids' blocks in order, block_size tokens each and the last one
    partial (input_length - (n - 1) * block_size tokens); tokens_per_block (0 = block_size)
    replays each block as that many tokens, the partial one and output_length scaled by the same
    ratio (at least 1). A row whose hash ids cover fewer tokens than input_length gets the rest
    as a block of its own (never shared); hash ids beyond input_length are ignored. Both are
    counted in a warning. Rows are in file order, sorted by timestamp (stable)."""
    tpb = tokens_per_block or block_size
    ratio = tpb / block_size
    rows = []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if max_rows:
        rows = rows[:max_rows]
    out, short, long_ = [], 0, 0
    for r, row in enumerate(rows):
        length, hashes = int(row["input_length"]), [int(h) for h in row["hash_ids"]]
        if length < 1 or int(row["output_length"]) < 1 or float(row["timestamp"]) < 0:
            raise ValueError(f"{path}: row {r} needs timestamp >= 0 and lengths >= 1, got {row}")
        if any(h < 0 or h >= _MULTITURN_KEYS for h in hashes):
            raise ValueError(f"{path}: row {r}: hash ids must be in [0, 2**40), got {row['hash_ids']}")
        need = math.ceil(length / block_size)
        short += len(hashes) < need
        long_ += len(hashes) > need
        blocks = []
        for j in range(need):
            n = min(block_size, length - j * block_size)
            key = hashes[j] if j < len(hashes) else _UNIQUE_KEYS + r  # uncovered tail: this row's own tokens
            if j >= len(hashes) and blocks and blocks[-1][0] == key:  # one own block for the whole tail
                blocks[-1] = (key, blocks[-1][1] + n)
            else:
                blocks.append((key, n))
        blocks = [(k, tpb if n == block_size else max(1, round(n * ratio))) for k, n in blocks]
        out.append(Arrival(float(row["timestamp"]) / 1000 * time_scale, sum(n for _, n in blocks),
                           max(1, round(int(row["output_length"]) * ratio)), tuple(blocks)))
    if short or long_:
        log.warning("%s: %d rows with fewer hash ids than input_length needs (tail unshared), %d with more (ignored)",
                    path, short, long_)
    return sorted(out, key=lambda a: a.t)


def make(name: str, c: WorkloadConfig) -> list[Arrival]:
    rng = np.random.default_rng([c.workload_seed, ALL_WORKLOADS.index(name)])
    if name == "trace":
        return read_trace(c.trace, c.time_scale)
    if name == "mooncake":
        return read_mooncake(c.mooncake_trace, c.mooncake_block_size, c.mooncake_tokens_per_block, c.time_scale,
                             c.mooncake_requests)
    return {"rollout": rollout, "agentic": agentic, "pressure": pressure, "multiturn": multiturn,
            "grouped": grouped}[name](c, rng)


# --- tokens ------------------------------------------------------------------------------------
def prompt_ids(i: int, length: int, vocab: int, seed: int) -> list[int]:
    """Token ids of request i's prompt (ids 2.. to stay clear of BOS/EOS)."""
    return np.random.default_rng([seed, 1_000_003, i]).integers(2, vocab, length).tolist()


def block_ids(key: int, length: int, vocab: int, seed: int) -> list[int]:
    """Tokens of content block `key` (ids 2..): the first `length` of one seeded sequence, so a
    partial block is a prefix of the full one."""
    return np.random.default_rng([seed, 7_919, key]).integers(2, vocab, length).tolist()


def own_ids(a: Arrival, i: int, vocab: int, seed: int) -> list[int]:
    """The tokens arrival i adds itself: its blocks, or (no blocks) its random prompt."""
    if not a.blocks:
        if a.follows >= 0:
            raise ValueError(f"arrival {i} follows {a.follows} but names no blocks of its own")
        return prompt_ids(i, a.prompt_len, vocab, seed)
    return [t for key, n in a.blocks for t in block_ids(key, n, vocab, seed)]


def build_prompt(a: Arrival, i: int, vocab: int, seed: int, history: list[int] | None = None) -> list[int]:
    """Arrival i's prompt: `history` (for a follow-up: the prompt and generated tokens of the
    request it follows) + its own tokens; checked against prompt_len."""
    if (a.follows >= 0) != (history is not None):
        raise ValueError(f"arrival {i}: a follow-up needs the history it extends, an open arrival none")
    ids = list(history or []) + own_ids(a, i, vocab, seed)
    if len(ids) != a.prompt_len:
        raise ValueError(f"arrival {i}: its prompt has {len(ids)} tokens, prompt_len says {a.prompt_len}")
    return ids


def sampling_seed(i: int, seed: int) -> int:
    """The sampling seed of request i (temperature > 0): reproducible per (workload seed, index)."""
    return int(np.random.default_rng([seed, 31_337, i]).integers(2**31))


class PrefixIndex:
    """Every page-aligned prefix seen so far, by its exact tokens (a trie of pages): how much of a
    new prompt an ideal cache (unbounded, filled the moment a request is submitted) would hold."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._nodes: dict[tuple[int, tuple[int, ...]], int] = {}

    def add(self, ids: list[int]) -> None:
        node, p = 0, self.page_size
        for j in range(len(ids) // p):
            node = self._nodes.setdefault((node, tuple(ids[j * p : (j + 1) * p])), len(self._nodes) + 1)

    def shared(self, ids: list[int]) -> int:
        """Tokens of the longest page-aligned prefix of `ids` seen before, below its last token
        (the last token is always computed: a fully seen prompt computes just that one, as the
        engine's cache does with copy-on-write: engine/admission.py, cached_start)."""
        node, p = 0, self.page_size
        for j in range(len(ids) // p):
            node = self._nodes.get((node, tuple(ids[j * p : (j + 1) * p])))
            if node is None:
                return j * p
        return min(len(ids) // p * p, len(ids) - 1)


def block_reuse(arrivals: list[Arrival]) -> float:
    """Fraction of the arrivals' blocks (own blocks only) whose key an earlier arrival named."""
    seen, total, reused = set(), 0, 0
    for a in arrivals:
        for key, _ in a.blocks:
            total += 1
            reused += key in seen
            seen.add(key)
    return reused / total if total else 0.0

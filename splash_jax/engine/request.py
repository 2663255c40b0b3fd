"""Requests as the engine sees them: sampling parameters, lifecycle state, outputs and metrics."""

from __future__ import annotations

import dataclasses
import enum
import time

MAX_LOGPROBS = 20  # top-n alternatives computed on device for every row (OpenAI's limit)


class RequestError(ValueError):
    """A request that cannot be served as given; only that request fails."""


@dataclasses.dataclass
class SamplingParams:
    """Per-request decoding controls (vLLM/OpenAI semantics)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; 0 = chosen token only; n = plus top-n alternatives

    def validate(self, vocab_size: int) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not 0 <= int(self.seed) < 2**63:
            raise RequestError(f"seed must be a non-negative 64-bit integer, got {self.seed}")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise RequestError(f"stop_token_ids entry {t} is outside the vocabulary (size {vocab_size})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestMetrics:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0

    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def tpot(self, num_tokens: int) -> float | None:
        if self.finished is None or self.first_token is None or num_tokens < 2:
            return None
        return (self.finished - self.first_token) / (num_tokens - 1)


@dataclasses.dataclass(eq=False)  # identity semantics: queues test membership by object, not by field values
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    sample_seed: int = 0  # the seed its sampling keys derive from (params.seed, or drawn by the engine)
    status: Status = Status.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose latent is in the cache
    device_pages: list[list[int]] = dataclasses.field(default_factory=list)  # per device, global page ids
    owner: int = 0  # device holding its pages under owner layouts (dp, dop)
    finish_reason: str | None = None
    stop_text: str | None = None  # the stop string that ended it
    text_sent: int = 0  # characters of the output text already returned as deltas
    metrics: RequestMetrics = dataclasses.field(default_factory=lambda: RequestMetrics(time.monotonic()))
    order: int = 0  # admission order (for preemption choice)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output without concatenating the whole sequence."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : stop - n]
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[: stop - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED


@dataclasses.dataclass
class RequestOutput:
    """What a caller gets back: the whole result so far plus the delta of this step."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    ttft: float | None = None
    tpot: float | None = None
    error: str | None = None

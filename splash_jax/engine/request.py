"""Requests as the engine sees them: sampling parameters, lifecycle state, outputs and metrics."""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from typing import TYPE_CHECKING

from splash_jax.engine.draft_budget import Acceptance

if TYPE_CHECKING:
    from splash_jax.structured.spec import StructuredOutputs

MAX_LOGPROBS = 20  # top-n alternatives computed on device for every row (OpenAI's limit)


class RequestError(ValueError):
    """A request that cannot be served as given; only that request fails.

    `field` names the SamplingParams field at fault (the server maps it to the request's own
    field name in its 400 answer)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class SamplingLimits:
    """Bounds that fix the shapes of the sampler's per-row arrays (so nothing a request sends
    changes a compiled program): EOS + stop_token_ids to suppress, logit_bias entries."""

    max_stop_token_ids: int = 16
    max_logit_bias: int = 64


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass
class SamplingParams:
    """Per-request decoding controls (vLLM/OpenAI semantics)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (0 = off)
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # vLLM: prompt + output tokens; positive logits / p, negative x p
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # None = off; 0 = chosen token only; n = plus top-n alternatives
    prompt_logprobs: int | None = None  # None = off; n: each prompt token's logprob plus the top-n (vLLM's name)
    structured_outputs: "StructuredOutputs | None" = None  # what the output must match (JSON schema, regex, ...)
    # The output begins inside a reasoning block ending with this token: the grammar applies from
    # the token after it (structured/reasoning_gate.py).
    reasoning_end_token_id: int | None = None
    thinking_token_budget: int | None = None  # at most this many reasoning tokens, then the end token is forced (vLLM's name)

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate(self, vocab_size: int, limits: SamplingLimits = SamplingLimits()) -> None:
        """Raise RequestError (naming the field) for anything the engine cannot run as given."""

        def bad(field: str, message: str):
            raise RequestError(f"{field} {message}", field)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or 1 <= self.top_k <= vocab_size):
            bad("top_k", f"must be -1 or 0 (off) or in [1, {vocab_size}] (the vocabulary size), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            bad("seed", f"must be a 64-bit integer, got {self.seed!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens!r}")
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                bad(field, f"must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10] (1 = off), got {self.repetition_penalty!r}")
        if not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > limits.max_stop_token_ids:
            bad("stop_token_ids", f"may hold at most {limits.max_stop_token_ids} ids")
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t < vocab_size:
                bad("stop_token_ids", f"entry {t!r} is outside the vocabulary (size {vocab_size})")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > limits.max_logit_bias:
            bad("logit_bias", f"may hold at most {limits.max_logit_bias} entries")
        for t, v in self.logit_bias.items():
            if not _is_int(t) or not 0 <= t < vocab_size:
                bad("logit_bias", f"key {t!r} is not a token id of the vocabulary (size {vocab_size})")
            if not _is_number(v) or not -100.0 <= v <= 100.0:
                bad("logit_bias", f"value for token {t} must be in [-100, 100], got {v!r}")
        end = self.reasoning_end_token_id
        if end is not None and (not _is_int(end) or not 0 <= end < vocab_size):
            bad("reasoning_end_token_id", f"must be a token id of the vocabulary (size {vocab_size}), got {end!r}")
        budget = self.thinking_token_budget
        if budget is not None:
            if not _is_int(budget) or budget < 0:
                bad("thinking_token_budget", f"must be an integer >= 0, got {budget!r}")
            if end is None:
                bad("thinking_token_budget", "needs reasoning_end_token_id (the token that ends the reasoning block)")


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
    num_step_failures: int = 0  # device steps that failed with this request in them

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
    output_ids: list[int] = dataclasses.field(default_factory=list)  # tokens that reached the host
    num_computed: int = 0  # tokens whose latent is in the cache (or being written by a dispatched step)
    num_pending: int = 0  # sampled tokens still on the device (overlapped scheduling: 0 or 1)
    num_unverified: int = 0  # speculative drafts in num_computed that their verify step has not yet accepted
    pending_row: int = -1  # their row in the last dispatched step's sampled tokens
    # sampling chunks scheduled whose tokens the host has not applied yet, oldest first (overlapped
    # speculation moves the next one once the verify chunk before it is applied: scheduler.py)
    unapplied: list = dataclasses.field(default_factory=list)
    acceptance: Acceptance = dataclasses.field(default_factory=Acceptance)  # its drafts kept so far (draft_budget.py)
    slot: int = -1  # its row in the persistent page tables, sampling and penalty state while running
    device_pages: list[list[int]] = dataclasses.field(default_factory=list)  # per device, global page ids
    owner: int = 0  # device holding its pages under owner layouts (dp, dop)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    metrics: RequestMetrics = dataclasses.field(default_factory=lambda: RequestMetrics(time.monotonic()))
    order: int = 0  # admission order (for preemption choice)
    cache_salt: str | None = None  # prefix-cache namespace: only requests with the same salt share pages
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    cache_nodes: list = dataclasses.field(default_factory=list)  # prefix-cache nodes of its first pages
    cache_computing: list = dataclasses.field(default_factory=list)  # cache nodes it is filling (others wait)
    num_cacheable: int = 0  # tokens whose latents dispatched steps wrote (what the cache may name)
    follows: "Request | None" = None  # admitted onto a leader's pages whose write of its last token it reads (admission.py)
    last_token_cached: bool = False  # admitted with every token's latent cached: its first chunk writes none (admission.py)
    admissions: int = 0  # times admitted (a preempted request is admitted again)
    cacheable: bool = True  # False: its pages hold no real latents (benchmarks' admit_cached)
    grammar: object = None  # llguidance.LLMatcher of params.structured_outputs, advanced as tokens reach the host
    reasoning_end: int = -1  # index in output_ids of params.reasoning_end_token_id once sampled (-1: not yet)
    prompt_lp_next: int = 0  # prompt logprobs: the next position whose logits a step returns
    prompt_lps: list = dataclasses.field(default_factory=list)  # entry p: logprob of prompt token p + 1
    prompt_tops: list = dataclasses.field(default_factory=list)  # entry p: its top-n alternatives {id: logprob}
    prompt_lps_sent: bool = False  # the first output carried them
    error: str | None = None  # why it failed (a grammar dead end), shown in its last output

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed (position P - 1 predicts the first output)."""
        return self.params.prompt_logprobs is not None and self.prompt_lp_next < len(self.prompt_ids) - 1

    @property
    def computes_whole_prompt(self) -> bool:
        """Admission skips the prefix cache for it: its prompt logprobs need every position's
        logits, or its penalties need the prompt fed from position 0 (the step programs build a
        slot's penalty history from the tokens they are fed, clearing it at position 0)."""
        return self.wants_prompt_logprobs or self.params.uses_penalties

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Known tokens [start, stop) of prompt + output without concatenating the whole sequence."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : stop - n]
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[: stop - n]

    @property
    def num_known(self) -> int:
        """Tokens whose values the host has (prompt + outputs read back)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence so far, including sampled ones still on the device."""
        return self.num_known + self.num_pending

    @property
    def num_stable(self) -> int:
        """Tokens whose latents are final: computed, less drafts awaiting verification (a rejected
        draft's slot is written again, so a page holding one is not full yet)."""
        return self.num_computed - self.num_unverified

    @property
    def awaits_verify(self) -> bool:
        """A verify chunk of it is on the device: how many drafts it keeps is not known yet."""
        return any(c.drafts for c in self.unapplied)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED


@dataclasses.dataclass
class RequestOutput:
    """What one step adds to a request: deltas only (a stream concatenates them).

    The engine holds back text that may still become a stop string and drops a matched stop
    string, so the concatenated `delta_text` is the final text. `Engine.generate()` returns
    accumulated outputs, where `text`, `token_ids`, `logprobs` and `top_logprobs` are the whole
    result; on streamed outputs those stay empty.
    """

    request_id: str
    delta_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    delta_logprobs: list[float] | None = None
    delta_top_logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details.cached_tokens)
    num_output_tokens: int = 0  # cumulative
    ttft: float | None = None
    tpot: float | None = None
    error: str | None = None
    # Prompt logprobs (SamplingParams.prompt_logprobs), on the request's first output only: one
    # entry per prompt token, None for the first (nothing precedes it), as vLLM returns them.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    # Accumulated results (Engine.generate, AsyncEngine collectors); empty on streamed deltas.
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None

    def extend(self, later: "RequestOutput") -> "RequestOutput":
        """One delta for two consecutive ones of the same request (a speculative step outputs
        several tokens): ids, text and logprobs concatenated, state fields from the later one."""
        lp = None if self.delta_logprobs is None else self.delta_logprobs + (later.delta_logprobs or [])
        top = None if self.delta_top_logprobs is None else self.delta_top_logprobs + (later.delta_top_logprobs or [])
        return dataclasses.replace(
            later, delta_token_ids=self.delta_token_ids + later.delta_token_ids,
            delta_text=self.delta_text + later.delta_text, delta_logprobs=lp, delta_top_logprobs=top,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            prompt_top_logprobs=self.prompt_top_logprobs if self.prompt_logprobs is not None else later.prompt_top_logprobs,
        )

    def accumulate(self, delta: "RequestOutput") -> "RequestOutput":
        """Fold a newer delta of the same request into this accumulated output (in place)."""
        self.token_ids += delta.delta_token_ids
        self.text += delta.delta_text
        if delta.delta_logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.delta_logprobs
            self.top_logprobs = (self.top_logprobs or []) + (delta.delta_top_logprobs or [])
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = delta.prompt_logprobs, delta.prompt_top_logprobs
        for f in ("finished", "finish_reason", "stop_reason", "num_cached_tokens", "num_output_tokens", "ttft", "tpot", "error"):
            setattr(self, f, getattr(delta, f))
        self.delta_token_ids, self.delta_text = delta.delta_token_ids, delta.delta_text
        self.delta_logprobs, self.delta_top_logprobs = delta.delta_logprobs, delta.delta_top_logprobs
        return self


def accumulate(acc: dict[str, RequestOutput], deltas: list[RequestOutput]) -> list[RequestOutput]:
    """Fold one step's deltas into per-request accumulated outputs (kept in `acc` by request id);
    returns the accumulated outputs this step touched, in order (notebooks, tests, collectors)."""
    touched = []
    for d in deltas:
        out = acc.get(d.request_id)
        if out is None:
            out = acc[d.request_id] = RequestOutput(d.request_id, [], "", False, None, num_prompt_tokens=d.num_prompt_tokens)
        touched.append(out.accumulate(d))
    return touched

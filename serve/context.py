"""What every route needs: the engine, its limits, the metrics, the served model names, the
tokenizer threads, and the plumbing from engine requests to tracked output streams and SSE events."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TypeVar

from pydantic import BaseModel

from serve.config import ServerLimits
from serve.errors import APIError, error_body, to_api_error
from serve.metrics import ServerMetrics
from serve.outputs import ChoiceAccumulator, ChoiceState, TokenText
from serve.protocol import CompletionTokensDetails, PromptTokensDetails, UsageInfo
from serve.reasoning import ReasoningMarkers
from splash_jax.engine.async_engine import AsyncEngine
from splash_jax.engine.core_client import EngineClient
from splash_jax.engine.output_streams import EngineStepError
from splash_jax.engine.request_factory import EngineFacts
from splash_jax.engine.request import Request, RequestOutput, SamplingLimits

SSE_DONE = "data: [DONE]\n\n"
T = TypeVar("T")


@dataclasses.dataclass
class ServerContext:
    engine: AsyncEngine | EngineClient  # the core in this process, or in its own (core_client.py)
    metrics: ServerMetrics
    served_model_names: list[str]
    model_root: str
    token_text: TokenText
    limits: ServerLimits
    facts: EngineFacts
    pool: concurrent.futures.ThreadPoolExecutor  # tokenization, chat templates, echo decoding
    reasoning_parser: str = "none"  # --reasoning-parser
    reasoning_markers: ReasoningMarkers | None = None  # its <think> / </think> tokens (None: no parser)

    @property
    def vocab_size(self) -> int:
        return self.facts.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def sampling_limits(self) -> SamplingLimits:
        return self.facts.sampling_limits

    async def run_blocking(self, fn: Callable[..., T], *args) -> T:
        """Run tokenizer-bound work on the tokenizer threads, never on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    def resolve_model(self, name: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if name is None or name == "":
            return self.served_model_names[0]
        if name not in self.served_model_names:
            raise APIError(
                f"the model {name[:200]!r} does not exist; this server serves {', '.join(map(repr, self.served_model_names))}",
                404, param="model", code="model_not_found",
            )
        return name

    @staticmethod
    def choice_states(requests: Sequence[Request]) -> dict[str, ChoiceState]:
        return {r.request_id: ChoiceState(i) for i, r in enumerate(requests)}

    async def outputs(self, requests: Sequence[Request]) -> AsyncIterator[RequestOutput]:
        """The requests' outputs as they come, counted in the metrics; closing it aborts them. A
        request the engine failed (finish reason "error": two failed device steps, a grammar dead
        end) raises EngineStepError with its reason: a 500, or an error event in a stream."""
        tracker = self.metrics.track(requests)
        try:
            async with contextlib.aclosing(self.engine.generate_many(requests)) as stream:
                async for out in stream:
                    tracker.observe(out)
                    if out.finished and out.finish_reason == "error":
                        raise EngineStepError(out.error or "the engine failed this request")
                    yield out
        finally:
            tracker.close()

    async def accumulated(self, requests: Sequence[Request], states: dict[str, ChoiceState]) -> dict[str, ChoiceAccumulator]:
        """Each request's deltas concatenated, once all have finished (non-streamed responses)."""
        results = {r.request_id: ChoiceAccumulator() for r in requests}
        async with contextlib.aclosing(self.outputs(requests)) as stream:
            async for out in stream:
                results[out.request_id].add(states[out.request_id].advance(out))
        return results

    def sse_error(self, exc: BaseException) -> str:
        """An error that happens after a stream started: one SSE event with the error JSON."""
        err = to_api_error(exc)
        self.metrics.errors.labels(str(err.status)).inc()
        return sse(error_body(err.message, err.status, err.param, err.code))


def sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"


def usage(requests: Sequence[Request], n: int, completion_tokens: int, cached_tokens: Mapping[str, int],
          reasoning_tokens: int | None = None) -> UsageInfo:
    """Prompt tokens count once per prompt (not once per choice), as OpenAI does; so do the cached
    ones (`prompt_tokens_details.cached_tokens`): those of each prompt's first choice, the one whose
    prompt tokens are counted. `cached_tokens`: request id -> its prompt tokens the prefix cache served.
    reasoning_tokens: all choices' tokens inside reasoning blocks (None: no reasoning parser ran)."""
    firsts = requests[::n]
    prompt_tokens = sum(len(r.prompt_ids) for r in firsts)
    cached = sum(min(cached_tokens.get(r.request_id, 0), len(r.prompt_ids)) for r in firsts)
    return UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens),
    )

"""What every route needs: the engine, the metrics, the served model names, and the plumbing
from engine requests to tracked output streams and SSE events."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

from pydantic import BaseModel

from serve.errors import APIError, error_body, to_api_error
from serve.metrics import ServerMetrics
from serve.outputs import TokenText
from serve.protocol import UsageInfo
from splash_jax.engine.async_engine import AsyncEngine
from splash_jax.engine.request import Request, RequestOutput

SSE_DONE = "data: [DONE]\n\n"


@dataclasses.dataclass
class ServerContext:
    engine: AsyncEngine
    metrics: ServerMetrics
    served_model_names: list[str]
    model_root: str
    token_text: TokenText

    def resolve_model(self, name: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if name is None or name == "":
            return self.served_model_names[0]
        if name not in self.served_model_names:
            raise APIError(
                f"the model {name!r} does not exist; this server serves {', '.join(map(repr, self.served_model_names))}",
                404, param="model", code="model_not_found",
            )
        return name

    async def outputs(self, requests: Sequence[Request]) -> AsyncIterator[RequestOutput]:
        """The requests' outputs as they come, counted in the metrics; closing it aborts them."""
        tracker = self.metrics.track(requests)
        try:
            async with contextlib.aclosing(self.engine.generate_many(requests)) as stream:
                async for out in stream:
                    tracker.observe(out)
                    yield out
        finally:
            tracker.close()

    async def final_outputs(self, requests: Sequence[Request]) -> dict[str, RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        async with contextlib.aclosing(self.outputs(requests)) as stream:
            async for out in stream:
                if out.finished:
                    finals[out.request_id] = out
        return finals

    def sse_error(self, exc: BaseException) -> str:
        """An error that happens after a stream started: one SSE event with the error JSON."""
        err = to_api_error(exc)
        self.metrics.errors.labels(str(err.status)).inc()
        return sse(error_body(err.message, err.status, err.param, err.code))


def sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"


def usage(requests: Sequence[Request], n: int, completion_tokens: int) -> UsageInfo:
    """Prompt tokens count once per prompt (not once per choice), as OpenAI does."""
    prompt_tokens = sum(len(r.prompt_ids) for r in requests[::n])
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)

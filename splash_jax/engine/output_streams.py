"""Async streams of RequestOutputs, the part every front end shares (engine/async_engine.py: the
core on a thread; engine/core_client.py: the core in another process).

A caller's `generate_many` gets an asyncio.Queue on its own event loop; whoever produces outputs
(the engine thread, or the receiver of the core's messages) hands them over with
`loop.call_soon_threadsafe`, once per step and loop. Closing a stream early (a client that went
away, `break`, cancellation) aborts the requests still running, which frees their pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

from splash_jax.engine.request import Request, RequestOutput, SamplingParams


class EngineDeadError(RuntimeError):
    """The engine is not running (shut down, crashed, or its core process died); nothing can be served."""


class EngineStepError(RuntimeError):
    """A step failed while this request was in it; the request was aborted."""


@dataclasses.dataclass(eq=False)
class _Stream:
    """Where the outputs of one caller's requests go."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    last: dict[str, RequestOutput | None]  # request id -> its latest output


@dataclasses.dataclass
class _Failure:
    """An error for a stream, naming its requests the producer already removed."""

    error: BaseException
    request_ids: list[str]


class OutputStreams:
    """generate / generate_many over `_open` (hand requests to the core) and `_close` (abort them)."""

    is_running: bool

    def make_request(self, prompt, params=None, request_id=None, cache_salt=None) -> Request:
        raise NotImplementedError

    def _open(self, requests: list[Request], stream: _Stream) -> None:
        raise NotImplementedError

    def _close(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def _dead_reason(self) -> str:
        return "the engine is not running"

    async def generate(
        self, prompt: str | Sequence[int] | Request, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs until it finishes; closing the iterator aborts it."""
        request = prompt if isinstance(prompt, Request) else self.make_request(prompt, params, request_id)
        async with contextlib.aclosing(self.generate_many([request])) as outputs:
            async for out in outputs:
                yield out

    async def generate_many(self, requests: Sequence[Request]) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of several requests as they come (tell them apart by request_id).

        Ends when all have finished; raises the first error of any of them. Closing it early
        aborts those still running.
        """
        if not self.is_running:
            raise EngineDeadError(self._dead_reason())
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), {r.request_id: None for r in requests})
        pending = set(stream.last)
        self._open(list(requests), stream)
        try:
            while pending:
                item = await stream.queue.get()
                if isinstance(item, _Failure):
                    pending.difference_update(item.request_ids)  # gone already: never abort an id reused since
                    raise item.error
                if item.finished:
                    pending.discard(item.request_id)
                yield item
        finally:
            if pending:
                self._close(list(pending))


def _put_all(items: list) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _aborted_output(request_id: str, last: RequestOutput | None) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt_ids=last.prompt_ids if last else [],
        token_ids=list(last.token_ids) if last else [],
        text=last.text if last else "",
        delta_text="",
        delta_token_ids=[],
        finished=True,
        finish_reason="abort",
        logprobs=last.logprobs if last else None,
        top_logprobs=last.top_logprobs if last else None,
        ttft=last.ttft if last else None,
    )

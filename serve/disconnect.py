"""Noticing that a client went away, so its requests are aborted and their pages freed.

A streaming response is cancelled as soon as the client disconnects, not at the next write
(Starlette skips the disconnect listener on ASGI servers of spec >= 2.4, and a request still
queued writes nothing for a while). A non-streaming request is cancelled the same way.
Cancellation closes the engine streams, which aborts their requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """`text/event-stream` that stops producing the moment the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, content, **kwargs):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, headers=headers, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                with contextlib.suppress(OSError):  # the socket closed under us: same as a disconnect
                    await self.stream_response(send)
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await _wait_for_disconnect(receive)
            tg.cancel_scope.cancel()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, or cancel it and return None if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None

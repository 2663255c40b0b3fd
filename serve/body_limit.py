"""A cap on request body size (413 with the OpenAI error shape), before anything parses it.

A body with a Content-Length over the cap is refused without reading it; a chunked body is
read up to the cap and refused as soon as it passes it. ASGI middleware, so it runs before
FastAPI reads the body.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.errors import error_body


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[], None] = lambda: None):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                return await self._reject(send)
            return await self.app(scope, receive, send)
        if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            return await self.app(scope, receive, send)
        buffered: list[Message] = []
        size, more = 0, True
        while more:  # read the whole (capped) body, then replay it to the app
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._reject(send)
            more = message.get("more_body", False)

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Send) -> None:
        self.on_reject()
        message = f"the request body exceeds {self.max_bytes} bytes (server flag --max-body-bytes)"
        body = json.dumps(error_body(message, 413).model_dump()).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
        ]})
        await send({"type": "http.response.body", "body": body})

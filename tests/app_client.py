"""The official openai client against a FastAPI app in-process (no socket, no server process)."""

from __future__ import annotations

import asyncio

import httpx
import openai


def run_client(app, fn, raw: bool = False):
    """fn(openai.AsyncOpenAI) run against `app`; raw: fn(client, the httpx client) for raw requests."""

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=300)
        async with http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http, max_retries=0)
            return await (fn(client, http) if raw else fn(client))

    return asyncio.run(main())

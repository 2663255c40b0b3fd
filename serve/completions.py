"""POST /v1/completions: text (or token-id) prompts, n choices each, streamed or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from serve.context import SSE_DONE, ServerContext, sse, usage
from serve.disconnect import SSEResponse, unless_disconnected
from serve.outputs import ChoiceState, completion_logprobs
from serve.params import FieldNames, check_completion, make_choices, sampling_params
from serve.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from splash_jax.engine.request import Request, SamplingParams

NAMES = FieldNames()


def _prepare(ctx: ServerContext, body: CompletionRequest, prompts, params: SamplingParams, rid: str):
    """Tokenize and build the engine requests (on a tokenizer thread); the echo texts."""
    requests: list[Request] = []
    echo: list[str] = []
    for p, prompt in enumerate(prompts):
        requests += make_choices(ctx, prompt, params, body.n, body.max_tokens, rid, p * body.n, NAMES, body.cache_salt)
        if body.echo:
            text = prompt if isinstance(prompt, str) else ctx.engine.tokenizer.decode(prompt)
            echo += [text] * body.n
    return requests, echo


async def create_completion(ctx: ServerContext, body: CompletionRequest, raw: HTTPRequest) -> Response:
    prompts = check_completion(ctx, body)
    model = ctx.resolve_model(body.model)
    params = sampling_params(ctx, body, body.max_tokens, body.logprobs, NAMES)
    rid = f"cmpl-{uuid.uuid4().hex}"
    requests, echo = await ctx.run_blocking(_prepare, ctx, body, prompts, params, rid)
    states = ctx.choice_states(requests)
    if body.stream:
        return SSEResponse(_stream(ctx, body, model, rid, requests, states, echo))

    results = await unless_disconnected(raw, ctx.accumulated(requests, states))
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices = []
    for r in requests:
        state, result = states[r.request_id], results[r.request_id]
        choices.append(CompletionChoice(
            index=state.index,
            text=(echo[state.index] if echo else "") + result.text,
            logprobs=completion_logprobs(state, result.as_delta(), ctx.token_text),
            finish_reason=result.finish_reason,
            token_ids=result.token_ids if body.return_token_ids else None,
        ))
    total = sum(len(a.token_ids) for a in results.values())
    cached = {request_id: a.num_cached_tokens for request_id, a in results.items()}
    return Response(
        CompletionResponse(id=rid, model=model, choices=choices, usage=usage(requests, body.n, total, cached)).model_dump_json(),
        media_type="application/json",
    )


async def _stream(
    ctx: ServerContext, body: CompletionRequest, model: str, rid: str, requests: list[Request],
    states: dict[str, ChoiceState], echo: list[str],
) -> AsyncIterator[str]:
    created = int(time.time())
    echoed: set[int] = set()
    wants_tokens = body.logprobs is not None or body.return_token_ids
    total = 0
    cached: dict[str, int] = {}  # request id -> its prompt tokens served from the prefix cache
    try:
        async for out in ctx.outputs(requests):
            state = states[out.request_id]
            delta = state.advance(out)
            total += len(delta.token_ids)
            cached[out.request_id] = delta.num_cached_tokens
            text = delta.text
            if echo and state.index not in echoed:
                echoed.add(state.index)
                text = echo[state.index] + text
            if not text and delta.finish_reason is None and not (wants_tokens and delta.token_ids):
                continue
            choice = CompletionChoice(
                index=state.index, text=text,
                logprobs=completion_logprobs(state, delta, ctx.token_text),
                finish_reason=delta.finish_reason,
                token_ids=delta.token_ids if body.return_token_ids else None,
            )
            yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[choice]))
        if body.stream_options and body.stream_options.include_usage:
            yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage(requests, body.n, total, cached)))
    except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
        yield ctx.sse_error(e)
    yield SSE_DONE

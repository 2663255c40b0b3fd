"""POST /v1/chat/completions: messages rendered with the model's chat template, n choices,
streamed or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import jinja2
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from serve.context import SSE_DONE, ServerContext, sse, usage
from serve.disconnect import SSEResponse, unless_disconnected
from serve.errors import APIError
from serve.outputs import ChoiceState, chat_logprobs
from serve.params import FieldNames, check_chat, make_choices, sampling_params
from serve.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatMessage,
    ChatResponseMessage, ChatStreamChoice,
)
from splash_jax.engine.request import Request, SamplingParams


def _message_text(i: int, message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise APIError(f"messages[{i}]: content parts of type {part.type[:40]!r} are not supported (text only)", param="messages")
        parts.append(part.text)
    return "".join(parts)


def render_prompt(ctx: ServerContext, body: ChatCompletionRequest) -> list[int]:
    """Token ids of the rendered chat template (blocking); the template writes any BOS itself."""
    tokenizer = ctx.engine.tokenizer
    if tokenizer is None:
        raise APIError("this model has no tokenizer, so chat is not available; use /v1/completions with token ids", 400)
    messages = [{"role": m.role, "content": _message_text(i, m)} for i, m in enumerate(body.messages)]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
    except jinja2.TemplateError as e:
        raise APIError(f"the chat template rejected the messages: {e}", param="messages") from e
    ids = tokenizer.encode(text, add_bos=False)
    if not ids:
        raise APIError("the rendered chat prompt is empty", param="messages")
    return ids


def _prepare(ctx: ServerContext, body: ChatCompletionRequest, params: SamplingParams, max_tokens, rid: str, names: FieldNames):
    return make_choices(ctx, render_prompt(ctx, body), params, body.n, max_tokens, rid, 0, names, body.cache_salt)


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, raw: HTTPRequest) -> Response:
    check_chat(ctx, body)
    model = ctx.resolve_model(body.model)
    given = body.max_completion_tokens is not None
    names = FieldNames(prompt="messages", max_tokens="max_completion_tokens" if given else "max_tokens", logprobs="top_logprobs")
    max_tokens = body.max_completion_tokens if given else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(ctx, body, max_tokens, logprobs, names)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    requests = await ctx.run_blocking(_prepare, ctx, body, params, max_tokens, rid, names)
    states = ctx.choice_states(requests)
    if body.stream:
        return SSEResponse(_stream(ctx, body, model, rid, requests, states))

    results = await unless_disconnected(raw, ctx.accumulated(requests, states))
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices = []
    for r in requests:
        state, result = states[r.request_id], results[r.request_id]
        choices.append(ChatChoice(
            index=state.index,
            message=ChatResponseMessage(content=result.text),
            logprobs=chat_logprobs(result.as_delta(), ctx.token_text),
            finish_reason=result.finish_reason,
            token_ids=result.token_ids if body.return_token_ids else None,
        ))
    total = sum(len(a.token_ids) for a in results.values())
    cached = {request_id: a.num_cached_tokens for request_id, a in results.items()}
    return Response(
        ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage(requests, body.n, total, cached)).model_dump_json(),
        media_type="application/json",
    )


async def _stream(
    ctx: ServerContext, body: ChatCompletionRequest, model: str, rid: str, requests: list[Request],
    states: dict[str, ChoiceState],
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatStreamChoice], **kw) -> str:
        return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, **kw))

    wants_tokens = body.logprobs or body.return_token_ids
    total = 0
    cached: dict[str, int] = {}  # request id -> its prompt tokens served from the prefix cache
    try:
        for state in states.values():  # the role first, as OpenAI does
            yield chunk([ChatStreamChoice(index=state.index, delta=ChatDelta(role="assistant", content=""))])
        async for out in ctx.outputs(requests):
            state = states[out.request_id]
            delta = state.advance(out)
            total += len(delta.token_ids)
            cached[out.request_id] = delta.num_cached_tokens
            if not delta.text and delta.finish_reason is None and not (wants_tokens and delta.token_ids):
                continue
            yield chunk([ChatStreamChoice(
                index=state.index,
                delta=ChatDelta(content=delta.text or None),
                logprobs=chat_logprobs(delta, ctx.token_text),
                finish_reason=delta.finish_reason,
                token_ids=delta.token_ids if body.return_token_ids else None,
            )])
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], usage=usage(requests, body.n, total, cached))
    except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
        yield ctx.sse_error(e)
    yield SSE_DONE

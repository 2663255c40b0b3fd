"""POST /v1/chat/completions: messages rendered with the model's chat template, n choices,
streamed or not, with OpenAI tool calls parsed out of the text (serve.tools, serve.tool_parser)."""

from __future__ import annotations

import dataclasses
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
from serve.params import FieldNames, check_chat, make_choices, sampling_params, structured_outputs_of
from serve.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatMessage,
    ChatResponseMessage, ChatStreamChoice, ToolCallDelta, ToolCallOut,
)
from serve.tool_parser import ParserDelta, ToolCallParser, parse_tool_calls
from serve.tools import ToolSetup, check_tools, finish_reason, template_messages, tool_grammar
from splash_jax.engine.request import Request, SamplingParams
from splash_jax.structured import StructuredOutputs


def _message_text(i: int, message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise APIError(f"messages[{i}]: content parts of type {part.type[:40]!r} are not supported (text only)", param="messages")
        parts.append(part.text)
    return "".join(parts)


def render_prompt(ctx: ServerContext, body: ChatCompletionRequest, tools: ToolSetup | None = None) -> list[int]:
    """Token ids of the rendered chat template (blocking); the template writes any BOS itself.
    tools: the request's validated tool settings (None: no tools in the prompt)."""
    tokenizer = ctx.engine.tokenizer
    if tokenizer is None:
        raise APIError("this model has no tokenizer, so chat is not available; use /v1/completions with token ids", 400)
    texts = [_message_text(i, m) for i, m in enumerate(body.messages)]
    messages, template_tools = template_messages(tokenizer, body.messages, texts, tools)
    try:
        extra = {} if template_tools is None else {"tools": template_tools}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, **extra)
    except jinja2.TemplateError as e:
        raise APIError(f"the chat template rejected the messages: {e}", param="messages") from e
    ids = tokenizer.encode(text, add_bos=False)
    if not ids:
        raise APIError("the rendered chat prompt is empty", param="messages")
    return ids


def _prepare(ctx: ServerContext, body: ChatCompletionRequest, params: SamplingParams, max_tokens, rid: str, names: FieldNames,
             tools: ToolSetup):
    prompt = render_prompt(ctx, body, tools)
    try:
        return make_choices(ctx, prompt, params, body.n, max_tokens, rid, 0, names, body.cache_salt)
    except APIError as e:
        if tools.enforced and e.param == "structured_outputs":  # the grammar is ours, made of the tools
            raise APIError(f"the tools' parameters do not compile into a grammar for tool_choice: {e.message}",
                           400, param="tools") from None
        raise


def _with_tool_grammar(params: SamplingParams, body: ChatCompletionRequest, tools: ToolSetup) -> SamplingParams:
    """tool_choice "required" or a named function: the output must be calls (llguidance enforces it)."""
    grammar = tool_grammar(tools.tools, body.tool_choice, tools.parallel) if tools.enforced else None
    return params if grammar is None else dataclasses.replace(params, structured_outputs=StructuredOutputs(grammar=grammar))


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, raw: HTTPRequest) -> Response:
    check_chat(ctx, body)
    tools = check_tools(ctx, body)
    model = ctx.resolve_model(body.model)
    given = body.max_completion_tokens is not None
    names = FieldNames(prompt="messages", max_tokens="max_completion_tokens" if given else "max_tokens", logprobs="top_logprobs",
                       structured_outputs=structured_outputs_of(ctx, body)[1])
    max_tokens = body.max_completion_tokens if given else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _with_tool_grammar(sampling_params(ctx, body, max_tokens, logprobs, names), body, tools)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    requests = await ctx.run_blocking(_prepare, ctx, body, params, max_tokens, rid, names, tools)
    states = ctx.choice_states(requests)
    if body.stream:
        return SSEResponse(_stream(ctx, body, model, rid, requests, states, tools))

    results = await unless_disconnected(raw, ctx.accumulated(requests, states))
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices = []
    for r in requests:
        state, result = states[r.request_id], results[r.request_id]
        content, calls, reason = result.text, [], result.finish_reason
        if tools.parses:
            content, calls = parse_tool_calls(result.text, tools.max_calls)
            reason = finish_reason(reason, calls)
        choices.append(ChatChoice(
            index=state.index,
            message=ChatResponseMessage(content=(content or None) if calls else content,
                                        tool_calls=[ToolCallOut(**c.as_openai()) for c in calls] or None),
            logprobs=chat_logprobs(result.as_delta(), ctx.token_text),
            finish_reason=reason,
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
    states: dict[str, ChoiceState], tools: ToolSetup,
) -> AsyncIterator[str]:
    created = int(time.time())
    parsers = {request_id: ToolCallParser(tools.max_calls) for request_id in states} if tools.parses else {}

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
            parsed, reason = ParserDelta(delta.text), delta.finish_reason
            parser = parsers.get(out.request_id)
            if parser is not None:
                parsed = parser.feed(delta.text)
                if reason is not None:
                    parsed = parsed.then(parser.finish())
                    reason = finish_reason(reason, parser.calls)
            if not parsed and reason is None and not (wants_tokens and delta.token_ids):
                continue
            yield chunk([ChatStreamChoice(
                index=state.index,
                delta=ChatDelta(content=parsed.content or None,
                                tool_calls=[ToolCallDelta(**c) for c in parsed.tool_calls] or None),
                logprobs=chat_logprobs(delta, ctx.token_text),
                finish_reason=reason,
                token_ids=delta.token_ids if body.return_token_ids else None,
            )])
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], usage=usage(requests, body.n, total, cached))
    except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
        yield ctx.sse_error(e)
    yield SSE_DONE

"""POST /v1/chat/completions: messages rendered with the model's chat template, n choices,
streamed or not, with a reasoning model's thinking split out (serve.reasoning) and OpenAI tool
calls parsed out of the answer (serve.tools, serve.tool_parser). `start_chat` is shared with the
Responses API (serve.responses), which is a chat request in another shape."""

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
from serve.answer import AnswerParser
from serve.outputs import ChoiceState, chat_logprobs
from serve.params import FieldNames, check_chat, make_choices, sampling_params, structured_outputs_of
from serve.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatMessage,
    ChatResponseMessage, ChatStreamChoice, ToolCallDelta, ToolCallOut,
)
from serve.reasoning import ReasoningMarkers, starts_in_reasoning
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
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                             **(body.chat_template_kwargs or {}), **extra)
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


def reasoning_of(ctx: ServerContext, body: ChatCompletionRequest) -> ReasoningMarkers | None:
    """The reasoning markers when this answer begins inside a reasoning block (None: it does not,
    or no --reasoning-parser). thinking_token_budget needs one (400 otherwise)."""
    markers = ctx.reasoning_markers
    if markers is not None and not starts_in_reasoning(ctx.reasoning_parser, body.chat_template_kwargs):
        markers = None
    if body.thinking_token_budget is not None:
        if markers is None:
            raise APIError("thinking_token_budget needs a reasoning answer: a server with --reasoning-parser"
                           + (" (deepseek_v3: and chat_template_kwargs {\"thinking\": true})" if ctx.reasoning_markers else ""),
                           400, param="thinking_token_budget")
        if body.thinking_token_budget < 0:
            raise APIError(f"thinking_token_budget must be >= 0, got {body.thinking_token_budget}", 400,
                           param="thinking_token_budget")
    return markers


def _with_reasoning(params: SamplingParams, body: ChatCompletionRequest, markers: ReasoningMarkers | None) -> SamplingParams:
    """The engine applies a grammar (response_format, tool calls) from the token after the block,
    and ends the block once thinking_token_budget tokens are in it."""
    if markers is None:
        return params
    return dataclasses.replace(params, reasoning_end_token_id=markers.end_id, thinking_token_budget=body.thinking_token_budget)


@dataclasses.dataclass
class ChatRun:
    """A chat request started in the engine: its choices and how their outputs are parsed."""

    rid: str
    model: str
    requests: list[Request]
    states: dict[str, ChoiceState]
    tools: ToolSetup
    reasoning: ReasoningMarkers | None

    def parser(self) -> AnswerParser:
        return AnswerParser(self.reasoning, self.tools.parses, self.tools.max_calls)


async def start_chat(ctx: ServerContext, body: ChatCompletionRequest, rid: str) -> ChatRun:
    """Validate, render, tokenize and build the engine requests (400s name the field)."""
    check_chat(ctx, body)
    tools = check_tools(ctx, body)
    model = ctx.resolve_model(body.model)
    markers = reasoning_of(ctx, body)
    given = body.max_completion_tokens is not None
    names = FieldNames(prompt="messages", max_tokens="max_completion_tokens" if given else "max_tokens", logprobs="top_logprobs",
                       structured_outputs=structured_outputs_of(ctx, body)[1])
    max_tokens = body.max_completion_tokens if given else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _with_reasoning(_with_tool_grammar(sampling_params(ctx, body, max_tokens, logprobs, names), body, tools),
                             body, markers)
    requests = await ctx.run_blocking(_prepare, ctx, body, params, max_tokens, rid, names, tools)
    return ChatRun(rid, model, requests, ctx.choice_states(requests), tools, markers)


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, raw: HTTPRequest) -> Response:
    run = await start_chat(ctx, body, f"chatcmpl-{uuid.uuid4().hex}")
    if body.stream:
        return SSEResponse(_stream(ctx, body, run))

    results = await unless_disconnected(raw, ctx.accumulated(run.requests, run.states))
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices, reasoning_tokens = [], 0
    for r in run.requests:
        state, result = run.states[r.request_id], results[r.request_id]
        parser = run.parser()
        answer = parser.feed(result.text, result.token_ids, finished=True)
        calls = parser.calls
        reasoning_tokens += parser.reasoning_tokens or 0
        shown = answer.reasoning if run.reasoning is not None and body.include_reasoning else None
        content = answer.content
        if parser.in_reasoning:
            content = None  # cut inside the block: no answer yet
        choices.append(ChatChoice(
            index=state.index,
            message=ChatResponseMessage(content=(content or None) if calls else content,
                                        reasoning_content=shown, reasoning=shown,
                                        tool_calls=[ToolCallOut(**c.as_openai()) for c in calls] or None),
            logprobs=chat_logprobs(result.as_delta(), ctx.token_text),
            finish_reason=finish_reason(result.finish_reason, calls),
            token_ids=result.token_ids if body.return_token_ids else None,
        ))
    total = sum(len(a.token_ids) for a in results.values())
    cached = {request_id: a.num_cached_tokens for request_id, a in results.items()}
    counted = reasoning_tokens if ctx.reasoning_markers is not None else None
    return Response(
        ChatCompletionResponse(id=run.rid, model=run.model, choices=choices,
                               usage=usage(run.requests, body.n, total, cached, counted)).model_dump_json(),
        media_type="application/json",
    )


async def _stream(ctx: ServerContext, body: ChatCompletionRequest, run: ChatRun) -> AsyncIterator[str]:
    created = int(time.time())
    parsers = {request_id: run.parser() for request_id in run.states}
    show_reasoning = run.reasoning is not None and body.include_reasoning

    def chunk(choices: list[ChatStreamChoice], **kw) -> str:
        return sse(ChatCompletionChunk(id=run.rid, created=created, model=run.model, choices=choices, **kw))

    wants_tokens = body.logprobs or body.return_token_ids
    total = 0
    cached: dict[str, int] = {}  # request id -> its prompt tokens served from the prefix cache
    try:
        for state in run.states.values():  # the role first, as OpenAI does
            yield chunk([ChatStreamChoice(index=state.index, delta=ChatDelta(role="assistant", content=""))])
        async for out in ctx.outputs(run.requests):
            state = run.states[out.request_id]
            delta = state.advance(out)
            total += len(delta.token_ids)
            cached[out.request_id] = delta.num_cached_tokens
            parser = parsers[out.request_id]
            answer = parser.feed(delta.text, delta.token_ids, finished=delta.finish_reason is not None)
            reason = finish_reason(delta.finish_reason, parser.calls)
            if not show_reasoning:
                answer.reasoning = ""
            if not answer and reason is None and not (wants_tokens and delta.token_ids):
                continue
            yield chunk([ChatStreamChoice(
                index=state.index,
                delta=ChatDelta(content=answer.content or None, reasoning_content=answer.reasoning or None,
                                reasoning=answer.reasoning or None,
                                tool_calls=[ToolCallDelta(**c) for c in answer.tool_calls] or None),
                logprobs=chat_logprobs(delta, ctx.token_text),
                finish_reason=reason,
                token_ids=delta.token_ids if body.return_token_ids else None,
            )])
        if body.stream_options and body.stream_options.include_usage:
            counted = sum(p.reasoning_tokens or 0 for p in parsers.values()) if ctx.reasoning_markers is not None else None
            yield chunk([], usage=usage(run.requests, body.n, total, cached, counted))
    except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
        yield ctx.sse_error(e)
    yield SSE_DONE

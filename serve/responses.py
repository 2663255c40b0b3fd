"""POST /v1/responses: the OpenAI Responses API (what the OpenAI Agents SDK calls by default), as a
chat request in another shape.

The body becomes a `ChatCompletionRequest` (serve.responses_input), `serve.chat.start_chat`
validates, renders and starts it, and the answer parser (serve.answer) splits the output into
reasoning, content and tool calls, which become output items: a reasoning item, an assistant
message, one function_call item per call. Streamed, the same items are announced and filled by
Server-Sent Events (`event: <type>`, `data: <json>`, increasing sequence_number, no [DONE]), and
the final `response.completed` carries the output the non-streamed answer would have.
Nothing is stored: `store` is answered false and previous_response_id is a 400.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from serve.chat import ChatRun, start_chat
from serve.context import ServerContext
from serve.disconnect import SSEResponse, unless_disconnected
from serve.errors import APIError, error_body, to_api_error
from serve.responses_input import responses_param, to_chat
from serve.responses_protocol import (
    ContentPartEvent,
    ErrorEvent,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItemEvent,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    sse_event,
)
from serve.tool_parser import ParsedCall


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclasses.dataclass
class Answer:
    """One generation as the output items show it."""

    reasoning: str = ""  # shown reasoning text ("" with none, or include_reasoning false)
    content: str = ""
    calls: list[ParsedCall] = dataclasses.field(default_factory=list)
    in_reasoning: bool = False  # cut off inside the reasoning block
    cut: bool = False  # finish reason "length" (max_output_tokens)


@dataclasses.dataclass
class Slots:
    """The output items' order and ids: ("reasoning", None), ("message", None), ("call", k)."""

    order: list[tuple[str, int | None]] = dataclasses.field(default_factory=list)
    ids: dict[tuple[str, int | None], str] = dataclasses.field(default_factory=dict)

    def add(self, kind: str, k: int | None = None) -> int:
        key = (kind, k)
        self.ids[key] = _id({"reasoning": "rs", "message": "msg", "call": "fc"}[kind])
        self.order.append(key)
        return len(self.order) - 1

    def has(self, kind: str, k: int | None = None) -> bool:
        return (kind, k) in self.ids

    @classmethod
    def of(cls, answer: Answer) -> Slots:
        """The order of a non-streamed answer: reasoning, the message (when there is content, or
        no calls), then the calls."""
        slots = cls()
        if answer.reasoning:
            slots.add("reasoning")
        if answer.content or not answer.calls:
            slots.add("message")
        for k in range(len(answer.calls)):
            slots.add("call", k)
        return slots


def _item(slots: Slots, index: int, answer: Answer):
    """Output item `index` once the generation is over."""
    kind, k = key = slots.order[index]
    item_id = slots.ids[key]
    if kind == "reasoning":
        return ReasoningItem(id=item_id, content=[ReasoningText(text=answer.reasoning)],
                             status="incomplete" if answer.in_reasoning else "completed")
    if kind == "message":
        cut = answer.cut and not answer.calls  # the calls come after it: cut there, not here
        return MessageItem(id=item_id, content=[OutputText(text=answer.content)], status="incomplete" if cut else "completed")
    call = answer.calls[k]
    cut = answer.cut and k == len(answer.calls) - 1
    return FunctionCallItem(id=item_id, call_id=call.id, name=call.name, arguments=call.arguments,
                            status="incomplete" if cut else "completed")


class Shape:
    """What a response echoes of its request, and how it reads the run's outputs."""

    def __init__(self, body: ResponsesRequest, run: ChatRun):
        self.body, self.run = body, run
        self.id = run.rid
        self.created_at = int(time.time())
        self.show_reasoning = run.reasoning is not None and body.include_reasoning

    def response(self, status: str, output: list | None = None, usage: ResponseUsage | None = None) -> ResponseObject:
        b = self.body
        text = {"format": (b.text.format if b.text is not None and b.text.format is not None else {"type": "text"})}
        if b.text is not None and b.text.verbosity is not None:
            text["verbosity"] = b.text.verbosity
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, model=self.run.model, output=output or [],
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            instructions=b.instructions, max_output_tokens=b.max_output_tokens,
            parallel_tool_calls=True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            reasoning=b.reasoning, temperature=1.0 if b.temperature is None else b.temperature,
            top_p=1.0 if b.top_p is None else b.top_p, text=text,
            tool_choice="auto" if b.tool_choice is None else b.tool_choice, tools=b.tools or [],
            truncation=b.truncation or "disabled", metadata=b.metadata, user=b.user, usage=usage,
        )

    def final(self, slots: Slots, answer: Answer, usage: ResponseUsage) -> ResponseObject:
        output = [_item(slots, i, answer) for i in range(len(slots.order))]
        return self.response("incomplete" if answer.cut else "completed", output, usage)

    def usage(self, output_tokens: int, cached: int, reasoning_tokens: int | None) -> ResponseUsage:
        prompt = len(self.run.requests[0].prompt_ids)
        return ResponseUsage(
            input_tokens=prompt, input_tokens_details=InputTokensDetails(cached_tokens=min(cached, prompt)),
            output_tokens=output_tokens, output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens or 0),
            total_tokens=prompt + output_tokens,
        )


async def _start(ctx: ServerContext, body: ResponsesRequest) -> ChatRun:
    try:
        chat = to_chat(body)
        return await start_chat(ctx, chat, _id("resp"))
    except APIError as e:
        raise responses_param(e) from None


async def create_response(ctx: ServerContext, body: ResponsesRequest, raw: HTTPRequest) -> Response:
    run = await _start(ctx, body)
    shape = Shape(body, run)
    if body.stream:
        return SSEResponse(_stream(ctx, shape))

    results = await unless_disconnected(raw, ctx.accumulated(run.requests, run.states))
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    result = results[run.requests[0].request_id]
    parser = run.parser()
    delta = parser.feed(result.text, result.token_ids, finished=True)
    answer = Answer(reasoning=delta.reasoning if shape.show_reasoning else "",
                    content=delta.content, calls=list(parser.calls),
                    in_reasoning=parser.in_reasoning, cut=result.finish_reason == "length")
    usage = shape.usage(len(result.token_ids), result.num_cached_tokens, parser.reasoning_tokens)
    return Response(shape.final(Slots.of(answer), answer, usage).model_dump_json(), media_type="application/json")


class _Events:
    """Stream events, numbered as they are made."""

    def __init__(self):
        self.count = 0

    def __call__(self, cls, **fields) -> str:
        event = cls(sequence_number=self.count, **fields)
        self.count += 1
        return sse_event(event)


async def _stream(ctx: ServerContext, shape: Shape) -> AsyncIterator[str]:
    run = shape.run
    ev = _Events()
    slots, answer = Slots(), Answer()
    parser = run.parser()
    opened: dict[int, int] = {}  # call index -> output index
    closed: set[int] = set()  # output indices whose output_item.done is sent
    tokens, cached = 0, 0

    def open_item(kind: str, k: int | None = None, **fields) -> list[str]:
        index = slots.add(kind, k)
        item_id = slots.ids[(kind, k)]
        if kind == "reasoning":
            item = ReasoningItem(id=item_id, status="in_progress")
        elif kind == "message":
            item = MessageItem(id=item_id, status="in_progress")
        else:
            item = FunctionCallItem(id=item_id, status="in_progress", **fields)
        out = [ev(OutputItemEvent, type="response.output_item.added", output_index=index, item=item)]
        if kind == "message":
            out.append(ev(ContentPartEvent, type="response.content_part.added", item_id=item_id, output_index=index,
                          part=OutputText(text="")))
        return out

    def close_item(index: int) -> list[str]:
        closed.add(index)
        item = _item(slots, index, answer)
        out = []
        if item.type == "reasoning":
            out.append(ev(ReasoningTextDoneEvent, item_id=item.id, output_index=index, text=answer.reasoning))
        elif item.type == "message":
            part = item.content[0]
            out += [ev(OutputTextDoneEvent, item_id=item.id, output_index=index, text=part.text),
                    ev(ContentPartEvent, type="response.content_part.done", item_id=item.id, output_index=index, part=part)]
        else:
            out.append(ev(FunctionCallArgumentsDoneEvent, item_id=item.id, output_index=index, name=item.name,
                          arguments=item.arguments))
        return out + [ev(OutputItemEvent, type="response.output_item.done", output_index=index, item=item)]

    try:
        yield ev(ResponseLifecycleEvent, type="response.created", response=shape.response("in_progress"))
        yield ev(ResponseLifecycleEvent, type="response.in_progress", response=shape.response("in_progress"))
        async for out in ctx.outputs(run.requests):
            delta = run.states[out.request_id].advance(out)
            tokens += len(delta.token_ids)
            cached = delta.num_cached_tokens
            finished = delta.finish_reason is not None
            piece = parser.feed(delta.text, delta.token_ids, finished=finished)
            events: list[str] = []
            if piece.reasoning and shape.show_reasoning:
                if not slots.has("reasoning"):
                    events += open_item("reasoning")
                answer.reasoning += piece.reasoning
                events.append(ev(ReasoningTextDeltaEvent, item_id=slots.ids[("reasoning", None)], output_index=0,
                                 delta=piece.reasoning))
            if (piece.content or piece.tool_calls) and slots.has("reasoning") and 0 not in closed:
                events += close_item(0)  # the answer began: the reasoning is complete
            if piece.content:
                if not slots.has("message"):
                    events += open_item("message")
                answer.content += piece.content
                index = slots.order.index(("message", None))
                events.append(ev(OutputTextDeltaEvent, item_id=slots.ids[("message", None)], output_index=index,
                                 delta=piece.content))
            for tc in piece.tool_calls:
                k = tc["index"]
                function = tc.get("function") or {}
                if k not in opened:
                    events += open_item("call", k, call_id=tc.get("id") or "", name=function.get("name") or "")
                    opened[k] = len(slots.order) - 1
                if function.get("arguments"):
                    events.append(ev(FunctionCallArgumentsDeltaEvent, item_id=slots.ids[("call", k)],
                                     output_index=opened[k], delta=function["arguments"]))
            if finished:
                answer.cut = delta.finish_reason == "length"
            for e in events:
                yield e
        answer.calls, answer.in_reasoning = list(parser.calls), parser.in_reasoning
        for index in range(len(slots.order)):
            if index not in closed:
                for e in close_item(index):
                    yield e
        if not slots.has("message") and not answer.calls:  # no content and no calls: an empty message, as when not streamed
            for e in open_item("message") + close_item(len(slots.order) - 1):
                yield e
        final = shape.final(slots, answer, shape.usage(tokens, cached, parser.reasoning_tokens))
        yield ev(ResponseLifecycleEvent, type="response.incomplete" if answer.cut else "response.completed", response=final)
    except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
        err = to_api_error(e)
        ctx.metrics.errors.labels(str(err.status)).inc()
        body = error_body(err.message, err.status, err.param, err.code).error
        yield ev(ErrorEvent, code=err.code or body.type, message=body.message, param=body.param)

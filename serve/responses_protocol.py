"""OpenAI Responses API bodies (POST /v1/responses, the subset splash-jax serves), as pydantic models.

The request is lenient like serve.protocol's: unknown fields are accepted and ignored; the
input items, tools and text.format stay plain JSON here and are checked (400 naming the field)
where they become a chat request (serve.responses). Responses and stream events are strict and
follow the field names of the `openai` package's types (openai/types/responses/).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field

from serve.protocol import _Body, _Out


# --- the request -----------------------------------------------------------------------
class ResponseTextParam(_Body):
    format: Any = None  # {"type": "text" | "json_object" | "json_schema", ...}, checked in serve.responses_input
    verbosity: str | None = None  # accepted, ignored


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseTextParam | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None  # only 0 (no logprobs in this API here)
    seed: int | None = None  # extra (vLLM's)
    stream: bool = False
    store: bool | None = None  # accepted; nothing is ever stored (the answer says false)
    background: bool | None = None  # only false
    previous_response_id: str | None = None  # refused: nothing is stored
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: accepted, ignored
    include: list[str] | None = None  # accepted, ignored
    metadata: dict[str, Any] | None = None  # echoed
    user: str | None = None
    truncation: str | None = None  # accepted; an input that does not fit is a 400, never truncated
    # chat extras (serve.protocol.ChatCompletionRequest)
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    thinking_token_budget: int | None = None


# --- output items ------------------------------------------------------------------------
Status = Literal["in_progress", "completed", "incomplete"]


class ReasoningText(_Out):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Out):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Status = "completed"


class OutputText(_Out):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict] = Field(default_factory=list)
    logprobs: list[dict] = Field(default_factory=list)


class MessageItem(_Out):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Status = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(_Out):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: Status = "completed"


OutputItem = Annotated[ReasoningItem | MessageItem | FunctionCallItem, Field(discriminator="type")]


# --- the response --------------------------------------------------------------------------
class InputTokensDetails(_Out):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class OutputTokensDetails(_Out):
    reasoning_tokens: int = 0  # tokens inside the reasoning block (--reasoning-parser), markers not counted


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseObject(_Out):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False  # nothing is kept: there is no GET /v1/responses/{id}
    temperature: float = 1.0
    top_p: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: str = "disabled"
    metadata: dict[str, Any] | None = None
    user: str | None = None
    usage: ResponseUsage | None = None

    @property
    def output_text(self) -> str:
        return "".join(part.text for item in self.output if item.type == "message" for part in item.content)


# --- stream events ------------------------------------------------------------------------
class _Event(_Out):
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    """response.created, response.in_progress, response.completed, response.incomplete."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class _PartEvent(_Event):
    """An event about one content part of one output item."""

    item_id: str
    output_index: int
    content_index: int = 0


class ContentPartEvent(_PartEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    part: OutputText


class OutputTextDeltaEvent(_PartEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list[dict] = Field(default_factory=list)


class OutputTextDoneEvent(_PartEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list[dict] = Field(default_factory=list)


class ReasoningTextDeltaEvent(_PartEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    delta: str


class ReasoningTextDoneEvent(_PartEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    text: str


class FunctionCallArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None


def sse_event(event: _Event) -> str:
    """One Server-Sent Event as OpenAI sends the Responses stream: its type as the event name."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


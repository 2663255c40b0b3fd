"""OpenAI API request and response bodies (the subset splash-jax serves), as pydantic models.

Request models check types only; value checks (ranges, sizes, counts) live in `serve.params`.
Both answer 400 naming the field, as OpenAI does. Unknown fields are accepted and ignored, as
OpenAI clients send new fields before servers know them.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _omitted_if_none(default=None):
    """A response field left out of the JSON when unset (extras and stream deltas)."""
    return Field(default=default, exclude_if=lambda v: v is None)


# --- errors ----------------------------------------------------------------------------
class ErrorInfo(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Out):
    error: ErrorInfo


# --- shared ----------------------------------------------------------------------------
class StreamOptions(_Body):
    include_usage: bool = False


class PromptTokensDetails(_Out):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(_Out):
    reasoning_tokens: int = 0  # tokens inside reasoning blocks (--reasoning-parser), markers not counted


class UsageInfo(_Out):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = _omitted_if_none()  # with a reasoning parser


class StructuredOutputsParams(_Body):
    json_: str | dict | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: str
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Body):
    """Fields both endpoints share; extras (top_k, ignore_eos, ...) follow vLLM's names."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False  # add token ids to each choice (vLLM's name); used to check outputs
    cache_salt: str | None = None  # prefix-cache namespace (vLLM's name): only requests with the same salt share cached pages
    # structured outputs (vLLM's names): exactly one of json, regex, choice, grammar, json_object
    structured_outputs: StructuredOutputsParams | None = None
    response_format: ResponseFormat | None = None
    guided_json: str | dict | None = None  # vLLM's older spellings of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob plus the top-n (vLLM's extra)
    _constraint: tuple | None = PrivateAttr(default=None)  # serve.params.structured_outputs_of, computed once


# --- /v1/completions -------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class CompletionLogprobs(_Out):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _omitted_if_none()
    # vLLM's prompt_logprobs extra: None, then per prompt token {token id: {logprob, rank, decoded_token}}
    prompt_logprobs: list[dict[str, dict] | None] | None = _omitted_if_none()
    prompt_token_ids: list[int] | None = _omitted_if_none()


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# --- /v1/chat/completions --------------------------------------------------------------
class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = ""  # a JSON string (OpenAI); an object is accepted and serialized


class ToolCall(_Body):
    """A call an earlier assistant message made (sent back in `messages`)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None  # None in an assistant message that only calls tools
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages: the calls it made
    tool_call_id: str | None = None  # role "tool": the call this message answers


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # None: true (OpenAI's default)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (DeepSeek-V3.1: {"thinking": true})
    include_reasoning: bool = True  # with a reasoning parser: false drops the reasoning from the answer
    thinking_token_budget: int | None = None  # at most this many reasoning tokens, then the block is closed (vLLM's name)


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Out):
    content: list[ChatLogprobToken] | None = None


class ToolCallFunction(_Out):
    name: str
    arguments: str  # JSON text as the model wrote it


class ToolCallOut(_Out):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # the reasoning block (--reasoning-parser), under vLLM's older name and its newer one
    reasoning_content: str | None = _omitted_if_none()
    reasoning: str | None = _omitted_if_none()
    tool_calls: list[ToolCallOut] | None = _omitted_if_none()


class ChatChoice(_Out):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _omitted_if_none()


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ToolCallFunctionDelta(_Out):
    name: str | None = _omitted_if_none()
    arguments: str | None = _omitted_if_none()


class ToolCallDelta(_Out):
    """A stream's piece of a call: the first has id, type and name, later ones argument text."""

    index: int
    id: str | None = _omitted_if_none()
    type: Literal["function"] | None = _omitted_if_none()
    function: ToolCallFunctionDelta | None = _omitted_if_none()


class ChatDelta(_Out):
    role: Literal["assistant"] | None = _omitted_if_none()
    content: str | None = _omitted_if_none()
    reasoning_content: str | None = _omitted_if_none()
    reasoning: str | None = _omitted_if_none()
    tool_calls: list[ToolCallDelta] | None = _omitted_if_none()


class ChatStreamChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _omitted_if_none()


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# --- models, layout, version -----------------------------------------------------------
class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "splash-jax"
    root: str
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LayoutRequest(_Body):
    layout: str
    preempt: bool = False  # if the destination cannot hold every running request, recompute the newest later
    wait: bool = False  # answer once the switch has finished (else at once, while it migrates)


class LayoutInfo(_Out):
    layout: str
    num_switches: int
    switching_available: bool
    switch: dict[str, Any] | None = None  # the switch in progress, as the engine describes it


class LayoutSwitchResponse(LayoutInfo):
    result: dict[str, Any]  # this switch: state (migrating | done | cancelled | refused), progress, plan, ...


class VersionInfo(_Out):
    version: str
    jax: str
    backend: str
    device_kind: str
    num_devices: int

"""A Responses API request (POST /v1/responses) as the chat request it stands for.

`to_chat` checks the Responses-only fields and turns input items, instructions, tools,
tool_choice and text.format into a `ChatCompletionRequest`; the chat machinery (serve.chat)
does the rest. Every 400 names the field as the Responses client sent it (`input`, `tools`,
`text.format`, ...); `responses_param` renames what the chat checks call it.
"""

from __future__ import annotations

import re
from typing import Any

import pydantic

from serve.errors import APIError, describe_validation_errors
from serve.params import check_text
from serve.protocol import ChatCompletionRequest
from serve.responses_protocol import ResponsesRequest

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
# SamplingFields extras passed on as sent (vLLM's names; the chat checks validate them)
SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
                   "stop_token_ids", "min_tokens", "ignore_eos", "logit_bias", "cache_salt")
# what the chat checks call a field -> its Responses name
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format"}


def responses_param(err: APIError) -> APIError:
    """A chat 400 with the field renamed as this API calls it."""
    param = _PARAMS.get(err.param, err.param) if err.param is not None else None
    message = err.message.replace("response_format", "text.format")
    if param == "max_output_tokens":
        message = re.sub(r"\bmax_(completion_)?tokens\b", "max_output_tokens", message)
    if param == err.param and message == err.message:
        return err
    return APIError(message, err.status, param=param, code=err.code, headers=err.headers)


def _bad(message: str, param: str = "input") -> APIError:
    return APIError(message, 400, param=param)


def _type_name(value: Any) -> str:
    return repr(value[:40]) if isinstance(value, str) else type(value).__name__


def _text(where: str, content: Any, part_types: tuple[str, ...] = TEXT_PARTS) -> str:
    """A message's content (a string, or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content parts, got {_type_name(content)}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in part_types or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}]: content parts of type {_type_name(kind)} are not supported "
                       f"(text only: {', '.join(part_types)} with a string text)")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{where}.{key} is required (a string)" if value is None else
                   f"{where}.{key} must be a string, got {_type_name(value)}")
    return value


def input_messages(body: ResponsesRequest) -> list[dict]:
    """instructions and input as chat messages (dicts in ChatMessage's shape)."""
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    calls: set[str] = set()  # call_ids of the function_call items so far
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"{where}.role must be one of {', '.join(ROLES)}, got {_type_name(role)}")
            messages.append({"role": ROLES[role], "content": _text(f"{where}.content", item.get("content"))})
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            arguments = item.get("arguments", "")
            if not isinstance(arguments, str):
                raise _bad(f"{where}.arguments must be a string (JSON text), got {_type_name(arguments)}")
            calls.add(call_id)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the calls of one turn: one assistant message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in calls:
                raise _bad(f"{where}.call_id {call_id[:80]!r} names no earlier function_call item in input "
                           "(send the call before its output; earlier responses are not stored)")
            output = _text(f"{where}.output", item.get("output"), ("input_text", "output_text"))
            messages.append({"role": "tool", "content": output, "tool_call_id": call_id})
        elif kind == "reasoning":
            continue  # earlier reasoning: the chat templates do not show it again
        else:
            raise _bad(f"{where}: input items of type {_type_name(kind)} are not supported "
                       "(message, function_call, function_call_output and reasoning are)")
    if not messages:
        raise _bad("input must hold at least one message")
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Function tools in the Responses (flat) shape -> chat tools; the chat checks do the rest."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise _bad(f"tools[{i}]: tools of type {_type_name(tool.get('type'))} are not supported (function only)",
                       "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict | None, has_tools: bool) -> str | dict | None:
    if isinstance(choice, str):
        return None if choice in ("auto", "none") and not has_tools else choice  # no tools: nothing to choose
    if choice is None:
        return None
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise _bad('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}', "tool_choice")
    return {"type": "function", "function": {"name": name}}


def response_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad(f"text.format must be an object with a type, got {_type_name(fmt)}", "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise _bad(f"text.format type must be text, json_object or json_schema, got {_type_name(kind)}", "text.format")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise _bad("text.format of type json_schema needs schema, a JSON schema object", "text.format")
    spec = {"name": fmt.get("name"), "schema": schema, "strict": fmt.get("strict")}
    if not isinstance(spec["name"], (str, type(None))) or not isinstance(spec["strict"], (bool, type(None))):
        raise _bad("text.format: name must be a string and strict a boolean", "text.format")
    return {"type": "json_schema", "json_schema": spec}


def check_responses_only(body: ResponsesRequest) -> None:
    """Fields with no chat counterpart that this server cannot honour."""
    if body.previous_response_id is not None:
        raise _bad("previous_response_id is not supported: this server stores no responses; "
                   "send the conversation in input", "previous_response_id")
    if body.background:
        raise _bad("background is not supported (responses are answered, or streamed, at once)", "background")
    if body.top_logprobs:
        raise _bad("top_logprobs is not supported on /v1/responses (use /v1/chat/completions for logprobs)",
                   "top_logprobs")
    check_echoed(body)


MAX_METADATA = 16  # OpenAI's limits on metadata: 16 pairs, keys of 64 and values of 512 characters


def check_echoed(body: ResponsesRequest) -> None:
    """Fields the response echoes: valid text (a lone surrogate cannot be answered) and OpenAI's bounds."""
    if body.user is not None:
        check_text("user", body.user)
        if len(body.user) > 512:
            raise _bad("user must be at most 512 characters", "user")
    metadata = body.metadata or {}
    if len(metadata) > MAX_METADATA:
        raise _bad(f"metadata holds at most {MAX_METADATA} pairs", "metadata")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
            raise _bad("metadata: keys of at most 64 and string values of at most 512 characters", "metadata")
        check_text("metadata", key)
        check_text("metadata", value)


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    check_responses_only(body)
    tools = chat_tools(body.tools)
    fields: dict[str, Any] = {
        "model": body.model, "messages": input_messages(body), "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "user": body.user,
        "tools": tools, "tool_choice": chat_tool_choice(body.tool_choice, bool(tools)),
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": response_format(body),
        "chat_template_kwargs": body.chat_template_kwargs, "include_reasoning": body.include_reasoning,
        "thinking_token_budget": body.thinking_token_budget,
    }
    extra = body.model_extra or {}
    fields.update({k: extra[k] for k in SAMPLING_EXTRAS if k in extra})
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except pydantic.ValidationError as e:  # an extra of the wrong type, or an input item's value
        message, param = describe_validation_errors(e.errors())
        raise responses_param(APIError(message, 400, param=param)) from None

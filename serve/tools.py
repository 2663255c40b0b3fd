"""OpenAI tool calling on the chat route, in the model's own (DeepSeek-V3) format.

Three jobs, each once per request: `check_tools` validates `tools`, `tool_choice` and
`parallel_tool_calls` on the event loop (bounded by the request limits; 400 naming the field);
`template_messages` turns OpenAI messages into what the chat template renders (a template that
reads `tools` gets them, otherwise a tool block goes into the system message; earlier calls and
their results are written in DeepSeek-V3's markers unless the template writes them itself);
`tool_grammar` is the Lark grammar that makes "required" or a named function a guarantee rather
than a request (llguidance enforces it token by token). Output parsing is `serve.tool_parser`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from serve.errors import APIError
from serve.params import check_text, structured_outputs_of
from serve.protocol import ChatCompletionRequest, ChatMessage, ToolCall
from serve.tool_parser import (
    ARGS_OPEN, CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, FENCE, OUTPUT_BEGIN, OUTPUT_END, OUTPUTS_BEGIN, OUTPUTS_END,
    SEP,
)

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # parameters omitted
# JSON as the model writes it after the tool block's example: ", " and ": ", nothing else; keywords
# llguidance cannot enforce (formats, ...) are ignored rather than refusing the request
GRAMMAR_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


def _bad(message: str, param: str) -> APIError:
    return APIError(message, 400, param=param)


@dataclasses.dataclass(frozen=True)
class ToolSetup:
    """A request's validated tool settings."""

    tools: tuple[dict, ...]  # OpenAI tool objects, as sent (validated)
    choice: str  # "none" | "auto" | "required" | "function" (a named function)
    name: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the output is searched for calls (never with tool_choice "none")."""
        return bool(self.tools) and self.choice != "none"

    @property
    def enforced(self) -> bool:
        """tool_choice "required" or a named function: a grammar makes the output calls."""
        return self.choice in ("required", "function")

    @property
    def max_calls(self) -> int | None:
        return 1 if (self.choice == "function" or not self.parallel) else None

    @property
    def in_prompt(self) -> list[dict] | None:
        """The tools the prompt describes (none with tool_choice "none": nothing would parse a call)."""
        return list(self.tools) if self.parses else None


def finish_reason(reason: str | None, calls) -> str | None:
    """"tool_calls" for an output that ended by itself with calls; a cut-off one keeps "length"."""
    return "tool_calls" if reason == "stop" and calls else reason


# --- validation -------------------------------------------------------------------------
def _check_tool(i: int, tool: Any) -> str:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise _bad(f"{where} must be an object with type \"function\"", "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{where}.function must be an object with a name", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {str(name)[:80]!r}", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.function.description must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"{where}.function.parameters must be a JSON schema object", "tools")
    if parameters is not None and parameters.get("type", "object") != "object":
        raise _bad(f"{where}.function.parameters must describe an object (type \"object\"), "
                   f"got type {str(parameters.get('type'))[:40]!r}", "tools")
    if not isinstance(function.get("strict", False), bool):
        raise _bad(f"{where}.function.strict must be a boolean", "tools")
    return name


def _check_choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad(f"tool_choice must be \"none\", \"auto\", \"required\" or a function object, got {choice[:40]!r}",
                       "tool_choice")
        if choice != "none" and not names:
            raise _bad(f"tool_choice {choice!r} needs tools", "tool_choice")
        return choice, None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise _bad('tool_choice as an object must be {"type": "function", "function": {"name": ...}}', "tool_choice")
    if not names:
        raise _bad("tool_choice names a function but the request has no tools", "tool_choice")
    if name not in names:
        raise _bad(f"tool_choice names the function {name[:80]!r}, which is not in tools", "tool_choice")
    return "function", name


def _check_messages(ctx, messages: list[ChatMessage]) -> int:
    """Tool calls and results in the history; the characters they add to the prompt."""
    chars = 0
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise _bad(f"messages[{i}]: only assistant messages carry tool_calls (this one is {m.role[:20]!r})", "messages")
        if len(m.tool_calls or ()) > ctx.limits.max_messages:
            raise _bad(f"messages[{i}]: at most {ctx.limits.max_messages} tool_calls per message", "messages")
        for call in m.tool_calls or ():
            arguments = call_arguments(call)
            for text in (call.function.name, arguments, call.id or ""):
                check_text("messages", text)
            chars += len(call.function.name) + len(arguments)
        if m.tool_call_id is not None:
            check_text("messages", m.tool_call_id)
    return chars


def check_tools(ctx, body: ChatCompletionRequest) -> ToolSetup:
    """The request's tool settings, validated (400 naming tools, tool_choice or messages).
    `tools: []` is no tools, as vLLM takes it."""
    tools = body.tools or []
    if len(tools) > MAX_TOOLS:
        raise _bad(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    names = [_check_tool(i, tool) for i, tool in enumerate(tools)]
    text = ""
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise _bad(f"tools name the function {duplicate!r} more than once", "tools")
    chars = _check_messages(ctx, body.messages)
    if tools:
        text = json.dumps(tools, ensure_ascii=False)
        check_text("tools", text)
        chars += len(text)
    if chars > ctx.limits.max_prompt_chars:
        raise _bad(f"tools and tool calls exceed {ctx.limits.max_prompt_chars} characters", "tools")
    choice, name = _check_choice(body.tool_choice, names)
    if choice in ("required", "function"):
        if len(text) > ctx.limits.max_grammar_chars:
            raise _bad(f"tool_choice {body.tool_choice if choice == 'required' else 'naming a function'} compiles the "
                       f"tools' schemas, at most {ctx.limits.max_grammar_chars} characters of them; these have {len(text)}",
                       "tools")
        if structured_outputs_of(ctx, body)[0] is not None:
            raise _bad("tool_choice \"required\" or naming a function constrains the output; it cannot be combined "
                       "with response_format or structured_outputs", "tool_choice")
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return ToolSetup(tuple(tools), choice, name, parallel)


def call_arguments(call: ToolCall) -> str:
    args = call.function.arguments
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


# --- the prompt -------------------------------------------------------------------------
def render_calls(calls: list[ToolCall]) -> str:
    """Earlier calls in DeepSeek-V3's format (calls separated by a newline, as its template does)."""
    body = "\n".join(f"{CALL_BEGIN}function{SEP}{c.function.name}\n{ARGS_OPEN}{call_arguments(c)}\n{FENCE}{CALL_END}"
                     for c in calls)
    return f"{CALLS_BEGIN}{body}{CALLS_END}"


def render_outputs(results: list[str]) -> str:
    return OUTPUTS_BEGIN + "".join(f"{OUTPUT_BEGIN}{r}{OUTPUT_END}" for r in results) + OUTPUTS_END


def tool_block(tools: list[dict], choice: str = "auto", name: str | None = None, parallel: bool = True) -> str:
    """The system-prompt text that describes the tools and the exact format of a call."""
    described = "\n".join(json.dumps({k: v for k, v in t["function"].items() if k in ("name", "description", "parameters")},
                                     ensure_ascii=False) for t in tools)
    example = (f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}FUNCTION_NAME\n{ARGS_OPEN}"
               f"{{\"argument\": \"value\"}}\n{FENCE}{CALL_END}{CALLS_END}")
    lines = [
        "## Tools",
        "You can call these functions, one JSON object each (name, description, parameters as a JSON schema):",
        described,
        "",
        "To call a function, answer with exactly this, the arguments one JSON object that matches its parameters:",
        example,
    ]
    if parallel and choice != "function":
        lines.append(f"To call several functions at once, put one {CALL_BEGIN}...{CALL_END} after another, "
                     f"separated by a newline, between {CALLS_BEGIN} and {CALLS_END}.")
    else:
        lines.append("Call at most one function per answer.")
    lines.append(f"Each result comes back as {OUTPUTS_BEGIN}{OUTPUT_BEGIN}RESULT{OUTPUT_END}{OUTPUTS_END}, "
                 "in the order of the calls.")
    if choice == "required":
        lines.append("You must call at least one function now.")
    elif choice == "function":
        lines.append(f"You must call the function {name} now.")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class TemplateSupport:
    """What a chat template writes itself (read from its source: transformers' convention of
    `tools`, `tool_calls` and a "tool" role)."""

    tools: bool
    tool_calls: bool
    tool_role: bool

    @classmethod
    def of(cls, tokenizer) -> "TemplateSupport":
        source = getattr(tokenizer, "chat_template", "")
        return cls(tools="tools" in getattr(tokenizer, "template_variables", ()), tool_calls="tool_calls" in source,
                   tool_role=re.search(r"""['"]tool['"]""", source) is not None)


def template_messages(
    tokenizer, messages: list[ChatMessage], texts: list[str], setup: ToolSetup | None,
) -> tuple[list[dict], list[dict] | None]:
    """(messages for the template, its `tools` argument). texts: each message's content as text."""
    support = TemplateSupport.of(tokenizer)
    out: list[dict] = []
    for m, text in zip(messages, texts):
        if m.role == "tool" and not support.tool_role:
            if out and out[-1].get("_tool_results") is not None:  # consecutive results: one block
                out[-1]["_tool_results"].append(text)
            else:
                out.append({"role": "user", "_tool_results": [text]})
            continue
        d: dict[str, Any] = {"role": m.role, "content": text}
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if support.tool_calls:
                d["content"] = text or None
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": call_arguments(c)}} for c in m.tool_calls]
            else:
                d["content"] = text + render_calls(m.tool_calls)
        out.append(d)
    for d in out:
        if "_tool_results" in d:
            d["content"] = render_outputs(d.pop("_tool_results"))
    tools = setup.in_prompt if setup is not None else None
    if not tools or support.tools:
        return out, tools
    block = tool_block(tools, setup.choice, setup.name, setup.parallel)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None


# --- the grammar ------------------------------------------------------------------------
def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def tool_grammar(tools: list[dict] | tuple[dict, ...], tool_choice: str | dict, parallel: bool = True) -> str | None:
    """llguidance Lark grammar for tool_choice "required" (one or more calls of any tool, one
    when not parallel) or a named function (exactly one call of it); None for "auto"/"none".
    Arguments follow each function's parameters schema (`%json`)."""
    if isinstance(tool_choice, dict):
        wanted = tool_choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == wanted]
        parallel = False
    elif tool_choice == "required":
        chosen = list(tools)
    else:
        return None
    if not chosen:
        raise ValueError(f"no tool for tool_choice {tool_choice!r}")
    rules = []
    for k, tool in enumerate(chosen):
        function = tool["function"]
        parameters = function.get("parameters")
        schema = dict(NO_PARAMETERS if parameters is None else parameters)
        own = schema.get("x-guidance")
        schema["x-guidance"] = {**GRAMMAR_JSON_OPTIONS, **(own if isinstance(own, dict) else {})}
        head = f"{CALL_BEGIN}function{SEP}{function['name']}\n{ARGS_OPEN}"
        tail = _literal("\n" + FENCE + CALL_END)
        rules.append(f"call_{k}: {_literal(head)} %json {json.dumps(schema, ensure_ascii=False)} {tail}")
    more = f' ({_literal(chr(10))} call)*' if parallel else ""  # calls separated by a newline
    lines = [f"start: {_literal(CALLS_BEGIN)} call{more} {_literal(CALLS_END)}",
             "call: " + " | ".join(f"call_{k}" for k in range(len(chosen))), *rules]
    return "\n".join(lines) + "\n"

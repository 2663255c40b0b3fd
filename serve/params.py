"""From an OpenAI request body to engine requests, in two stages.

`check_*` and `sampling_params` run on the event loop and do only work bounded by the limits
(lengths, counts, ranges): every value is checked before anything is tokenized, and each 400
names the field as the client sent it (`max_completion_tokens`, `top_logprobs`, ...).
`make_choices` tokenizes and builds the engine requests; the routes run it on the tokenizer
threads (`ServerContext.run_blocking`), never on the event loop.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Sequence

from serve.errors import APIError
from serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from splash_jax.engine.request import MAX_LOGPROBS, Request, RequestError, SamplingParams
from splash_jax.engine.stop import compile_stops
from splash_jax.structured import StructuredOutputs

_INT_KEY = re.compile(r"-?\d{1,10}")


@dataclasses.dataclass(frozen=True)
class FieldNames:
    """How this request names the SamplingParams fields, for errors (chat says
    max_completion_tokens and top_logprobs where the engine says max_tokens and logprobs)."""

    prompt: str = "prompt"
    max_tokens: str = "max_tokens"
    logprobs: str = "logprobs"
    structured_outputs: str = "structured_outputs"  # or response_format, guided_json, ...

    def of(self, field: str | None) -> str:
        if field is None:
            return self.prompt
        return {"max_tokens": self.max_tokens, "logprobs": self.logprobs,
                "structured_outputs": self.structured_outputs}.get(field, field)


def _bad(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(message, 400, param=param, code=code)


def check_text(param: str, text: str) -> None:
    """A lone surrogate (JSON "\\ud800") is no text any tokenizer can take: 400, naming the field."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _bad(f"{param} contains an unpaired surrogate (\\u{ord(text[e.start]):04x}) at character {e.start}; "
                       "send valid Unicode", param) from None


def check_common(ctx, body: SamplingFields, num_prompts: int) -> None:
    """Reject what the engine cannot do, rather than silently ignoring it."""
    limits = ctx.limits
    if not 1 <= body.n <= limits.max_n:
        raise _bad(f"n must be in [1, {limits.max_n}], got {body.n}", "n")
    if num_prompts * body.n > limits.max_choices:
        raise _bad(f"this request asks for {num_prompts * body.n} choices (prompts x n); at most {limits.max_choices}",
                   "n" if num_prompts == 1 else "prompt")
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if len(stops) > limits.max_stop_strings:
        raise _bad(f"stop may hold at most {limits.max_stop_strings} strings, got {len(stops)}", "stop")
    for s in stops:
        if not s or len(s) > limits.max_stop_string_chars:
            raise _bad(f"stop strings must have 1 to {limits.max_stop_string_chars} characters, got {len(s)}", "stop")
        check_text("stop", s)
    if body.logit_bias is not None and len(body.logit_bias) > ctx.sampling_limits.max_logit_bias:
        raise _bad(f"logit_bias may hold at most {ctx.sampling_limits.max_logit_bias} entries, got {len(body.logit_bias)}",
                   "logit_bias")
    if body.prompt_logprobs is not None and not 0 <= body.prompt_logprobs <= MAX_LOGPROBS:
        raise _bad(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {body.prompt_logprobs}", "prompt_logprobs")
    structured_outputs_of(ctx, body)  # checks sizes and that exactly one constraint is given
    if body.stream_options is not None and not body.stream:
        raise _bad("stream_options is only allowed when stream is true", "stream_options")
    if body.cache_salt is not None:  # a string (pydantic checked the type); vLLM also refuses an empty one
        if not 1 <= len(body.cache_salt) <= limits.max_cache_salt_chars:
            raise _bad(f"cache_salt must have 1 to {limits.max_cache_salt_chars} characters, got {len(body.cache_salt)}",
                       "cache_salt")
        check_text("cache_salt", body.cache_salt)


def _prompt_forms(prompt) -> list[str | list[int]]:
    """OpenAI's four prompt forms: a string, a list of strings, token ids, lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise _bad("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def check_completion(ctx, body: CompletionRequest) -> list[str | list[int]]:
    """The prompts, once every field is known to be within bounds."""
    limits = ctx.limits
    prompts = _prompt_forms(body.prompt)
    if len(prompts) > limits.max_prompts:
        raise _bad(f"at most {limits.max_prompts} prompts per request, got {len(prompts)}", "prompt")
    check_prompt_sizes(ctx, "prompt", prompts)
    check_common(ctx, body, len(prompts))
    if body.suffix:
        raise _bad("suffix is not supported by this server", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise _bad("best_of is not supported by this server (leave it unset or equal to n)", "best_of")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise _bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {body.logprobs}", "logprobs")
    if body.max_tokens is not None and body.max_tokens == 0 and not body.echo:
        raise _bad("max_tokens must be >= 1 (0 only with echo: the prompt's logprobs alone)", "max_tokens")
    return prompts


def check_prompt_sizes(ctx, param: str, prompts: Iterable[str | Sequence[int]]) -> None:
    """Character and token counts before any tokenization (text prompts are checked for valid
    Unicode here too: a C-speed pass over at most max_prompt_chars)."""
    chars = 0
    for p in prompts:
        if isinstance(p, str):
            chars += len(p)
            if chars > ctx.limits.max_prompt_chars:
                raise _bad(f"the prompt text exceeds {ctx.limits.max_prompt_chars} characters", param)
            check_text(param, p)
        elif len(p) >= ctx.max_model_len:
            raise _bad(f"the prompt has {len(p)} tokens; the maximum model length is {ctx.max_model_len} "
                       "(prompt plus at least one generated token)", param, "context_length_exceeded")
        elif not p:
            raise _bad("a token-id prompt must not be empty", param)


def check_chat(ctx, body: ChatCompletionRequest) -> None:
    limits = ctx.limits
    if not body.messages:
        raise _bad("messages must not be empty", "messages")
    if len(body.messages) > limits.max_messages:
        raise _bad(f"at most {limits.max_messages} messages, got {len(body.messages)}", "messages")
    texts = []
    for m in body.messages:
        check_text("messages", m.role)
        if m.name is not None:
            check_text("messages", m.name)
        if isinstance(m.content, list):
            if len(m.content) > limits.max_messages:
                raise _bad(f"at most {limits.max_messages} content parts per message", "messages")
            texts += [part.text for part in m.content if part.text is not None]
        elif m.content is not None:
            texts.append(m.content)
    check_prompt_sizes(ctx, "messages", texts)
    check_common(ctx, body, 1)
    if body.top_logprobs is not None and not body.logprobs:
        raise _bad("top_logprobs needs logprobs set to true", "top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise _bad(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}", "top_logprobs")
    check_template_kwargs(ctx, body.chat_template_kwargs)


RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")


def check_template_kwargs(ctx, kwargs: dict | None) -> None:
    """chat_template_kwargs: names the template may read, bounded like a prompt; never the
    variables the server itself passes."""
    if not kwargs:
        return
    for name in kwargs:
        if not name.isidentifier():
            raise _bad(f"chat_template_kwargs: {name[:80]!r} is not a template variable name", "chat_template_kwargs")
        if name in RESERVED_TEMPLATE_VARIABLES:
            raise _bad(f"chat_template_kwargs may not set {name!r} (the server passes it)", "chat_template_kwargs")
    text = json.dumps(kwargs, ensure_ascii=False)
    check_text("chat_template_kwargs", text)
    if len(text) > ctx.limits.max_prompt_chars:
        raise _bad(f"chat_template_kwargs exceed {ctx.limits.max_prompt_chars} characters", "chat_template_kwargs")


def structured_outputs_of(ctx, body: SamplingFields) -> tuple[StructuredOutputs | None, str]:
    """The request's output constraint and the field it came from (for 400s): response_format,
    structured_outputs, or vLLM's older guided_* fields. Bounded work: sizes are checked here;
    the grammar compiles later, on a tokenizer thread (Engine.make_request). Computed once per
    body (admission checks, error names and the sampling parameters all ask)."""
    if body._constraint is None:
        body._constraint = _constraint_of(ctx, body)
    return body._constraint


def _constraint_of(ctx, body: SamplingFields) -> tuple[StructuredOutputs | None, str]:
    found: list[tuple[str, StructuredOutputs]] = []
    rf = body.response_format
    if rf is not None:
        if rf.type == "json_object":
            found.append(("response_format", StructuredOutputs(json_object=True)))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise _bad("response_format of type json_schema needs json_schema.schema", "response_format")
            found.append(("response_format", StructuredOutputs(json=rf.json_schema.schema_)))
        elif rf.type != "text":
            raise _bad(f"response_format type must be text, json_object or json_schema, got {rf.type[:40]!r}", "response_format")
    so = body.structured_outputs
    if so is not None:
        given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar), ("json_object", so.json_object or None)) if v is not None}
        if len(given) != 1:
            raise _bad(f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got "
                       f"{', '.join(given) or 'none'}", "structured_outputs")
        found.append(("structured_outputs", StructuredOutputs(**given)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, StructuredOutputs(**{kind: value})))
    if len(found) > 1:
        raise _bad(f"give one output constraint, not {' and '.join(n for n, _ in found)}", found[1][0])
    if not found:
        return None, "structured_outputs"
    name, spec = found[0]
    kind, text = spec.key()
    limit = ctx.limits.max_grammar_chars
    if len(text) > limit:
        raise _bad(f"the {kind} constraint has {len(text)} characters; at most {limit}", name)
    if kind == "choice" and (not spec.choice or not all(isinstance(c, str) and c for c in spec.choice)):
        raise _bad("choice must be a non-empty list of non-empty strings", name)
    check_text(name, text)
    return spec, name


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys (strings)."""
    out: dict[int, float] = {}
    for key, value in (raw or {}).items():
        if not _INT_KEY.fullmatch(key.strip()):
            raise _bad(f"logit_bias keys must be token ids, got {key[:20]!r}", "logit_bias")
        tid = int(key)
        if tid in out:
            raise _bad(f"logit_bias names token {tid} twice", "logit_bias")
        out[tid] = value
    return out


def sampling_params(ctx, body: SamplingFields, max_tokens: int | None, logprobs: int | None, names: FieldNames,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's parameters for one choice, validated (400 naming the request's field).
    max_tokens None (chat's default) stands for the rest of the context, fixed in make_choices.
    prompt_logprobs: what echo + logprobs asks for (else the request's prompt_logprobs extra)."""
    params = SamplingParams(
        max_tokens=ctx.max_model_len - 1 if max_tokens is None else max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=0 if body.top_k is None else body.top_k,
        top_p=1.0 if body.top_p is None else body.top_p,
        min_p=0.0 if body.min_p is None else body.min_p,
        seed=body.seed,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else body.prompt_logprobs,
        structured_outputs=structured_outputs_of(ctx, body)[0],
    )
    try:
        params.validate(ctx.vocab_size, ctx.sampling_limits)
    except RequestError as e:
        raise _bad(str(e), names.of(e.field)) from None
    return params


def make_choices(
    ctx, prompt: str | Sequence[int], params: SamplingParams, n: int, max_tokens: int | None,
    id_prefix: str, first_index: int, names: FieldNames, cache_salt: str | None = None,
) -> list[Request]:
    """n engine requests for one prompt (tokenized once; blocking: run it on a tokenizer thread).
    A seeded request gives choice j the seed + j, so choices differ yet the whole response is
    reproducible (as vLLM does). Every choice gets the request's cache_salt (its prefix-cache namespace)."""
    try:
        first = ctx.engine.make_request(prompt, dataclasses.replace(params), f"{id_prefix}-{first_index}", cache_salt=cache_salt)
    except RequestError as e:
        field = names.of(getattr(e, "field", None))
        message = re.sub(r"^structured_outputs(\.\w+)?", field, str(e)) if e.field == "structured_outputs" else str(e)
        raise _bad(message, field) from None
    limit, prompt_len = ctx.max_model_len, len(first.prompt_ids)
    if max_tokens is None:  # OpenAI's chat default: as many as fit
        max_tokens = limit - prompt_len
    elif prompt_len + max_tokens > limit:
        raise _bad(
            f"this model's maximum context length is {limit} tokens; the request asks for "
            f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate)",
            names.max_tokens, "context_length_exceeded",
        )
    if params.min_tokens > max_tokens:
        raise _bad(f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens this prompt leaves", "min_tokens")
    first.params.max_tokens = max_tokens
    if params.stop:
        compile_stops(tuple(params.stop))  # built here, off the engine thread; the engine's matcher reuses it
    requests = [first]
    for j in range(1, n):
        seed = None if params.seed is None else (params.seed + j + 2**63) % 2**64 - 2**63
        child = dataclasses.replace(params, max_tokens=max_tokens, seed=seed)
        requests.append(ctx.engine.make_request(first.prompt_ids, child, f"{id_prefix}-{first_index + j}",
                                                cache_salt=cache_salt))
    return requests

"""From an OpenAI request body to engine requests: the checks OpenAI answers with 400, the
sampling parameters, and one engine request per choice (n choices per prompt)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from serve.errors import APIError
from serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from splash_jax.engine.async_engine import AsyncEngine
from splash_jax.engine.request import MAX_LOGPROBS, Request, SamplingParams

MAX_N = 128  # choices per request at most: each is a separate engine request


def check_common(body: SamplingFields) -> None:
    """Reject what the engine cannot do, rather than silently ignoring it."""
    if not 1 <= body.n <= MAX_N:
        raise APIError(f"n must be in [1, {MAX_N}], got {body.n}", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value not in (None, 0, 0.0):
            raise APIError(f"{name} is not supported by this server (only 0)", param=name)
    if body.logit_bias:
        raise APIError("logit_bias is not supported by this server", param="logit_bias")
    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")


def check_completion(body: CompletionRequest) -> None:
    check_common(body)
    if body.suffix:
        raise APIError("suffix is not supported by this server", param="suffix")
    if body.best_of not in (None, body.n):
        raise APIError("best_of is not supported by this server (leave it unset or equal to n)", param="best_of")
    if body.echo and body.logprobs is not None:
        raise APIError("echo with logprobs is not supported (prompt logprobs are not computed)", param="echo")


def check_chat(body: ChatCompletionRequest) -> None:
    check_common(body)
    if body.tools and body.tool_choice != "none":
        raise APIError("tools are not supported by this server", param="tools")
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError("response_format other than 'text' is not supported", param="response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}", param="top_logprobs")
    if not body.messages:
        raise APIError("messages must not be empty", param="messages")


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The engine's parameters for one choice (values are checked by the engine: 400 on bad ones)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="logprobs")
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else 1,  # None: make_choices fills in the rest of the context
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=0 if body.top_k is None else body.top_k,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )


def make_choices(
    engine: AsyncEngine, prompt: str | Sequence[int], params: SamplingParams, n: int, max_tokens: int | None,
    id_prefix: str, first_index: int,
) -> list[Request]:
    """n engine requests for one prompt (tokenized once). A seeded request gives choice j the
    seed + j, so choices differ yet the whole response is reproducible (as vLLM does)."""
    first = engine.make_request(prompt, dataclasses.replace(params), f"{id_prefix}-{first_index}")
    limit = engine.max_model_len
    prompt_len = len(first.prompt_ids)
    if max_tokens is None:  # OpenAI's chat default: as many as fit
        max_tokens = limit - prompt_len
    elif prompt_len + max_tokens > limit:
        raise APIError(
            f"this model's maximum context length is {limit} tokens; the request asks for "
            f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate)",
            param="max_tokens", code="context_length_exceeded",
        )
    first.params.max_tokens = max_tokens
    requests = [first]
    for j in range(1, n):
        child = dataclasses.replace(params, max_tokens=max_tokens, seed=None if params.seed is None else params.seed + j)
        requests.append(engine.make_request(first.prompt_ids, child, f"{id_prefix}-{first_index + j}"))
    return requests

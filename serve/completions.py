"""POST /v1/completions: text (or token-id) prompts, n choices each, streamed or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from serve.context import SSE_DONE, ServerContext, sse, usage
from serve.disconnect import SSEResponse, unless_disconnected
from serve.outputs import ChoiceDelta, ChoiceState, completion_logprobs, echo_logprobs, joined_logprobs, vllm_prompt_logprobs
from serve.params import FieldNames, check_completion, make_choices, sampling_params, structured_outputs_of
from serve.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from splash_jax.engine.request import Request, SamplingParams

def _prepare(ctx: ServerContext, body: CompletionRequest, prompts, params: SamplingParams, rid: str, names: FieldNames):
    """Tokenize and build the engine requests (on a tokenizer thread); the echo texts. max_tokens 0
    (echo only) runs one token that is never shown."""
    requests: list[Request] = []
    echo: list[str] = []
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
    for p, prompt in enumerate(prompts):
        requests += make_choices(ctx, prompt, params, body.n, max_tokens, rid, p * body.n, names, body.cache_salt)
        if body.echo:
            text = prompt if isinstance(prompt, str) else ctx.engine.tokenizer.decode(prompt)
            echo += [text] * body.n
    return requests, echo


def _echo_lps(body: CompletionRequest) -> int | None:
    """Prompt logprobs the engine computes: echo + logprobs asks for them (top-n = logprobs), as
    does vLLM's prompt_logprobs extra."""
    echoed = body.logprobs if body.echo and body.logprobs is not None else None
    if echoed is None or body.prompt_logprobs is None:
        return body.prompt_logprobs if echoed is None else echoed
    return max(echoed, body.prompt_logprobs)


def _shown(body: CompletionRequest, delta: ChoiceDelta) -> ChoiceDelta:
    """max_tokens 0 with echo: the one token the engine ran is not part of the answer."""
    if body.max_tokens != 0:
        return delta
    return ChoiceDelta("", [], [] if delta.logprobs is not None else None, [] if delta.logprobs is not None else None,
                       "length" if delta.finish_reason else None, delta.num_cached_tokens, delta.prompt_logprobs,
                       delta.prompt_top_logprobs)


def _choice_logprobs(ctx: ServerContext, body: CompletionRequest, state: ChoiceState, request: Request,
                     delta: ChoiceDelta, first: bool):
    """The choice's logprobs: with echo, the prompt's (on its first chunk) before the generated ones."""
    generated = completion_logprobs(state, delta, ctx.token_text) if body.logprobs is not None else None
    if body.echo and body.logprobs is not None and first:
        prompt = echo_logprobs(ChoiceState(state.index), request.prompt_ids, delta, ctx.token_text)
        shift = prompt.text_offset[-1] + len(prompt.tokens[-1]) if prompt.tokens else 0
        if generated is not None:  # the generated tokens' offsets follow the echoed prompt's text
            generated.text_offset = [o + shift for o in generated.text_offset]
        state.text_offset += shift
        return joined_logprobs(prompt, generated or CompletionLogprobs())
    return generated


async def create_completion(ctx: ServerContext, body: CompletionRequest, raw: HTTPRequest) -> Response:
    prompts = check_completion(ctx, body)
    model = ctx.resolve_model(body.model)
    names = FieldNames(structured_outputs=structured_outputs_of(ctx, body)[1])
    params = sampling_params(ctx, body, max(body.max_tokens or 0, 1) if body.max_tokens is not None else None,
                             body.logprobs, names, _echo_lps(body))
    rid = f"cmpl-{uuid.uuid4().hex}"
    requests, echo = await ctx.run_blocking(_prepare, ctx, body, prompts, params, rid, names)
    states = ctx.choice_states(requests)
    if body.stream:
        return SSEResponse(_stream(ctx, body, model, rid, requests, states, echo))

    results = await unless_disconnected(raw, ctx.accumulated(requests, states))
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices = []
    for r in requests:
        state, result = states[r.request_id], _shown(body, results[r.request_id].as_delta())
        choices.append(CompletionChoice(
            index=state.index,
            text=(echo[state.index] if echo else "") + result.text,
            logprobs=_choice_logprobs(ctx, body, state, r, result, first=True),
            finish_reason=result.finish_reason,
            token_ids=result.token_ids if body.return_token_ids else None,
            prompt_logprobs=vllm_prompt_logprobs(r.prompt_ids, result, ctx.token_text) if body.prompt_logprobs is not None else None,
            prompt_token_ids=r.prompt_ids if body.prompt_logprobs is not None or body.return_token_ids else None,
        ))
    total = 0 if body.max_tokens == 0 else sum(len(a.token_ids) for a in results.values())
    cached = {request_id: a.num_cached_tokens for request_id, a in results.items()}
    return Response(
        CompletionResponse(id=rid, model=model, choices=choices, usage=usage(requests, body.n, total, cached)).model_dump_json(),
        media_type="application/json",
    )


async def _stream(
    ctx: ServerContext, body: CompletionRequest, model: str, rid: str, requests: list[Request],
    states: dict[str, ChoiceState], echo: list[str],
) -> AsyncIterator[str]:
    created = int(time.time())
    echoed: set[int] = set()
    wants_tokens = body.logprobs is not None or body.return_token_ids
    total = 0
    cached: dict[str, int] = {}  # request id -> its prompt tokens served from the prefix cache
    by_id = {r.request_id: r for r in requests}
    try:
        async for out in ctx.outputs(requests):
            state = states[out.request_id]
            delta = _shown(body, state.advance(out))
            total += len(delta.token_ids)
            cached[out.request_id] = delta.num_cached_tokens
            text, first = delta.text, state.index not in echoed
            echoed.add(state.index)
            if echo and first:
                text = echo[state.index] + text
            if not text and delta.finish_reason is None and not (wants_tokens and delta.token_ids) and not first:
                continue
            request = by_id[out.request_id]
            choice = CompletionChoice(
                index=state.index, text=text,
                logprobs=_choice_logprobs(ctx, body, state, request, delta, first),
                finish_reason=delta.finish_reason,
                token_ids=delta.token_ids if body.return_token_ids else None,
                prompt_logprobs=(vllm_prompt_logprobs(request.prompt_ids, delta, ctx.token_text)
                                 if body.prompt_logprobs is not None and first else None),
                prompt_token_ids=request.prompt_ids if first and (body.prompt_logprobs is not None or body.return_token_ids) else None,
            )
            yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[choice]))
        if body.stream_options and body.stream_options.include_usage:
            yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage(requests, body.n, total, cached)))
    except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
        yield ctx.sse_error(e)
    yield SSE_DONE

"""Core outputs -> RequestOutput deltas: detokenization, stop strings, metrics, in one place.

This is the front end's half of a step (vLLM v1's output processor): it runs where the user's
requests live, beside the engine core in a notebook (`Engine`) or in each API server process
(serve/), never in the core's step loop. Each request has an incremental decoder and a
StopMatcher; the matcher holds back text that could still become a stop string and drops a
matched one, so the deltas of a request concatenate to its final text and nothing downstream
re-checks stops. A stop string ends the request here: the caller aborts it in the core, and
tokens the core produced past the stop (later in the same delta, or in steps already under way)
are dropped. A stop token (EOS, stop_token_ids) ends the output without its text, as vLLM does;
its id stays in the token ids.
"""

from __future__ import annotations

import dataclasses
import time

from splash_jax.engine.core_output import CoreOutput
from splash_jax.engine.request import Request, RequestOutput
from splash_jax.engine.stop import StopMatcher
from splash_jax.tokenizer import IncrementalDecoder, Tokenizer


@dataclasses.dataclass
class _Detok:
    request: Request
    decoder: IncrementalDecoder | None
    matcher: StopMatcher
    num_output_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._state: dict[str, _Detok] = {}

    def add(self, request: Request) -> None:
        decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None
        self._state[request.request_id] = _Detok(request, decoder, StopMatcher(request.params.stop if decoder else ()))

    def remove(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._state

    def __len__(self) -> int:
        return len(self._state)

    def process(self, core: CoreOutput, now: float | None = None) -> tuple[RequestOutput | None, str | None]:
        """The delta for one request's core output, and the stop string it completed (then the
        caller aborts the request in the core). None for a request this front end no longer has."""
        state = self._state.get(core.request_id)
        if state is None:
            return None, None  # finished here already (a stop string): what the core sent since is dropped
        now = time.monotonic() if now is None else now
        request = state.request
        tokens, text, hit = core.new_token_ids, "", None
        if state.decoder is not None:
            last = len(tokens) - 1
            for i, token in enumerate(tokens):
                raw = "" if (i == last and core.stop_token) else state.decoder.push(token)
                safe, hit = state.matcher.push(raw)
                text += safe
                if hit is not None:
                    tokens = tokens[: i + 1]  # the stop string ends here: later tokens are never shown
                    break
        reason = "stop" if hit is not None else core.finish_reason
        finished = reason is not None
        if finished and hit is None and state.decoder is not None:
            text += state.matcher.flush()
        if tokens and request.metrics.first_token is None:
            request.metrics.first_token = now
        state.num_output_tokens += len(tokens)
        n = len(tokens)
        if finished:
            request.metrics.finished = now
            self.remove(core.request_id)
        out = RequestOutput(
            request_id=core.request_id,
            delta_token_ids=list(tokens),
            delta_text=text,
            finished=finished,
            finish_reason=reason,
            delta_logprobs=core.logprobs[:n] if core.logprobs is not None else None,
            delta_top_logprobs=core.top_logprobs[:n] if core.top_logprobs is not None else None,
            stop_reason=hit if hit is not None else core.stop_reason,
            num_prompt_tokens=len(request.prompt_ids),
            num_cached_tokens=core.num_cached_tokens,
            num_output_tokens=state.num_output_tokens,
            ttft=request.metrics.ttft(),
            tpot=request.metrics.tpot(state.num_output_tokens) if finished else None,
            error=core.error if finished else None,
            prompt_logprobs=core.prompt_logprobs,
            prompt_top_logprobs=core.prompt_top_logprobs,
        )
        return out, hit

    def process_all(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """A step's deltas, and the ids of requests a stop string ended (to abort in the core)."""
        now = time.monotonic()
        deltas, stopped = [], []
        for core in outputs:
            out, hit = self.process(core, now)
            if out is None:
                continue
            deltas.append(out)
            if hit is not None:
                stopped.append(core.request_id)
        return deltas, stopped

    def final(self, request_id: str, reason: str, error: str | None = None) -> RequestOutput | None:
        """An empty last delta for a request ended outside a step (abort, a failed step)."""
        state = self._state.pop(request_id, None)
        if state is None:
            return None
        r = state.request
        return RequestOutput(
            request_id=request_id, delta_token_ids=[], delta_text="", finished=True, finish_reason=reason,
            num_prompt_tokens=len(r.prompt_ids), num_cached_tokens=r.num_cached_tokens,
            num_output_tokens=state.num_output_tokens, ttft=r.metrics.ttft(), error=error,
        )

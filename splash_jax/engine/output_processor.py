"""Sampled tokens -> RequestOutput deltas: detokenization, stop strings, logprobs, in one place.

Runs once per step on the tokens `Scheduler.update` applied. Each request has an incremental
decoder and a StopMatcher; the matcher holds back text that could still become a stop string
and drops a matched one, so the deltas of a request concatenate to its final text and nothing
downstream (server, notebooks) re-checks stops. A stop token (EOS, stop_token_ids) ends the
output without its text, as vLLM does; its id stays in the token ids.
"""

from __future__ import annotations

import dataclasses

from splash_jax.engine.request import Request, RequestOutput
from splash_jax.engine.scheduler import TokenUpdate
from splash_jax.engine.stop import StopMatcher
from splash_jax.tokenizer import IncrementalDecoder, Tokenizer


@dataclasses.dataclass
class _Detok:
    decoder: IncrementalDecoder | None
    matcher: StopMatcher


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._state: dict[str, _Detok] = {}

    def add(self, request: Request) -> None:
        decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None
        self._state[request.request_id] = _Detok(decoder, StopMatcher(request.params.stop if decoder else ()))

    def remove(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def process(self, update: TokenUpdate, logprobs, now: float) -> tuple[RequestOutput, str | None]:
        """The output delta for one applied token, and the stop string it completed (if any)."""
        request, token = update.request, update.token
        state = self._state[request.request_id]
        text, hit = "", None
        if state.decoder is not None:
            raw = "" if update.stop_token else state.decoder.push(token)
            text, hit = state.matcher.push(raw)
            if hit is None and (update.finish_reason is not None):
                text += state.matcher.flush()
        if request.metrics.first_token is None:
            request.metrics.first_token = now
        delta_lp = delta_top = None
        if request.params.logprobs is not None and logprobs is not None:
            chosen, top_ids, top_lp = logprobs
            k, row = request.params.logprobs, update.row
            delta_lp = [float(chosen[row])]
            delta_top = [{int(t): float(v) for t, v in zip(top_ids[row][:k], top_lp[row][:k])}]
        reason = "stop" if hit is not None else update.finish_reason
        finished = reason is not None
        prompt_lp = prompt_top = None
        if request.params.prompt_logprobs is not None and not request.prompt_lps_sent:
            request.prompt_lps_sent = True  # the first output carries them (vLLM does the same)
            prompt_lp = [None] + request.prompt_lps
            prompt_top = [None] + (request.prompt_tops if request.params.prompt_logprobs else [{}] * len(request.prompt_lps))
        if finished:
            request.metrics.finished = now
            self.remove(request.request_id)
        out = RequestOutput(
            request_id=request.request_id,
            delta_token_ids=[token],
            delta_text=text,
            finished=finished,
            finish_reason=reason,
            delta_logprobs=delta_lp,
            delta_top_logprobs=delta_top,
            stop_reason=hit if hit is not None else request.stop_reason,
            num_prompt_tokens=len(request.prompt_ids),
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_ids),
            ttft=request.metrics.ttft(),
            tpot=request.metrics.tpot(len(request.output_ids)) if finished else None,
            error=request.error if finished else None,
            prompt_logprobs=prompt_lp,
            prompt_top_logprobs=prompt_top,
        )
        return out, hit

    @staticmethod
    def final(request: Request, reason: str, error: str | None = None) -> RequestOutput:
        """An empty last delta for a request ended outside a step (abort, failure)."""
        return RequestOutput(
            request_id=request.request_id, delta_token_ids=[], delta_text="", finished=True, finish_reason=reason,
            num_prompt_tokens=len(request.prompt_ids), num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_ids), ttft=request.metrics.ttft(), error=error,
        )

"""Engine output deltas -> what one OpenAI choice shows: text, token ids, logprobs.

The engine sends deltas only, already with any possible stop-string tail held back, a matched
stop string removed and a stop token's text never decoded, so a stream forwards them as they
come and a non-streamed response is the concatenation (`ChoiceAccumulator`): both show the
same text.
"""

from __future__ import annotations

import dataclasses

from serve.protocol import ChatLogprobs, ChatLogprobToken, CompletionLogprobs, TopLogprob
from splash_jax.engine.request import RequestOutput
from splash_jax.tokenizer import Tokenizer


class TokenText:
    """Token id -> (text, bytes) as logprobs show it, cached (the same ids come back all the time).

    A token that is only part of a UTF-8 character is shown as OpenAI does, "bytes:\\xe2\\x80",
    so distinct tokens never share a text (top_logprobs of /v1/completions is keyed by text).
    """

    def __init__(self, tokenizer: Tokenizer | None):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> str:
        return self.lookup(token_id)[0]

    def lookup(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._describe(token_id)
        return hit

    def _describe(self, token_id: int) -> tuple[str, bytes]:
        if self._tokenizer is None:
            text = f"<{token_id}>"
            return text, text.encode()
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        raw = self._tokenizer.token_bytes(token_id) if "\ufffd" in text else None
        if raw is None:
            return text, text.encode()
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


@dataclasses.dataclass
class ChoiceDelta:
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    num_cached_tokens: int = 0  # the request's prompt tokens served from the prefix cache (not a delta)


@dataclasses.dataclass
class ChoiceState:
    """One choice of a response: its index, and where its completion logprobs' offsets are."""

    index: int
    text_offset: int = 0  # completion logprobs: where the next token starts in the choice text

    @staticmethod
    def advance(out: RequestOutput) -> ChoiceDelta:
        return ChoiceDelta(
            text=out.delta_text, token_ids=list(out.delta_token_ids), logprobs=out.delta_logprobs,
            top_logprobs=out.delta_top_logprobs, finish_reason=out.finish_reason if out.finished else None,
            num_cached_tokens=out.num_cached_tokens,
        )


@dataclasses.dataclass
class ChoiceAccumulator:
    """A non-streamed choice: the concatenation of its deltas."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
            self.top_logprobs = (self.top_logprobs or []) + (delta.top_logprobs or [{}] * len(delta.logprobs))
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.num_cached_tokens = delta.num_cached_tokens  # every output carries the request's count

    def as_delta(self) -> ChoiceDelta:
        return ChoiceDelta(self.text, self.token_ids, self.logprobs, self.top_logprobs, self.finish_reason, self.num_cached_tokens)


def completion_logprobs(state: ChoiceState, delta: ChoiceDelta, token_text: TokenText) -> CompletionLogprobs | None:
    if delta.logprobs is None:
        return None
    out = CompletionLogprobs()
    for token, lp, top in zip(delta.token_ids, delta.logprobs, delta.top_logprobs or [{}] * len(delta.token_ids)):
        text = token_text(token)
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.top_logprobs.append({token_text(t): v for t, v in top.items()})
        out.text_offset.append(state.text_offset)
        state.text_offset += len(text)
    return out


def chat_logprobs(delta: ChoiceDelta, token_text: TokenText) -> ChatLogprobs | None:
    if delta.logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> TopLogprob:
        text, raw = token_text.lookup(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(raw))

    content = []
    for token, lp, top in zip(delta.token_ids, delta.logprobs, delta.top_logprobs or [{}] * len(delta.token_ids)):
        content.append(ChatLogprobToken(**entry(token, lp).model_dump(), top_logprobs=[entry(t, v) for t, v in top.items()]))
    return ChatLogprobs(content=content)

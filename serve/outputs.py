"""Engine outputs -> what one OpenAI choice shows: text deltas, token ids, logprobs.

The engine removes a stop string from the text only once it is complete, so a stream that
forwarded every delta could already have sent its first characters. `ChoiceState` holds back
any tail of the text that could still become a stop string, so the streamed text always
equals the final (non-streamed) text.
"""

from __future__ import annotations

import dataclasses

from serve.protocol import ChatLogprobs, ChatLogprobToken, CompletionLogprobs, TopLogprob
from splash_jax.engine.request import RequestOutput
from splash_jax.engine.stop import stop_prefix_len
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
        raw = self._raw_bytes(token_id) if "\ufffd" in text else None
        if raw is None:
            return text, text.encode()
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def _raw_bytes(self, token_id: int) -> bytes | None:
        return self._tokenizer.token_bytes(token_id)


@dataclasses.dataclass
class ChoiceDelta:
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None

    @property
    def empty(self) -> bool:
        return not self.text and not self.token_ids and self.finish_reason is None


@dataclasses.dataclass
class ChoiceState:
    """What one choice has sent so far."""

    index: int
    stops: tuple[str, ...] = ()
    text_sent: int = 0
    tokens_sent: int = 0
    text_offset: int = 0  # completion logprobs: where the next token starts in the choice text
    finished: bool = False

    def advance(self, out: RequestOutput) -> ChoiceDelta:
        """The part of `out` (cumulative) not sent yet."""
        text = out.text
        visible = len(text) if out.finished else len(text) - stop_prefix_len(text, self.stops)
        delta_text = text[self.text_sent : visible] if visible > self.text_sent else ""
        self.text_sent = max(self.text_sent, visible)
        start, self.tokens_sent = self.tokens_sent, len(out.token_ids)
        self.finished = out.finished
        return ChoiceDelta(
            text=delta_text,
            token_ids=out.token_ids[start:],
            logprobs=out.logprobs[start:] if out.logprobs is not None else None,
            top_logprobs=out.top_logprobs[start:] if out.top_logprobs is not None else None,
            finish_reason=out.finish_reason if out.finished else None,
        )


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

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
    prompt_logprobs: list[float | None] | None = None  # on the first delta only (SamplingParams.prompt_logprobs)
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


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
            num_cached_tokens=out.num_cached_tokens, prompt_logprobs=out.prompt_logprobs,
            prompt_top_logprobs=out.prompt_top_logprobs,
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
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None

    def add(self, delta: ChoiceDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = delta.prompt_logprobs, delta.prompt_top_logprobs
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
            self.top_logprobs = (self.top_logprobs or []) + (delta.top_logprobs or [{}] * len(delta.logprobs))
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.num_cached_tokens = delta.num_cached_tokens  # every output carries the request's count

    def as_delta(self) -> ChoiceDelta:
        return ChoiceDelta(self.text, self.token_ids, self.logprobs, self.top_logprobs, self.finish_reason,
                           self.num_cached_tokens, self.prompt_logprobs, self.prompt_top_logprobs)


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


def echo_logprobs(state: ChoiceState, prompt_ids: list[int], delta: ChoiceDelta, token_text: TokenText) -> CompletionLogprobs:
    """The prompt's part of an echoed completion's logprobs (OpenAI's legacy format, as vLLM
    returns it): every prompt token, its logprob (None for the first) and its top-n."""
    out = CompletionLogprobs()
    lps = delta.prompt_logprobs or [None] * len(prompt_ids)
    tops = delta.prompt_top_logprobs or [None] * len(prompt_ids)
    for token, lp, top in zip(prompt_ids, lps, tops):
        text = token_text(token)
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.top_logprobs.append(None if top is None else {token_text(t): v for t, v in top.items()})
        out.text_offset.append(state.text_offset)
        state.text_offset += len(text)
    return out


def joined_logprobs(first: CompletionLogprobs | None, second: CompletionLogprobs | None) -> CompletionLogprobs | None:
    if first is None or second is None:
        return first or second
    return CompletionLogprobs(tokens=first.tokens + second.tokens, token_logprobs=first.token_logprobs + second.token_logprobs,
                              top_logprobs=first.top_logprobs + second.top_logprobs, text_offset=first.text_offset + second.text_offset)


def vllm_prompt_logprobs(prompt_ids: list[int], delta: ChoiceDelta, token_text: TokenText) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs` field: None, then per prompt token {id: {logprob, rank, decoded_token}}
    holding the token itself and its top-n (rank: 1-based place among the top-n; null for the
    prompt token when it is not among them, since only the top-n are ranked on the device)."""
    out: list[dict[str, dict] | None] = []
    lps = delta.prompt_logprobs or [None] * len(prompt_ids)
    tops = delta.prompt_top_logprobs or [None] * len(prompt_ids)
    for token, lp, top in zip(prompt_ids, lps, tops):
        if lp is None:
            out.append(None)
            continue
        ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])
        entry = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": token_text(t)} for r, (t, v) in enumerate(ranked)}
        if str(token) not in entry:
            entry = {str(token): {"logprob": lp, "rank": None, "decoded_token": token_text(token)}, **entry}
        out.append(entry)
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

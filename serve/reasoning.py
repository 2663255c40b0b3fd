"""Reasoning models' `<think> ... </think>` blocks, split out of the answer (`--reasoning-parser`).

DeepSeek-R1 opens the block in its chat template (or writes `<think>` itself) and closes it with
`</think>`; DeepSeek-V3.1 thinks only when the template is asked to (`chat_template_kwargs`
`{"thinking": true}`), and otherwise its template closes the block in the prompt. Both markers are
single tokens in their tokenizers, so the split follows token ids: the text before the token
`</think>` is reasoning, the text after it is the answer (`content`), and a stream cut inside the
block is all reasoning. One parser serves streams and whole responses (a whole response is one
`feed`), so both split the same text the same way.

The engine gets the end marker's id with the request (`SamplingParams.reasoning_end_token_id`):
a grammar (JSON schema, tool calls) applies from the token after it, and
`thinking_token_budget` forces it once the block is that long.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

PARSERS = ("none", "deepseek_r1", "deepseek_v3")
THINK, END_THINK = "<think>", "</think>"
THINKING_KWARGS = ("thinking", "enable_thinking")  # V3.1's switch, and Qwen3's / vLLM's common name


@dataclasses.dataclass(frozen=True)
class ReasoningMarkers:
    start_id: int
    end_id: int
    start_text: str = THINK
    end_text: str = END_THINK

    @classmethod
    def of(cls, tokenizer, parser: str) -> "ReasoningMarkers | None":
        """The markers of `tokenizer` for `parser` (None for "none"); ValueError if the parser is
        unknown or the tokenizer has no single-token markers (the parser cannot work without them)."""
        if parser not in PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got {parser!r}")
        if parser == "none":
            return None
        if tokenizer is None:
            raise ValueError(f"--reasoning-parser {parser} needs the model's tokenizer")
        ids = []
        for text in (THINK, END_THINK):
            found = tokenizer.encode(text)
            if len(found) != 1 or tokenizer.decode(found, skip_special_tokens=True) != text:
                raise ValueError(f"--reasoning-parser {parser}: this tokenizer has no single token {text!r} that decodes "
                                 f"to itself (it encodes to {found[:8]}); the parser splits on the marker tokens")
            ids.append(found[0])
        return cls(ids[0], ids[1])


def starts_in_reasoning(parser: str, template_kwargs: Mapping | None) -> bool:
    """Whether a chat answer begins inside the reasoning block: always for R1 (its template opens
    it); for V3.1 only in thinking mode (`chat_template_kwargs` thinking / enable_thinking)."""
    if parser == "deepseek_r1":
        return True
    if parser == "deepseek_v3":
        kwargs = template_kwargs or {}
        return any(bool(kwargs.get(k)) for k in THINKING_KWARGS)
    return False


@dataclasses.dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""
    reasoning_tokens: int = 0  # tokens of this delta inside the block (the markers not counted)


class ReasoningParser:
    """One choice's split, fed its deltas (text and the token ids that made it)."""

    def __init__(self, markers: ReasoningMarkers):
        self.markers = markers
        self.in_reasoning = True
        self.reasoning_tokens = 0
        self._at_start = True  # a leading <think> (R1 may write it itself) is dropped
        self._owed_end = False  # the end token came but its text was held back (a stop-string prefix)

    def feed(self, text: str, token_ids: Sequence[int]) -> ReasoningDelta:
        m = self.markers
        if not self.in_reasoning:
            if self._owed_end and text:
                self._owed_end = False
                if text.startswith(m.end_text):
                    text = text[len(m.end_text):]
            return ReasoningDelta(content=text)
        ids = list(token_ids)
        if self._at_start and ids:
            self._at_start = False
            if ids[0] == m.start_id:
                ids = ids[1:]
                if text.startswith(m.start_text):
                    text = text[len(m.start_text):]
        if m.end_id not in ids:
            n = len(ids)
            self.reasoning_tokens += n
            return ReasoningDelta(reasoning=text, reasoning_tokens=n)
        n = ids.index(m.end_id)
        self.reasoning_tokens += n
        self.in_reasoning = False
        cut = text.find(m.end_text)
        if cut < 0:  # its text is held back: it comes at the start of a later delta
            self._owed_end = True
            return ReasoningDelta(reasoning=text, reasoning_tokens=n)
        return ReasoningDelta(reasoning=text[:cut], content=text[cut + len(m.end_text):], reasoning_tokens=n)


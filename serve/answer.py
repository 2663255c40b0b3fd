"""One choice's generated output as the API shows it: reasoning (serve.reasoning) first, then the
answer's content and tool calls (serve.tool_parser), fed delta by delta.

Chat completions and the Responses API both use it, streamed or not (a whole output is one
`feed` with `finished=True`), so every route and both forms split the same tokens the same way.
"""

from __future__ import annotations

import dataclasses

from serve.reasoning import ReasoningMarkers, ReasoningParser
from serve.tool_parser import ParsedCall, ToolCallParser


@dataclasses.dataclass
class AnswerDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = dataclasses.field(default_factory=list)  # OpenAI's stream shape (index, id, function)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class AnswerParser:
    """reasoning: the markers when this output begins inside a reasoning block (None: it does not).
    parse_tools: search the content for tool calls; max_calls as ToolCallParser takes it."""

    def __init__(self, reasoning: ReasoningMarkers | None = None, parse_tools: bool = False, max_calls: int | None = None):
        self._reasoning = ReasoningParser(reasoning) if reasoning is not None else None
        self._tools = ToolCallParser(max_calls) if parse_tools else None

    @property
    def calls(self) -> list[ParsedCall]:
        return self._tools.calls if self._tools is not None else []

    @property
    def reasoning_tokens(self) -> int | None:
        """Tokens inside the reasoning block so far (the markers not counted); None without a parser."""
        return self._reasoning.reasoning_tokens if self._reasoning is not None else None

    @property
    def in_reasoning(self) -> bool:
        """Still inside the reasoning block (a cut-off output has no answer yet)."""
        return self._reasoning is not None and self._reasoning.in_reasoning

    def feed(self, text: str, token_ids, finished: bool = False) -> AnswerDelta:
        out = AnswerDelta()
        if self._reasoning is not None:
            split = self._reasoning.feed(text, token_ids)
            out.reasoning, text = split.reasoning, split.content
        if self._tools is None:
            out.content = text
            return out
        parsed = self._tools.feed(text)
        if finished:
            parsed = parsed.then(self._tools.finish())
        out.content, out.tool_calls = parsed.content, parsed.tool_calls
        return out

"""DeepSeek-V3 tool calls out of generated text, incrementally.

The model writes

    text <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

One state machine serves streams and whole responses: a whole response is one `feed` and a
`finish`, so a stream and a non-streamed response of the same text give the same calls and the
same content, wherever the stream's deltas were split. Text that may still become a marker is
held back until it is known; a call is announced once its header is complete (so a header that
goes wrong is returned as content, never half a call) and its arguments then stream as written.
Arguments are the model's text, not re-serialized: OpenAI's contract too (they may be invalid JSON).
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Callable

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
OUTPUTS_END = "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"
ARGS_OPEN = "```json\n"  # after "NAME\n"
FENCE = "```"

HEADER_PREFIX = "function" + SEP
MAX_NAME = 64  # OpenAI's limit on function names; a longer "name" is no header
_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,%d}" % MAX_NAME)
_NAME_SO_FAR = re.compile(r"[ \t\r]*[A-Za-z0-9_.:\-]{0,%d}[ \t\r]*" % MAX_NAME)
_WS = " \t\r\n"

_TEXT, _CALLS, _HEADER, _ARGS = "text", "calls", "header", "args"
_WAIT = object()  # a header not decidable yet: more text may complete it


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class ParserDelta:
    """What one feed adds: content text and tool-call deltas in OpenAI's stream shape."""

    content: str = ""
    tool_calls: list[dict] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def then(self, later: "ParserDelta") -> "ParserDelta":
        return ParserDelta(self.content + later.content, self.tool_calls + later.tool_calls)


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _held_suffix(s: str, marker: str) -> int:
    """Length of the longest suffix of s that is a proper prefix of marker (may become it)."""
    for n in range(min(len(s), len(marker) - 1), 0, -1):
        if marker.startswith(s[-n:]):
            return n
    return 0


def _back_over_ws(s: str, i: int) -> int:
    while i > 0 and s[i - 1] in _WS:
        i -= 1
    return i


def _args_end(s: str) -> tuple[int, int] | None:
    """Where the arguments end, `[ws] [```] [ws] <｜tool▁call▁end｜>`: (start, end) of that end, or None.
    Found from the marker backwards, so each feed is linear in the text however it is spaced."""
    j = s.find(CALL_END)
    if j < 0:
        return None
    i = _back_over_ws(s, j)
    if s.endswith(FENCE, 0, i):
        i = _back_over_ws(s, i - len(FENCE))
    return i, j + len(CALL_END)


def _args_end_so_far(s: str) -> int:
    """Where the tail that may still become the end of the arguments starts (len(s) if none):
    `[ws] [``` [ws]] [part of the marker]` or `[ws] ` or ``` (a fence cut off)."""
    i = len(s) - _held_suffix(s, CALL_END)
    a = _back_over_ws(s, i)
    start = _back_over_ws(s, a - len(FENCE)) if s.endswith(FENCE, 0, a) else a
    if i == len(s):  # no part of the marker: the text may end inside a fence
        ticks = len(s) - len(s.rstrip("`"))
        if ticks in (1, 2):
            start = min(start, _back_over_ws(s, len(s) - ticks))
    return start


def _header(s: str):
    """`function<｜tool▁sep｜>NAME\\n```json\\n`: (name, its length), _WAIT, or None (no header)."""
    i = _skip_ws(s, 0)
    rest = s[i:]
    if not rest.startswith(HEADER_PREFIX):
        return _WAIT if HEADER_PREFIX.startswith(rest) else None
    j = i + len(HEADER_PREFIX)
    nl = s.find("\n", j)
    if nl < 0:
        return _WAIT if _NAME_SO_FAR.fullmatch(s[j:]) else None
    name = s[j:nl].strip(" \t\r")
    if not _NAME.fullmatch(name):
        return None
    k = nl + 1
    while k < len(s) and s[k] in " \t":
        k += 1
    rest = s[k:]
    if rest.startswith(ARGS_OPEN):
        return name, k + len(ARGS_OPEN)
    return _WAIT if ARGS_OPEN.startswith(rest) else None


class ToolCallParser:
    """Feed text deltas, get content and tool-call deltas; `finish()` at the end of the output.

    max_calls: calls after this many are parsed and dropped (parallel_tool_calls false).
    """

    def __init__(self, max_calls: int | None = None, new_id: Callable[[], str] = new_call_id):
        self.max_calls = max_calls
        self.new_id = new_id
        self.calls: list[ParsedCall] = []  # the calls shown to the client
        self._num_parsed = 0  # calls parsed, dropped ones included
        self._state = _TEXT
        self._buf = ""  # text not yet decided
        self._pending = ""  # markers consumed since the last complete call: content again if what follows is no call
        self._out = ParserDelta()
        self._current: ParsedCall | None = None  # the call whose arguments are streaming (None: dropped)

    def feed(self, text: str) -> ParserDelta:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> ParserDelta:
        """The end of the output: held-back text is decided (a cut-off marker is content, a cut-off call stays)."""
        self._run(final=True)
        return self._take()

    def _take(self) -> ParserDelta:
        out, self._out = self._out, ParserDelta()
        return out

    def _run(self, final: bool) -> None:
        steps = {_TEXT: self._text, _CALLS: self._calls, _HEADER: self._header, _ARGS: self._args}
        while True:
            before = (self._state, len(self._buf))
            steps[self._state](final)
            if (self._state, len(self._buf)) == before:
                return

    # --- emitting ---------------------------------------------------------------------
    def _content(self, text: str) -> None:
        self._out.content += text

    def _arguments(self, text: str) -> None:
        if not text or self._current is None:
            return
        self._current.arguments += text
        index = len(self.calls) - 1
        last = self._out.tool_calls[-1] if self._out.tool_calls else None
        if last is not None and last["index"] == index and "id" not in last:  # one argument delta per call per feed
            last["function"]["arguments"] += text
        else:
            self._out.tool_calls.append({"index": index, "function": {"arguments": text}})

    def _no_call(self) -> None:
        """What was taken for the start of a call is not one: its markers become content again."""
        self._content(self._pending)
        self._pending = ""
        self._state = _TEXT

    # --- states -----------------------------------------------------------------------
    def _text(self, final: bool) -> None:
        i = self._buf.find(CALLS_BEGIN)
        if i >= 0:
            self._content(self._buf[:i])
            self._buf = self._buf[i + len(CALLS_BEGIN):]
            self._pending = CALLS_BEGIN
            self._state = _CALLS
            return
        keep = 0 if final else _held_suffix(self._buf, CALLS_BEGIN)
        self._content(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]

    def _calls(self, final: bool) -> None:
        """Between calls: the next call, the end of the calls, or (anything else) text again."""
        i = _skip_ws(self._buf, 0)
        rest = self._buf[i:]
        if rest.startswith(CALL_BEGIN):
            self._pending += self._buf[:i + len(CALL_BEGIN)]
            self._buf = rest[len(CALL_BEGIN):]
            self._state = _HEADER
        elif rest.startswith(CALLS_END):
            if self._pending:  # an empty block is no call: it stays text
                self._content(self._pending + self._buf[:i + len(CALLS_END)])
            self._buf = rest[len(CALLS_END):]
            self._pending = ""
            self._state = _TEXT
        elif not final and (CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest)):
            return  # undecided (rest may be empty)
        elif final and not rest:  # the output ended without the closing marker
            if self._pending:  # no call since the opening marker: all of it is content
                self._pending += self._buf
            self._buf = ""  # (else the whitespace after the last call is dropped)
            self._no_call()
        else:
            self._no_call()

    def _header(self, final: bool) -> None:
        found = _header(self._buf)
        if found is _WAIT and not final:
            return
        if found is None or found is _WAIT:
            self._no_call()
            return
        name, length = found
        self._buf = self._buf[length:]
        self._pending = ""
        self._state = _ARGS
        self._num_parsed += 1
        if self.max_calls is not None and self._num_parsed > self.max_calls:
            self._current = None
            return
        self._current = ParsedCall(self.new_id(), name)
        self.calls.append(self._current)
        self._out.tool_calls.append({"index": len(self.calls) - 1, "id": self._current.id, "type": "function",
                                     "function": {"name": name, "arguments": ""}})

    def _args(self, final: bool) -> None:
        end = _args_end(self._buf)
        if end is not None:
            self._arguments(self._buf[:end[0]])
            self._buf = self._buf[end[1]:]
            self._state = _CALLS
            return
        held = _args_end_so_far(self._buf)
        self._arguments(self._buf[:held])
        if final:  # the output ended inside the arguments: the call stays, cut off; a cut-off end is dropped
            self._buf = ""
            self._state = _TEXT
        else:
            self._buf = self._buf[held:]


def parse_tool_calls(
    text: str, max_calls: int | None = None, new_id: Callable[[], str] = new_call_id,
) -> tuple[str, list[ParsedCall]]:
    """A whole output: (content, calls), as a stream of the same text gives them."""
    parser = ToolCallParser(max_calls, new_id)
    content = parser.feed(text).content + parser.finish().content
    return content, parser.calls

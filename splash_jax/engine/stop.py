"""Stop strings over incrementally decoded text, in one place: `StopMatcher`.

An Aho-Corasick automaton over the stop strings. Its state after each character is the longest
tail of the text that is a prefix of some stop string, which is exactly the text that must be
held back (it could still become a stop string); everything before it is safe to show. Each
pushed character costs amortized O(1) however many or long the stop strings are, so one request
with many long stop strings cannot slow the step that serves everyone else.

Which stop wins: the first to COMPLETE in the text (ties: the longest, i.e. the one that starts
first). That choice does not depend on how the text was split into deltas, so a streamed and a
non-streamed request stop at the same place.

The automaton of a stop list is built once and cached (`compile_stops`), so the server can
build it while admitting a request, off the engine thread, and n choices share it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, eq=False)
class StopAutomaton:
    """Immutable Aho-Corasick automaton over characters (shared by every matcher of a stop list)."""

    stops: tuple[str, ...]
    children: tuple[dict[str, int], ...]  # node -> next char -> node (the trie)
    fail: tuple[int, ...]  # node -> longest proper suffix of its string that is also a trie node
    depth: tuple[int, ...]  # node -> length of its string
    match: tuple[int, ...]  # node -> longest stop string that is a suffix of its string (index), or -1

    def step(self, node: int, ch: str) -> int:
        children, fail = self.children, self.fail
        while node and ch not in children[node]:
            node = fail[node]
        return children[node].get(ch, 0)


@functools.lru_cache(maxsize=256)
def compile_stops(stops: tuple[str, ...]) -> StopAutomaton:
    """Build the automaton (O(total length of the stop strings)); cached per stop list."""
    children: list[dict[str, int]] = [{}]
    depth, terminal = [0], [-1]
    for i, stop in enumerate(stops):
        if not stop:
            raise ValueError("stop strings must be non-empty")
        node = 0
        for ch in stop:
            nxt = children[node].get(ch)
            if nxt is None:
                nxt = children[node][ch] = len(children)
                children.append({})
                depth.append(depth[node] + 1)
                terminal.append(-1)
            node = nxt
        if terminal[node] == -1:
            terminal[node] = i
    fail = [0] * len(children)
    match = list(terminal)
    queue = collections.deque(children[0].values())  # depth-1 nodes fail to the root
    while queue:  # breadth-first: a node's fail link is final before its children need it
        node = queue.popleft()
        if match[node] == -1:
            match[node] = match[fail[node]]  # a shorter stop ending here (the node's own is longer)
        for ch, child in children[node].items():
            f = fail[node]
            while f and ch not in children[f]:
                f = fail[f]
            fail[child] = children[f].get(ch, 0) if children[f].get(ch, 0) != child else 0
            queue.append(child)
    return StopAutomaton(tuple(stops), tuple(children), tuple(fail), tuple(depth), tuple(match))


class StopMatcher:
    """One request's stop-string state: feed decoded text, get the text that is safe to show."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._auto = compile_stops(tuple(stops)) if stops else None
        self._node = 0
        self._held = ""  # the text tail that could still become a stop string
        self.done = False
        self.matched: str | None = None

    def push(self, delta: str) -> tuple[str, str | None]:
        """Feed newly decoded text. Returns (text now safe to emit, matched stop string or None).
        Safe text never contains any part of a possible stop string; on a match it ends right
        before the stop string (the stop and anything after are dropped) and the matcher is done
        (later pushes return ("", None))."""
        if self.done:
            return "", None
        auto = self._auto
        if auto is None:
            return delta, None
        node, match, held = self._node, auto.match, self._held
        for i, ch in enumerate(delta):
            node = auto.step(node, ch)
            if match[node] >= 0:
                stop = auto.stops[match[node]]
                start = len(held) + i + 1 - len(stop)  # in held + delta; >= 0 since held covers any prefix
                safe = held[:start] if start <= len(held) else held + delta[: start - len(held)]
                self.done, self.matched, self._held = True, stop, ""
                return safe, stop
        self._node = node
        keep = auto.depth[node]
        if keep <= len(delta):
            safe, self._held = held + delta[: len(delta) - keep], delta[len(delta) - keep :]
        else:
            cut = len(held) + len(delta) - keep
            safe, self._held = held[:cut], held[cut:] + delta
        return safe, None

    def flush(self) -> str:
        """The request finished without a stop string: the held-back tail."""
        held, self._held, self.done = self._held, "", True
        return held

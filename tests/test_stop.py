"""StopMatcher against a brute-force reference: random texts, stop lists and delta splits."""

from __future__ import annotations

import random
import time

import pytest

from splash_jax.engine.stop import StopMatcher


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The first stop string to complete (ties: the longest); the text before it."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end - len(stop)], stop
    return text, None


def held_back(text: str, stops: list[str]) -> int:
    """The longest tail of `text` that is a prefix of a stop string (what may not be shown yet)."""
    return max((k for s in stops for k in range(1, min(len(s), len(text)) + 1) if text.endswith(s[:k])), default=0)


def _split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text), 8))))
    pieces, last = [], 0
    for c in [*cuts, len(text)]:
        pieces.append(text[last:c])
        last = c
    return pieces


@pytest.mark.parametrize("alphabet", ["ab", "abc", "aé😀"])
def test_matches_the_reference_on_random_inputs(alphabet):
    rng = random.Random(alphabet)
    for _ in range(1500):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        matcher, shown, seen, matched = StopMatcher(stops), "", "", None
        for piece in _split(rng, text):
            safe, hit = matcher.push(piece)
            shown += safe
            if matched is None:
                seen += piece
            if hit is not None:
                matched = hit
            elif matched is None:  # exactly everything but the possible stop prefix is out
                assert shown == seen[: len(seen) - held_back(seen, stops)], (stops, text)
            else:
                assert safe == ""  # done: later pushes give nothing
        if matched is None:
            shown += matcher.flush()
        assert (shown, matched) == reference(text, stops), (stops, text)


def test_examples():
    m = StopMatcher(["world"])
    assert m.push("hello wor") == ("hello ", None)
    assert m.push("ld and more") == ("", "world")
    assert m.push("x") == ("", None)
    m = StopMatcher(["abcd", "bc"])
    assert m.push("abcd") == ("a", "bc")  # "bc" completes first, whatever the split
    m = StopMatcher(["STOP"])
    assert m.push("Hello S") == ("Hello ", None) and m.push("un") == ("Sun", None) and m.flush() == ""
    m = StopMatcher(["ab"])
    assert m.push("a") == ("", None) and m.flush() == "a"
    assert StopMatcher([]).push("anything") == ("anything", None)


def test_cost_per_push_does_not_grow_with_stop_lengths():
    """50 stop strings of 8,000 characters (the issue's case): a push costs about what it costs
    with one short stop string."""
    rng = random.Random(0)
    long_stops = ["".join(rng.choice("ab") for _ in range(8000)) for _ in range(50)]
    text = "".join(rng.choice("ab") for _ in range(4000))

    def per_push(stops):
        matcher = StopMatcher(stops)
        t0 = time.perf_counter()
        for ch in text:
            matcher.push(ch)
        return (time.perf_counter() - t0) / len(text)

    per_push(long_stops)  # build (cached) outside the timing
    long, short = per_push(long_stops), per_push(["zz"])
    assert long < 20e-6 + 5 * short, (long, short)

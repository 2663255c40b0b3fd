"""Probe: the engine thread's time to index a prompt for n-gram drafts (prompt lookup), by length.

    python -m benchmarks.probes.ngram_index --tokens 1024,8192,32768

A request's first n-gram draft indexes its whole prompt (engine/speculative.NgramIndex: every
window of min_n..max_n tokens -> its latest start), on the engine thread between two steps, so
every running request's next token waits for it; agents send 16-32K-token prompts, and prompt
lookup is made for them. This times NgramIndex.extend, called until it has caught up (it takes
NgramIndex.TOKENS_PER_EXTEND tokens per call, one call per lookup: `extend_longest_call_ms` bounds
what one step waits), on a random prompt against the per-window Python loop that indexed the whole
prompt in one call before (`loop`, kept here only as the reference of this comparison), alternating
the two --repeats times, and checks both give the same index. Host-only: run it on the machine
whose host you care about. Prints a table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import logging
import time
from types import SimpleNamespace

import numpy as np

from benchmarks.common import table, write_results
from splash_jax.engine.speculative import NgramIndex

log = logging.getLogger("benchmarks.probes.ngram_index")


def loop_extend(index: NgramIndex, request) -> None:
    """The per-window loop NgramIndex.extend used before (one tuple slice and dict store each)."""
    known, size = request.num_known, len(index.seq)
    if known <= size:
        return
    index.seq += request.token_slice(size, known)
    seq = index.seq
    for end in range(size, known):
        for n in range(index.min_n, index.max_n + 1):
            if end - n >= 0:
                index.latest[tuple(seq[end - n : end])] = end - n


def chunked_extend(index: NgramIndex, request) -> float:
    """NgramIndex.extend until the index has caught up with the request: the longest call's ms (one
    call runs per lookup, so this bounds what one step waits for)."""
    longest = 0.0
    while True:
        t = time.perf_counter()
        index.extend(request)
        longest = max(longest, (time.perf_counter() - t) * 1e3)
        if not index.behind:
            return longest


def index_ms(tokens: int, vocab: int, min_n: int, max_n: int, repeats: int) -> dict:
    prompt = np.random.default_rng(tokens).integers(0, vocab, tokens).tolist()
    request = SimpleNamespace(num_known=tokens, token_slice=lambda a, b: prompt[a:b])
    times: dict[str, list[float]] = {"extend": [], "loop": []}
    longest: list[float] = []
    indexes = {}
    for _ in range(repeats):
        for name, fn in (("extend", chunked_extend), ("loop", loop_extend)):
            index = NgramIndex(min_n, max_n)
            t = time.perf_counter()
            out = fn(index, request)
            times[name].append((time.perf_counter() - t) * 1e3)
            if name == "extend":
                longest.append(out)
            indexes[name] = index.latest
    if indexes["extend"] != indexes["loop"]:
        raise AssertionError(f"the two indexes of a {tokens}-token prompt differ")
    best = {k: min(v) for k, v in times.items()}
    return {"tokens": tokens, "windows": len(indexes["extend"]), "calls": -(-tokens // NgramIndex.TOKENS_PER_EXTEND),
            "extend_ms": best["extend"], "extend_longest_call_ms": min(longest), "loop_ms": best["loop"],
            "loop_over_extend": best["loop"] / best["extend"], "extend_ms_all": times["extend"],
            "extend_longest_call_ms_all": longest, "loop_ms_all": times["loop"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1024,8192,32768")
    p.add_argument("--vocab", type=int, default=102400, help="token ids drawn uniformly below this")
    p.add_argument("--min-n", type=int, default=1)
    p.add_argument("--max-n", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5, help="alternating (extend, loop) pairs; the minimum of each is reported")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows = []
    for tokens in (int(x) for x in args.tokens.split(",")):
        rows.append(index_ms(tokens, args.vocab, args.min_n, args.max_n, args.repeats))
        log.info("%d tokens: extend %.2f ms, loop %.2f ms", tokens, rows[-1]["extend_ms"], rows[-1]["loop_ms"])
    print(table(rows, ["tokens", "windows", "calls", "extend_ms", "extend_longest_call_ms", "loop_ms", "loop_over_extend"]))
    write_results("ngram_index", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

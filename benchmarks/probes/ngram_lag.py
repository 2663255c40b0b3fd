"""Probe: what n-gram drafts lose to overlapped scheduling's one-step lag, rule by rule, replayed on
the bundled model's own greedy outputs.

    python -m benchmarks.probes.ngram_lag --workloads copy,fresh,repeat --batch 8 --max-tokens 256

With overlapped scheduling a verify chunk is drafted while the step before it is still on the
device: the host knows the request's tokens up to that step, the drafts the step verifies, but not
how many it keeps nor the token it samples after them (engine/spec_scheduling.py). So the drafts
must be guessed around that token. This generates each workload's outputs once (greedy,
speculation off, the engine as benchmarks/speculative.py runs it), then replays, per request, a
verify step after another at a fixed K with each drafting rule, and counts tokens per verify step
and the steps of the slowest request (a closed batch lasts as many):

  lag      a lookup of K + 1 after the known tokens; its first token guesses the unknown one and
           the next K are the drafts (the rule before 2026-12-07)
  relook   a lookup guesses the unknown token, a second lookup after it gives the K drafts
           (NgramDrafter.propose_after now)
  candN    drafts for up to N candidates of the unknown token (the tokens that followed the
           latest occurrences of the known suffix), the device picking the one it sampled: the
           sync drafts when the sampled token is a candidate, else lag's (not built; an upper
           bound of what a table of candidates would buy)
  sync     the lookup after the sampled token itself: what synchronous steps draft

Offline and exact for greedy decoding (the accepted count of a verify chunk is the drafts' common
prefix with the greedy output); no draft budget (every step drafts K), no timing. Prints a table
and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

from benchmarks.common import table, write_results
from benchmarks.speculative import prompts
from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.engine.speculative import NgramDrafter, ngram_draft

log = logging.getLogger("benchmarks.probes.ngram_lag")


class _Request:
    """What NgramDrafter reads of a request (weakly referenced, as the engine's are)."""

    def __init__(self, tokens: list[int], known: int):
        self.num_known, self.token_slice = known, lambda a, b: tokens[a:b]


def candidates(seq: list[int], count: int, min_n: int, max_n: int) -> list[int]:
    """Up to `count` distinct tokens that followed the latest occurrences of seq's suffixes,
    longest suffix (max_n - 1 tokens) first."""
    out: list[int] = []
    for n in range(min(max_n - 1, len(seq) - 1), min_n - 2, -1):
        suffix = seq[len(seq) - n :] if n else []
        for j in range(len(seq) - n - 1, -1, -1):
            if seq[j : j + n] == suffix and seq[j + n] not in out:
                out.append(seq[j + n])
                if len(out) == count:
                    return out
    return out


def drafts(rule: str, tokens: list[int], known: int, sampled: int, k: int, min_n: int, max_n: int) -> list[int]:
    """The K drafts `rule` gives the chunk after `known` tokens and one more, `sampled`, that the
    host does not know when it drafts."""
    head = tokens[:known]
    if rule == "relook":
        return NgramDrafter(min_n, max_n).propose_after(_Request(tokens, known), k, ())
    if rule == "sync" or rule.startswith("cand") and sampled in candidates(head, int(rule[4:]), min_n, max_n):
        return ngram_draft(np.array(head + [sampled]), k, min_n, max_n)
    return ngram_draft(np.array(head), k + 1, min_n, max_n)[1:]  # lag (and a candidate table's miss)


def replay(rule: str, prompt: list[int], output: list[int], k: int, min_n: int, max_n: int) -> int:
    """Verify steps for one request to output `output` with drafts by `rule` (the first step has none)."""
    tokens, p, chunk, steps = prompt + output, 0, [], 0
    while p < len(output):
        a = 0
        while a < len(chunk) and p + a < len(output) and output[p + a] == chunk[a]:
            a += 1
        q = p + a  # the token this step samples: output[q]
        steps += 1
        if q + 1 >= len(output):
            break
        chunk = drafts(rule, tokens, len(prompt) + q, output[q], k, min_n, max_n)
        p = q + 1
    return steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="copy,fresh,repeat")
    p.add_argument("--batch", type=int, default=8, help="requests per workload (a closed batch)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-chars", type=int, default=1200)
    p.add_argument("--k", type=int, default=3, help="drafts per verify step")
    p.add_argument("--rules", default="lag,relook,cand2,cand4,cand8,sync")
    p.add_argument("--min-n", type=int, default=1)
    p.add_argument("--max-n", type=int, default=4)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine(EngineConfig(max_num_seqs=max(8, args.batch), max_num_batched_tokens=256))
    rules = args.rules.split(",")
    rows = []
    for workload in args.workloads.split(","):
        texts = prompts(workload, args.batch, args.prompt_chars)
        outs = engine.generate(texts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
        prompt_ids = [engine.tokenizer.encode(t) for t in texts]
        outputs = [list(o.token_ids) for o in outs]
        total = sum(map(len, outputs))
        for rule in rules:
            steps = [replay(rule, pr, out, args.k, args.min_n, args.max_n) for pr, out in zip(prompt_ids, outputs)]
            rows.append({"workload": workload, "rule": rule, "tokens_per_step": total / sum(steps),
                         "slowest_steps": max(steps), "steps": steps})
            log.info("%s %s: %.2f tokens per verify step, slowest request %d steps", workload, rule,
                     rows[-1]["tokens_per_step"], max(steps))
    print(table(rows, ["workload", "rule", "tokens_per_step", "slowest_steps"]))
    write_results("ngram_lag", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

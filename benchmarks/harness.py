"""Benchmark helpers that put an engine into a chosen state quickly."""

from __future__ import annotations

import numpy as np

from splash_jax.engine import Engine, SamplingParams
from splash_jax.engine.request import Request


SAMPLING = {  # benchmark sampling modes: what a step's requests ask for (all ignore EOS)
    "greedy": {},
    "random": {"temperature": 1.0},  # a plain draw (RL rollouts)
    "top-p": {"temperature": 0.8, "top_p": 0.95},
    "top-k-top-p": {"temperature": 0.8, "top_k": 50, "top_p": 0.95},
    "logprobs": {"temperature": 0.8, "top_p": 0.95, "logprobs": 5},
}


def inject_decoding(engine: Engine, batch: int, context: int, tag: str = "bench", sampling: str = "greedy") -> list[Request]:
    """`batch` running requests whose first `context` tokens count as cached: the next step decodes.
    `sampling`: a key of SAMPLING (the requests' sampling parameters).

    Their pages are allocated as the layout places them, their contents are whatever the pool
    holds: the work of a decode step is the same as after a real prefill, without its cost.
    """
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(batch):
        prompt = rng.integers(0, engine.model_config.vocab_size, context + 1).tolist()
        r = engine.make_request(prompt, SamplingParams(max_tokens=1_000_000, ignore_eos=True, seed=i, **SAMPLING[sampling]), f"{tag}-{batch}-{context}-{i}")
        engine.add_request(r)
        if not engine.scheduler.admit_cached(r, context, reserve=64):
            clear(engine, reqs + [r])
            raise MemoryError(f"{batch} x {context} tokens do not fit the {engine.layout.name} pool")
        reqs.append(r)
    return reqs


def clear(engine: Engine, reqs: list[Request]) -> None:
    for r in reqs:
        engine.abort(r.request_id)

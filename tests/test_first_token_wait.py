"""A step in flight that samples a request's first token is read back before the next step is
dispatched (EngineCore._reads_first_tokens_now): the token leaves the engine one host dispatch
sooner, and every request's tokens are those of fully overlapped steps."""

import collections

import pytest

from splash_jax.engine import Engine, EngineConfig, SamplingParams

KW = dict(page_size=8, max_num_seqs=8, max_num_batched_tokens=32, max_pages=96, compile_cache_dir=None, warmup=False)
FIRST = "Latent attention caches one compressed vector per token, shared by all heads."
LATER = ["Serving engines batch requests continuously.", "x = 1"]


def run(limit: int, **kw):
    """Tokens by request, and for each later request whether a step was in flight when its first token came back."""
    engine = Engine(EngineConfig(first_token_wait_max_requests=limit, **KW, **kw))
    tokens, in_flight = collections.defaultdict(list), {}

    def step():
        for o in engine.step():
            if o.delta_token_ids and o.request_id not in tokens:
                in_flight[o.request_id] = engine.has_inflight()
            tokens[o.request_id] += o.delta_token_ids

    engine.add_request(FIRST, SamplingParams(max_tokens=24, ignore_eos=True), request_id="first")
    for _ in range(6):  # "first" decodes, overlapped
        step()
    for i, prompt in enumerate(LATER):
        engine.add_request(prompt, SamplingParams(max_tokens=10, ignore_eos=True), request_id=f"later{i}")
    while engine.has_work():
        step()
    return dict(tokens), {k: v for k, v in in_flight.items() if k.startswith("later")}


def test_first_tokens_come_back_before_the_next_dispatch_and_outputs_do_not_change():
    overlapped, overlapped_in_flight = run(0)
    waited, waited_in_flight = run(8)
    assert overlapped_in_flight and all(overlapped_in_flight.values()), "overlapped: the next step is already dispatched"
    assert waited_in_flight and not any(waited_in_flight.values()), "read before the next step was dispatched"
    assert waited == overlapped
    assert all(len(waited[f"later{i}"]) == 10 for i in range(len(LATER))) and len(waited["first"]) == 24


def test_a_batch_larger_than_the_limit_stays_overlapped():
    _, in_flight = run(1)  # "first" decodes beside them: two or more requests in the step
    assert in_flight and all(in_flight.values())


def test_the_limit_is_checked():
    with pytest.raises(ValueError, match="first-token-wait-max-requests"):
        EngineConfig(first_token_wait_max_requests=-1).validate()

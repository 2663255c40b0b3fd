"""Workloads with shared prefixes: the Mooncake reader reproduces a trace's sharing (equal hash
prefixes give equal token prefixes, different hash ids different tokens), the shipped synthetic
trace is its generator's output, multiturn histories extend exactly (served on a real engine:
turn k+1's prompt = turn k's prompt + its generated tokens + the next tool result), the ideal-cache
emulation admits exactly the page-aligned shared prefixes, and (once the engine has
set_prefix_caching) the engine's cache serves prompt tokens and never more than the ideal."""

import dataclasses
import json

import pytest

from benchmarks import workloads as W
from benchmarks.dynamic import rows_of, serve, summarize
from benchmarks.traces import make_mooncake
from splash_jax.engine import Engine, EngineConfig
from splash_jax.model import RuntimeOptions
from splash_jax.paths import DEFAULT_MODEL
from splash_jax.weights.loader import load_model

VOCAB, SEED, PAGE = 4096, 0, 8
needs_cache = pytest.mark.skipif(not hasattr(Engine, "set_prefix_caching"),
                                 reason="needs Engine.set_prefix_caching (the engine core's prefix cache, not landed)")


def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompt_of(a: W.Arrival, i: int = 0) -> list[int]:
    return W.build_prompt(a, i, VOCAB, SEED)


def test_mooncake_equal_hash_prefixes_give_equal_token_prefixes(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1300, "output_length": 40, "hash_ids": [0, 1, 2]},  # 512 + 512 + 276
        {"timestamp": 2500, "input_length": 1100, "output_length": 30, "hash_ids": [0, 1, 3]},
        {"timestamp": 1000, "input_length": 600, "output_length": 20, "hash_ids": [4, 5]},
        {"timestamp": 3000, "input_length": 1700, "output_length": 10, "hash_ids": [0, 1, 2, 6]},
    ]
    arr = W.read_mooncake(write_trace(tmp_path / "t.jsonl", rows), block_size=512)
    assert [a.t for a in arr] == [0.0, 1.0, 2.5, 3.0]  # ms -> s, sorted
    a, c, b, d = arr
    pa, pb, pc, pd = (prompt_of(x) for x in (a, b, c, d))
    assert [len(p) for p in (pa, pb, pc, pd)] == [1300, 1100, 600, 1700]
    assert [x.output_len for x in (a, b, c, d)] == [40, 30, 20, 10]
    assert pa[:1024] == pb[:1024]  # hash ids 0, 1 shared
    assert pa[1024:1100] != pb[1024:1100]  # third block: 2 vs 3
    assert pa[:512] != pc[:512]  # nothing shared
    assert pd[:1300] == pa  # A's partial block 2 is a prefix of D's full block 2
    assert all(2 <= t < VOCAB for t in pd)
    assert W.block_reuse(arr) == pytest.approx(make_mooncake.reuse(sorted(rows, key=lambda r: r["timestamp"])))


def test_mooncake_scaled_replay_keeps_the_sharing(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1300, "output_length": 64, "hash_ids": [0, 1, 2]},
            {"timestamp": 5, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]}]
    a, b = W.read_mooncake(write_trace(tmp_path / "t.jsonl", rows), block_size=512, tokens_per_block=16)
    assert a.blocks == ((0, 16), (1, 16), (2, round(276 * 16 / 512)))  # partial block scaled too
    assert (a.prompt_len, a.output_len, b.prompt_len, b.output_len) == (41, 2, 32, 1)  # outputs at least 1
    assert prompt_of(a)[:32] == prompt_of(b)


def test_mooncake_rows_whose_hash_ids_do_not_cover_their_length(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1200, "output_length": 4, "hash_ids": [0]},  # 688 tokens uncovered
            {"timestamp": 1, "input_length": 1200, "output_length": 4, "hash_ids": [0]},
            {"timestamp": 2, "input_length": 300, "output_length": 4, "hash_ids": [0, 7, 8]}]  # ids past the length
    a, b, c = W.read_mooncake(write_trace(tmp_path / "t.jsonl", rows), block_size=512)
    pa, pb, pc = prompt_of(a, 0), prompt_of(b, 1), prompt_of(c, 2)
    assert len(pa) == len(pb) == 1200 and len(a.blocks) == 2 and pa[:512] == pb[:512]
    assert pa[512:600] != pb[512:600]  # each row's uncovered tail is its own
    assert c.blocks == ((0, 300),) and pc == pa[:300]
    bad = write_trace(tmp_path / "bad.jsonl", [{"timestamp": 0, "input_length": 0, "output_length": 4, "hash_ids": []}])
    with pytest.raises(ValueError, match="lengths >= 1"):
        W.read_mooncake(bad)


def test_shipped_synthetic_trace_is_reproducible_and_reuses_blocks():
    rows = [json.loads(line) for line in open(W.TRACES / "mooncake_synthetic.jsonl")]
    assert rows == make_mooncake.generate()  # the generator's defaults, seeded
    assert rows != make_mooncake.generate(seed=1)
    for r in rows:  # Mooncake's shape: one hash id per started block, ids in order of first appearance
        assert len(r["hash_ids"]) == -(-r["input_length"] // 512)
    first = [h for r in rows for h in r["hash_ids"]]
    assert sorted(dict.fromkeys(first)) == list(dict.fromkeys(first))
    assert 0.3 < make_mooncake.reuse(rows) < 0.8
    arr = W.make("mooncake", dataclasses.replace(W.WorkloadConfig(), mooncake_tokens_per_block=0))
    assert len(arr) == len(rows) and [a.prompt_len for a in arr] == [r["input_length"] for r in rows]
    assert W.block_reuse(arr) == pytest.approx(make_mooncake.reuse(rows))


def test_multiturn_and_grouped_arrivals():
    c = dataclasses.replace(W.WorkloadConfig(), multiturn_conversations=3, multiturn_turns=4, multiturn_think_s=0.5)
    S, U, A = c.multiturn_system, c.multiturn_tool, c.multiturn_answer
    arr = W.make("multiturn", c)
    assert len(arr) == 12
    for i, a in enumerate(arr):
        conv, k = divmod(i, 4)
        assert (a.session, a.turn, a.output_len, a.temperature) == (conv, k, A, 0.0)
        assert a.prompt_len == S + (k + 1) * U + k * A
        assert a.follows == (i - 1 if k else -1) and a.t == (0.5 if k else 0.0)
    first = [prompt_of(a, i) for i, a in enumerate(arr) if a.turn == 0]
    assert all(p[:S] == first[0][:S] for p in first) and first[0][S:] != first[1][S:]
    with pytest.raises(ValueError, match="history"):
        W.build_prompt(arr[1], 1, VOCAB, SEED)
    g = W.make("grouped", W.WorkloadConfig())
    assert len(g) == W.WorkloadConfig().grouped_prompts * W.WorkloadConfig().grouped_samples
    ps = [prompt_of(a, i) for i, a in enumerate(g)]
    assert all(ps[i] == ps[i - 1] for i, a in enumerate(g) if a.turn) and ps[0] != ps[-1]
    assert all(a.temperature == 1.0 and a.t == 0 for a in g)
    assert len({W.sampling_seed(i, SEED) for i in range(len(g))}) == len(g)


def test_prefix_index():
    idx = W.PrefixIndex(4)
    idx.add(list(range(10)))  # pages [0..3], [4..7]; the partial [8, 9] is not a page
    assert idx.shared(list(range(10))) == 8
    assert idx.shared(list(range(9))) == 8 and idx.shared(list(range(8))) == 7  # below the last token
    assert idx.shared([0, 1, 2, 3, 9, 9, 9, 9, 9]) == 4 and idx.shared([1, 2, 3, 4, 5]) == 0
    assert idx.shared([7]) == 0


# --- on an engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    model = load_model(DEFAULT_MODEL, RuntimeOptions(dtype="float32", attention_impl="xla"))
    cfg = EngineConfig(page_size=PAGE, max_num_seqs=8, max_num_batched_tokens=32, max_pages=96, compile_cache_dir=None,
                       warmup=False)
    return Engine(cfg, model=model)


SMALL = dataclasses.replace(W.WorkloadConfig(), multiturn_conversations=2, multiturn_turns=3, multiturn_system=24,
                            multiturn_tool=8, multiturn_answer=4, grouped_prompts=2, grouped_samples=3,
                            grouped_prompt=20, grouped_output=4)


def test_multiturn_histories_extend_exactly(engine):
    arr = W.make("multiturn", SMALL)
    s = serve(engine, arr, SEED, "off")
    assert s.complete and all(r.finished is not None for r in s.records)
    for i, a in enumerate(arr):
        assert len(s.outputs[i]) == a.output_len and len(s.prompts[i]) == a.prompt_len
        if a.follows >= 0:
            prev = a.follows
            assert s.prompts[i] == s.prompts[prev] + s.outputs[prev] + W.own_ids(a, i, VOCAB, SEED)
            assert s.records[i].arrival >= s.records[prev].finished  # closed loop: after the answer
    assert [r.cached for r in s.records] == [0] * len(arr)
    assert engine.allocator.usage()[0].used_pages == 0


def test_ideal_cache_admits_the_page_aligned_shared_prefixes(engine):
    arr = W.make("multiturn", SMALL)
    off, ideal = serve(engine, arr, SEED, "off"), serve(engine, arr, SEED, "ideal")
    S = SMALL.multiturn_system
    for i, a in enumerate(arr):
        if a.follows >= 0:  # the previous turn's prompt + answer but its last token
            want = (len(ideal.prompts[a.follows]) + a.output_len - 1) // PAGE * PAGE
        else:
            want = 0 if a.session == 0 else S // PAGE * PAGE  # the first conversation computes the system prompt
        assert ideal.records[i].cached == want, i
        assert len(ideal.outputs[i]) == a.output_len
    s_off, s_ideal = summarize(off.records, off.samples, 0, []), summarize(ideal.records, ideal.samples, 0, [])
    assert s_off["prompt_tokens"] == s_ideal["prompt_tokens"] == sum(a.prompt_len for a in arr)
    assert s_off["computed_tokens"] == s_off["prompt_tokens"] and s_off["hit_rate"] == 0
    cached = sum(r.cached for r in ideal.records)
    assert s_ideal["computed_tokens"] == s_ideal["prompt_tokens"] - cached < s_off["computed_tokens"]
    rows = rows_of({"multiturn/off": {"tp": s_off | {"caching": "off"}},
                    "multiturn/ideal": {"tp": s_ideal | {"caching": "ideal"}}})
    assert [(r["workload"], r["caching"]) for r in rows] == [("multiturn", "off"), ("multiturn", "ideal")]

    g = W.make("grouped", SMALL)
    gi = serve(engine, g, SEED, "ideal")
    assert [r.cached for r in gi.records] == [0 if a.turn == 0 else (SMALL.grouped_prompt - 1) // PAGE * PAGE for a in g]
    assert all(len(o) == SMALL.grouped_output for o in gi.outputs)
    assert engine.allocator.usage()[0].used_pages == 0


@needs_cache
def test_engine_cache_serves_shared_prefixes_within_the_ideal(engine):
    for name in ("multiturn", "grouped"):
        arr = W.make(name, SMALL)
        on, ideal = serve(engine, arr, SEED, "on"), serve(engine, arr, SEED, "ideal")
        cached_on = [r.cached for r in on.records]
        assert all(len(o) == a.output_len for o, a in zip(on.outputs, arr))
        assert 0 < sum(cached_on) <= sum(r.cached for r in ideal.records), name
        assert all(c % PAGE == 0 and c < a.prompt_len for c, a in zip(cached_on, arr))
        if name == "multiturn":  # every later turn finds at least the system prompt's whole pages
            assert all(c >= SMALL.multiturn_system // PAGE * PAGE for c, a in zip(cached_on, arr) if a.turn > 0)
        assert on.prefix_cache is not None and on.prefix_cache["hits"] >= sum(cached_on)
        assert on.prefix_cache["queries"] >= sum(a.prompt_len for a in arr)
    engine.set_prefix_caching(False)  # drops every cached page
    assert engine.stats()["prefix_cache"]["cached_pages"] == 0 and engine.allocator.usage()[0].used_pages == 0

"""Start-up compiles: what is compiled and reported, one program set on one device, parallel compiles."""

from splash_jax.compile_guard import count_compiles
from splash_jax.engine import Engine, EngineConfig, SamplingParams

KW = dict(max_pages=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, page_size=16, compile_cache_dir=None)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_one_device_switching_compiles_one_layout_and_switches_without_compiling():
    fixed = Engine(EngineConfig(layout="tp", **KW))
    want = [o.token_ids for o in fixed.generate(PROMPTS, GREEDY)]
    steps = fixed.stats()["compile"]["by_kind"]["steps"]["programs"]

    engine = Engine(EngineConfig(layout="dp", enable_switching=True, compile_threads=2, **KW))
    stats = engine.stats()["compile"]
    assert stats["by_kind"]["steps"]["programs"] == steps  # tp's programs serve all four layouts
    samplers = fixed.stats()["compile"]["by_kind"]["samplers"]["programs"]
    assert samplers == 4 * len({b.requests for b in fixed.executor.buckets(fixed.layout)})  # every (rows, mode)
    assert stats["by_kind"]["samplers"]["programs"] == samplers
    assert stats["programs"] == steps + samplers + stats["by_kind"]["migration"]["programs"]
    assert stats["seconds"] > 0 and stats["cache_hits"] == 0
    with count_compiles() as compiles:
        for dst in ("dop", "cp", "tp"):
            for p in PROMPTS:
                engine.add_request(p, GREEDY)
            got = engine.step()
            handle = engine.switch_layout(dst)
            while engine.has_work():
                got += engine.step()
            assert handle.state.value == "done", handle.as_dict()
            final = {}
            for out in got:
                final.setdefault(out.request_id, []).extend(out.delta_token_ids)
            assert sorted(final.values()) == sorted(want), dst
    assert compiles.count == 0

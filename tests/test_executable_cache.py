"""An engine built again with the same configuration reuses the executables the first one compiled
(splash_jax/executable_cache.py): nothing reaches XLA's compiler, and its outputs are the first
engine's; a configuration whose programs differ compiles its own."""

from splash_jax import executable_cache
from splash_jax.engine import Engine, EngineConfig, SamplingParams

KW = dict(page_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_pages=32, compile_cache_dir=None, num_devices=2,
          warmup=False)  # each engine compiles what its steps use: the same programs for the same config
PROMPTS = ["Latent attention", "ok"]
PARAMS = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=0.9, seed=4, logprobs=1)]


def test_a_rebuilt_engine_compiles_nothing_and_generates_the_same():
    executable_cache.clear()
    first = Engine(EngineConfig(layout="dp", **KW))
    want = [(o.token_ids, o.logprobs) for o in first.generate(PROMPTS, PARAMS)]
    compiles = executable_cache.stats["compiles"]
    hits = executable_cache.stats["hits"]
    again = Engine(EngineConfig(layout="dp", **KW))
    assert [(o.token_ids, o.logprobs) for o in again.generate(PROMPTS, PARAMS)] == want
    assert executable_cache.stats["compiles"] == compiles, "the same programs compiled again"
    assert executable_cache.stats["hits"] - hits == again.executor.num_compiled > 0

    other = Engine(EngineConfig(layout="tp", **KW))  # different shardings: different programs
    assert [o.token_ids for o in other.generate(PROMPTS, PARAMS)][0] == want[0][0]  # greedy row: layout-independent
    assert executable_cache.stats["compiles"] - compiles == other.executor.num_compiled > 0

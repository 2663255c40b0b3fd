"""Prefill in the expanded form (attention/expanded.py) against the absorbed form and plain softmax:
the attention pieces, a chunk over a prefix split across pool segments and blocks, the tp and dp
layouts on 8 devices against the single-device model, and the engine's greedy outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from splash_jax.attention import expanded
from splash_jax.attention.paged_reference import paged_mla_attention
from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.engine.executor import layout_step
from splash_jax.engine.request import Request, SamplingParams as Params
from splash_jax.engine.sampler import SamplerWidths
from splash_jax.engine.scheduler import ScheduledChunk
from splash_jax.engine.step_packer import SlotSampling, StepShape, host_step_input, pack_step
from splash_jax.kv.allocator import PageAllocator
from splash_jax.kv.page_table import PageTables
from splash_jax.kv.placement import OWNER
from splash_jax.mesh.layouts import POOL_SPEC, get_layout, make_mesh, param_sharding_fn
from splash_jax.model import RuntimeOptions
from splash_jax.paths import DEFAULT_MODEL
from splash_jax.weights.loader import load_model


def softmax_reference(q, k, v, q_len, kv_len, causal, scale):
    """float64 numpy: rows < q_len over keys < kv_len (and j <= i when causal)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = np.einsum("thd,shd->hts", q, k) * scale
    t, n = np.arange(q.shape[0])[:, None], np.arange(k.shape[0])[None, :]
    visible = (n < kv_len) & (t < q_len) & ((n <= t) if causal else True)
    s = np.where(visible[None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.where(visible[None], np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    l = p.sum(-1)
    out = np.einsum("hts,shd->thd", p, v) / np.where(l > 0, l, 1).T[..., None]
    return out, np.where(l > 0, np.log(np.where(l > 0, l, 1)) + np.where(np.isfinite(m[..., 0]), m[..., 0], 0), -np.inf).T


@pytest.mark.parametrize("causal", [False, True])
def test_attend_matches_softmax_with_padding_and_causal_masks(causal):
    rng = np.random.default_rng(0)
    t, s, h = 12, 12 if causal else 20, 3
    q, k, v = rng.normal(size=(t, h, 24)), rng.normal(size=(s, h, 24)), rng.normal(size=(s, h, 16))
    q_len, kv_len = 9, (9 if causal else 13)
    out, lse = expanded.attend(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
                               jnp.int32(q_len), jnp.int32(kv_len), causal, 0.2, "xla")
    want_out, want_lse = softmax_reference(q, k, v, q_len, kv_len, causal, 0.2)
    np.testing.assert_allclose(np.asarray(out)[:q_len], want_out[:q_len], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse)[:q_len], want_lse[:q_len], rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[q_len:] == 0) and np.all(np.isneginf(np.asarray(lse)[q_len:]))


def test_merge_of_two_key_sets_equals_attention_over_both():
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(5, 2, 8)), rng.normal(size=(11, 2, 8)), rng.normal(size=(11, 2, 4))
    f = lambda a: jnp.asarray(a, jnp.float32)
    o1, l1 = expanded.attend(f(q), f(k[:4]), f(v[:4]), 5, 4, False, 0.3, "xla")
    o2, l2 = expanded.attend(f(q), f(k[4:]), f(v[4:]), 5, 7, False, 0.3, "xla")
    out, lse = expanded.merge(o1, l1, o2, l2)
    want, want_lse = softmax_reference(q, k, v, 5, 11, False, 0.3)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)


def test_chunk_over_a_prefix_in_two_segments_and_several_blocks_equals_the_absorbed_form():
    """A 7-token chunk after a 45-token prefix whose pages are split over two pool segments (in
    compact order, as a head-sharded layout's base and extra segments hold them), the prefix read
    in blocks of 2 pages: per-head values equal the absorbed reference with per-token kv_lens."""
    rng = np.random.default_rng(2)
    H, L, R, Dn, Dv, S, scale = 4, 32, 8, 16, 12, 4, 0.25
    prefix, chunk, T = 45, 7, 12
    total = prefix + chunk
    pages = -(-total // S)
    seg_of_page = rng.integers(0, 2, pages)  # which segment holds each page
    pools, rows, local = [], [], {}
    for g in range(2):
        mine = np.flatnonzero(seg_of_page == g)
        ids = rng.permutation(20)[: len(mine)]  # scattered page ids in a 20-page pool
        for i, page in enumerate(mine):
            local[page] = (g, i, ids[i])
        rows.append(np.concatenate([ids, np.zeros(16 - len(ids), np.int64)]).astype(np.int32))
        pools.append([np.zeros((20, S, L), np.float32), np.zeros((20, S, R), np.float32)])
    lat, kr = rng.normal(size=(total, L)).astype(np.float32), rng.normal(size=(total, R)).astype(np.float32)
    for pos in range(total):  # every key is in the pool (the chunk's were written this step)
        g, _, pid = local[pos // S]
        pools[g][0][pid, pos % S], pools[g][1][pid, pos % S] = lat[pos], kr[pos]
    w_uk, w_uv = rng.normal(size=(L, H, Dn)).astype(np.float32), rng.normal(size=(L, H, Dv)).astype(np.float32)
    q_nope, q_pe = rng.normal(size=(T, H, Dn)).astype(np.float32), rng.normal(size=(T, H, R)).astype(np.float32)

    # Per segment: compact slots of the prefix (positions < prefix held there, in position order).
    def compact_len(g, pos_end):
        return sum(min(S, max(0, pos_end - p * S)) for p in range(pages) if seg_of_page[p] == g)

    prefix_lens = [jnp.int32(compact_len(g, prefix)) for g in range(2)]
    own = lambda a: jnp.asarray(np.pad(a[prefix:], ((0, prefix + T - total), (0, 0))))  # the chunk's rows, padded to T
    got = expanded.chunk_attention(
        jnp.asarray(q_nope), jnp.asarray(q_pe), own(lat), own(kr), [tuple(map(jnp.asarray, p)) for p in pools],
        [jnp.asarray(r) for r in rows], prefix_lens, jnp.int32(chunk), jnp.asarray(w_uk), jnp.asarray(w_uv), scale, "xla",
        block_tokens=2 * S,
    )
    # The absorbed form, token by token, each segment with its own compact kv_len, merged.
    q_lat = np.einsum("thn,lhn->thl", q_nope, w_uk)
    outs, lses = [], []
    for g in range(2):
        kv_lens = np.array([compact_len(g, prefix + i + 1) for i in range(chunk)] + [0] * (T - chunk), np.int32)
        o, l = paged_mla_attention(jnp.asarray(q_lat), jnp.asarray(q_pe), jnp.asarray(pools[g][0]), jnp.asarray(pools[g][1]),
                                   jnp.asarray(np.tile(rows[g], (T, 1))), jnp.asarray(kv_lens), scale)
        outs.append(np.asarray(o, np.float64)), lses.append(np.asarray(l, np.float64))
    lse = np.logaddexp(lses[0], lses[1])[:chunk]
    o_lat = sum(o[:chunk] * np.exp(l[:chunk] - lse)[..., None] for o, l in zip(outs, lses))
    want = np.einsum("thl,lhv->thv", o_lat, w_uv)
    np.testing.assert_allclose(np.asarray(got)[:chunk], want, rtol=1e-4, atol=1e-4)
    assert np.all(np.asarray(got)[chunk:] == 0)


# --- layouts on 8 devices against the single-device model -------------------------------------

OPTS = RuntimeOptions(dtype="float32", attention_impl="xla")
N, S, M = 8, 8, 8
rng = np.random.default_rng(0)
PROMPTS = {"a": rng.integers(0, 1024, 30).tolist(), "b": rng.integers(0, 1024, 23).tolist(), "c": rng.integers(0, 1024, 6).tolist()}
OWNERS = {"a": 0, "b": 3, "c": 0}
# Chunks after a prefix are the longest of their step (each device's span in dp, the step's in tp).
STEPS = [
    [("a", 0, 10), ("b", 0, 5)],
    [("a", 10, 17), ("b", 5, 2), ("c", 0, 3)],
    [("a", 27, 3), ("b", 7, 9), ("c", 3, 1)],
    [("a", 30, 1), ("b", 16, 1), ("c", 4, 1)],
]
WIDTHS = SamplerWidths(1, 1)


def packed(n, layout, alloc, segments, expanded_form):
    tables = PageTables(n, len(PROMPTS), M)
    slots = {r: i for i, r in enumerate(PROMPTS)}
    requests = {r: Request(r, PROMPTS[r], Params(), slot=slots[r], owner=OWNERS[r] % n,
                           device_pages=[[] for _ in range(n)]) for r in PROMPTS}
    shape = StepShape(32, 32, n, segments, M, layout.owner_rows, WIDTHS, expanded_form)  # a logits row per token
    for spec in STEPS:
        chunks = []
        for r, s, k in spec:
            req = requests[r]
            for d, count in enumerate(layout.kv_placement.pages_needed(n, req.owner, req.device_pages, s + k, S)):
                pages = alloc.allocate(count, d)
                req.device_pages[d] += pages
                tables.append(req.slot, d, pages, layout.kv_placement, alloc)
            chunks.append(ScheduledChunk(req, s, k, False))
        step = pack_step(shape, chunks, tables, SlotSampling(len(PROMPTS), WIDTHS, ()), S, all_logits=True, span_min_tokens=2)
        yield sum(k for _, _, k in spec), host_step_input(shape, step)


def run_layout(name, expanded_form):
    layout = get_layout("tp" if name == "single" else name)
    mesh = make_mesh(1 if name == "single" else N)
    n = mesh.devices.size
    model = load_model(DEFAULT_MODEL, OPTS, sharding_for=param_sharding_fn(layout, mesh))
    base, extra = (3, 13) if layout.heads_sharded and n > 1 else (16, 0)  # tp: requests spill into the extra segment
    kv = model.new_cache(n * base, S, NamedSharding(mesh, POOL_SPEC), extra_pages=n * extra)
    graphdef, state = nnx.split(model)
    forward = jax.jit(layout_step(graphdef, state, kv, mesh, layout, "xla"))
    alloc = PageAllocator(n, base, S, extra)
    out = []
    for num, batch in packed(n, layout, alloc, 2 if extra else 1, expanded_form):
        logits, kv = forward(state, kv, jax.tree.map(jnp.asarray, batch))
        out.append(np.asarray(logits[:num]))
    if extra:
        assert alloc.extra_pages_in_use() > 0
    return out


@pytest.fixture(scope="module")
def absorbed_single():
    return run_layout("single", False)


@pytest.mark.parametrize("name", ["tp", "dp", "single"])
def test_expanded_prefill_logits_equal_the_absorbed_single_device_model(name, absorbed_single):
    """Every token's logits (all_logits) through 4 steps of chunked prefill and decode."""
    for step, (got, want) in enumerate(zip(run_layout(name, True), absorbed_single)):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-4, f"{name} step {step}: max relative error {err:.2e}"


def test_dop_and_cp_refuse_a_prefill_span():
    from splash_jax.attention.layouts import ShardedContext
    from splash_jax.kv.cache import StepInput

    batch = StepInput(*[None] * 8, prefill_span=jnp.zeros(2, jnp.int32))
    for name in ("dop", "cp"):
        assert not get_layout(name).expanded_prefill
        with pytest.raises(ValueError, match="expanded form"):
            ShardedContext(get_layout(name), N, "xla").attention(None, None, None, None, batch)
    assert get_layout("tp").expanded_prefill and get_layout("dp").expanded_prefill


def test_engine_greedy_outputs_with_expanded_prefill_equal_absorbed_and_compile_nothing_after_warmup():
    prompts = ["Latent attention " * 6, "One shared latent per token means the cache can live anywhere. " * 3, "ok"]
    params = SamplingParams(max_tokens=6)
    kw = dict(page_size=8, max_num_seqs=8, max_num_batched_tokens=32, max_pages=32, compile_cache_dir=None)
    absorbed = [o.token_ids for o in Engine(EngineConfig(warmup=False, **kw)).generate(prompts, params)]
    engine = Engine(EngineConfig(layout="tp", num_devices=2, prefill_attention="expanded", expanded_prefill_min_tokens=16,
                                 min_token_bucket=32, **kw))  # one bucket: 2 programs + 2 expanded ones
    compiled = engine.executor.num_compiled
    assert any(key[4] for key in engine.executor._compiled), "warm-up compiled no expanded program"
    assert [o.token_ids for o in engine.generate(prompts, params)] == absorbed
    assert engine.executor.num_compiled == compiled  # dp's expanded logits: test_expanded_prefill_logits_...[dp]


def test_which_chunks_are_worth_expanding():
    w = lambda tokens, context: bool(expanded.worth_expanding(tokens, context, 1024))  # noqa: E731
    assert not w(512, 512) and w(1024, 1024)  # one-chunk prompts: the measured crossover
    assert w(256, 4096) and w(512, 16384)  # short chunks after a long prefix
    assert not w(255, 100_000)  # fewer than N/4 tokens: never
    assert not bool(expanded.worth_expanding(4096, 4096, 0))  # 0 disables
    np.testing.assert_array_equal(expanded.worth_expanding(np.array([512, 1024, 300]), np.array([512, 1024, 4000]), 1024),
                                  [False, True, True])


def test_prefill_attention_flag_is_checked_and_auto_expands_on_gpus_only():
    assert EngineConfig().resolved_expanded_min_tokens("gpu") == 1024
    assert EngineConfig().resolved_expanded_min_tokens("cpu") == 0
    assert EngineConfig(prefill_attention="absorbed").resolved_expanded_min_tokens("gpu") == 0
    assert EngineConfig(prefill_attention="expanded", expanded_prefill_min_tokens=64).resolved_expanded_min_tokens("cpu") == 64
    with pytest.raises(ValueError, match="prefill-attention"):
        EngineConfig(prefill_attention="mha").resolved_expanded_min_tokens("gpu")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_cudnn_chunk_attention_equals_xla_on_gpu():
    """bf16 on a GPU: the cuDNN path (log-sum-exp layout and base) against the XLA path."""
    rng = np.random.default_rng(3)
    H, L, R, S, T = 16, 512, 64, 64, 512
    prefix, chunk = 3000, 400
    pages = -(-(prefix + chunk) // S)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    pools = [(f(pages + 3, S, L), f(pages + 3, S, R))]
    rows = [jnp.asarray(rng.permutation(pages + 3)[:pages], jnp.int32)]
    args = (f(T, H, 128), f(T, H, R), f(T, L), f(T, R), pools, rows, [jnp.int32(prefix)], jnp.int32(chunk),
            f(L, H, 128) * 0.05, f(L, H, 128) * 0.05, 0.07)
    got = jax.jit(lambda *a: expanded.chunk_attention(*a, "cudnn", block_tokens=1024), static_argnums=10)(*args)
    want = jax.jit(lambda *a: expanded.chunk_attention(*a, "xla", block_tokens=1024), static_argnums=10)(*args)
    err = float(jnp.max(jnp.abs(got[:chunk] - want[:chunk])) / jnp.max(jnp.abs(want[:chunk])))
    assert err < 2e-2, err


def test_expanded_programs_get_command_buffer_options_on_gpus_and_fall_back_if_refused():
    from splash_jax.engine.executor import EXPANDED_GPU_OPTIONS, StepExecutor, step_compiler_options

    assert "WHILE" in step_compiler_options("gpu", True, expanded=True)["xla_gpu_enable_command_buffer"]
    assert "xla_gpu_enable_command_buffer" not in step_compiler_options("gpu", True)
    assert step_compiler_options("cpu", True, expanded=True) == {}

    class Lowered:  # an XLA that does not know the option's values
        def as_text(self):  # executable_cache's key
            return "module @refused_options_test"

        def compile(self, compiler_options=None):
            if compiler_options and "xla_gpu_enable_command_buffer" in compiler_options:
                raise RuntimeError("While setting option xla_gpu_enable_command_buffer, 'WHILE' is not a valid enum value.")
            return ("compiled", compiler_options)

    ex = StepExecutor.__new__(StepExecutor)
    ex.device_key = ()
    ex.compiler_options = {(False, False): {}, (True, False): dict(EXPANDED_GPU_OPTIONS, other=1)}
    assert ex._compile(Lowered(), expanded=True) == ("compiled", {"other": 1})
    assert ex.compiler_options[(True, False)] == {"other": 1}  # later compiles skip the refused option


def test_gpu_steps_get_concurrent_graph_scheduling_unless_asked_for_xlas():
    from splash_jax.engine.executor import CONCURRENT_GRAPH_OPTIONS, OPTIONAL_OPTIONS, step_compiler_options

    for expanded_ in (False, True):
        options = step_compiler_options("gpu", True, expanded_)
        assert all(options[k] == v for k, v in CONCURRENT_GRAPH_OPTIONS.items())
        assert not set(CONCURRENT_GRAPH_OPTIONS) & set(step_compiler_options("gpu", True, expanded_, "xla"))
    assert step_compiler_options("cpu", False) == {}
    assert set(CONCURRENT_GRAPH_OPTIONS) <= set(OPTIONAL_OPTIONS)  # an XLA without them still compiles
    with pytest.raises(ValueError, match="graph-scheduling"):
        step_compiler_options("gpu", True, graph_scheduling="parallel")
    with pytest.raises(ValueError, match="graph-scheduling"):
        EngineConfig(graph_scheduling="parallel").validate()


def test_an_expanded_program_that_does_not_build_leaves_its_bucket_absorbed(monkeypatch):
    """A cuDNN that refuses the shapes (here: chunk_attention raising while the program is traced)
    costs the expanded form, not the engine: start-up succeeds, outputs equal the absorbed form."""
    def refuse(*args, **kwargs):
        raise NotImplementedError("cuDNN refuses these shapes")

    monkeypatch.setattr(expanded, "chunk_attention", refuse)
    kw = dict(page_size=8, max_num_seqs=8, max_num_batched_tokens=32, max_pages=32, compile_cache_dir=None)
    prompts, params = ["Latent attention " * 6, "ok"], SamplingParams(max_tokens=4)
    want = [o.token_ids for o in Engine(EngineConfig(warmup=False, **kw)).generate(prompts, params)]
    engine = Engine(EngineConfig(prefill_attention="expanded", expanded_prefill_min_tokens=16, min_token_bucket=32, **kw))
    assert not any(key[4] for key in engine.executor._compiled)
    assert not any(engine.executor.expands(engine.layout, b) for b in engine.executor.buckets(engine.layout))
    assert [o.token_ids for o in engine.generate(prompts, params)] == want


def test_small_scanned_gpu_steps_get_xlas_unrolled_layer_loop():
    """Buckets of at most unroll_max_tokens slots compile with XLA's full loop unroll (one CUDA graph
    per step); bigger ones, CPU and unscanned programs keep their options."""
    from splash_jax.engine.executor import OPTIONAL_OPTIONS, UNROLLED_GPU_OPTIONS, Bucket, StepExecutor, step_compiler_options

    unrolled = step_compiler_options("gpu", True, unrolled=True)
    assert all(unrolled[k] == v for k, v in UNROLLED_GPU_OPTIONS.items())
    assert not set(UNROLLED_GPU_OPTIONS) & set(step_compiler_options("gpu", True))
    assert not set(UNROLLED_GPU_OPTIONS) & set(step_compiler_options("gpu", False, unrolled=True))  # nothing to unroll
    assert step_compiler_options("cpu", True, unrolled=True) == {}
    assert set(UNROLLED_GPU_OPTIONS) <= set(OPTIONAL_OPTIONS)  # an XLA without it still compiles

    ex = StepExecutor.__new__(StepExecutor)
    ex.unroll_max_tokens, ex.fused_max_tokens = 8, 8
    assert [ex.unrolled(Bucket(requests=r, tokens=t)) for r, t in ((1, 8), (8, 8), (8, 16))] == [True, True, False]
    # programs that hand their logits to a sampler program keep the loop above the fused buckets
    ex.unroll_max_tokens = 64
    sizes = (8, 16, 64, 128)
    assert [ex.unrolled(Bucket(requests=t, tokens=t)) for t in sizes] == [True, True, True, False]
    assert [ex.unrolled(Bucket(requests=t, tokens=t), logits=True) for t in sizes] == [True, False, False, False]
    with pytest.raises(ValueError, match="unroll-max-tokens"):
        EngineConfig(unroll_max_tokens=-1).validate()

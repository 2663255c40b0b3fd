"""Prefill in the expanded form (attention/expanded.py) against the absorbed form and plain softmax:
the attention pieces, a chunk over a prefix split across pool segments and blocks, several chunks
of one step against one chunk at a time, the tp and dp layouts on 8 devices (several expanded
chunks per device, or one) against the single-device model, and the engine's greedy outputs."""

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


def test_several_spans_in_one_step_equal_one_chunk_at_a_time():
    """Three chunks (after prefixes of 13, 0 and 6 tokens, one in 2-page blocks) among a step's 32
    slots, longest first plus an unused row: spans_attention equals chunk_attention per chunk and
    leaves every other slot zero; a span longer than its row's capacity is cut there."""
    rng = np.random.default_rng(5)
    H, L, R, Dn, Dv, S, T, scale = 2, 16, 4, 8, 6, 4, 32, 0.3
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    pools = [(f(40, S, L), f(40, S, R))]
    page_ids = rng.permutation(40)[:24].reshape(3, 8).astype(np.int32)  # each chunk's request: 8 pages
    q_nope, q_pe, lat, kr, w_uk, w_uv = f(T, H, Dn), f(T, H, R), f(T, L), f(T, R), f(L, H, Dn), f(L, H, Dv)
    chunks = [(16, 12, 6, 2), (0, 9, 13, 0), (9, 5, 0, 1)]  # (first slot, length, prefix, request): slots 14, 15, 28.. absorbed
    spans = jnp.asarray([(a, n) for a, n, _, _ in chunks] + [(0, 0)], jnp.int32)
    rows = [jnp.asarray(page_ids[[r for *_, r in chunks] + [0]])]
    prefix = [jnp.asarray([p for _, _, p, _ in chunks] + [0], jnp.int32)]
    got = np.asarray(expanded.spans_attention(q_nope, q_pe, lat, kr, pools, rows, prefix, spans, w_uk, w_uv, scale, "xla",
                                              block_tokens=2 * S))
    seen = np.zeros(T, bool)
    for a, n, p, r in chunks:
        pad = lambda x, a=a, n=n: jnp.pad(x[a : a + n], [(0, T - n)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
        want = expanded.chunk_attention(pad(q_nope), pad(q_pe), pad(lat), pad(kr), pools, [jnp.asarray(page_ids[r])],
                                        [jnp.int32(p)], jnp.int32(n), w_uk, w_uv, scale, "xla", block_tokens=2 * S)
        np.testing.assert_allclose(got[a : a + n], np.asarray(want)[:n], rtol=1e-5, atol=1e-5)
        seen[a : a + n] = True
    assert np.all(got[~seen] == 0)
    assert expanded.span_capacities(T, 4) == (32, 16, 16, 8)
    index = np.asarray(expanded.span_index(jnp.asarray([(0, 9), (9, 20), (0, 0), (0, 0)], jnp.int32), T))
    np.testing.assert_array_equal(index, list(range(9)) + list(range(32, 48)) + [-1] * 7)  # row 1 holds 16


def test_packer_expands_each_devices_chunks_with_most_pairs_longest_first():
    from splash_jax.engine.step_packer import prefill_spans

    lengths, starts = np.array([6, 30, 8, 12, 1, 9]), np.array([0, 0, 500, 0, 40, 0])
    lslot, owners = np.array([0, 6, 36, 44, 56, 57]), np.array([0, 0, 0, 0, 0, 1])
    # min 8: chunks of >= 2 tokens with tokens * context >= 64; pairs 36 (no), 900, 4064, 144, 41 (no), 81
    got = prefill_spans(2, lengths, starts, lslot, owners, 8, spans=2, tokens=64)
    np.testing.assert_array_equal(got[0], [(6, 30), (36, 8)])  # the two with most pairs, longest first
    np.testing.assert_array_equal(got[1], [(57, 9), (0, 0)])
    got = prefill_spans(2, lengths, starts, lslot, None, 8, spans=4, tokens=66)  # tp: every device sees every chunk
    for d in range(2):
        np.testing.assert_array_equal(got[d], [(6, 30), (44, 12), (57, 9), (36, 8)])
    with pytest.raises(ValueError, match="overlap"):  # 30 + 30 tokens cannot be disjoint in 40 slots
        prefill_spans(1, np.array([30, 30]), np.array([0, 0]), np.array([0, 5]), None, 8, spans=2, tokens=40)


# --- layouts on 8 devices against the single-device model -------------------------------------

OPTS = RuntimeOptions(dtype="float32", attention_impl="xla")
N, S, M = 8, 8, 8
rng = np.random.default_rng(0)
PROMPTS = {"a": rng.integers(0, 1024, 30).tolist(), "b": rng.integers(0, 1024, 23).tolist(),
           "c": rng.integers(0, 1024, 6).tolist(), "d": rng.integers(0, 1024, 14).tolist()}
OWNERS = {"a": 0, "b": 0, "c": 0, "d": 3}
# With span_min_tokens=2 every chunk is worth expanding: step 2 has 4 in tp and 3 on dp's device 0,
# most after a prefix (with one span, the one with the most query-key pairs per device expands).
STEPS = [
    [("a", 0, 10), ("b", 0, 5), ("d", 0, 8)],
    [("a", 10, 17), ("b", 5, 2), ("c", 0, 3), ("d", 8, 4)],
    [("a", 27, 3), ("b", 7, 9), ("c", 3, 1), ("d", 12, 2)],
    [("a", 30, 1), ("b", 16, 1), ("c", 4, 1), ("d", 14, 1)],
]
WIDTHS = SamplerWidths(1, 1)


def packed(n, layout, alloc, segments, expanded_form, spans=expanded.DEFAULT_SPANS):
    tables = PageTables(n, len(PROMPTS), M)
    slots = {r: i for i, r in enumerate(PROMPTS)}
    requests = {r: Request(r, PROMPTS[r], Params(), slot=slots[r], owner=OWNERS[r] % n,
                           device_pages=[[] for _ in range(n)]) for r in PROMPTS}
    shape = StepShape(32, 32, n, segments, M, layout.owner_rows, WIDTHS, expanded_form, spans)  # a logits row per token
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
        batch = host_step_input(shape, step)
        if expanded_form and len(spec) == 4:  # step 2: as many chunks expand as spans allow
            used = (batch.prefill_span[..., 1] > 0).sum(-1)
            assert used.max() == min(spans, 3 if layout.owner_rows else 4), used
        yield sum(k for _, _, k in spec), batch


def run_layout(name, expanded_form, spans=expanded.DEFAULT_SPANS):
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
    for num, batch in packed(n, layout, alloc, 2 if extra else 1, expanded_form, spans):
        logits, kv = forward(state, kv, jax.tree.map(jnp.asarray, batch))
        out.append(np.asarray(logits[:num]))
    if extra:
        assert alloc.extra_pages_in_use() > 0
    return out


@pytest.fixture(scope="module")
def absorbed_single():
    return run_layout("single", False)


@pytest.mark.parametrize("name,spans", [("tp", 4), ("dp", 4), ("single", 4), ("dp", 1)])
def test_expanded_prefill_logits_equal_the_absorbed_single_device_model(name, spans, absorbed_single):
    """Every token's logits (all_logits) through 4 steps of chunked prefill and decode, with up to
    4 expanded chunks per device (3 on dp's device 0, 4 in tp) or one (the rest absorbed)."""
    for step, (got, want) in enumerate(zip(run_layout(name, True, spans), absorbed_single)):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-4, f"{name} step {step}: max relative error {err:.2e}"


def test_dop_and_cp_refuse_a_prefill_span():
    from splash_jax.attention.layouts import ShardedContext
    from splash_jax.kv.cache import StepInput

    batch = StepInput(*[None] * 8, prefill_span=jnp.zeros((4, 2), jnp.int32))
    for name in ("dop", "cp"):
        assert not get_layout(name).expanded_prefill
        with pytest.raises(ValueError, match="expanded form"):
            ShardedContext(get_layout(name), N, "xla").attention(None, None, None, None, batch)
    assert get_layout("tp").expanded_prefill and get_layout("dp").expanded_prefill


def test_engine_greedy_outputs_with_expanded_prefill_equal_absorbed_and_compile_nothing_after_warmup(monkeypatch):
    """The first step packs three prompts' chunks (13, 14 and 5 tokens), all worth expanding at
    N = 4: all three run expanded in the one expanded program of the bucket."""
    from splash_jax.engine import step_packer

    prompts = ["A layout is a rule table over one mesh.", "Latent attention " * 3, "Latent attention " * 6,
               "One shared latent per token means the cache can live anywhere. " * 3, "ok"]
    params = SamplingParams(max_tokens=6)
    kw = dict(page_size=8, max_num_seqs=8, max_num_batched_tokens=32, max_pages=32, compile_cache_dir=None)
    absorbed = [o.token_ids for o in Engine(EngineConfig(warmup=False, **kw)).generate(prompts, params)]
    engine = Engine(EngineConfig(layout="tp", num_devices=2, prefill_attention="expanded", expanded_prefill_min_tokens=4,
                                 min_token_bucket=32, **kw))  # one bucket: 2 programs + 2 expanded ones
    compiled = engine.executor.num_compiled
    assert any(key[4] for key in engine.executor._compiled), "warm-up compiled no expanded program"
    used = []
    pack = step_packer.prefill_spans
    monkeypatch.setattr(step_packer, "prefill_spans", lambda *a, **k: used.append(pack(*a, **k)) or used[-1])
    assert [o.token_ids for o in engine.generate(prompts, params)] == absorbed
    assert engine.executor.num_compiled == compiled  # dp's expanded logits: test_expanded_prefill_logits_...[dp]
    assert max(int((u[..., 1] > 0).sum(-1).max()) for u in used) >= 3, used


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
    with pytest.raises(ValueError, match="expanded-prefill-spans"):
        EngineConfig(expanded_prefill_spans=0).resolved_expanded_min_tokens("gpu")


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


def test_graph_update_mode_reaches_gpu_step_compiles_only_and_an_xla_without_it_still_compiles():
    from splash_jax.engine.compile_options import GRAPH_UPDATE
    from splash_jax.engine.executor import OPTIONAL_OPTIONS, step_compiler_options

    key = "xla_gpu_command_buffer_update_mode"
    for expanded_ in (False, True):
        assert step_compiler_options("gpu", True, expanded_, graph_update="skip-temp")[key] == "SKIP_TEMP"
        assert key not in step_compiler_options("gpu", True, expanded_, graph_update="always")  # XLA's own default
    assert step_compiler_options("cpu", True, graph_update="skip-temp") == {}
    assert key in OPTIONAL_OPTIONS and set(GRAPH_UPDATE) == {"always", "skip-temp"}
    with pytest.raises(ValueError, match="graph-update"):
        step_compiler_options("gpu", True, graph_update="never")
    with pytest.raises(ValueError, match="graph-update"):
        EngineConfig(graph_update="never").validate()
    # the engine's config reaches the executor (its one recipe for StepExecutor's arguments)
    from splash_jax.engine.sampler import SamplerWidths
    from splash_jax.engine.step_programs import step_executor_args

    args = step_executor_args(EngineConfig(graph_update="skip-temp"), "gpu", 1, 4, SamplerWidths(1, 0), 0, 0)
    assert args["graph_update"] == "skip-temp"


def test_an_expanded_program_that_does_not_build_leaves_its_bucket_absorbed(monkeypatch):
    """A cuDNN that refuses the shapes (here: spans_attention raising while the program is traced)
    costs the expanded form, not the engine: start-up succeeds, outputs equal the absorbed form."""
    def refuse(*args, **kwargs):
        raise NotImplementedError("cuDNN refuses these shapes")

    monkeypatch.setattr(expanded, "spans_attention", refuse)
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

"""Each attention layout on 8 simulated devices against the single-device model, and the
collectives each layout's compiled program contains."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from splash_jax.attention.layouts import ShardedContext
from splash_jax.engine import Engine, EngineConfig, SamplingParams
from splash_jax.engine.executor import layout_step, param_specs
from splash_jax.engine.request import Request, SamplingParams as Params
from splash_jax.engine.sampler import SamplerWidths
from splash_jax.engine.scheduler import ScheduledChunk
from splash_jax.engine.step_packer import SlotSampling, StepShape, host_step_input, pack_step
from splash_jax.kv.allocator import PageAllocator
from splash_jax.kv.page_table import PageTables
from splash_jax.kv.placement import OWNER
from splash_jax.mesh.layouts import AXIS, LAYOUT_NAMES, POOL_SPEC, get_layout, make_mesh, param_sharding_fn
from splash_jax.model import RuntimeOptions
from splash_jax.paths import DEFAULT_MODEL
from splash_jax.weights.loader import load_model

OPTS = RuntimeOptions(dtype="float32", attention_impl="xla")
N, S, PER_DEVICE, M = 8, 8, 16, 8
rng = np.random.default_rng(0)
PROMPTS = {"a": rng.integers(0, 1024, 14).tolist(), "b": rng.integers(0, 1024, 23).tolist(), "c": rng.integers(0, 1024, 6).tolist()}
OWNERS = {"a": 0, "b": 3, "c": 7}
# (request, first position, number of tokens): prefill, then chunked prefill + decode + new prefill, then decode.
STEPS = [
    [("a", 0, 10), ("b", 0, 21)],
    [("a", 10, 3), ("b", 21, 1), ("c", 0, 5)],
    [("a", 13, 1), ("b", 22, 1), ("c", 5, 1)],
]


WIDTHS = SamplerWidths(1, 1)


def packed_steps(n, owner_rows, placement, alloc, segments, tokens_bucket):
    """STEPS packed by the engine's packer for n devices (pages allocated as the scheduler does)."""
    tables = PageTables(n, len(PROMPTS), M)
    slots = {r: i for i, r in enumerate(PROMPTS)}
    requests = {r: Request(r, PROMPTS[r], Params(), slot=slots[r], owner=OWNERS[r] % n,
                           device_pages=[[] for _ in range(n)]) for r in PROMPTS}
    shape = StepShape(tokens_bucket, 4, n, segments, M, owner_rows, WIDTHS)
    for spec in STEPS:
        chunks = []
        for r, s, k in spec:
            req = requests[r]
            for d, count in enumerate(placement.pages_needed(n, req.owner, req.device_pages, s + k, S)):
                pages = alloc.allocate(count, d)
                req.device_pages[d] += pages
                tables.append(req.slot, d, pages, placement, alloc)
            chunks.append(ScheduledChunk(req, s, k, False))
        yield len(spec), host_step_input(shape, pack_step(shape, chunks, tables, SlotSampling(len(PROMPTS), WIDTHS, ()), S))


def reference_logits():
    """The single-device model, with no mesh: the packer's N = 1 case."""
    model = load_model(DEFAULT_MODEL, OPTS)
    kv = model.new_cache(64, S)
    step = jax.jit(lambda m, kv, b: m(kv, b))
    out = []
    for num, b in packed_steps(1, False, OWNER, PageAllocator(1, 64, S), 1, 32):
        local = type(b)(b.tokens, b.positions, b.token_request[0], b.write_page[0, 0], b.write_offset[0],
                        b.kv_lens[0, 0], b.page_table[0, 0], b.logits_index)
        logits, kv = step(model, kv, jax.tree.map(jnp.asarray, local))
        out.append(np.asarray(logits[:num]))
    return out


def layout_logits(name, moe_impl="auto"):
    layout, mesh = get_layout(name), make_mesh(N)
    opts = dataclasses.replace(OPTS, moe_impl=moe_impl)
    model = load_model(DEFAULT_MODEL, opts, sharding_for=param_sharding_fn(layout, mesh))
    # Head-sharded layouts get a 2-page base segment and a 14-page extra segment, so requests
    # spill across both and attention merges the segments.
    base, extra = (2, 14) if layout.heads_sharded else (PER_DEVICE, 0)
    kv = model.new_cache(N * base, S, NamedSharding(mesh, POOL_SPEC), extra_pages=N * extra)
    graphdef, state = nnx.split(model)
    forward = jax.jit(layout_step(graphdef, state, kv, mesh, layout, "xla"))
    alloc = PageAllocator(N, base, S, extra)
    out = []
    steps = packed_steps(N, layout.owner_rows, layout.kv_placement, alloc, 2 if extra else 1, 32)
    for num, batch in steps:
        logits, kv = forward(state, kv, jax.tree.map(jnp.asarray, batch))
        out.append(np.asarray(logits[:num]))
    if layout.heads_sharded:
        assert alloc.extra_pages_in_use() > 0  # the extra segment really served pages
    return out


@pytest.fixture(scope="module")
def reference():
    return reference_logits()


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_layout_logits_match_single_device(name, reference):
    for step, (got, want) in enumerate(zip(layout_logits(name), reference)):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-4, f"{name} step {step}: max relative error {err:.2e}"


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_pallas_moe_in_every_layout_matches_the_xla_single_device_model(name, reference, monkeypatch):
    """The fused MoE kernel (interpret mode here) under each layout's expert-sharded FFN: each device
    runs its own experts' pairs and the partial sums are reduced, as on GPUs."""
    from pallas_kernels import moe_grouped

    traced, kernel = [], moe_grouped.routed_experts
    monkeypatch.setattr(moe_grouped, "routed_experts", lambda *a, **k: traced.append(1) or kernel(*a, **k))
    got_steps = layout_logits(name, moe_impl="pallas")
    assert traced  # the kernel path was taken, not XLA's
    for step, (got, want) in enumerate(zip(got_steps, reference)):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-4, f"{name} step {step}: max relative error {err:.2e}"


# --- collectives of the compiled programs ---------------------------------------------------

def _attention_hlo(name):
    """HLO of one layer's attention block for `name` inside shard_map, compiled for 8 devices."""
    layout, mesh = get_layout(name), make_mesh(N)
    model = load_model(DEFAULT_MODEL, OPTS, sharding_for=param_sharding_fn(layout, mesh))
    graphdef, state = nnx.split(model.layer(0).attn)
    ctx = ShardedContext(layout, N, "xla")
    t = 16 * N if layout.owner_rows else 16

    def block(state, x, cos_sin, latent, rope, batch):
        attn = nnx.merge(graphdef, state)
        local = {k: v[0] for k, v in batch.items()}
        local = type("B", (), {"prefill_span": None, **local})  # a StepInput without the expanded path
        out, pools = ctx.attention(attn, x, cos_sin, ((latent, rope),), local)
        return out, pools[0]

    specs = param_specs(state, layout)
    batch = {k: jnp.zeros((N, 16), jnp.int32) for k in ("token_request", "write_offset")}
    batch |= {k: jnp.zeros((N, 1, 16), jnp.int32) for k in ("write_page", "kv_lens")}
    batch["page_table"] = jnp.zeros((N, 1, 4, M), jnp.int32)
    fn = jax.jit(jax.shard_map(
        block, mesh=mesh, in_specs=(specs, P(), P(), P(AXIS), P(AXIS), {k: P(AXIS) for k in batch}),
        out_specs=(P(), (P(AXIS), P(AXIS))), check_vma=False,
    ))
    cfg = model.cfg
    args = (state, jnp.zeros((t, cfg.hidden_size)), jnp.zeros((t, cfg.qk_rope_head_dim)),
            jnp.zeros((N * PER_DEVICE, S, cfg.kv_lora_rank)), jnp.zeros((N * PER_DEVICE, S, cfg.qk_rope_head_dim)), batch)
    return fn.lower(*args).compile().as_text(), model


def _ops(hlo, op):
    """Result types of every `op` instruction (async -start forms included)."""
    found = []
    for line in hlo.splitlines():
        if " = " not in line:
            continue
        rhs = line.split(" = ", 1)[1]
        if re.search(rf"(^|\s){op}(-start)?\(", rhs):
            found.append(rhs.split(" ")[0])
    return found


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_attention_collectives(name):
    hlo, model = _attention_hlo(name)
    cfg = model.cfg
    gathers, a2a = _ops(hlo, "all-gather"), _ops(hlo, "all-to-all")
    reduces, scatters = _ops(hlo, "all-reduce"), _ops(hlo, "reduce-scatter")
    if name == "tp":
        assert not a2a and not gathers and not scatters and len(reduces) == 1
    elif name == "dp":
        # No collective inside attention: only the all-gather that rebuilds the replicated rows.
        assert not a2a and not reduces and not scatters and len(gathers) == 1
    elif name == "dop":
        assert len(a2a) == 2
        assert len(reduces) + len(scatters) == 1
    elif name == "cp":
        assert len(a2a) == 2 and len(reduces) == 1 and len(gathers) == 1
    # No layout ever gathers a head-sharded weight back to full size.
    full_weights = {
        f"f32[{','.join(map(str, s))}]"
        for s in [(cfg.q_lora_rank, cfg.num_heads, cfg.qk_head_dim), (cfg.kv_lora_rank, cfg.num_heads, cfg.qk_nope_head_dim),
                  (cfg.kv_lora_rank, cfg.num_heads, cfg.v_head_dim), (cfg.num_heads, cfg.v_head_dim, cfg.hidden_size)]
    }
    assert not [g for g in gathers if g.split("{")[0] in full_weights]


def test_engine_greedy_outputs_equal_single_device_in_every_layout():
    prompts = ["Latent attention", "One shared latent per token means the cache can live anywhere.", "ok"]
    params = SamplingParams(max_tokens=8)
    # warmup=False: each engine compiles only the programs this workload runs (outputs do not depend
    # on warm-up; test_switching.py's module engine warms up every layout's programs on 8 devices).
    kw = dict(page_size=8, max_num_seqs=8, max_num_batched_tokens=32, max_pages=32, compile_cache_dir=None, warmup=False)
    single = [o.token_ids for o in Engine(EngineConfig(**kw)).generate(prompts, params)]
    for name in LAYOUT_NAMES:
        engine = Engine(EngineConfig(layout=name, num_devices=N, **kw))
        assert [o.token_ids for o in engine.generate(prompts, params)] == single, name



def test_partitioner_flag_is_checked_and_auto_picks_gspmd_on_gpus():
    import jax

    from splash_jax.engine import EngineConfig
    from splash_jax.mesh.partitioner import use_partitioner

    assert EngineConfig().resolved_partitioner("gpu") == "gspmd"
    assert EngineConfig().resolved_partitioner("cpu") == "shardy"
    assert EngineConfig(partitioner="gspmd").resolved_partitioner("cpu") == "gspmd"
    with pytest.raises(ValueError, match="--partitioner"):
        EngineConfig(partitioner="alpa").resolved_partitioner("cpu")
    before = jax.config.jax_use_shardy_partitioner
    try:
        use_partitioner("gspmd")
        assert jax.config.jax_use_shardy_partitioner is False
        use_partitioner("shardy")
        assert jax.config.jax_use_shardy_partitioner is True
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)


def test_warmup_runs_flag_is_checked_and_auto_runs_programs_on_accelerators_only():
    assert EngineConfig().resolved_warmup_runs("gpu") is True
    assert EngineConfig().resolved_warmup_runs("cpu") is False
    assert EngineConfig(warmup=False).resolved_warmup_runs("gpu") is False  # nothing compiled ahead to run
    assert EngineConfig(warmup_runs="on").resolved_warmup_runs("cpu") is True
    with pytest.raises(ValueError, match="--warmup-runs"):
        EngineConfig(warmup_runs="maybe").resolved_warmup_runs("cpu")

"""The Pallas paged MLA decode kernel against the XLA reference.

CPU: interpret mode at small shapes (both KV-load paths, split-K on and off, ragged lengths,
a zero-length token, garbage page ids, NaN in never-written slots, jit and shard_map dispatch).
GPU (skipped without one): real shapes, bf16 inputs, output memory poisoned beforehand.
Inputs are fresh random draws on every run; the seed is in the failure message.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as Ps

from attention_checks import assert_attention_matches
from pallas_kernels.mla_combine import combine_splits
from pallas_kernels.mla_decode import paged_mla_decode
from pallas_kernels.mla_decode_config import DecodeConfig, plan_splits
from splash_jax.attention import dispatch
from splash_jax.attention.paged_reference import merge_partial_attention, paged_mla_attention

ON_GPU = jax.default_backend() == "gpu"


def _problem(seed, T, H, L, R, P, S, M, lens, dtype=np.float32):
    """Random inputs; page-table entries past each length are garbage (huge, negative, random)."""
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, np.int32)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    q_lat, q_rope, latent, rope = f(T, H, L), f(T, H, R), f(P, S, L), f(P, S, R)
    table = np.stack([rng.permutation(P)[:M] for _ in range(T)]).astype(np.int32)
    for t, n in enumerate(lens):
        used = -(-int(n) // S)
        table[t, used:] = rng.choice([-(2**30), -1, P, P + 7, 2**30], M - used)
    to = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (to(q_lat), to(q_rope), to(latent), to(rope), jnp.asarray(table), jnp.asarray(lens))


def _reference(q_lat, q_rope, latent, rope, table, lens, scale):
    """The XLA path in float32, on a table with the garbage clamped (what it would read)."""
    table = jnp.clip(table, 0, latent.shape[0] - 1)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return paged_mla_attention(f32(q_lat), f32(q_rope), f32(latent), f32(rope), table, lens, scale)


def _seed():
    return int(np.random.SeedSequence().generate_state(1)[0])


# (page size, config): one page per step / several gathered pages, split-K off / fixed / auto.
CPU_CASES = [
    (4, DecodeConfig(block_k=4, num_splits=1)),
    (4, DecodeConfig(block_k=8, num_splits=3)),
    (4, DecodeConfig(block_k=8, num_splits=3, combine="xla")),
    (8, DecodeConfig(block_k=16, num_splits=0, min_pages_per_split=1)),
    (8, DecodeConfig(block_k=4, num_splits=2)),  # a step is half a page
]


@pytest.mark.skipif(ON_GPU, reason="interpret mode is the CPU path (GPU float32 dots use TF32)")
@pytest.mark.parametrize("page_size,cfg", CPU_CASES)
def test_interpret_matches_reference(page_size, cfg):
    seed = _seed()
    S, M = page_size, 7
    lens = [1, S - 1, S, 3 * S + 1, 0, M * S, 2 * S + 3]
    args = _problem(seed, T=7, H=3, L=32, R=16, P=40, S=S, M=M, lens=lens)
    got = paged_mla_decode(*args, 0.3, config=cfg, interpret=True)
    assert_attention_matches(got, _reference(*args, 0.3), seed)
    assert np.all(np.asarray(got[0])[np.asarray(lens) == 0] == 0)


@pytest.mark.skipif(ON_GPU, reason="interpret mode is the CPU path (GPU float32 dots use TF32)")
def test_never_written_slots_cannot_leak():
    """NaN in slots past each length (own last page and garbage pages) must not reach the output."""
    seed = _seed()
    S, M, P = 4, 5, 16
    lens = [1, 6, 17, 11]
    q_lat, q_rope, latent, rope, table, kv_lens = _problem(seed, T=4, H=2, L=16, R=16, P=P, S=S, M=M, lens=lens)
    want = _reference(q_lat, q_rope, latent, rope, table, kv_lens, 0.5)
    lat, rp = np.array(latent), np.array(rope)
    live = np.zeros((P, S), bool)
    for t, n in enumerate(lens):
        for i in range(n):
            live[np.asarray(table)[t, i // S], i % S] = True
    lat[~live], rp[~live] = np.nan, np.nan
    for cfg in (DecodeConfig(block_k=4, num_splits=2), DecodeConfig(block_k=8, num_splits=1)):
        got = paged_mla_decode(q_lat, q_rope, jnp.asarray(lat), jnp.asarray(rp), table, kv_lens, 0.5,
                               config=cfg, interpret=True)
        assert_attention_matches(got, want, seed)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_combine_matches_reference_merge(impl):
    rng = np.random.default_rng(_seed())
    o = jnp.asarray(rng.standard_normal((3, 5, 16, 256)), jnp.float32)  # two column blocks
    lse = np.asarray(rng.standard_normal((3, 5, 16)), np.float32)
    lse[0] = -np.inf  # a token with no KV at all
    lse[1, 2] = -np.inf  # one empty split
    got = combine_splits(o, jnp.asarray(lse), jnp.float32, impl=impl, interpret=not ON_GPU)
    want = merge_partial_attention(jnp.moveaxis(o, 1, 0), jnp.moveaxis(jnp.asarray(lse), 1, 0))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)
    assert np.all(np.asarray(got[0])[0] == 0)


def test_split_range_deals_a_tokens_pages_from_split_zero():
    """Each token's [0, kv_len) is cut into ordered, disjoint split ranges that start on a
    multiple of page_multiple pages, use a prefix of the splits, and never pass the static
    pages-per-split bound the page table is padded to."""
    from pallas_kernels.mla_decode import split_range

    S, M = 8, 40
    for splits in (1, 3, 7, 32):
        for multiple in (1, 2):
            bound = -(-(-(-M // multiple)) // splits) * multiple  # the wrapper's pages_per_split
            lens = jnp.arange(0, M * S + 1, dtype=jnp.int32)
            ranges = [split_range(lens, jnp.int32(k), splits, S, multiple) for k in range(splits)]
            starts = np.stack([np.asarray(a) for a, _ in ranges], 1)
            ends = np.stack([np.asarray(b) for _, b in ranges], 1)
            sizes = np.maximum(ends - starts, 0)
            np.testing.assert_array_equal(sizes.sum(1), np.asarray(lens))
            used = sizes > 0
            assert not np.any(~used[:, :-1] & used[:, 1:]), "used splits must be a prefix"
            for k in range(splits):
                u = used[:, k]
                assert np.all(starts[u, k] % (S * multiple) == 0)
                assert np.all(ends[u, k] <= np.asarray(lens)[u])
                assert np.all(sizes[:, k] <= bound * S)
                if k:
                    assert np.all(starts[u, k] == ends[u, k - 1])


def test_plan_splits_fills_the_grid_but_not_past_the_pages():
    cfg = DecodeConfig()
    assert plan_splits(cfg, tokens=1, head_blocks=1, num_pages=256, sms=132) == cfg.max_splits
    assert plan_splits(cfg, tokens=1, head_blocks=1, num_pages=16, sms=132) == 4  # >= 4 pages each
    assert plan_splits(cfg, tokens=128, head_blocks=2, num_pages=256, sms=132) == 1  # already full
    assert plan_splits(cfg, tokens=64, head_blocks=1, num_pages=64, sms=132) == 4  # 2 programs per SM
    assert plan_splits(cfg, tokens=128, head_blocks=1, num_pages=16, sms=132) == 2
    assert plan_splits(cfg, tokens=300, head_blocks=1, num_pages=16, sms=132) == 1  # more than full
    assert plan_splits(cfg.replace(num_splits=5), tokens=1, head_blocks=1, num_pages=3, sms=132) == 3


@pytest.mark.skipif(ON_GPU, reason="interpret mode is the CPU path")
def test_empty_batch_and_lengths_past_the_table():
    """No tokens at all; a length beyond the page table's capacity attends to the table only."""
    seed = _seed()
    args = _problem(seed, T=2, H=2, L=16, R=16, P=12, S=4, M=3, lens=[12, 5])
    q_lat, q_rope, latent, rope, table, kv_lens = args
    out, lse = paged_mla_decode(q_lat[:0], q_rope[:0], latent, rope, table[:0], kv_lens[:0], 0.5, interpret=True)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)
    got = paged_mla_decode(q_lat, q_rope, latent, rope, table, kv_lens.at[0].set(1000), 0.5,
                           config=DecodeConfig(block_k=4, num_splits=2), interpret=True)
    assert_attention_matches(got, _reference(*args, 0.5), seed)


def test_dispatch_resolves_by_backend_and_flag():
    assert dispatch.resolve_impl("auto") == ("pallas" if ON_GPU else "xla")
    assert dispatch.resolve_impl("mosaic") == "mosaic"
    assert dispatch.resolve_impl("xla") == "xla"
    assert dispatch.resolve_impl("pallas") == "pallas"
    with pytest.raises(ValueError):
        dispatch.resolve_impl("cuda")


@pytest.mark.skipif(ON_GPU, reason="interpret-mode dispatch is the CPU path")
def test_dispatch_pallas_under_jit_and_shard_map():
    """DP-style: tokens and pool pages sharded over 8 devices, each device its own local pool."""
    seed = _seed()
    n = len(jax.devices())
    T, S, M, P = n, 4, 3, 6 * n
    lens = np.random.default_rng(seed).integers(0, M * S + 1, T)
    args = _problem(seed, T=T, H=2, L=16, R=16, P=P, S=S, M=M, lens=lens)
    q_lat, q_rope, latent, rope, table, kv_lens = args
    local_table = jnp.asarray(np.random.default_rng(seed).integers(0, P // n, (T, M)), jnp.int32)

    mesh = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    row = Ps("d")

    @jax.jit
    def step(*a):
        f = functools.partial(dispatch.paged_attention, scale=0.25, impl="pallas")
        return jax.shard_map(lambda *b: f(*b), mesh=mesh, in_specs=(row,) * 6, out_specs=(row, row),
                             check_vma=False)(*a)  # interpret mode needs it

    put = lambda x: jax.device_put(x, NamedSharding(mesh, row))  # noqa: E731
    got = step(*map(put, (q_lat, q_rope, latent, rope, local_table, kv_lens)))
    # Same thing by hand: device d sees pool pages [d*P/n, (d+1)*P/n) under local ids.
    per = P // n
    glob_table = local_table + (jnp.arange(T) * per)[:, None]
    want = _reference(q_lat, q_rope, latent, rope, glob_table, kv_lens, 0.25)
    assert_attention_matches(got, want, seed)
    assert dispatch.resolve_impl("auto") == "xla"
    xla = jax.jit(functools.partial(dispatch.paged_attention, scale=0.25, impl="auto"))(
        q_lat, q_rope, latent, rope, glob_table, kv_lens)
    assert_attention_matches(xla, want, seed)


def test_compiled_kernel_traces_under_shard_map_with_check_vma():
    """The GPU path declares how its outputs vary, so layouts may keep check_vma=True
    (only tracing here: lowering needs a GPU)."""
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sds = jax.ShapeDtypeStruct
    T, H, L, R, P, S, M = n, 16, 512, 64, 8 * n, 64, 4
    args = (sds((T, H, L), jnp.bfloat16), sds((T, H, R), jnp.bfloat16), sds((P, S, L), jnp.bfloat16),
            sds((P, S, R), jnp.bfloat16), sds((T, M), jnp.int32), sds((T,), jnp.int32))
    for cfg in (DecodeConfig(num_splits=1), DecodeConfig(num_splits=2)):
        f = jax.shard_map(lambda *a, c=cfg: paged_mla_decode(*a, 0.1, config=c), mesh=mesh,
                          in_specs=(Ps("d"),) * 6, out_specs=(Ps("d"), Ps("d")), check_vma=True)
        jax.jit(f).trace(*args)


@pytest.mark.skipif(ON_GPU, reason="the GPU tests run the kernel itself")
def test_mosaic_kernel_lowers_for_cuda_under_shard_map():
    """The Mosaic GPU kernel lowers to a CUDA custom call from this CPU host (jax.export), inside
    shard_map with check_vma (its outputs vary like q): Pallas/Mosaic API drift shows up here
    instead of on the GPU machine. Splits > 1 use the XLA combine (the Triton one needs a GPU)."""
    from pallas_kernels.mla_decode_mgpu import CONFIG, paged_mla_decode_mgpu

    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    sds = jax.ShapeDtypeStruct
    T, H, P, S, M = 4, 128, 64, 64, 16
    args = (sds((T, H, 512), jnp.bfloat16), sds((T, H, 64), jnp.bfloat16), sds((P, S, 512), jnp.bfloat16),
            sds((P, S, 64), jnp.bfloat16), sds((T, M), jnp.int32), sds((T,), jnp.int32))
    for cfg in (CONFIG.replace(num_splits=1), CONFIG.replace(num_splits=4, combine="xla")):
        f = jax.shard_map(lambda *a, c=cfg: paged_mla_decode_mgpu(*a, 0.07, config=c), mesh=mesh,
                          in_specs=(Ps("d"),) * 6, out_specs=(Ps("d"), Ps("d")), check_vma=True)
        exported = jax.export.export(jax.jit(f), platforms=["cuda"])(*args)
        assert "mosaic_gpu" in exported.mlir_module()


def _poison_device_memory(nbytes: int):
    """Fill freed device memory with NaN so an unwritten output element shows up as NaN."""
    junk = jnp.full((nbytes // 4,), jnp.nan, jnp.float32)
    junk.block_until_ready()
    del junk


def _assert_close_bf16(out, lse, want, lens, what):
    """A bf16 GPU result against the float32 reference: every element written and finite, 1%
    relative error, lse to 1e-3, -inf and zeros exactly where a token has no KV."""
    o, r = np.asarray(out, np.float32), np.asarray(want[0])
    assert np.isfinite(o).all(), f"{what}: unwritten or NaN output"
    rel = np.linalg.norm(o - r) / np.linalg.norm(r)
    assert rel < 1e-2, f"{what}: relative error {rel}"
    lse_r = np.asarray(want[1])
    fin = np.isfinite(lse_r)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), ~fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], lse_r[fin], rtol=1e-3, atol=1e-3)
    assert np.all(o[np.asarray(lens) == 0] == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_real_shapes_bf16(heads):
    seed = _seed()
    T, L, R, S, M = 9, 512, 64, 64, 40
    lens = [1, 63, 64, 65, 0, 1000, M * S, 777, 2049]
    args = _problem(seed, T=T, H=heads, L=L, R=R, P=2 * T * M, S=S, M=M, lens=lens, dtype=jnp.bfloat16)
    want = _reference(*args, 0.07)
    for cfg in (None, DecodeConfig(num_splits=1), DecodeConfig(num_splits=4, block_k=128)):
        _poison_device_memory(T * heads * L * 4 * 8)
        out, lse = paged_mla_decode(*args, 0.07, config=cfg)
        assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
        _assert_close_bf16(out, lse, want, lens, f"seed {seed}, {cfg}")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("heads", [64, 96, 128])
def test_gpu_mosaic_kernel_matches_reference(heads):
    """The Mosaic GPU kernel (>= 64 heads) against the float32 XLA path: partial last pages,
    empty requests, lengths at the table's end, several split counts, heads padded to 64, and
    NaN in every slot no request wrote (a recycled page may hold anything)."""
    from pallas_kernels.mla_decode_mgpu import CONFIG, paged_mla_decode_mgpu

    seed = _seed()
    T, L, R, S, M = 9, 512, 64, 64, 40
    P = 2 * T * M
    lens = [1, 63, 64, 65, 0, 1000, M * S, 777, 2049]
    args = _problem(seed, T=T, H=heads, L=L, R=R, P=P, S=S, M=M, lens=lens, dtype=jnp.bfloat16)
    want = _reference(*args, 0.07)
    live = np.zeros((P, S), bool)
    for t, n in enumerate(lens):
        for i in range(n):
            live[np.asarray(args[4])[t, i // S], i % S] = True
    lat, rp = np.array(args[2], np.float32), np.array(args[3], np.float32)
    lat[~live], rp[~live] = np.nan, np.nan
    args = (*args[:2], jnp.asarray(lat, jnp.bfloat16), jnp.asarray(rp, jnp.bfloat16), *args[4:])
    for cfg in (CONFIG, CONFIG.replace(num_splits=1), CONFIG.replace(num_splits=7)):
        _poison_device_memory(T * heads * L * 4 * 8)
        out, lse = paged_mla_decode_mgpu(*args, 0.07, config=cfg)
        assert out.dtype == jnp.bfloat16 and out.shape == (T, heads, L) and lse.shape == (T, heads)
        _assert_close_bf16(out, lse, want, lens, f"seed {seed}, {cfg}")


def _packed_step(seed, H=4, L=32, R=16, P=40, S=8, M=8):
    """A step as the packer lays it out: a decode token, a 7-token chunk after a 20-token prefix,
    a 5-token chunk from position 0, a 1-token chunk, then padding (kv_len 0, garbage table)."""
    rng = np.random.default_rng(seed)
    chunks = [(1, 13), (7, 20), (5, 0), (1, 3)]  # (tokens, cached prefix before the chunk)
    table_rows, lens = [], []
    for n, prefix in chunks:
        row = rng.permutation(P)[:M].astype(np.int32)
        for i in range(n):
            table_rows.append(row)
            lens.append(prefix + i + 1)  # causal: token i sees the prefix and the chunk up to itself
    for _ in range(3):
        table_rows.append(rng.integers(-5, P + 5, M).astype(np.int32))
        lens.append(0)
    T = len(lens)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    return f(T, H, L), f(T, H, R), f(P, S, L), f(P, S, R), jnp.asarray(np.stack(table_rows)), jnp.asarray(np.array(lens, np.int32))


@pytest.mark.skipif(ON_GPU, reason="interpret mode is the CPU path (GPU float32 dots use TF32)")
@pytest.mark.parametrize("block_q,splits", [(4, 1), (2, 3), (8, 2)])
def test_grouped_kernel_equals_the_reference_on_a_packed_step(block_q, splits):
    """Chunks grouped block_q tokens at a time (runs longer and shorter than a block, a block
    spilling into the next chunk, padding) give the reference's out and lse for every token."""
    from pallas_kernels.mla_grouped import paged_mla_grouped, run_offsets

    seed = _seed()
    args = _packed_step(seed)
    assert np.asarray(run_offsets(args[4], args[5])).tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 0, -1, -1, -1]
    got = paged_mla_grouped(*args, 0.3, block_q=block_q, splits=splits, interpret=True)
    assert_attention_matches(got, _reference(*args, 0.3), seed)


@pytest.mark.skipif(ON_GPU, reason="interpret-mode dispatch is the CPU path")
def test_grouped_kernel_through_dispatch():
    seed = _seed()
    args = _packed_step(seed)
    got = jax.jit(lambda *a: dispatch.paged_attention(*a, 0.3, impl="pallas_grouped"))(*args)
    assert_attention_matches(got, _reference(*args, 0.3), seed)


@pytest.mark.skipif(ON_GPU, reason="interpret mode is the CPU path")
def test_engine_with_grouped_attention_generates_what_xla_does(layout="cp"):
    """Chunked prefill (8-token chunks of longer prompts) through the grouped kernel in a 2-device
    layout (CP: each device attends over its own pages, some requests have none there)."""
    from splash_jax.engine import Engine, EngineConfig, SamplingParams

    prompts = [list(range(3, 40)), [7, 8, 9], list(range(100, 121))]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    kw = dict(layout=layout, num_devices=2, page_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_pages=32,
              max_model_len=64, compile_cache_dir=None, warmup=False)
    want = [o.token_ids for o in Engine(EngineConfig(attention_impl="xla", **kw)).generate(prompts, params)]
    got = [o.token_ids for o in Engine(EngineConfig(attention_impl="pallas_grouped", **kw)).generate(prompts, params)]
    assert got == want


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("block_q", [4, 8])
def test_gpu_grouped_kernel_real_shapes_bf16(block_q):
    """The compiled grouped kernel (bf16, 16 heads, latent 512 + 64, page 64) on a packed step with
    a decode token, a 300-token chunk after 2048 cached tokens, a 64-token first chunk and padding."""
    from pallas_kernels.mla_grouped import paged_mla_grouped

    seed = _seed()
    rng = np.random.default_rng(seed)
    H, L, R, S, M, P = 16, 512, 64, 64, 48, 160
    chunks = [(1, 1000), (300, 2048), (64, 0)]
    rows, lens = [], []
    for n, prefix in chunks:
        row = rng.permutation(P)[:M].astype(np.int32)
        rows += [row] * n
        lens += [prefix + i + 1 for i in range(n)]
    rows += [rng.integers(-5, P + 5, M).astype(np.int32)] * 3
    lens += [0] * 3
    T = len(lens)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    args = (f(T, H, L), f(T, H, R), f(P, S, L), f(P, S, R), jnp.asarray(np.stack(rows)), jnp.asarray(np.array(lens, np.int32)))
    want = _reference(*args, 0.07)
    _poison_device_memory(T * H * L * 4 * 8)
    out, lse = paged_mla_grouped(*args, 0.07, block_q=block_q)
    o, r = np.asarray(out, np.float32), np.asarray(want[0])
    assert np.isfinite(o).all(), f"seed {seed}: unwritten or NaN output"
    assert np.linalg.norm(o - r) / np.linalg.norm(r) < 1e-2, f"seed {seed}"
    fin = np.isfinite(np.asarray(want[1]))
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), ~fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(want[1])[fin], rtol=1e-3, atol=1e-3)
    assert np.all(o[np.asarray(lens) == 0] == 0)


def test_grouped_kernel_kv_tile_fits_shared_memory():
    """On the H200 block_q 8 (128 query rows at 512 + 64) with a 64-row KV tile asked for 294,912
    bytes of shared memory (limit 232,448); the tile choice keeps the query tile plus the
    pipelined KV copies under the limit and stays as large as possible."""
    from pallas_kernels.mla_grouped import NUM_STAGES, SHARED_MEMORY_BYTES, _fitting_block_k

    def smem(rows, block_k):
        return (rows + NUM_STAGES * block_k) * 576 * 2

    assert smem(128, 64) == 294912  # what the GPU refused
    for rows, want in ((64, 64), (128, 32), (256, 16)):
        got = _fitting_block_k(rows, 576, 64, 2)
        assert got == want
        assert got == 16 or smem(rows, got) <= SHARED_MEMORY_BYTES < smem(rows, 2 * got)
    assert _fitting_block_k(64, 576, 32, 2) == 32  # never larger than the page


def test_float32_caches_get_kv_tiles_that_fit_shared_memory():
    """The tuned (bf16) step asked a float32 cache for 288 KB of pipelined tiles on an H200 (227 KB
    per block) and failed to compile; the fitted one stays under SMEM_BYTES, bf16 keeps its table."""
    from pallas_kernels.mla_decode import SMEM_BYTES, fit_shared_memory

    for block_k, stages, page in ((64, 2, 64), (128, 3, 64), (32, 2, 16), (256, 2, 64)):
        k, s = fit_shared_memory(block_k, stages, 576, 4, page)
        assert s * k * 576 * 4 <= SMEM_BYTES and k >= min(block_k, page) // 2 and (k % page == 0 or page % k == 0)
        assert fit_shared_memory(block_k, stages, 576, 2, page) == (block_k, stages)

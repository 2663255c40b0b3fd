"""Every start-up program of a switching engine compiled for a TPU topology of 8 chips (v5e:2x4)
on this CPU machine, by libtpu (scripts/setup.sh installs a compile-only copy), from abstract
inputs: no TPU, no arrays.

A small model with DeepSeek's latent (512 + 64, so the Mosaic MLA kernel is in every step), few
buckets. The collectives of each layout's step on the TPU are those of the same program compiled
for the 8-device CPU mesh, and one layer's attention block passes tests/test_layouts.py's checks
(mesh/collectives.attention_collective_problems) on the TPU HLO too.
"""

from __future__ import annotations

import pytest

from random_models import tiny_config
from splash_jax.aot import AotBuild, attention_block_lowered
from splash_jax.engine.config import EngineConfig
from splash_jax.mesh.collectives import attention_collective_problems, collective_counts
from splash_jax.mesh.layouts import LAYOUT_NAMES, get_layout, make_mesh

TOPOLOGY = "v5e:2x4"
CFG = tiny_config(kv_lora_rank=512, qk_rope_head_dim=64, num_heads=8)
KW = dict(layout="tp", enable_switching=True, page_size=16, max_num_seqs=2, max_num_batched_tokens=2,
          min_token_bucket=2, max_pages=16, max_model_len=128, compile_cache_dir=None, warmup=False)
BUCKETS = {"tp": ["t2r2"], "cp": ["t2r2"], "dp": ["t1r1", "t2r2"], "dop": ["t1r1", "t2r2"]}
VARIANTS = ["greedy", "full", "greedy+moving", "full+moving"]
# Two-token steps keep the set small (41 programs; the owner layouts' ladder starts at
# min_token_bucket / 8 per device). Logits rows of the full steps: 2 (tp, cp), 8 x 1 and 8 x 2
# (the owner layouts' 8 segments), each
# with the four sampler modes; the handoff movers of both pool structures, the attention weight
# reshards both ways, the extra segment's allocation.
SAMPLERS = [f"sampler/r{r}/{m}" for r in (2, 8, 16) for m in ("plain", "top_logprobs", "filter", "filter+top_logprobs")]
MIGRATION = ["migration/mover_1seg", "migration/mover_2seg", "migration/reshard_sharded_to_replicated",
             "migration/reshard_replicated_to_sharded", "migration/extra_segment"]
KEPT = {f"step/{name}/t2r2/{v}" for name in LAYOUT_NAMES for v in ("greedy", "greedy+moving")}


@pytest.fixture(scope="module")
def tpu_build():
    build = AotBuild(EngineConfig(**KW), TOPOLOGY, model_config=CFG)
    assert build.platform == "tpu" and build.n == 8
    reports, hlo = {}, {}
    for rep, text in build.compile_all(build.programs(), threads=2, keep_hlo=True):
        reports[rep.name] = rep
        if rep.name in KEPT or rep.kind == "migration":
            hlo[rep.name] = text
        elif text is not None and rep.kind == "step":
            hlo[rep.name] = "tpu_custom_call" in text and "mla_decode_tpu" in text
    return build, reports, hlo


def test_every_startup_program_compiles_for_tpu(tpu_build):
    build, reports, hlo = tpu_build
    steps = [f"step/{name}/{b}/{v}" for name in LAYOUT_NAMES for b in BUCKETS[name] for v in VARIANTS]
    assert sorted(reports) == sorted(steps + SAMPLERS + MIGRATION)  # the engine's start-up set, nothing else
    failed = {name: rep.error for name, rep in reports.items() if rep.error}
    assert not failed, failed
    for name, rep in reports.items():
        assert rep.hbm_bytes > 0 and rep.code_bytes > 0, name
        if rep.kind != "migration":
            assert rep.flops > 0 and rep.bytes_accessed > 0, name
    # Pool sized as on the chip: max_pages base pages per chip, the extra segment beside it in tp.
    assert build.pages_per_device == 16 and build.executor.extra_pages_total == 8 * build.extra_pages > 0
    for name in steps:  # auto picked the Mosaic kernel in every step program
        text = hlo[name]
        assert text is True or ("tpu_custom_call" in text and "mla_decode_tpu" in text), name
    # Migration: the mover is one all_to_all; gathering head-sharded weights is all-gathers.
    assert collective_counts(hlo["migration/mover_1seg"]) == {"all-to-all": 1}
    assert collective_counts(hlo["migration/mover_2seg"]) == {"all-to-all": 1}
    assert set(collective_counts(hlo["migration/reshard_sharded_to_replicated"])) == {"all-gather"}


def _families(counts: dict) -> dict:
    """Collectives by what they do. The TPU compiler turns small reduce-scatters into all-reduces
    (dop's o_proj psum_scatter at these sizes): the kind of reduction may change, the number of
    all_to_alls (what moves queries, partials and pages) and all-gathers may not. (At one token
    it also rewrites dp's row all-gathers as all-reduces, so the largest bucket is compared.)"""
    return {"all-to-all": counts.get("all-to-all", 0), "all-gather": counts.get("all-gather", 0),
            "reduction": counts.get("all-reduce", 0) + counts.get("reduce-scatter", 0) > 0,
            "collective-permute": counts.get("collective-permute", 0)}


def test_each_layouts_step_has_its_cpu_collectives_on_tpu(tpu_build):
    build, _, hlo = tpu_build
    cpu = AotBuild(EngineConfig(dtype="float32", **KW), TOPOLOGY, model_config=CFG, mesh=make_mesh(8))
    plain = {name for name in KEPT if name.endswith("/greedy")}
    programs = {p.name: p for p in cpu.programs() if p.name in plain}
    assert len(programs) == len(plain) == len(LAYOUT_NAMES)
    for name in sorted(plain):
        cpu_report, cpu_hlo = cpu.compile(programs[name], keep_hlo=True)
        assert cpu_report.error is None, cpu_report.error
        want, got = collective_counts(cpu_hlo), collective_counts(hlo[name])
        assert _families(got) == _families(want), (name, got, want)
    for name in LAYOUT_NAMES:  # the in-step page copies: one all_to_all more (test_switching.py's check)
        plain, moving = (collective_counts(hlo[f"step/{name}/t2r2/{v}"]) for v in ("greedy", "greedy+moving"))
        assert moving.get("all-to-all", 0) == plain.get("all-to-all", 0) + 1, (name, plain, moving)


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_attention_block_collectives_on_tpu(name):
    """tests/test_layouts.py's per-layout checks on the TPU HLO (bf16, the Mosaic kernel), and
    the same collectives as the block compiled for the CPU mesh."""
    from splash_jax.mesh.topology import topology_mesh

    layout = get_layout(name)
    tpu = attention_block_lowered(CFG, topology_mesh(TOPOLOGY), layout, dtype="bfloat16", impl="auto",
                                  page_size=16).compile().as_text()
    cpu = attention_block_lowered(CFG, make_mesh(8), layout, dtype="float32", page_size=16).compile().as_text()
    assert "tpu_custom_call" in tpu
    assert attention_collective_problems(name, tpu, CFG, "bf16") == []
    assert attention_collective_problems(name, cpu, CFG, "f32") == []
    assert collective_counts(tpu) == collective_counts(cpu)

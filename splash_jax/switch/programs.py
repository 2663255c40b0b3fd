"""The migration programs a switching engine compiles at start-up, named and lowered from
abstract inputs: the controller compiles them for its mesh, splash_jax/aot.py for a TPU
topology with no devices (one enumeration, so the two cannot drift apart).

  mover_<segments>: the handoff's standalone page copy, one per pool structure (without and
                    with the extra segment); the in-step copies are the executor's `moving` steps
  reshard_<a>_to_<b>: the attention weight leaves that change between head-sharded and
                    replicated layouts, all in one identity with target shardings (both ways)
  extra_segment:    the zeros of the extra segment a head-sharded destination adds
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from splash_jax.mesh.layouts import POOL_SPEC, get_layout
from splash_jax.switch.migration import PageMover, WeightResharder

MOVER_LAYOUTS = ("dp", "tp")  # one pool without and one with the extra segment


@dataclasses.dataclass(frozen=True)
class MigrationProgram:
    name: str
    lower: Callable[[], object]  # -> jax.stages.Lowered


def handoff_chunk_pages(chunk_pages: int, max_num_seqs: int, n: int, page_bytes: int,
                        budget_bytes: int = 256 * 2**20) -> int:
    """Pages per device pair in one call of the handoff's mover: room for one partial last page
    per running request, so the handoff makes one call instead of max_num_seqs / chunk_pages
    (each a program launch and an index upload; that phase took 2-8 ms on 2 H200s with several
    calls), capped so its in-flight buffer (N x K pages, all layers) stays under `budget_bytes`."""
    cap = budget_bytes // max(1, n * page_bytes)
    return max(chunk_pages, min(max_num_seqs, cap))


def weight_reshards(executor) -> list[tuple[list, list, list]]:
    """(abstract leaves, source specs, target specs) of the reshards between head-sharded (tp) and
    replicated (dp) attention weights, both ways; empty when no leaf changes (one device)."""
    head, flat = get_layout("tp"), get_layout("dp")
    items = [(path, x) for path, x in executor.param_items() if head.param_spec(path) != flat.param_spec(path)]
    if not items:
        return []
    abstracts = [jax.ShapeDtypeStruct(x.shape, x.dtype) for _, x in items]
    sharded, replicated = [head.param_spec(p) for p, _ in items], [flat.param_spec(p) for p, _ in items]
    return [(abstracts, sharded, replicated), (abstracts, replicated, sharded)]


def lower_extra_segment(mesh, executor):
    """The program that allocates the extra segment (zeros), lowered; None without one."""
    if not executor.extra_pages_total:
        return None
    target = executor.kv_abstract(get_layout("tp"))
    shapes = (target.extra_latent, target.extra_rope)
    sharding = NamedSharding(mesh, POOL_SPEC)

    def zeros():
        return tuple(jnp.zeros(s.shape, s.dtype) for s in shapes)

    return jax.jit(zeros, out_shardings=tuple(sharding for _ in shapes)).lower()


def migration_programs(mesh, executor, handoff_k: int) -> list[MigrationProgram]:
    """Every migration program a switching engine compiles at start-up (see the module doc)."""
    out, structures = [], set()
    for name in MOVER_LAYOUTS:
        kv = executor.kv_abstract(get_layout(name))
        if kv.num_segments not in structures:
            structures.add(kv.num_segments)
            out.append(MigrationProgram(f"mover_{kv.num_segments}seg",
                                        lambda kv=kv: PageMover.lower(mesh, kv, handoff_k)))
    resharder = WeightResharder(mesh)
    for abstracts, src, dst in weight_reshards(executor):
        kind = "replicated_to_sharded" if src[0] == jax.sharding.PartitionSpec() else "sharded_to_replicated"
        out.append(MigrationProgram(f"reshard_{kind}", lambda a=abstracts, s=src, d=dst: resharder.lower(a, s, d)))
    if executor.extra_pages_total:
        out.append(MigrationProgram("extra_segment", lambda: lower_extra_segment(mesh, executor)))
    return out

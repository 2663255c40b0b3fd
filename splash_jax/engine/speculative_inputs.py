"""Step inputs the device completes: speculative steps packed before the host knows everything.

Two cases, both packed on the host by step_packer.pack_step and finished inside the step program
(step_packer.unpack_step):
  - ahead verify chunks (engine/spec_scheduling.py): a verify chunk scheduled behind a verify
    chunk of the same request whose step is still on the device. The host packs it as if that
    step kept none of its drafts, with every variant of what it may keep (`pack_ahead`); the
    step program moves it on by the count the earlier step left in prev_tokens (`shift_ahead`).
  - MTP drafts still on the device (engine/mtp_draft.py): the host packs a code for draft j of
    the previous draft program's chain row (`device_draft_code`); the step program reads the
    draft there (`device_drafts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from splash_jax.engine.sampler import SamplingInputs
from splash_jax.kv.page_table import PageTables
from splash_jax.mesh.layouts import AXIS

if TYPE_CHECKING:
    from splash_jax.engine.step_packer import StepShape


def shift_ahead(shape: StepShape, r: dict, d: dict, sampling: SamplingInputs, prev_tokens: jax.Array):
    """Inside the step program: move each ahead verify chunk (pack_ahead) to where the verify chunk
    before it ended. That chunk's step, still on the device when this one was packed, kept a of
    its drafts (prev_tokens' row 1, step_programs.token_vector); the host packed this chunk
    as if a were 0. Its tokens move a positions on, its first token is that step's row first + a,
    its drafts are variant a, and its cache writes and key lengths come from the two pages its
    tokens may fall in (var_page, var_before: the host's page facts for them)."""
    rows = r["row_shift"].shape[0]
    rs = r["row_shift"]
    a_row = row_shifts(r, prev_tokens)
    tr = r["tok_row"]
    shifted = tr >= 0
    trc = jnp.clip(tr, 0, rows - 1)
    a_tok = jnp.where(shifted, a_row[trc], 0)
    base = r["positions"]
    pos = base + a_tok
    drafted = r["var_draft"][a_tok, jnp.clip(trc - 1, 0, rows - 1)]
    src = jnp.where(r["src_row"] >= 0, r["src_row"] + a_tok, -1)
    r = dict(r, positions=pos, src_row=src, tokens=jnp.where(shifted & (src < 0), drafted, r["tokens"]))
    draft = jnp.where(rs >= 0, r["var_draft"][a_row, jnp.arange(rows)], sampling.draft)
    sampling = dataclasses.replace(sampling, draft=draft, step=sampling.step + a_row)
    # this device's token slots: segment d of the step's slots (owner rows) or all of them
    tq, ps = shape.tokens, shape.page_size
    if shape.owner_rows:
        at = jax.lax.axis_index(AXIS) * tq
        pos, base = jax.lax.dynamic_slice(pos, (at,), (tq,)), jax.lax.dynamic_slice(base, (at,), (tq,))
        shifted, trc = jax.lax.dynamic_slice(shifted, (at,), (tq,)), jax.lax.dynamic_slice(trc, (at,), (tq,))
    j = pos // ps - base // ps  # 0 or 1: a < page size
    seg = jnp.arange(shape.segments)[:, None]
    page = d["var_page"][seg, j[None, :], trc[None, :]]  # [G, Tq]
    before = d["var_before"][seg, j[None, :], trc[None, :]]
    held = page != np.iinfo(np.int32).max
    d = dict(d, write_page=jnp.where(shifted, page, d["write_page"]),
             write_offset=jnp.where(shifted, pos % ps, d["write_offset"]),
             kv_lens=jnp.where(shifted, before * ps + jnp.where(held, pos % ps + 1, 0), d["kv_lens"]))
    return r, d, sampling


def row_shifts(r: dict, prev_tokens: jax.Array) -> jax.Array:
    """Inside a program: per logits row, the drafts the verify chunk before it kept (the shift of
    an ahead chunk's rows, row_shift naming where the previous step counted them); 0 elsewhere."""
    rs = r["row_shift"]
    return jnp.where(rs >= 0, prev_tokens[1, jnp.clip(rs, 0, prev_tokens.shape[1] - 1)], 0)


DEVICE_DRAFT = -2  # token values at or below this name an MTP draft still on the device (device_draft_code)


def device_draft_code(chain_row: int, j: int, k: int) -> int:
    """The value the host packs for draft j of the previous step's chain row (its draft program
    chains k drafts), before the draft exists on the host: device_drafts reads it back on the device."""
    return DEVICE_DRAFT - (chain_row * k + j)


def device_drafts(values: jax.Array, prev_tokens: jax.Array) -> jax.Array:
    """Inside a program: values packed as device_draft_code(c, j, k) become draft j of chain row c
    of the previous step's draft program (prev_tokens row 2 + j); other values stay."""
    k = prev_tokens.shape[0] - 2
    code = DEVICE_DRAFT - values
    coded = code >= 0
    c = jnp.clip(code // k, 0, prev_tokens.shape[1] - 1)
    return jnp.where(coded, prev_tokens[2 + code % k, c], values)


def pack_ahead(shape: StepShape, chunks: Sequence, tables: PageTables, row: np.ndarray, nrows: np.ndarray,
               first_slot: np.ndarray, owners: np.ndarray) -> tuple[dict, dict]:
    """The fields of ahead verify chunks (chunk.shift_k > 0: scheduled behind a verify chunk of
    the same request whose step is still on the device; shift_ahead moves them on the device):
    -> (replicated fields, per-device fields). Each token of such a chunk names its logits row
    (tok_row); its rows name the earlier chunk's sampling row, where that step's accepted count
    is (row_shift); var_draft[v] are the drafts if v were kept; var_page / var_before the page
    facts of the two pages a token at base position p may fall in (p // page_size and the next)."""
    from splash_jax.engine.step_packer import offsets_in_runs

    n, g, r, ps = shape.devices, shape.segments, shape.rows, shape.page_size
    t_total = shape.total_tokens
    tok_row = np.full(t_total, -1, np.int32)
    row_shift = np.full(r, -1, np.int32)
    var_draft = np.full((shape.variants, r), -1, np.int32)
    var_page = np.full((n, g, 2, r), np.iinfo(np.int32).max, np.int32)
    var_before = np.zeros((n, g, 2, r), np.int32)
    ahead = [i for i, c in enumerate(chunks) if c.shift_k]
    if ahead:
        idx = np.asarray(ahead)
        ks = np.fromiter((len(chunks[i].drafts) for i in ahead), np.int64, len(ahead))
        firsts = (row[idx] - nrows[idx] + 1).astype(np.int64)
        counts = ks + 1
        which = np.repeat(np.arange(len(ahead)), counts)  # each ahead token's chunk (of `ahead`)
        offset = offsets_in_runs(counts)
        rows = firsts[which] + offset  # each ahead token's logits row
        tok_row[first_slot[idx][which] + offset] = rows
        row_shift[rows] = np.fromiter((chunks[i].request.pending_row for i in ahead), np.int64, len(ahead))[which]
        for n_i, i in enumerate(ahead):  # one small assignment per chunk: its variants x drafts
            if ks[n_i]:
                v = np.asarray(chunks[i].variants)
                var_draft[: len(v), firsts[n_i] : firsts[n_i] + ks[n_i]] = v
        starts = np.fromiter((chunks[i].start for i in ahead), np.int64, len(ahead))
        slots = np.fromiter((chunks[i].request.slot for i in ahead), np.int64, len(ahead))[which]
        j = np.minimum(((starts[which] + offset) // ps)[None, :] + np.arange(2)[:, None], tables.m - 1)  # [2, T]
        segs = np.arange(g)[:, None, None]
        devices = [owners[idx][which]] if shape.owner_rows else [np.full(len(rows), d) for d in range(n)]
        for dev in devices:  # the token's owner (owner rows), or every device
            local = tables.local_of[dev[None, None, :], segs, slots[None, None, :], j[None, :, :]]  # [G, 2, T]
            var_page[dev[None, None, :], segs, np.arange(2)[None, :, None], rows[None, None, :]] = np.where(
                local >= 0, local, np.iinfo(np.int32).max)
            var_before[dev[None, None, :], segs, np.arange(2)[None, :, None], rows[None, None, :]] = tables.before[
                dev[None, None, :], segs, slots[None, None, :], j[None, :, :]]
    return ({"tok_row": tok_row, "row_shift": row_shift, "var_draft": var_draft},
            {"var_page": var_page, "var_before": var_before})

"""Where a request's pages live under a layout, and the per-device step arrays that follow.

A request holds `device_pages[d]`: global page ids on device d, in position order.
  replicated (tp): every device holds all of its pages (a replica each).
  owner (dp, dop): only its owner device holds pages.
  striped (cp): global page j of the request lives on device j % N.
`build_layout_step` turns scheduled chunks into StepInput arrays whose per-device fields have
a leading [N] axis (sharded over the mesh), with page ids local to a device's pool segment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from splash_jax.kv.allocator import PageAllocator, pages_for_tokens
from splash_jax.kv.cache import StepInput
from splash_jax.mesh.layouts import Layout


def pages_needed(kv_placement: str, n: int, owner: int, device_pages: list[list[int]], upto: int, page_size: int) -> list[int]:
    """New pages each device needs so a request can hold `upto` tokens under the placement."""
    g = pages_for_tokens(upto, page_size)
    if kv_placement == "replicated":
        held = [g] * n
    elif kv_placement == "striped":
        held = [len(range(d, g, n)) for d in range(n)]
    else:
        held = [g if d == owner else 0 for d in range(n)]
    return [max(0, h - len(p)) for h, p in zip(held, device_pages)]


@dataclasses.dataclass
class LayoutChunk:
    tokens: Sequence[int]
    start: int
    device_pages: list[list[int]]
    owner: int = 0


def build_layout_step(
    layout: Layout,
    allocator: PageAllocator,
    chunks: Sequence[LayoutChunk],
    tokens_bucket: int,
    requests_bucket: int,
    pages_bucket: int,
) -> StepInput:
    """Per-device step arrays (leading [N] axis; page fields also carry a [G] segment axis).

    Every device's view of a request is its list of pages in position order, split by pool
    segment. Within a segment positions increase with the list, so the cached positions a
    token may attend there are a prefix whose length is the segment's kv_len for that token.
    Vectorized over chunks and tokens: the only Python loops are over chunks (a few integer
    operations each) and devices.
    """
    n, page_size = allocator.num_devices, allocator.page_size
    segments = 2 if allocator.extra_per_device else 1
    sentinel = allocator.pages_per_device + allocator.extra_per_device  # beyond either segment: dropped
    owner_rows, tq = layout.owner_rows, tokens_bucket
    num = len(chunks)
    lengths = np.fromiter((len(c.tokens) for c in chunks), np.int64, num)
    starts = np.fromiter((c.start for c in chunks), np.int64, num)
    owners = np.fromiter((c.owner for c in chunks), np.int64, num)
    # Where each chunk's tokens go: a slot range in the step, and a row in its device's page table.
    if owner_rows:
        rows, slot_in_dev = np.zeros(num, np.int64), np.zeros(num, np.int64)
        fill, count = np.zeros(n, np.int64), np.zeros(n, np.int64)
        for i in range(num):
            d = owners[i]
            rows[i], slot_in_dev[i] = count[d], fill[d]
            count[d] += 1
            fill[d] += lengths[i]
        if (fill > tq).any() or (count > requests_bucket).any():
            raise ValueError(f"a device overflows its bucket ({tq} tokens, {requests_bucket} requests)")
        base = owners * tq + slot_in_dev
    else:
        if lengths.sum() > tq or num > requests_bucket:
            raise ValueError(f"step overflows its bucket ({tq} tokens, {requests_bucket} requests)")
        rows = np.arange(num)
        slot_in_dev = base = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    chunk_of = np.repeat(np.arange(num), lengths)  # per token
    offset = np.arange(lengths.sum()) - np.repeat(np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    pos = starts[chunk_of] + offset
    slots = base[chunk_of] + offset  # index in the step's token array
    local_slots = slot_in_dev[chunk_of] + offset  # index in a device's query rows

    total_tokens = n * tq if owner_rows else tq
    tokens = np.zeros(total_tokens, np.int32)
    positions = np.zeros(total_tokens, np.int32)
    if num:
        tokens[slots] = np.concatenate([np.asarray(c.tokens, np.int32) for c in chunks])
        positions[slots] = pos
    logits_index = np.zeros(n * requests_bucket if owner_rows else requests_bucket, np.int32)
    logits_index[:num] = base + lengths - 1

    token_request = np.zeros((n, tq), np.int32)
    kv_lens = np.zeros((n, segments, tq), np.int32)
    write_page = np.full((n, segments, tq), sentinel, np.int32)
    write_offset = np.zeros((n, tq), np.int32)
    page_table = np.zeros((n, segments, requests_bucket, pages_bucket), np.int32)
    for d in range(n):
        mine = owners == d if owner_rows else np.ones(num, bool)
        if not mine.any():
            continue
        ids = np.nonzero(mine)[0]
        lists = [chunks[i].device_pages[d] for i in ids]
        width = max(1, max(len(x) for x in lists))
        table = np.full((len(ids), width), -1, np.int64)
        for j, pages in enumerate(lists):
            table[j, : len(pages)] = pages
        valid = table >= 0
        _, seg, local = allocator.locate(np.where(valid, table, 0))
        k = np.arange(width)
        first = ((d + k * n) if layout.kv_placement == "striped" else k) * page_size  # first position of list entry k
        tok = np.nonzero(mine[chunk_of])[0]  # this device's tokens
        row_of = np.searchsorted(ids, chunk_of[tok])  # their row in `table`
        tslot, tpos = local_slots[tok], pos[tok]
        token_request[d, tslot] = rows[chunk_of[tok]]
        write_offset[d, tslot] = tpos % page_size
        covered = np.clip(tpos[:, None] + 1 - first[None, :], 0, page_size) * valid[row_of]  # [tokens, width]
        page_index = tpos // page_size
        if layout.kv_placement == "striped":
            held = page_index % n == d
            entry = np.where(held, page_index // n, 0)
        else:
            held, entry = np.ones(len(tok), bool), page_index
        entry = np.minimum(entry, width - 1)
        for g in range(segments):
            in_g = valid & (seg == g)
            kv_lens[d, g, tslot] = (covered * in_g[row_of]).sum(-1)
            hit = held & in_g[row_of, entry]
            write_page[d, g, tslot] = np.where(hit, local[row_of, entry], sentinel)
            # Compact this segment's entries to the front of each row, keeping position order.
            order = np.argsort(~in_g, axis=1, kind="stable")
            compact = np.where(np.take_along_axis(in_g, order, 1), np.take_along_axis(local, order, 1), 0)
            m = min(width, pages_bucket)
            page_table[d, g, rows[ids], :m] = compact[:, :m]
    return StepInput(tokens, positions, token_request, write_page, write_offset, kv_lens, page_table, logits_index)

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
    """
    n, page_size = allocator.num_devices, allocator.page_size
    segments = 2 if allocator.extra_per_device else 1
    sentinel = allocator.pages_per_device + allocator.extra_per_device  # beyond either segment: dropped
    owner_rows = layout.owner_rows
    tq = tokens_bucket
    total_tokens = n * tq if owner_rows else tq
    rows_total = n * requests_bucket if owner_rows else requests_bucket
    tokens = np.zeros(total_tokens, np.int32)
    positions = np.zeros(total_tokens, np.int32)
    token_request = np.zeros((n, tq), np.int32)
    kv_lens = np.zeros((n, segments, tq), np.int32)
    write_page = np.full((n, segments, tq), sentinel, np.int32)
    write_offset = np.zeros((n, tq), np.int32)
    page_table = np.zeros((n, segments, requests_bucket, pages_bucket), np.int32)
    logits_index = np.zeros(rows_total, np.int32)

    fill, req_rows, slot = [0] * n, [0] * n, 0
    for ci, c in enumerate(chunks):
        m = len(c.tokens)
        pos = c.start + np.arange(m, dtype=np.int64)
        if owner_rows:
            d = c.owner
            if fill[d] + m > tq or req_rows[d] >= requests_bucket:
                raise ValueError(f"device {d} overflows its bucket ({tq} tokens, {requests_bucket} requests)")
            devices, base, row, local_slots = [d], d * tq + fill[d], req_rows[d], slice(fill[d], fill[d] + m)
            fill[d] += m
            req_rows[d] += 1
        else:
            if slot + m > tq or ci >= requests_bucket:
                raise ValueError(f"step overflows its bucket ({tq} tokens, {requests_bucket} requests)")
            devices, base, row, local_slots = range(n), slot, ci, slice(slot, slot + m)
            slot += m
        for d in devices:
            pages = c.device_pages[d]
            _, seg, local = allocator.locate(pages)
            k = np.arange(len(pages))
            first = ((d + k * n) if layout.kv_placement == "striped" else k) * page_size  # first position per page
            token_request[d, local_slots] = row
            write_offset[d, local_slots] = pos % page_size
            holder = (pos[:, None] >= first[None, :]) & (pos[:, None] < first[None, :] + page_size)  # [m, pages]
            for g in range(segments):
                in_g = seg == g
                table = local[in_g]
                page_table[d, g, row, : len(table)] = table
                kv_lens[d, g, local_slots] = np.clip(pos[:, None] + 1 - first[in_g][None, :], 0, page_size).sum(-1)
                hit = holder & in_g[None, :]
                write_page[d, g, local_slots] = np.where(hit.any(-1), (hit * local[None, :]).sum(-1), sentinel)
        tokens[base : base + m] = np.asarray(c.tokens, np.int32)
        positions[base : base + m] = pos
        logits_index[ci] = base + m - 1
    return StepInput(tokens, positions, token_request, write_page, write_offset, kv_lens, page_table, logits_index)

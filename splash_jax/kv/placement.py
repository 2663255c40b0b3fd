"""Where a request's pages live under a layout, and the per-device step arrays that follow.

A request holds `device_pages[d]`: global page ids on device d, in position order.
  replicated (tp): every device holds all of its pages (a replica each).
  owner (dp, dop): only its owner device holds pages.
  striped (cp): global page j of the request lives on device j % N.
`build_layout_step` turns scheduled chunks into StepInput arrays whose per-device fields have
a leading [N] axis (sharded over the mesh), with local page ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from splash_jax.kv.allocator import pages_for_tokens
from splash_jax.kv.cache import StepInput
from splash_jax.mesh.layouts import Layout


def pages_held(kv_placement: str, n: int, num_tokens: int, page_size: int) -> list[int]:
    """Pages each device must hold for a request of `num_tokens` tokens."""
    g = pages_for_tokens(num_tokens, page_size)
    if kv_placement == "replicated":
        return [g] * n
    if kv_placement == "striped":
        return [len(range(d, g, n)) for d in range(n)]
    return [g] + [0] * (n - 1)  # owner: relative to the owner; callers rotate to the owner


def pages_needed(kv_placement: str, n: int, owner: int, device_pages: list[list[int]], upto: int, page_size: int) -> list[int]:
    held = pages_held(kv_placement, n, upto, page_size)
    if kv_placement == "owner":
        held = [held[0] if d == owner else 0 for d in range(n)]
    return [max(0, h - len(p)) for h, p in zip(held, device_pages)]


@dataclasses.dataclass
class LayoutChunk:
    tokens: Sequence[int]
    start: int
    device_pages: list[list[int]]
    owner: int = 0


def build_layout_step(
    layout: Layout,
    n: int,
    page_size: int,
    pages_per_device: int,
    chunks: Sequence[LayoutChunk],
    tokens_bucket: int,
    requests_bucket: int,
    pages_bucket: int,
) -> tuple[StepInput, np.ndarray]:
    """Returns the StepInput and, for each logits row, the index of its chunk (-1 = padding)."""
    owner_rows = layout.owner_rows
    total_tokens = n * tokens_bucket if owner_rows else tokens_bucket
    rows_total = n * requests_bucket if owner_rows else requests_bucket
    tq = tokens_bucket
    tokens = np.zeros(total_tokens, np.int32)
    positions = np.zeros(total_tokens, np.int32)
    token_request = np.zeros((n, tq), np.int32)
    kv_lens = np.zeros((n, tq), np.int32)
    write_page = np.full((n, tq), pages_per_device, np.int32)
    write_offset = np.zeros((n, tq), np.int32)
    page_table = np.zeros((n, requests_bucket, pages_bucket), np.int32)
    logits_index = np.zeros(rows_total, np.int32)
    row_chunk = np.full(rows_total, -1, np.int64)

    fill = [0] * n  # owner layouts: next free slot / request row per device
    req_rows = [0] * n
    slot = 0
    for ci, c in enumerate(chunks):
        m = len(c.tokens)
        pos = c.start + np.arange(m, dtype=np.int32)
        if owner_rows:
            d = c.owner
            if fill[d] + m > tq or req_rows[d] >= requests_bucket:
                raise ValueError(f"device {d} overflows its bucket ({tq} tokens, {requests_bucket} requests)")
            base, r = d * tq + fill[d], req_rows[d]
            local_pages = np.asarray(c.device_pages[d], np.int64) - d * pages_per_device
            page_table[d, r, : len(local_pages)] = local_pages
            sl = slice(fill[d], fill[d] + m)
            token_request[d, sl] = r
            kv_lens[d, sl] = pos + 1
            write_page[d, sl] = local_pages[pos // page_size]
            write_offset[d, sl] = pos % page_size
            fill[d] += m
            req_rows[d] += 1
            row = ci
        else:
            if slot + m > tq or ci >= requests_bucket:
                raise ValueError(f"step overflows its bucket ({tq} tokens, {requests_bucket} requests)")
            base = slot
            sl = slice(slot, slot + m)
            page_index = pos // page_size
            for d in range(n):
                local_pages = np.asarray(c.device_pages[d], np.int64) - d * pages_per_device
                page_table[d, ci, : len(local_pages)] = local_pages
                token_request[d, sl] = ci
                write_offset[d, sl] = pos % page_size
                if layout.kv_placement == "replicated":
                    kv_lens[d, sl] = pos + 1
                    write_page[d, sl] = local_pages[page_index]
                else:  # striped: page j on device j % n; local index j // n
                    padded = np.append(local_pages, pages_per_device)  # last entry: the drop sentinel
                    local_index = np.where(page_index % n == d, page_index // n, len(local_pages))
                    write_page[d, sl] = padded[np.minimum(local_index, len(local_pages))]
                    # Local slots hold global positions (d + k*n)*S + o; count those <= pos.
                    k = np.arange(len(local_pages))
                    first = (d + k * n) * page_size
                    kv_lens[d, sl] = np.clip(pos[:, None] + 1 - first[None, :], 0, page_size).sum(-1)
            slot += m
            row = ci
        tokens[base : base + m] = np.asarray(c.tokens, np.int32)
        positions[base : base + m] = pos
        logits_index[row] = base + m - 1
        row_chunk[row] = ci
    batch = StepInput(tokens, positions, token_request, write_page, write_offset, kv_lens, page_table, logits_index)
    return batch, row_chunk

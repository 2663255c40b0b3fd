"""Host-side packing of a step's request chunks into the fixed-shape StepInput arrays.

Vectorized numpy (no per-token Python loop): each chunk is one request's run of consecutive
tokens (a prefill chunk, or a single decode token) plus the pages that hold its cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from splash_jax.kv.cache import StepInput


@dataclasses.dataclass
class Chunk:
    tokens: Sequence[int] | np.ndarray  # tokens fed this step
    start: int  # position of tokens[0] in the request
    pages: Sequence[int] | np.ndarray  # page ids holding positions [0, start + len(tokens))
    want_logits: str = "last"  # "last" | "all" | "none"


def build_step_input(
    chunks: Sequence[Chunk],
    page_size: int,
    num_pages: int,
    token_bucket: int,
    request_bucket: int,
    pages_bucket: int,
    logits_bucket: int | None = None,
) -> tuple[StepInput, np.ndarray]:
    """Returns the StepInput (numpy) and, per chunk, how many logits rows it owns (in order)."""
    lengths = np.array([len(c.tokens) for c in chunks], np.int64)
    total = int(lengths.sum())
    if total > token_bucket or len(chunks) > request_bucket:
        raise ValueError(f"step of {total} tokens / {len(chunks)} requests exceeds bucket ({token_bucket}, {request_bucket})")
    tokens = np.zeros(token_bucket, np.int32)
    positions = np.zeros(token_bucket, np.int32)
    token_request = np.zeros(token_bucket, np.int32)
    kv_lens = np.zeros(token_bucket, np.int32)
    write_page = np.full(token_bucket, num_pages, np.int32)
    write_offset = np.zeros(token_bucket, np.int32)
    page_table = np.zeros((request_bucket, pages_bucket), np.int32)
    logits_rows: list[np.ndarray] = []
    counts = np.zeros(len(chunks), np.int64)
    offset = 0
    for r, c in enumerate(chunks):
        n = int(lengths[r])
        pages = np.asarray(c.pages, np.int32)
        if len(pages) > pages_bucket:
            raise ValueError(f"request needs {len(pages)} pages > bucket {pages_bucket}")
        page_table[r, : len(pages)] = pages
        pos = c.start + np.arange(n, dtype=np.int32)
        sl = slice(offset, offset + n)
        tokens[sl] = np.asarray(c.tokens, np.int32)
        positions[sl] = pos
        token_request[sl] = r
        kv_lens[sl] = pos + 1
        write_page[sl] = pages[pos // page_size]
        write_offset[sl] = pos % page_size
        if c.want_logits == "all":
            logits_rows.append(np.arange(offset, offset + n, dtype=np.int32))
            counts[r] = n
        elif c.want_logits == "last":
            logits_rows.append(np.array([offset + n - 1], np.int32))
            counts[r] = 1
        offset += n
    rows = np.concatenate(logits_rows) if logits_rows else np.zeros(0, np.int32)
    logits_bucket = logits_bucket or request_bucket
    if len(rows) > logits_bucket:
        raise ValueError(f"{len(rows)} logits rows exceed bucket {logits_bucket}")
    logits_index = np.zeros(logits_bucket, np.int32)
    logits_index[: len(rows)] = rows
    return (
        StepInput(tokens, positions, token_request, write_page, write_offset, kv_lens, page_table, logits_index),
        counts,
    )

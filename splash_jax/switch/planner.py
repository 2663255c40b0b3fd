"""Transition planning between attention layouts: what is reused, what moves, what is freed.

For every running request and every page index j of its cache, the destination layout names
the devices that must hold page j (owner: one; replicated: all; striped: j % N). A device that
already holds page j in a usable segment keeps it (reuse, no copy); any other gets a freshly
reserved page and a copy from a device that holds it. Source pages not reused are freed at
handoff. Weights move only when the head-sharded attention roles change placement (DP <->
the others): a local slice when they become sharded, an all-gather when they become replicated.

Worked examples (N devices):
  TP -> DOP : cache: keep the owner's replica, free the rest (no copy). weights: none.
  DP -> DOP : cache: nothing. weights: local slice (no copy), then the extra segment appears.
  DOP -> TP : cache: broadcast each owned page to the N-1 other devices.
  DOP -> DP : cache: pages in the extra segment move to base pages on the same device; weights: all-gather.
  CP <-> DOP: cache: gather the stripes to the owner / scatter the owner's pages to their stripes.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import numpy as np

from splash_jax.engine.request import Request
from splash_jax.kv.allocator import OutOfPages, PageAllocator, pages_for_tokens
from splash_jax.mesh.layouts import HEAD_SHARDED, Layout


class SwitchRefused(RuntimeError):
    """The destination layout cannot hold the running requests (the message says why)."""


@dataclasses.dataclass
class RequestPlan:
    request: Request
    owner: int
    dst_pages: list[list[int]]  # per device, global ids in position order (reused or reserved)
    copies: list[tuple[int, int]]  # (source page, reserved destination page)
    reserved: list[int]  # destination pages allocated for this plan (freed on cancel)
    planned_pages: int  # pages of the request covered by this plan
    order: int  # the request's admission order when planned: a re-admitted request's plan is stale
    # Copies from this index on are of a page that was partly filled when planned: the steps after
    # may still write it, so they run at the handoff, not inside the steps (None: none held).
    held_from: int | None = None

    @property
    def ready_copies(self) -> int:
        """How many of the copies (a prefix) may run inside the steps."""
        return len(self.copies) if self.held_from is None else self.held_from

    @property
    def stale(self) -> bool:
        """The request was preempted (its pages freed) and admitted again since this plan was made."""
        return self.request.order != self.order


@dataclasses.dataclass
class WeightMove:
    path: tuple
    kind: str  # "slice" (replicated -> head-sharded, local) | "gather" (head-sharded -> replicated)
    bytes: int


@dataclasses.dataclass
class TransitionPlan:
    src: Layout
    dst: Layout
    requests: dict[str, RequestPlan]
    weights: list[WeightMove]
    extra_segment: str  # "add" | "remove" | "keep"
    page_bytes: int
    pages_freed: int = 0  # source pages the destination did not keep (known at handoff)

    @property
    def num_copies(self) -> int:
        return sum(len(p.copies) for p in self.requests.values())

    @property
    def cache_bytes(self) -> int:
        return self.num_copies * self.page_bytes

    @property
    def weight_bytes(self) -> int:
        return sum(w.bytes for w in self.weights if w.kind == "gather")

    def summary(self) -> dict:
        copies = self.num_copies
        reused = sum(len(d) for p in self.requests.values() for d in p.dst_pages) - copies
        return {
            "src": self.src.name, "dst": self.dst.name,
            "pages_copied": copies, "pages_reused": reused,
            "pages_freed": self.pages_freed,
            "cache_bytes": self.cache_bytes, "weight_bytes_gathered": self.weight_bytes,
            "weight_leaves": {k: sum(1 for w in self.weights if w.kind == k) for k in ("slice", "gather")},
            "extra_segment": self.extra_segment,
        }


def plan_weights(param_paths: list[tuple[tuple, int]], src: Layout, dst: Layout) -> list[WeightMove]:
    if src.heads_sharded == dst.heads_sharded:
        return []
    kind = "slice" if dst.heads_sharded else "gather"
    return [WeightMove(path, kind, nbytes) for path, nbytes in param_paths if str(path[-1]) in HEAD_SHARDED]


def plan_request(
    request: Request, src: Layout, dst: Layout, allocator: PageAllocator, base_only: bool, owner: int,
    upto_tokens: int | None = None, existing: RequestPlan | None = None,
) -> RequestPlan:
    """Reserve destination pages for `request`'s pages (up to `upto_tokens`), extending `existing`.

    For each new page index j and each device the destination needs it on: the page that device
    already holds is reused (under `base_only` only a base-segment one), otherwise a page is
    reserved there and copied from that device's page or else from the lowest device holding it.
    Array operations over all the request's new pages at once (per page in Python it was ~85% of
    a switch's start on the CPU mesh's host: 30 ms for 64 requests x 64 pages). All or nothing:
    without the free pages it needs, OutOfPages and `existing` is left as it was."""
    n = allocator.num_devices
    upto = upto_tokens if upto_tokens is not None else request.num_computed
    num_pages = pages_for_tokens(upto, allocator.page_size)
    plan = existing or RequestPlan(request, owner, [[] for _ in range(n)], [], [], 0, request.order)
    first = plan.planned_pages
    if num_pages <= first:
        return plan
    count = num_pages - first
    need = dst.kv_placement.page_mask(np.arange(first, num_pages), plan.owner, n)  # [J, n]
    held = np.full((count, n), -1, np.int64)  # the page device d holds for index first + i, or -1
    for d, pages in enumerate(request.device_pages):
        if pages:
            js = np.asarray(src.kv_placement.page_index(d, np.arange(len(pages)), n))
            sel = (js >= first) & (js < num_pages)
            held[js[sel] - first, d] = np.asarray(pages, np.int64)[sel]
    usable = held >= 0
    if base_only:
        usable &= held < allocator.num_base_pages
    fresh = need & ~usable  # a page to reserve and copy into
    any_holder = held[np.arange(count), np.argmax(held >= 0, axis=1)]  # the lowest device's page
    source = np.where(held >= 0, held, any_holder[:, None])
    if (source[fresh] < 0).any():
        raise RuntimeError(f"request {request.request_id}: a page index below {num_pages} is on no device")
    per_device = fresh.sum(axis=0)
    for d in np.flatnonzero(per_device).tolist():
        free = allocator.num_free_base(d) if base_only else allocator.num_free(d)
        if per_device[d] > free:
            raise OutOfPages(f"device {d}: the switch needs {int(per_device[d])} pages for request "
                             f"{request.request_id}, {free} free")
    new = np.full((count, n), -1, np.int64)
    for d in np.flatnonzero(per_device).tolist():
        new[fresh[:, d], d] = allocator.allocate(int(per_device[d]), d, base_only=base_only)
    chosen = np.where(fresh, new, held)
    for d in range(n):
        plan.dst_pages[d].extend(chosen[need[:, d], d].tolist())
    rows, cols = np.nonzero(fresh)  # page-major, then device: the last page's copies come last
    reserved = new[rows, cols].tolist()
    plan.reserved.extend(reserved)
    last_page_from = len(plan.copies) + int((rows < count - 1).sum())
    plan.copies.extend(zip(source[rows, cols].tolist(), reserved))
    # A partly filled last page is held for the handoff; a full one releases what was held.
    plan.held_from = last_page_from if upto % allocator.page_size else None
    plan.planned_pages = num_pages
    return plan


def pages_to_free(page_lists, num_pages: int) -> np.ndarray:
    """Source pages the destination does not keep, over every request of a handoff at once.
    `page_lists`: per request (source device_pages, destination device_pages). A page belongs to
    one request, so one mark array over the pool's `num_pages` global ids covers all."""
    chain = itertools.chain.from_iterable
    src = np.fromiter(chain(chain(old for old, _ in page_lists)), np.int64)
    dst = np.fromiter(chain(chain(new for _, new in page_lists)), np.int64)
    keep = np.zeros(num_pages, bool)
    keep[dst] = True
    return src[~keep[src]]


def choose_owner(request: Request, src: Layout, dst: Layout, n: int, load: Counter, page_size: int,
                 pages_per_device: int) -> int:
    """Keep the owner between owner layouts. Otherwise, among the devices with room for the
    request's pages (`load`: pages already given to each device; `pages_per_device`: the
    destination's), the one holding most of its pages (fewest to copy), then the least loaded.
    Without a device that has room, the least loaded (the capacity check then refuses)."""
    if src.keeps_owner:
        return request.owner
    need = pages_for_tokens(request.num_tokens + 1, page_size)
    counts = [len(p) for p in request.device_pages] if request.device_pages else [0] * n
    room = [d for d in range(n) if load[d] + need <= pages_per_device]
    if not room:
        return min(range(n), key=lambda d: (load[d], d))
    return min(room, key=lambda d: (-counts[d], load[d], d))


def capacity_check(requests: list[Request], dst: Layout, allocator: PageAllocator, dst_pages_per_device: int, page_size: int, owners: dict[str, int]) -> str | None:
    """None if the destination can hold every running request, else the reason it cannot."""
    n = allocator.num_devices
    need = np.zeros(n, np.int64)
    for r in requests:
        g = pages_for_tokens(r.num_tokens + 1, page_size)
        need += np.asarray(dst.kv_placement.per_device_need(n, owners.get(r.request_id, 0), g))
    worst = int(np.argmax(need - dst_pages_per_device))
    if need[worst] > dst_pages_per_device:
        return (
            f"layout {dst.name} cannot hold the {len(requests)} running requests: device {worst} would need "
            f"{int(need[worst])} pages and has {dst_pages_per_device}"
        )
    return None

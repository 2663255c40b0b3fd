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
    # Per device: arrays of the source pages planning found the destination does not keep, in
    # position order (freed after the handoff; see pages_to_free).
    dropped: list[list[np.ndarray]] = dataclasses.field(default_factory=list)

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
    # Prefix cache: pages it names after the handoff (cached pages no request holds stay where they
    # are: their contents are valid in every layout); those evicted because their segment went.
    cached_pages: int = 0
    cached_evicted: int = 0
    shared: "SharedCopies" = dataclasses.field(default_factory=lambda: SharedCopies())

    @property
    def num_copies(self) -> int:
        return sum(len(p.copies) for p in self.requests.values()) + len(self.shared.copies)

    @property
    def cache_bytes(self) -> int:
        return self.num_copies * self.page_bytes

    @property
    def weight_bytes(self) -> int:
        return sum(w.bytes for w in self.weights if w.kind == "gather")

    def summary(self) -> dict:
        copies = self.num_copies
        reused = sum(len(d) for p in self.requests.values() for d in p.dst_pages) - copies - self.shared.shared_by
        return {
            "src": self.src.name, "dst": self.dst.name,
            "pages_copied": copies, "pages_reused": reused,
            "pages_freed": self.pages_freed,
            "cache_bytes": self.cache_bytes, "weight_bytes_gathered": self.weight_bytes,
            "weight_leaves": {k: sum(1 for w in self.weights if w.kind == k) for k in ("slice", "gather")},
            "extra_segment": self.extra_segment,
            "pages_shared_copies": len(self.shared.copies), "pages_copy_shared_by": self.shared.shared_by,
            "cached_pages_kept": self.cached_pages, "cached_pages_evicted": self.cached_evicted,
        }


@dataclasses.dataclass
class SharedCopies:
    """Copies of pages several requests share (prefix-cache hits): each (source page, destination
    device) is copied once and every request needing it there references the one copy. The switch
    holds a reference on each destination page of its own, so a copy stays valid to run even if
    the request it was planned for finishes first; it drops them after the handoff (or cancel)."""

    dst_of: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # (source page, device) -> page
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (source, destination), planned order
    shared_by: int = 0  # destination pages other requests referenced instead of copying again

    def held(self) -> list[int]:
        """The destination pages the switch references itself."""
        return [d for _, d in self.copies]


def plan_weights(param_paths: list[tuple[tuple, int]], src: Layout, dst: Layout) -> list[WeightMove]:
    if src.heads_sharded == dst.heads_sharded:
        return []
    kind = "slice" if dst.heads_sharded else "gather"
    return [WeightMove(path, kind, nbytes) for path, nbytes in param_paths if str(path[-1]) in HEAD_SHARDED]


PlanItem = tuple[Request, int, int, "RequestPlan | None"]  # (request, owner, plan up to this many tokens, plan to extend)


def plan_request(
    request: Request, src: Layout, dst: Layout, allocator: PageAllocator, base_only: bool, owner: int,
    upto_tokens: int | None = None, existing: RequestPlan | None = None, shared: SharedCopies | None = None,
) -> RequestPlan:
    """Reserve destination pages for `request`'s pages (up to `upto_tokens`), extending `existing`
    (plan_requests for one request)."""
    upto = upto_tokens if upto_tokens is not None else request.num_computed
    return plan_requests([(request, owner, upto, existing)], src, dst, allocator, base_only, shared)[0]


def plan_requests(items: list[PlanItem], src: Layout, dst: Layout, allocator: PageAllocator,
                  base_only: bool, shared: SharedCopies | None = None) -> list[RequestPlan]:
    """Reserve destination pages for several requests' pages at once, as plan_request for each in
    turn would (the same pages, in the same order), returning their plans.

    For each new page index j and each device the destination needs it on: the page that device
    already holds is reused (under `base_only` only a base-segment one), otherwise a page is
    reserved there and copied from that device's page or else from the lowest device holding it.
    Array operations over all the requests' new pages at once (per page in Python it was ~85% of
    a switch's start on the CPU mesh's host: 30 ms for 64 requests x 64 pages; per request, a
    handoff whose requests each started a page took 0.4-3 ms on the H200 host). All or nothing:
    without the free pages they need, OutOfPages and every `existing` plan is left as it was.

    With `shared`, a source page more than one holder references (a cached prefix) is copied to
    a device once: the first request needing it there reserves the page and `shared` takes the
    copy (and a reference); later ones reference that page (see SharedCopies)."""
    n, size = allocator.num_devices, allocator.page_size
    plans = [existing or RequestPlan(r, owner, [[] for _ in range(n)], [], [], 0, r.order, dropped=[[] for _ in range(n)])
             for r, owner, _, existing in items]
    first = np.array([p.planned_pages for p in plans], np.int64)
    counts = np.maximum(np.array([pages_for_tokens(upto, size) for _, _, upto, _ in items], np.int64) - first, 0)
    total = int(counts.sum())
    if total == 0:
        return plans
    item_of = np.repeat(np.arange(len(items)), counts)  # each new page's request
    row0 = np.cumsum(counts) - counts  # each request's first row
    js = first[item_of] + np.arange(total) - row0[item_of]
    need = dst.kv_placement.page_mask(js, np.array([p.owner for p in plans])[item_of], n)  # [rows, n]
    held = _held_pages(items, src, first, counts, row0, n, total)
    usable = held >= 0
    if base_only:
        usable &= held < allocator.num_base_pages
    fresh = need & ~usable  # a page to reserve and copy into
    any_holder = held[np.arange(total), np.argmax(held >= 0, axis=1)]  # the lowest device's page
    source = np.where(held >= 0, held, any_holder[:, None])
    if (source[fresh] < 0).any():
        i = int(item_of[np.flatnonzero((source < 0) & fresh)[0] // n])
        raise RuntimeError(f"request {items[i][0].request_id}: a page index below {int(first[i] + counts[i])} is on no device")
    reusing = np.zeros(fresh.shape, bool)  # a copy of the same page to the same device is planned: reference it
    lead = np.zeros(fresh.shape, bool)  # the first copy of a shared page to its device
    if shared is not None and fresh.any():
        rows, cols = np.nonzero(fresh)
        srcs = source[rows, cols]
        multi = allocator.refs_of(srcs) > 1
        seen = set()
        for r, c, sp in zip(rows[multi].tolist(), cols[multi].tolist(), srcs[multi].tolist()):
            if (sp, c) in shared.dst_of or (sp, c) in seen:
                reusing[r, c] = True
            else:
                lead[r, c] = True
                seen.add((sp, c))
    new = _reserve(fresh & ~reusing, allocator, base_only, items, item_of)
    if lead.any() or reusing.any():
        _settle_shared(shared, allocator, new, reusing, lead, source)
    chosen = np.where(fresh, new, held)
    _extend(plans, items, need, chosen, fresh, source, new, item_of, row0 + counts - 1, first + counts, size,
            copied=fresh & ~reusing & ~lead)
    _record_dropped(plans, held, (held >= 0) & ~(need & usable), item_of)
    return plans


def _held_pages(items: list[PlanItem], src: Layout, first: np.ndarray, counts: np.ndarray, row0: np.ndarray,
                n: int, total: int) -> np.ndarray:
    """[rows, n]: the source page device d holds for each new page index (row), or -1. Only the
    tail of each device's list from the first new index on is read."""
    todo = np.flatnonzero(counts)
    lists = [items[i][0].device_pages for i in todo.tolist()]
    lens = np.fromiter((len(pages) for per_device in lists for pages in per_device), np.int64, count=len(todo) * n)
    lo = np.minimum(lens, src.kv_placement.entries_below(np.tile(np.arange(n), len(todo)), np.repeat(first[todo], n), n))
    runs = lens - lo
    read = np.flatnonzero(runs).tolist()  # (request, device) pairs with pages to read: k * n + d
    tails = [lists[k // n][k % n][lo_k:] for k, lo_k in zip(read, lo[read].tolist())]
    held = np.full((total, n), -1, np.int64)
    if not tails:
        return held
    read, runs = np.asarray(read), runs[read]
    pages = np.fromiter(itertools.chain.from_iterable(tails), np.int64, count=int(runs.sum()))
    item, dev = np.repeat(todo[read // n], runs), np.repeat(read % n, runs)
    entry = np.repeat(lo[read] - (np.cumsum(runs) - runs), runs) + np.arange(len(pages))
    js = np.asarray(src.kv_placement.page_index(dev, entry, n)) - first[item]
    sel = (js >= 0) & (js < counts[item])
    held[row0[item[sel]] + js[sel], dev[sel]] = pages[sel]
    return held


def _settle_shared(shared: SharedCopies, allocator: PageAllocator, new: np.ndarray, reusing: np.ndarray,
                   lead: np.ndarray, source: np.ndarray) -> None:
    """Record the first copies of shared pages (the switch takes a reference on each), then give
    the rows that reuse a copy its page (each such row references it: a reservation)."""
    for r, c in zip(*np.nonzero(lead)):
        page = int(new[r, c])
        shared.dst_of[(int(source[r, c]), int(c))] = page
        shared.copies.append((int(source[r, c]), page))
    rows, cols = np.nonzero(reusing)
    for r, c in zip(rows.tolist(), cols.tolist()):
        new[r, c] = shared.dst_of[(int(source[r, c]), c)]
    allocator.ref(np.concatenate([new[lead], new[rows, cols]]))
    shared.shared_by += len(rows)


def _reserve(fresh: np.ndarray, allocator: PageAllocator, base_only: bool, items: list[PlanItem],
             item_of: np.ndarray) -> np.ndarray:
    """Allocate the fresh pages (per device in row order, as one request after another would);
    OutOfPages before any allocation if some device lacks them."""
    per_device = fresh.sum(axis=0)
    for d in np.flatnonzero(per_device).tolist():
        free = allocator.num_free_base(d) if base_only else allocator.num_free(d)
        if per_device[d] > free:
            who = f"request {items[0][0].request_id}" if len(items) == 1 else f"{len(np.unique(item_of[fresh[:, d]]))} requests"
            raise OutOfPages(f"device {d}: the switch needs {int(per_device[d])} pages for {who}, {free} free")
    new = np.full(fresh.shape, -1, np.int64)
    for d in np.flatnonzero(per_device).tolist():
        new[fresh[:, d], d] = allocator.allocate(int(per_device[d]), d, base_only=base_only)
    return new


def _extend(plans: list[RequestPlan], items: list[PlanItem], need: np.ndarray, chosen: np.ndarray,
            fresh: np.ndarray, source: np.ndarray, new: np.ndarray, item_of: np.ndarray, last_row: np.ndarray,
            planned: np.ndarray, size: int, copied: np.ndarray | None = None) -> None:
    """Append each request's new rows to its plan: destination pages, copies (of the `copied`
    rows: default every fresh one), reservations (every fresh row: each holds a reference)."""
    n, bounds = need.shape[1], np.arange(len(plans) + 1)
    per_device = []  # (the chosen pages device d needs, as a list; where each request's start)
    for d in range(n):
        rows = np.flatnonzero(need[:, d])
        per_device.append((chosen[rows, d].tolist(), np.searchsorted(item_of[rows], bounds).tolist()))
    rows, cols = np.nonzero(fresh)  # request, then page, then device: a request's last page's copies come last
    copy_item = item_of[rows]
    cb = np.searchsorted(copy_item, bounds).tolist()
    reserved = new[rows, cols].tolist()
    copied = fresh if copied is None else copied
    crows, ccols = np.nonzero(copied)
    ccb = np.searchsorted(item_of[crows], bounds).tolist()
    before_last = np.r_[0, np.cumsum(crows < last_row[item_of[crows]])].tolist()  # copies of earlier pages, cumulative
    copies = list(zip(source[crows, ccols].tolist(), new[crows, ccols].tolist()))
    for i in np.unique(item_of).tolist():
        plan, upto, (a, b), (ca, cb_) = plans[i], items[i][2], cb[i : i + 2], ccb[i : i + 2]
        for d, (pages, starts) in enumerate(per_device):
            plan.dst_pages[d].extend(pages[starts[i] : starts[i + 1]])
        plan.reserved.extend(reserved[a:b])
        last_page_from = len(plan.copies) + before_last[cb_] - before_last[ca]
        plan.copies.extend(copies[ca:cb_])
        # A partly filled last page is held for the handoff; a full one releases what was held.
        plan.held_from = last_page_from if upto % size else None
        plan.planned_pages = int(planned[i])


def _record_dropped(plans: list[RequestPlan], held: np.ndarray, dropped: np.ndarray, item_of: np.ndarray) -> None:
    """Append each request's newly planned source pages that the destination does not keep."""
    bounds = np.arange(len(plans) + 1)
    for d in range(held.shape[1]):
        rows = np.flatnonzero(dropped[:, d])
        if len(rows):
            pages, starts = held[rows, d], np.searchsorted(item_of[rows], bounds).tolist()
            for i in np.flatnonzero(np.diff(starts)).tolist():
                plans[i].dropped[d].append(pages[starts[i] : starts[i + 1]])


def pages_to_free(plans, src: Layout) -> np.ndarray:
    """Source pages the destination does not keep, over every planned request of a handoff, in
    request, device and position order: those planning found dropped, then any a device holds past
    the planned pages (kept by none). From arrays recorded while planning: flattening every source
    and destination list here instead took 0.5-3.6 ms of a handoff on the H200 host."""
    plans = list(plans)
    if not plans:
        return np.zeros(0, np.int64)
    n = len(plans[0].request.device_pages)
    planned = src.kv_placement.entries_below(np.tile(np.arange(n), len(plans)),
                                             np.repeat([p.planned_pages for p in plans], n), n).tolist()
    parts = []
    for i, p in enumerate(plans):
        for d, pages in enumerate(p.request.device_pages):
            parts += p.dropped[d]
            if planned[i * n + d] < len(pages):
                parts.append(np.asarray(pages[planned[i * n + d]:], np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


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


def capacity_check(requests: list[Request], dst: Layout, allocator: PageAllocator, dst_pages_per_device: int,
                   page_size: int, owners: dict[str, int], src=None) -> str | None:
    """None if the destination can hold every running request, else the reason it cannot. With the
    source placement `src`, a page several requests share (a cached prefix) counts once per device."""
    n = allocator.num_devices
    need = np.zeros(n, np.int64)
    seen: set[tuple[int, int]] = set()  # (source page, device): a page requests share is needed there once
    for r in requests:
        g = pages_for_tokens(r.num_tokens + 1, page_size)
        owner = owners.get(r.request_id, 0)
        need += np.asarray(dst.kv_placement.per_device_need(n, owner, g))
        if src is None:
            continue
        for j in range(len(r.cache_nodes)):  # its first pages: the only ones it may share
            held = src.devices_of_page(j, r.owner, n)
            entry = src.entry_of(j, n)
            for d in dst.kv_placement.devices_of_page(j, owner, n):
                key = (r.device_pages[d if d in held else held[0]][entry], d)  # what planning reuses or copies
                if key in seen:
                    need[d] -= 1
                else:
                    seen.add(key)
    worst = int(np.argmax(need - dst_pages_per_device))
    if need[worst] > dst_pages_per_device:
        return (
            f"layout {dst.name} cannot hold the {len(requests)} running requests: device {worst} would need "
            f"{int(need[worst])} pages and has {dst_pages_per_device}"
        )
    return None

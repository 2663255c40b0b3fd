"""The switch's host-side planning: the per-request page planner, the copy queue and the chunk
packer, each against a plain one-at-a-time reference (no devices)."""

import numpy as np
import pytest

from splash_jax.kv.allocator import PageAllocator
from splash_jax.switch.copy_queue import PairQueues
from splash_jax.switch.migration import locate_copies, move_sentinel, pack_located, rank_within_groups


def random_copies(rng, alloc: PageAllocator, count: int) -> list[tuple[int, int]]:
    n = alloc.num_devices
    out = []
    for _ in range(count):
        a, b = int(rng.integers(n)), int(rng.integers(n))
        src = alloc.allocate(1, a)[0]
        dst = alloc.allocate(1, b)[0] if rng.random() < 0.7 else alloc.allocate(1, b, base_only=True)[0]
        out.append((src, dst))
    return out


def reference_pack(copies, alloc: PageAllocator, k: int):
    """One copy at a time: the i-th copy of a device pair lands in chunk i // k, slot i % k."""
    n, sentinel = alloc.num_devices, move_sentinel(alloc)
    seen: dict[tuple[int, int], int] = {}
    chunks: dict[int, list[np.ndarray]] = {}
    for src, dst in copies:
        (sd,), (ss,), (sl,) = alloc.locate([src])
        (dd,), (ds,), (dl,) = alloc.locate([dst])
        i = seen.get((sd, dd), 0)
        seen[(sd, dd)] = i + 1
        c, s = divmod(i, k)
        arrays = chunks.setdefault(c, [np.zeros((n, n, k), np.int32), np.zeros((n, n, k), np.int32),
                                       np.full((n, n, k), sentinel, np.int32), np.zeros((n, n, k), np.int32)])
        arrays[0][sd, dd, s], arrays[1][sd, dd, s] = sl, ss
        arrays[2][dd, sd, s], arrays[3][dd, sd, s] = dl, ds
    return [chunks[c] for c in sorted(chunks)]


@pytest.mark.parametrize("n,k,count", [(1, 4, 9), (2, 1, 17), (2, 64, 300), (4, 3, 120), (8, 16, 700)])
def test_packed_chunks_equal_the_per_copy_reference(n, k, count):
    rng = np.random.default_rng(n * 1000 + k)
    alloc = PageAllocator(n, 2000, 16, extra_pages_per_device=300)  # both segments in use
    copies = random_copies(rng, alloc, count)
    got = pack_located(locate_copies(copies, alloc), n, k, move_sentinel(alloc))
    want = reference_pack(copies, alloc, k)
    assert len(got) == len(want)
    for chunk, ref in zip(got, want):
        for field, arr in zip(("send_ids", "send_seg", "recv_ids", "recv_seg"), ref):
            np.testing.assert_array_equal(getattr(chunk, field), arr, err_msg=field)
    assert sum(c.count for c in got) == count


def test_rank_within_groups_counts_earlier_equal_keys():
    keys = np.random.default_rng(0).integers(0, 5, 200)
    want = [int((keys[:i] == keys[i]).sum()) for i in range(len(keys))]
    np.testing.assert_array_equal(rank_within_groups(keys), want)
    assert rank_within_groups(np.zeros(0, np.int64)).shape == (0,)


def test_pair_queues_take_at_most_k_per_pair_in_order_and_every_copy_once():
    n, k = 4, 5
    rng = np.random.default_rng(1)
    alloc = PageAllocator(n, 1000, 16)
    q = PairQueues(n)
    copies = random_copies(rng, alloc, 150)
    located = locate_copies(copies, alloc)
    codes = rng.integers(0, 10, len(copies))
    q.add(located[:, :100], codes[:100])
    q.add(located[:, 100:], codes[100:])  # a later planning round queues behind the first
    assert len(q) == 150
    dropped = q.drop(3)
    keep = codes != 3
    assert dropped == int((~keep).sum()) and len(q) == int(keep.sum())
    taken = []
    while len(q):
        step = q.take(k)
        pair = step[0] * n + step[3]
        assert np.bincount(pair, minlength=n * n).max() <= k
        taken.append(step)
    assert q.take(k).shape == (6, 0)
    got = np.concatenate(taken, axis=1)
    want = located[:, keep]
    # Every remaining copy exactly once, and within each device pair in the order queued.
    for p in range(n * n):
        np.testing.assert_array_equal(got[:, got[0] * n + got[3] == p], want[:, want[0] * n + want[3] == p])


def test_take_all_empties_the_queues():
    alloc = PageAllocator(2, 100, 16)
    q = PairQueues(2)
    located = locate_copies(random_copies(np.random.default_rng(2), alloc, 30), alloc)
    q.add(located, np.zeros(30, np.int64))
    first = q.take(2)
    per_pair = np.bincount(located[0] * 2 + located[3], minlength=4)
    assert first.shape[1] == np.minimum(per_pair, 2).sum()
    assert q.take().shape[1] == 30 - first.shape[1]
    assert len(q) == 0


# --- planning a request's pages ---------------------------------------------------------------


def reference_plan(request, src, dst, allocator, base_only, owner, upto, existing=None):
    """The definition, one page index and one device at a time: reuse the page the device holds
    (a base-segment one under base_only), else reserve one there and copy it from that device's
    page or the lowest device holding it. Returns (dst_pages, copies, reserved, held_from)."""
    n, size = allocator.num_devices, allocator.page_size
    dst_pages = [list(x) for x in existing.dst_pages] if existing else [[] for _ in range(n)]
    copies, reserved = (list(existing.copies), list(existing.reserved)) if existing else ([], [])
    held_from = existing.held_from if existing else None
    first = existing.planned_pages if existing else 0
    holders: dict[int, list[tuple[int, int]]] = {}
    for d, pages in enumerate(request.device_pages):
        for k, page in enumerate(pages):
            holders.setdefault(src.kv_placement.page_index(d, k, n), []).append((d, page))
    last = -(-upto // size)
    for j in range(first, last):
        if j == last - 1:
            held_from = len(copies) if upto % size else None
        have = sorted(holders[j])
        for d in dst.kv_placement.devices_of_page(j, owner, n):
            local = [p for dev, p in have if dev == d]
            usable = [p for p in local if not (base_only and p >= allocator.num_base_pages)]
            if usable:
                dst_pages[d].append(usable[0])
                continue
            new = allocator.allocate(1, d, base_only=base_only)[0]
            reserved.append(new)
            dst_pages[d].append(new)
            copies.append((local[0] if local else have[0][1], new))
    return dst_pages, copies, reserved, held_from


def placed_request(alloc, layout, owner, tokens, rid):
    """A request holding `tokens` tokens as `layout` places them (pages taken from `alloc`)."""
    import types

    n = alloc.num_devices
    g = -(-tokens // alloc.page_size)
    device_pages = [alloc.allocate(layout.kv_placement.pages_held(d, owner, n, g), d) for d in range(n)]
    return types.SimpleNamespace(request_id=rid, num_computed=tokens, device_pages=device_pages, order=0)


@pytest.mark.parametrize("n", [2, 4])
def test_plan_request_matches_the_per_page_definition(n):
    import copy
    import itertools

    from splash_jax.mesh.layouts import LAYOUT_NAMES, get_layout
    from splash_jax.switch.planner import plan_request

    rng = np.random.default_rng(n)
    for src_name, dst_name in itertools.permutations(LAYOUT_NAMES, 2):
        src, dst = get_layout(src_name), get_layout(dst_name)
        for base_only in (False, True):
            alloc = PageAllocator(n, 300, 8, extra_pages_per_device=60)
            # some pages in the extra segment: take most base pages first
            hog = [alloc.allocate(280, d) for d in range(n)]
            owner, tokens = int(rng.integers(n)), int(rng.integers(9, 150))
            r = placed_request(alloc, src, owner, tokens, f"{src_name}-{dst_name}")
            for d in range(n):
                alloc.free(hog[d])
            ref_alloc = copy.deepcopy(alloc)
            mid = int(rng.integers(1, tokens + 1))
            plan = plan_request(r, src, dst, alloc, base_only, owner, upto_tokens=mid)
            want = reference_plan(r, src, dst, ref_alloc, base_only, owner, mid)
            assert (plan.dst_pages, plan.copies, plan.reserved, plan.held_from) == want, (src_name, dst_name, base_only)
            before = copy.deepcopy(plan)
            plan = plan_request(r, src, dst, alloc, base_only, owner, upto_tokens=tokens, existing=plan)  # extend
            want = reference_plan(r, src, dst, ref_alloc, base_only, owner, tokens, existing=before)
            assert (plan.dst_pages, plan.copies, plan.reserved, plan.held_from) == want, (src_name, dst_name, base_only)
            assert alloc._free == ref_alloc._free and alloc._free_extra == ref_alloc._free_extra


def test_plan_request_is_all_or_nothing_without_free_pages():
    from splash_jax.kv.allocator import OutOfPages
    from splash_jax.mesh.layouts import get_layout
    from splash_jax.switch.planner import plan_request

    alloc = PageAllocator(2, 20, 8)
    r = placed_request(alloc, get_layout("cp"), 0, 100, "r")  # 13 pages striped over 2 devices
    rest = [alloc.allocate(alloc.num_free(d) - 3, d) for d in range(2)]  # 3 free pages per device
    free = [alloc.num_free(d) for d in range(2)]
    with pytest.raises(OutOfPages):
        plan_request(r, get_layout("cp"), get_layout("tp"), alloc, False, 0)  # TP needs all 13 everywhere
    assert [alloc.num_free(d) for d in range(2)] == free and rest


@pytest.mark.parametrize("n", [2, 4])
def test_planning_many_requests_at_once_equals_planning_each_in_turn(n):
    """plan_requests (a handoff's or a planning slice's requests at once) against plan_request for
    each request in turn: the same plans, the same pages reserved from the same free lists; new
    plans and extensions of existing ones mixed, some requests with nothing new to plan."""
    import copy
    import itertools

    from splash_jax.mesh.layouts import LAYOUT_NAMES, get_layout
    from splash_jax.switch.planner import plan_request, plan_requests

    rng = np.random.default_rng(10 + n)
    for src_name, dst_name in itertools.permutations(LAYOUT_NAMES, 2):
        src, dst = get_layout(src_name), get_layout(dst_name)
        for base_only in (False, True):
            alloc = PageAllocator(n, 400, 8, extra_pages_per_device=200)
            hog = [alloc.allocate(370, d) for d in range(n)]  # some pages in the extra segment
            reqs = [placed_request(alloc, src, int(rng.integers(n)), int(rng.integers(1, 90)), f"r{i}") for i in range(6)]
            for d in range(n):
                alloc.free(hog[d])
            owners = [int(rng.integers(n)) for _ in reqs]
            plans = [plan_request(r, src, dst, alloc, base_only, o, upto_tokens=int(rng.integers(1, r.num_computed + 1)))
                     if rng.random() < 0.6 else None for r, o in zip(reqs, owners)]
            items = [(r, o, r.num_computed if rng.random() < 0.8 else int(rng.integers(1, r.num_computed + 1)), p)
                     for r, o, p in zip(reqs, owners, plans)]
            ref_alloc, ref_items = copy.deepcopy((alloc, items))
            got = plan_requests(items, src, dst, alloc, base_only)
            want = [plan_request(r, src, dst, ref_alloc, base_only, o, upto_tokens=u, existing=p) for r, o, u, p in ref_items]
            for g, w in zip(got, want):
                assert (g.dst_pages, g.copies, g.reserved, g.held_from, g.planned_pages, g.owner) == (
                    w.dst_pages, w.copies, w.reserved, w.held_from, w.planned_pages, w.owner), (src_name, dst_name, base_only)
            assert alloc._free == ref_alloc._free and alloc._free_extra == ref_alloc._free_extra


def test_planning_many_requests_is_all_or_nothing_without_free_pages():
    import copy

    from splash_jax.kv.allocator import OutOfPages
    from splash_jax.mesh.layouts import get_layout
    from splash_jax.switch.planner import plan_request, plan_requests

    cp, tp = get_layout("cp"), get_layout("tp")
    alloc = PageAllocator(2, 40, 8)
    a, b = (placed_request(alloc, cp, 0, 60, r) for r in "ab")  # 8 pages each, striped
    first = plan_request(a, cp, tp, alloc, False, 0, upto_tokens=20)
    [alloc.allocate(alloc.num_free(d) - 6, d) for d in range(2)]  # 6 free per device: a's rest fits, b's not too
    before, free = copy.deepcopy(first), [alloc.num_free(d) for d in range(2)]
    with pytest.raises(OutOfPages, match="2 requests"):
        plan_requests([(a, 0, 60, first), (b, 0, 60, None)], cp, tp, alloc, False)
    assert [alloc.num_free(d) for d in range(2)] == free
    assert (first.dst_pages, first.copies, first.reserved, first.planned_pages) == (
        before.dst_pages, before.copies, before.reserved, before.planned_pages)


def test_entries_below_counts_the_entries_of_lower_page_indices():
    """Placement.entries_below (arrays at once) against its definition: how many entries k of a
    holding device's list have page_index(d, k) < j."""
    from splash_jax.kv.placement import OWNER, REPLICATED, STRIPED

    n = 3
    for placement in (REPLICATED, OWNER, STRIPED):
        devices, js = np.meshgrid(np.arange(n), np.arange(12), indexing="ij")
        got = np.asarray(placement.entries_below(devices.ravel(), js.ravel(), n))
        want = [sum(1 for k in range(12) if placement.page_index(d, k, n) < j) for d, j in zip(devices.ravel(), js.ravel())]
        assert got.tolist() == want, placement.name

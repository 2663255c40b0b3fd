"""PageTables.append (vectorized) against a page-at-a-time reference, for every placement, both
pool segments, appends of one page (decode) and of many (admission, a handoff's rebuild)."""

import numpy as np
import pytest

from splash_jax.kv.allocator import PageAllocator
from splash_jax.kv.page_table import PageTables
from splash_jax.kv.placement import OWNER, REPLICATED, STRIPED


def reference_append(t: PageTables, slot, device, pages, placement, allocator):
    """The definition, one page at a time (module doc of page_table.py)."""
    _, segments, locals_ = allocator.locate(pages)
    for seg, local in zip(segments.tolist(), locals_.tolist()):
        k = int(t.entries[device, slot])
        j = placement.page_index(device, k, t.n)
        c = int(t.count[device, seg, slot])
        t.local_of[device, seg, slot, j] = local
        t.compact[device, seg, slot, c] = local
        t.count[device, seg, slot] = c + 1
        t.before[device, seg, slot, j + 1 :] += 1
        t.entries[device, slot] = k + 1


@pytest.mark.parametrize("placement", [REPLICATED, OWNER, STRIPED], ids=lambda p: p.name)
def test_vectorized_append_matches_the_page_at_a_time_definition(placement):
    rng = np.random.default_rng(7)
    n, slots, m = 4, 6, 64
    allocator = PageAllocator(n, 40, 16, extra_pages_per_device=12)  # pages come from both segments
    got, want = PageTables(n, slots, m), PageTables(n, slots, m)
    segments_seen = set()
    for _ in range(60):
        slot, device = int(rng.integers(slots)), int(rng.integers(n))
        entries = int(got.entries[device, slot])
        room = sum(1 for k in range(entries, entries + 16) if placement.page_index(device, k, n) < m)
        if room == 0 or allocator.num_free(device) == 0:
            got.clear(slot), want.clear(slot)
            continue
        count = int(rng.choice([1, 1, 2, 5, 16]))
        pages = allocator.allocate(min(count, room, allocator.num_free(device)), device)
        rng.shuffle(pages)  # base and extra pages interleaved
        segments_seen.update(allocator.locate(pages)[1].tolist())
        got.append(slot, device, pages, placement, allocator)
        reference_append(want, slot, device, pages, placement, allocator)
        for name in ("local_of", "before", "compact", "count", "entries"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert segments_seen == {0, 1}  # base and extra pages both exercised


def test_append_past_the_table_width_is_refused():
    allocator = PageAllocator(1, 8, 16)
    t = PageTables(1, 1, 4)
    with pytest.raises(ValueError, match="exceeds the 4 pages"):
        t.append(0, 0, allocator.allocate(5, 0), REPLICATED, allocator)


@pytest.mark.parametrize("placement", [REPLICATED, OWNER, STRIPED], ids=lambda p: p.name)
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_appending_to_many_slots_at_once_equals_appending_each(placement, seed):
    """A switch records its destination's pages for many requests per call (several calls as it
    plans, on top of pages already recorded, slots cleared between); the tables must be what
    appending each request's pages device by device gives (other slots untouched)."""
    rng = np.random.default_rng(seed)
    n, slots, m = 4, 8, 48
    allocator = PageAllocator(n, 90, 16, extra_pages_per_device=90)
    got, want = PageTables(n, slots, m), PageTables(n, slots, m)
    for slot in range(slots):  # earlier state in every slot, to be extended or kept
        page = allocator.allocate(1, slot % n)
        got.append(slot, slot % n, page, placement, allocator)
        reference_append(want, slot, slot % n, page, placement, allocator)
    for d in range(n):
        allocator.allocate(allocator.num_free(d) - 90 - 8, d)  # leave 8 base pages: the rest come from the extra segment
    for _ in range(4):
        chosen = rng.choice(slots, int(rng.integers(1, slots + 1)), replace=False).tolist()
        pages = []
        for slot in chosen:
            per_device = []
            for d in range(n):
                entries = int(got.entries[d, slot])
                room = sum(1 for k in range(entries, entries + int(rng.integers(0, 6))) if placement.page_index(d, k, n) < m)
                got_pages = allocator.allocate(room, d) if room else []
                rng.shuffle(got_pages)
                per_device.append(list(got_pages))
            pages.append(per_device)
        got.append_many(chosen, pages, placement, allocator)
        for slot, per_device in zip(chosen, pages):
            for d, p in enumerate(per_device):
                if p:
                    reference_append(want, slot, d, p, placement, allocator)
        for name in ("local_of", "before", "compact", "count", "entries"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        cleared = int(rng.integers(slots))
        got.clear(cleared), want.clear(cleared)
    assert any(allocator.locate(p)[1].any() for per_device in pages for p in per_device if p)  # extra pages used


@pytest.mark.parametrize("extra", [0, 7])
def test_locate_matches_the_page_id_layout(extra):
    """allocator.locate against the id layout its module states, page by page: base ids of device
    d are [d*B, (d+1)*B), extra ids [N*B + d*E, N*B + (d+1)*E)."""
    n, b = 3, 10
    allocator = PageAllocator(n, b, 4, extra_pages_per_device=extra)
    pages = np.arange(n * (b + extra))
    want = [(p // b, 0, p % b) if p < n * b else ((p - n * b) // extra, 1, (p - n * b) % extra) for p in pages.tolist()]
    for chosen in (pages, pages[: n * b], pages[::-1], pages[:0]):
        got = allocator.locate(chosen)
        assert list(zip(*(x.tolist() for x in got))) == [want[p] for p in chosen.tolist()]

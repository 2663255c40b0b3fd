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
def test_rebuilding_many_slots_at_once_equals_appending_each(placement):
    """A handoff rewrites every running request's slot in one call; the tables must be what
    clearing each slot and appending its pages device by device gives (other slots untouched)."""
    rng = np.random.default_rng(11)
    n, slots, m = 4, 8, 48
    allocator = PageAllocator(n, 60, 16, extra_pages_per_device=60)
    got, want = PageTables(n, slots, m), PageTables(n, slots, m)
    for slot in range(slots):  # earlier state in every slot, to be overwritten or kept
        page = allocator.allocate(1, slot % n)
        got.append(slot, slot % n, page, placement, allocator)
        reference_append(want, slot, slot % n, page, placement, allocator)
    for d in range(n):
        allocator.allocate(allocator.num_free(d) - 60 - 8, d)  # leave 8 base pages: the rest come from the extra segment
    chosen = [6, 1, 3, 4]
    pages = []
    for _ in chosen:
        per_device = []
        for d in range(n):
            count = sum(1 for k in range(int(rng.integers(0, 12))) if placement.page_index(d, k, n) < m)
            got_pages = allocator.allocate(count, d) if count else []
            rng.shuffle(got_pages)
            per_device.append(list(got_pages))
        pages.append(per_device)
    got.rebuild_many(chosen, pages, placement, allocator)
    for slot, per_device in zip(chosen, pages):
        want.clear(slot)
        for d, p in enumerate(per_device):
            if p:
                reference_append(want, slot, d, p, placement, allocator)
    for name in ("local_of", "before", "compact", "count", "entries"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert any(allocator.locate(p)[1].any() for per_device in pages for p in per_device if p)  # extra pages used

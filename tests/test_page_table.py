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

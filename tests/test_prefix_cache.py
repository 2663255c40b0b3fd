"""Prefix caching without a model: the reference-counting allocator, the radix tree, and the
scheduler driven by a fake step over random interleavings (hypothesis), checked against a shadow
of what every page holds: no page is written while shared or freed while referenced, a hit never
returns a page holding other tokens, and an idle engine leaves every page free or cached."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splash_jax.engine.request import Request, SamplingParams, Status
from splash_jax.engine.scheduler import Scheduler
from splash_jax.kv.allocator import OutOfPages, PageAllocator
from splash_jax.kv.placement import OWNER, REPLICATED, STRIPED
from splash_jax.kv.prefix_cache import PrefixCache

S = 4  # tokens per page
VOCAB = 50


def test_a_cached_page_at_zero_references_stays_until_its_memory_is_needed():
    a = PageAllocator(1, 4, S)
    a.on_evict = evicted = []
    a.on_evict = evicted.append
    p = a.allocate(2)
    a.mark_cached(p[0])
    a.free(p)
    assert a.num_free() == 4 and a.num_cached() == 1  # cached pages count as free
    a.ref([p[0]])  # a hit revives it
    assert a.refs(p[0]) == 1 and a.num_evictable(0) == 0
    a.free([p[0]])
    got = a.allocate(4)  # needs every page: the cached one is evicted last
    assert got[-1] == p[0] and evicted == [p[0]] and a.num_cached() == 0
    with pytest.raises(OutOfPages):
        a.allocate(1)
    a.check_invariants()


def test_references_and_double_frees():
    a = PageAllocator(2, 3, S)
    (p,) = a.allocate(1, 1)
    a.mark_cached(p)
    a.ref([p, p])
    a.free([p])
    a.free([p])
    assert a.refs(p) == 1
    a.free([p])
    with pytest.raises(RuntimeError):
        a.free([p])  # no reference left
    (q,) = a.allocate(1, 0)
    a.free([q])
    with pytest.raises(RuntimeError):
        a.ref([q])  # free and uncached: nobody to share it with
    a.check_invariants()


def test_least_recently_released_is_evicted_first_deepest_page_first():
    a = PageAllocator(1, 6, S)
    order = []
    a.on_evict = order.append
    first, second = a.allocate(3), a.allocate(3)
    for p in first + second:
        a.mark_cached(p)
    a.free(first)  # released first: evicted first, its last page before its first
    a.free(second)
    a.allocate(4)
    assert order == first[::-1] + second[::-1][:1]


def test_the_extra_segment_goes_with_its_unreferenced_cached_pages():
    a = PageAllocator(2, 2, S, extra_pages_per_device=2)
    pages = a.allocate(4, 0)  # 2 base, 2 extra
    for p in pages:
        a.mark_cached(p)
    a.free(pages)
    assert a.remove_extra_segment() == 2 and a.num_cached() == 2 and a.num_free(0) == 2
    a.check_invariants()


def req(rid, tokens, max_tokens=6, salt=None):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), cache_salt=salt)


def test_tree_matches_exact_tokens_and_salts():
    a = PageAllocator(1, 16, S)
    cache = PrefixCache(a)
    r = req("a", range(2, 14))  # 3 full pages
    r.device_pages = [a.allocate(3)]
    cache.insert(r, REPLICATED, 3)
    same = req("b", list(range(2, 10)) + [99, 98, 97, 96, 1])
    chain = cache.chain(same, 10)
    assert cache.hits(chain, REPLICATED, 0) == 2  # the third page holds other tokens
    assert cache.hits(cache.chain(req("c", range(2, 14), salt="t1"), 10), REPLICATED, 0) == 0  # another tenant
    assert cache.hits(cache.chain(req("d", [3] + list(range(3, 14))), 10), REPLICATED, 0) == 0


class Shadow:
    """What each page holds, per slot: (salt, the exact tokens up to and including that slot)."""

    def __init__(self):
        self.slots: dict[int, dict[int, tuple]] = {}

    def write(self, sched, r, start, end):
        """A step writes a request's positions: never into a cached page; into a page others hold
        only as a leader (its followers read those positions as their own prefix: `check`)."""
        a = sched.allocator
        n = sched.n
        for p in range(start, end):
            j = p // S
            for d in sched.placement.devices_of_page(j, r.owner, n):
                page = r.device_pages[d][sched.placement.entry_of(j, n)]
                assert not a._cached[page], f"cached page {page} written"
                self.slots.setdefault(page, {})[p % S] = (r.cache_salt, tuple(r.token_slice(0, p + 1)))

    def check(self, sched, r, upto):
        """Every position below `upto` of `r` holds r's own tokens, on each device holding it."""
        n = sched.n
        for p in range(upto):
            j = p // S
            for d in sched.placement.devices_of_page(j, r.owner, n):
                page = r.device_pages[d][sched.placement.entry_of(j, n)]
                want = (r.cache_salt, tuple(r.token_slice(0, p + 1)))
                assert self.slots.get(page, {}).get(p % S) == want, f"{r.request_id} position {p}: page {page} holds other tokens"

    def copy(self, src, dst):
        """A copy-on-write page copy (the engine runs them before the step)."""
        self.slots[dst] = dict(self.slots.get(src, {}))

    def check_hit(self, sched, r):
        n = sched.n
        for j in range(len(r.cache_nodes)):
            for d in sched.placement.devices_of_page(j, r.owner, n):
                page = r.device_pages[d][sched.placement.entry_of(j, n)]
                for s in range(S):
                    p = j * S + s
                    want = (r.cache_salt, tuple(r.token_slice(0, p + 1)))
                    assert self.slots.get(page, {}).get(s) == want, f"hit page {page} holds other tokens"


def fake_token(r):
    seq = r.token_slice(max(0, r.num_known - 3), r.num_known)
    return (sum(seq) * 31 + r.num_known) % (VOCAB - 2) + 2


def drive(ops, placement, n, caching, pages_per_device, share_last=True):
    """Run the scheduler on a fake step over `ops`; returns outputs by request id. share_last:
    a fully cached prompt shares its last page (False: copies it on write, as MTP engines do)."""
    a = PageAllocator(n, pages_per_device, S)
    # As the engine does: a request never outgrows what one device holds (max_model_len is capped).
    max_len = pages_per_device * S
    sched = Scheduler(a, max_num_seqs=6, max_num_batched_tokens=12, placement=placement, max_model_len=max_len,
                      pages_per_request=16, enable_prefix_caching=caching, balance_pages=2)
    sched.share_last_cached_page = share_last
    shadow = Shadow()
    reqs, outs = {}, {}
    prefixes = [list(range(2, 2 + 9)), list(range(20, 20 + 6)), [7, 7, 7, 7, 8, 8, 8, 8]]
    count = 0
    for op in ops:
        kind = op[0]
        if kind == "add":
            _, which, tail, salt, max_tokens = op
            rid = f"r{count}"
            count += 1
            r = req(rid, prefixes[which] + tail, max_tokens, salt)
            if len(r.prompt_ids) >= max_len:
                continue  # the engine refuses it (prompt plus one token exceed the model length)
            reqs[rid] = r
            sched.add(r)
        elif kind == "abort" and sched.running:
            victim = sched.running[op[1] % len(sched.running)]
            sched.finish(victim, "abort")
        elif kind == "preempt" and sched.running:
            sched.preempt(sched.running[op[1] % len(sched.running)])
        for _ in range(op[-1] if kind == "step" else 1):
            step(sched, shadow)
        a.check_invariants()
        for r in sched.running:
            for pages in r.device_pages:
                assert all(a.refs(p) >= 1 for p in pages)
    guard = 0
    while sched.has_work():
        step(sched, shadow)
        guard += 1
        assert guard < 2000
    a.check_invariants()
    assert a.num_referenced() == 0  # idle: every page free or cached
    assert all(a.num_free(d) == pages_per_device for d in range(n))
    for rid, r in reqs.items():
        outs[rid] = (r.finish_reason, list(r.output_ids))
    return outs, sched


def step(sched, shadow):
    before = {id(r) for r in sched.running}
    out = sched.schedule()
    for src, dst in sched.take_page_copies():
        shadow.copy(src, dst)
    for c in out.chunks:
        r = c.request
        if id(r) not in before and c.leader is None:
            shadow.check_hit(sched, r)
        if c.writes:
            shadow.write(sched, r, c.start, c.end)
    for c in out.chunks:  # what each request's attention reads this step (its leader's writes included)
        if c.request.status == Status.RUNNING:
            shadow.check(sched, c.request, c.end)
    sched.dispatched(out.chunks)
    sampling = [c for c in out.chunks if c.samples]
    tokens = np.array([fake_token(c.request) for c in sampling], np.int64)
    sched.update(out.chunks, list(range(len(sampling))), tokens)


OP = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.lists(st.integers(2, VOCAB - 1), max_size=9),
              st.sampled_from([None, None, "t"]), st.integers(1, 8)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 5)),
    st.tuples(st.just("preempt"), st.integers(0, 5)),
)


@pytest.mark.parametrize("placement,n", [(REPLICATED, 2), (OWNER, 3), (STRIPED, 2)], ids=["tp", "dp", "cp"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OP, min_size=1, max_size=30), pages=st.integers(5, 14), share=st.booleans())
def test_random_interleavings_keep_every_page_consistent(placement, n, ops, pages, share):
    cached, sched = drive(ops, placement, n, True, pages, share)
    plain, _ = drive(ops, placement, n, False, pages)
    # With caching the same tokens come out (the fake step's token depends only on the sequence),
    # except where aborts landed on different steps (they are keyed by position in `running`).
    if not any(op[0] in ("abort", "preempt") for op in ops):
        assert cached == plain
    stats = sched.cache_stats
    assert 0 <= stats.hits <= stats.queries


def test_identical_prompts_arriving_together_compute_their_prefix_once():
    a = PageAllocator(1, 40, S)
    sched = Scheduler(a, 8, 20, REPLICATED, 64, 16, enable_prefix_caching=True)
    prompt = list(range(2, 2 + 18))  # 4 full pages + 2 tokens
    for i in range(4):
        sched.add(req(f"g{i}", prompt, 3))
    computed = 0
    while sched.has_work():
        out = sched.schedule()
        computed += sum(c.num_tokens for c in out.chunks if c.num_tokens > 1 or c.start < len(prompt))
        sched.dispatched(out.chunks)
        s = [c for c in out.chunks if c.samples]
        sched.update(out.chunks, list(range(len(s))), np.full(len(s), 5))
    # the leader computes 18 prompt tokens, each follower its last 2 (4 pages shared): the first
    # in the leader's step on its pages (the budget of 20 holds no more), the others from the cache
    assert computed == 18 + 3 * 2, computed
    assert sched.cache_stats.hits == 3 * 16 and sched.cache_stats.followed == 1


def run_until_idle(sched, computed=None, copies=None):
    while sched.has_work():
        out = sched.schedule()
        if copies is not None:
            copies += sched.take_page_copies()
        if computed is not None:
            computed += [(c.request.request_id, c.num_tokens, c.writes) for c in out.chunks if c.start < len(c.request.prompt_ids)]
        sched.dispatched(out.chunks)
        s = [c for c in out.chunks if c.samples]
        sched.update(out.chunks, list(range(len(s))), np.full(len(s), 5))
        sched.allocator.check_invariants()


def test_a_fully_cached_prompt_shares_every_page_and_computes_one_token_without_writing():
    a = PageAllocator(2, 40, S)
    sched = Scheduler(a, 8, 20, REPLICATED, 64, 16, enable_prefix_caching=True)
    prompt = list(range(2, 2 + 4 * S))  # 4 full pages
    sched.add(req("g0", prompt, 3))
    run_until_idle(sched)
    computed, copies = [], []
    for i in (1, 2):
        sched.add(req(f"g{i}", prompt, 3))
    out = sched.schedule()
    # both take every cached page, the last one included, and compute their last token reading its
    # cached latent (no write: a page several requests reference is never written)
    assert [(c.request.request_id, c.start, c.num_tokens, c.writes) for c in out.chunks] == [
        ("g1", 4 * S - 1, 1, False), ("g2", 4 * S - 1, 1, False)]
    g1, g2 = (c.request for c in out.chunks)
    assert g1.device_pages == g2.device_pages and all(len(p) == 4 for p in g1.device_pages)
    assert all(a.refs(p) == 2 for pages in g1.device_pages for p in pages)
    assert sched.take_page_copies() == [] and sched.cache_stats.copied_pages == 0
    sched.dispatched(out.chunks)
    sched.update(out.chunks, [0, 1], np.array([5, 6]))
    out = sched.schedule()  # their next tokens start a page of their own each
    assert [(c.start, c.writes) for c in out.chunks] == [(4 * S, True)] * 2
    for d in range(2):
        assert g1.device_pages[d][:4] == g2.device_pages[d][:4] and g1.device_pages[d][4] != g2.device_pages[d][4]
    sched.dispatched(out.chunks)
    sched.update(out.chunks, [0, 1], np.array([5, 6]))
    run_until_idle(sched, computed, copies)
    assert copies == [] and sched.cache_stats.hits == 2 * (4 * S - 1)
    assert a.num_referenced() == 0 and a.num_cached() >= 2 * 4  # the prompt's pages stay cached, on each device


def test_an_mtp_engine_copies_the_last_cached_page_on_write_instead():
    a = PageAllocator(2, 40, S)
    sched = Scheduler(a, 8, 20, REPLICATED, 64, 16, enable_prefix_caching=True)
    sched.share_last_cached_page = False  # as EngineCore sets it for MTP
    prompt = list(range(2, 2 + 4 * S))  # 4 full pages
    sched.add(req("g0", prompt, 3))
    run_until_idle(sched)
    computed, copies = [], []
    for i in (1, 2):
        sched.add(req(f"g{i}", prompt, 3))
    run_until_idle(sched, computed, copies)
    # every page is cached: each computes its last token on a private copy of the last page, one
    # per device (tp)
    assert computed == [("g1", 1, True), ("g2", 1, True)], computed
    assert len(copies) == 2 * 2 and sched.cache_stats.copied_pages == 4
    assert len({src for src, _ in copies}) == 2 and len({dst for _, dst in copies}) == 4  # one cached page per device
    assert (a.locate([s for s, _ in copies])[0] == a.locate([d for _, d in copies])[0]).all()
    assert sched.cache_stats.hits == 2 * (4 * S - 1)
    assert a.num_referenced() == 0


def test_followers_of_a_page_aligned_prompt_start_in_their_leaders_step_without_writing():
    a = PageAllocator(2, 40, S)
    sched = Scheduler(a, 8, 4 * S + 8, REPLICATED, 64, 16, enable_prefix_caching=True)
    prompt = list(range(2, 2 + 4 * S))
    for i in range(3):
        sched.add(req(f"g{i}", prompt, 3))
    out = sched.schedule()
    # one step: the leader's whole prompt, each follower its last token on the leader's pages,
    # written by the leader only
    assert [(c.request.request_id, c.start, c.num_tokens, c.writes) for c in out.chunks] == [
        ("g0", 0, 4 * S, True), ("g1", 4 * S - 1, 1, False), ("g2", 4 * S - 1, 1, False)]
    assert out.chunks[1].request.device_pages == out.chunks[0].request.device_pages
    assert sched.take_page_copies() == [] and sched.cache_stats.followed == 2
    sched.dispatched(out.chunks)
    sched.update(out.chunks, [0, 1, 2], np.array([5, 6, 7]))
    nxt = sched.schedule()  # each writes its own next token on a page of its own
    pages = [c.request.device_pages[0][-1] for c in nxt.chunks]
    assert len(set(pages)) == 3 and all(c.writes for c in nxt.chunks)
    sched.dispatched(nxt.chunks)
    sched.update(nxt.chunks, [0, 1, 2], np.array([5, 6, 7]))
    run_until_idle(sched)
    assert a.num_referenced() == 0


def test_followers_of_a_whole_prompt_take_no_token_budget():
    """A step whose budget the leader's prompt fills still starts every follower of that prompt:
    their last token reads the leader's slot (GRPO groups: a group per 8K step instead of
    groups spilling into the next). The packed step has the leader's slots only, and each
    follower's logits row is the leader's last slot."""
    from splash_jax.engine.sampler import SamplerWidths
    from splash_jax.engine.step_packer import SlotSampling, StepShape, pack_step

    a = PageAllocator(1, 40, S)
    sched = Scheduler(a, 8, 4 * S, REPLICATED, 64, 16, enable_prefix_caching=True)
    prompt = list(range(2, 2 + 4 * S))
    for i in range(3):
        sched.add(req(f"g{i}", prompt, 3))
    sched.add(req("other", list(range(100, 110)), 3))  # no budget left for it
    out = sched.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens, c.num_slots) for c in out.chunks] == [
        ("g0", 0, 4 * S, 4 * S), ("g1", 4 * S - 1, 1, 0), ("g2", 4 * S - 1, 1, 0)]
    widths = SamplerWidths(1, 1)
    shape = StepShape(4 * S, 4, 1, 1, 16, False, widths)
    packed = pack_step(shape, out.chunks, sched.tables, SlotSampling(8, widths, ()), S)
    fields = shape.replicated_spec().unpack(packed.rep)
    assert (fields["token_slot"] >= 0).sum() == 4 * S  # the leader's tokens only
    assert fields["logits_index"][:3].tolist() == [4 * S - 1] * 3
    sched.dispatched(out.chunks)
    sched.update(out.chunks, [0, 1, 2], np.array([5, 6, 7]))
    nxt = sched.schedule()
    assert [c.request.request_id for c in nxt.chunks] == ["g0", "g1", "g2", "other"]  # decoding; its turn now
    sched.dispatched(nxt.chunks)
    sched.update(nxt.chunks, [0, 1, 2, 3], np.array([5, 6, 7, 8]))
    run_until_idle(sched)
    assert a.num_referenced() == 0


def test_owner_layouts_place_a_request_on_the_device_holding_its_prefix():
    a = PageAllocator(2, 20, S)
    sched = Scheduler(a, 8, 16, OWNER, 64, 16, enable_prefix_caching=True, balance_pages=4)
    first = req("a", range(2, 14), 1)
    sched.add(first)
    run_all(sched)
    owner = first.owner
    follower = req("b", list(range(2, 14)) + [9], 1)
    sched.add(follower)
    run_steps(sched, 1)
    assert follower.owner == owner and follower.num_cached_tokens == 12
    run_all(sched)
    # Unless load says otherwise: fill the prefix's device beyond the balance threshold.
    hogs = [req(f"h{i}", [40 + i] * 24, 30) for i in range(2)]
    for h in hogs:
        h.owner = owner
        sched.waiting.append(h)
    for h in hogs:  # place them by hand on the prefix's device
        sched.waiting.remove(h)
        h.device_pages = [[] for _ in range(2)]
        h.slot = sched._free_slots.pop()
        assert sched.allocate(h, 24)
        h.num_computed, h.cacheable = 24, False  # holding pages, idle (never scheduled: no step runs them)
        sched.running.append(h)
    late = req("c", list(range(2, 14)) + [8], 1)
    sched.add(late)
    run_steps(sched, 1)
    assert late.owner != owner and late.num_cached_tokens == 0
    for h in hogs:
        sched.finish(h, "abort")
    run_all(sched)
    a.check_invariants()


def run_all(sched):
    while sched.has_work():
        out = sched.schedule()
        sched.dispatched(out.chunks)
        s = [c for c in out.chunks if c.samples]
        sched.update(out.chunks, list(range(len(s))), np.full(len(s), 5))


def test_the_policy_prices_only_uncached_prompt_tokens_and_counts_shared_pages_once():
    from types import SimpleNamespace

    from splash_jax.policy import Load

    a = PageAllocator(1, 40, S)
    sched = Scheduler(a, 8, 64, REPLICATED, 64, 16, enable_prefix_caching=True)
    engine = SimpleNamespace(scheduler=sched, allocator=a, config=SimpleNamespace(page_size=S), n=1,
                             layout=SimpleNamespace(kv_placement=REPLICATED))
    system = list(range(2, 2 + 16))  # 4 pages
    sched.add(req("lead", system + [40, 41], 30))
    run_steps(sched, 2)  # computed and cached; still decoding
    for i in range(3):
        sched.add(req(f"w{i}", system + [50 + i, 60 + i, 70 + i], 30))
    load = Load.of(engine)
    # each waiting prompt: 19 tokens, 16 cached -> 3 to compute
    assert sorted(t for c, t in load.prompts) == [3, 3, 3] and all(c == 16 for c, _ in load.prompts)
    run_steps(sched, 2)  # all admitted, sharing the 4 system pages
    load = Load.of(engine)
    pages = sum(len(p) for r in sched.running for p in r.device_pages)
    assert load.pool_tokens == a.num_referenced() * S < pages * S  # shared pages counted once
    assert load.cached_tokens == sum(r.num_tokens for r in sched.running)  # attention still reads each


def run_steps(sched, k):
    for _ in range(k):
        out = sched.schedule()
        sched.dispatched(out.chunks)
        s = [c for c in out.chunks if c.samples]
        sched.update(out.chunks, list(range(len(s))), np.full(len(s), 5))


def test_a_follower_whose_leader_cannot_be_packed_is_preempted_not_run():
    """Packing isolates the requests that fail (engine/device_steps.py): a follower reads the latent
    its leader writes in the same step, so without its leader it is requeued, not run alone."""
    from types import SimpleNamespace

    from splash_jax.engine.device_steps import DeviceSteps

    a = PageAllocator(1, 40, S)
    sched = Scheduler(a, 8, 4 * S + 8, REPLICATED, 64, 16, enable_prefix_caching=True)
    prompt = list(range(2, 2 + 4 * S))
    for i in range(2):
        sched.add(req(f"g{i}", prompt, 3))
    chunks = sched.schedule().chunks
    leader, follower = (c.request for c in chunks)
    assert chunks[1].leader is leader
    failed = []

    def pack(batch):
        if batch[0].request is leader:
            raise ValueError("cannot pack")

    steps = SimpleNamespace(scheduler=sched, _pack=pack, _fail=lambda r, why: (failed.append(r), sched.finish(r, "error")))
    assert DeviceSteps._isolate(steps, chunks, ValueError("step")) == []
    assert failed == [leader] and follower in sched.waiting and follower.slot < 0
    run_until_idle(sched)  # it computes its prompt itself and finishes
    assert follower.finish_reason == "length" and len(follower.output_ids) == 3
    assert a.num_referenced() == 0


@pytest.mark.parametrize("placement", [REPLICATED, OWNER, STRIPED], ids=lambda p: p.name)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_devices_of_every_page_is_devices_of_page_for_each_page_or_none(placement, n):
    """The shortcut the cache's page loops take (one device lookup per request, not per page) names
    exactly the devices devices_of_page names for every page index, or declines."""
    for owner in range(n):
        every = placement.devices_of_every_page(owner, n)
        per_page = {placement.devices_of_page(j, owner, n) for j in range(3 * n + 2)}
        if every is None:
            assert len(per_page) > 1  # declines only where pages differ
        else:
            assert per_page == {every}

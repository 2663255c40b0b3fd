"""A staggered greedy workload with live switches, shared by the switching tests."""

from splash_jax.engine import SamplingParams
from splash_jax.engine.request import accumulate


def run_with_switches(engine, prompts, max_tokens, arrivals, switches=(), rng=None, max_steps=2000):
    """Prompt i arrives at step arrivals[i] (greedy, max_tokens[i]); each layout in `switches`
    starts once the previous switch is done, at a random step (rng; None: at once). Returns
    (outputs by prompt index, switch handles)."""
    acc, ids, done, handles, step = {}, {}, {}, [], 0
    pending = sorted(zip(arrivals, range(len(prompts))))
    queue = list(switches or [])
    while pending or engine.has_work() or queue:
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            ids[engine.add_request(prompts[i], SamplingParams(max_tokens=max_tokens[i]))] = i
        if queue and engine.switcher.active is None and (rng is None or rng.random() < 0.6):
            dst = queue.pop(0)
            if dst != engine.layout.name:
                handles.append(engine.switch_layout(dst))
        for out in accumulate(acc, engine.step()):
            if out.finished:
                done[ids[out.request_id]] = out
        step += 1
        if step > max_steps:
            raise RuntimeError("workload did not finish")
    return done, handles


def settle_in(engine, layout: str) -> None:
    """Hand a shared engine over idle in `layout` (docs/testing.md, "Shared engines"): a switch in
    progress cancelled, every request aborted and its last step applied, prefix caching on with an
    empty cache, and the layout switched to; then that state is asserted. Whatever a test ran
    before, the next one starts from here; a test that needs another state builds it from here."""
    switcher = engine.switcher
    if switcher is not None and switcher.active is not None:
        switcher.active[0].cancel()
    for rid in list(engine._requests):
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    if engine.layout.name != layout:
        h = engine.switch_layout(layout)
        while not h.done:
            engine.step()
        assert h.state.value == "done", h.as_dict()
        while engine.has_work():  # the handoff's source pages are freed at the next boundary
            engine.step()
    if not engine.config.enable_prefix_caching:
        engine.set_prefix_caching(True)
    engine.reset_prefix_cache()
    stats = engine.stats()
    assert engine.layout.name == layout and not engine.has_work() and not engine._requests
    assert switcher is None or switcher.active is None
    assert stats["pages_used"] == 0 and stats["prefix_cache"]["cached_pages"] == 0, stats["prefix_cache"]
    engine.allocator.check_invariants()

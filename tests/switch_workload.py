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
    """Finish or abort what an earlier test left running, then switch to `layout`."""
    for rid in list(engine._requests):
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    if engine.layout.name != layout:
        h = engine.switch_layout(layout)
        while not h.done:
            engine.step()

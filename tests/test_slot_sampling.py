"""SlotSampling.gather (a step's sampling rows, reusing the last gather while the slots and the
table are unchanged) equals a fresh gather from the table every step (the reference)."""

import dataclasses

import numpy as np

from splash_jax.engine import SamplingParams
from splash_jax.engine.sampler import SamplerWidths, SamplingInputs
from splash_jax.engine.step_packer import SlotSampling

WIDTHS = SamplerWidths(num_suppress=3, num_bias=2)


def _fresh(slot_sampling: SlotSampling, n: int, rows, slots, generated) -> SamplingInputs:
    """Rows copied from the table one field at a time, then the output position's fields."""
    out = SamplingInputs.host(n, WIDTHS)
    for f in dataclasses.fields(SamplingInputs):
        getattr(out, f.name)[rows] = getattr(slot_sampling.table, f.name)[slots]
    out.step[rows] = generated
    out.suppress_ids[rows[generated >= slot_sampling.min_tokens[slots]]] = -1
    return out


def _params(rng) -> SamplingParams:
    return SamplingParams(
        max_tokens=64, temperature=float(rng.choice([0.0, 0.7, 1.3])), top_k=int(rng.integers(0, 5)),
        top_p=float(rng.choice([1.0, 0.9])), min_tokens=int(rng.integers(0, 6)),
        presence_penalty=float(rng.choice([0.0, 0.5])), logit_bias={int(rng.integers(0, 50)): 1.5},
        stop_token_ids=[int(rng.integers(0, 50))],
    )


def test_gather_equals_a_fresh_gather_through_assigns_remaps_and_writes_to_its_result():
    rng = np.random.default_rng(0)
    ss = SlotSampling(8, WIDTHS, eos_ids=[2])
    for slot in range(8):
        ss.assign(slot, _params(rng), seed=slot)
    generated = np.zeros(8, np.int64)
    slots = np.array([3, 5], np.int64)
    reused = 0
    for step in range(200):
        event = rng.random()
        if event < 0.05:  # a request takes a slot: the table changes
            ss.assign(int(rng.integers(0, 8)), _params(rng), seed=step)
        elif event < 0.12:  # the batch changes: other slots, other rows
            slots = rng.choice(8, size=int(rng.integers(0, 6)), replace=False).astype(np.int64)
        n = 8 if rng.random() < 0.9 else 16
        rows = np.arange(len(slots), dtype=np.int64) * (2 if n == 16 else 1)
        generated[slots] += 1
        key_before = ss._last[0] if ss._last else None
        got = ss.gather(n, WIDTHS, rows, slots, generated[slots])
        reused += key_before is not None and ss._last[0] == key_before
        want = _fresh(ss, n, rows, slots, generated[slots])
        for f in dataclasses.fields(SamplingInputs):
            np.testing.assert_array_equal(getattr(got, f.name), getattr(want, f.name), err_msg=f"step {step}: {f.name}")
        got.draft[:] = 7  # the caller owns its result: the next gather must not see this
        got.temperature[:] = 9.0
    assert reused > 100  # the case the memo is for happened

"""Single-request generation with the model alone: prefill, then decode one token at a time.

This is the independent reference the engine is tested against (no scheduler, no batching,
no buckets beyond one), and a minimal way to run a model from a notebook.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from splash_jax.engine.request import Request, SamplingParams
from splash_jax.engine.sampler import SamplerWidths
from splash_jax.engine.scheduler import ScheduledChunk
from splash_jax.engine.step_packer import SlotSampling, StepShape, pack_step, unpack_step
from splash_jax.kv.allocator import PageAllocator
from splash_jax.kv.cache import StepInput
from splash_jax.kv.page_table import PageTables
from splash_jax.kv.placement import REPLICATED

_WIDTHS = SamplerWidths(1, 1)


@dataclasses.dataclass
class SingleRequestRunner:
    model: object
    page_size: int = 16
    max_len: int = 256

    def __post_init__(self):
        self.num_pages = -(-self.max_len // self.page_size)
        allocator = PageAllocator(1, self.num_pages, self.page_size)
        self.tables = PageTables(1, 1, self.num_pages)  # one request in slot 0, every page in order
        self.tables.append(0, 0, allocator.allocate(self.num_pages, 0), REPLICATED, allocator)
        self.sampling = SlotSampling(1, _WIDTHS, ())
        self.graphdef, self._state = nnx.split(self.model)
        self._steps: dict[int, tuple] = {}

    def _step(self, bucket: int):
        """The bare model (no mesh) on the engine's own packed step buffers, for a token bucket."""
        if bucket not in self._steps:
            self._steps[bucket] = self._make_step(bucket)
        return self._steps[bucket]

    def _make_step(self, bucket: int):
        shape = StepShape(bucket, bucket, 1, 1, self.num_pages, False, _WIDTHS)
        graphdef = self.graphdef

        def step(state, kv, rep, dev):
            b, _, _, _ = unpack_step(shape, rep, dev[0], jnp.zeros((2, 1), jnp.int32))  # no step before: no ahead tokens
            local = StepInput(b.tokens, b.positions, b.token_request, b.write_page[0], b.write_offset, b.kv_lens[0],
                              b.page_table[0], b.logits_index)
            return nnx.merge(graphdef, state)(kv, local)

        return shape, jax.jit(step, donate_argnums=(1,))

    def new_cache(self):
        return self.model.new_cache(self.num_pages, self.page_size)

    def run(self, kv, tokens, start: int, want: str = "last"):
        """Feed `tokens` at positions start.. ; returns (logits [n, V] numpy, kv)."""
        n = len(tokens)
        bucket = max(8, 1 << (n - 1).bit_length())
        shape, step = self._step(bucket)
        request = Request("reference", [0] * start + [int(t) for t in tokens], SamplingParams(), slot=0)
        packed = pack_step(
            shape, [ScheduledChunk(request, start, n, False)], self.tables, self.sampling, self.page_size,
            all_logits=want == "all",
        )
        logits, kv = step(self._state, kv, packed.rep, packed.dev)
        return np.asarray(logits[: n if want == "all" else 1]), kv
    def greedy(self, prompt, max_new_tokens: int, eos_ids=()) -> list[int]:
        kv = self.new_cache()
        logits, kv = self.run(kv, prompt, 0)
        out = [int(logits[-1].argmax())]
        pos = len(prompt)
        while len(out) < max_new_tokens and out[-1] not in eos_ids:
            logits, kv = self.run(kv, [out[-1]], pos)
            pos += 1
            out.append(int(logits[-1].argmax()))
        return out

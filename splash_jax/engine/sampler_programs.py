"""The sampler programs of a StepExecutor: one small program per (logits rows, SamplerMode) that
samples a full step's logits (penalties, grammar masks, the draw, top-n logprobs), so no step
program is compiled per sampling wish. `SamplerPrograms` is a part of StepExecutor
(engine/executor.py), which owns the penalty state and the compiled programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from splash_jax.engine.penalties import PenaltyState
from splash_jax.engine.program_memory import slow_compile_watch
from splash_jax.engine.sampler import SAMPLER_MODES, SamplerMode, SamplingInputs, sample
from splash_jax.engine.step_programs import StepLogits, StepResult, sampler_name, token_vector
from splash_jax.executable_cache import compile_lowered
from splash_jax.mesh.layouts import Layout
from splash_jax.structured.masks import mask_words


class SamplerPrograms:
    """Sampler programs of StepExecutor (see the module docstring)."""

    def _sampler_program(self, rows: int, mode: SamplerMode):
        """Penalties, the grammar masks, the draw and what `mode` asks for, on a full step's
        StepLogits; replicated like the logits (every device samples the same rows), the penalty
        state only read. The mask is an input of fixed shape ([rows, ceil(V/32)] int32, all ones
        for rows without a grammar), so constrained steps run the same programs."""
        max_rows, draft_rows = self.max_rows, self.mtp_drafts
        spec = bool(self.spec_variants)  # accepted counts only where ahead chunks read them (executor._program)

        def fn(step: StepLogits, penalties: PenaltyState, mask: jax.Array) -> StepResult:
            out = sample(step.logits, step.sampling, penalties, full=True, mode=mode, mask=mask)
            tokens = token_vector(out.tokens, step.sampling.draft if spec else None, max_rows, draft_rows)
            return StepResult(tokens, out.logprob, out.top_ids, out.top_logprobs)

        return jax.jit(fn, out_shardings=self.replicated)

    @property
    def mask_words(self) -> int:
        return mask_words(self.penalties.output_counts.shape[-1])

    def lower_sampler(self, rows: int, mode: SamplerMode):
        vocab = self.penalties.output_counts.shape[-1]
        step = StepLogits(jax.ShapeDtypeStruct((rows, vocab), jnp.float32, sharding=self.replicated),
                          SamplingInputs.abstract(rows, self.widths, self.replicated))
        pen = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated), self.penalties)
        mask = jax.ShapeDtypeStruct((rows, self.mask_words), jnp.int32, sharding=self.replicated)
        return self._sampler_program(rows, mode).lower(step, pen, mask)

    def sampler_program(self, rows: int, mode: SamplerMode):
        """The compiled sampler program for `rows` logits rows (compiled here only without warm-up)."""
        program = self._samplers.get((rows, mode))
        if program is None:
            program = self._samplers[(rows, mode)] = self._compile_sampler(rows, mode)
            self.num_compiled += 1
        return program

    def _compile_sampler(self, rows: int, mode: SamplerMode):
        name = sampler_name(rows, mode)
        with slow_compile_watch(name):
            program = compile_lowered(self.lower_sampler(rows, mode), None, self.device_key)
        self.program_memory.record(name, program)
        return program

    def open_mask(self, rows: int) -> jax.Array:
        """The all-ones mask of `rows` rows, kept on the device (steps without a grammar send none)."""
        mask = self._open_masks.get(rows)
        if mask is None:
            mask = self._open_masks[rows] = jax.device_put(np.full((rows, self.mask_words), -1, np.int32), self.replicated)
        return mask

    def sampler_rows(self, layouts: list[Layout]) -> list[int]:
        """Logits rows of every bucket's step in these layouts: the sampler programs warm-up needs."""
        return sorted({self.shape(lay, b).rows for lay in layouts for b in self.buckets(lay)})

    def compile_samplers(self, layouts: list[Layout]) -> int:
        """Compile the sampler program of every (rows, mode) these layouts' full steps can need."""
        todo = [key for key in self.sampler_keys(layouts) if key not in self._samplers]
        with self.compile_stats.track("samplers") as rec:
            for key in todo:
                self._samplers[key] = self._compile_sampler(*key)
                self.open_mask(key[0])
            rec["programs"] = len(todo)
        self.num_compiled += len(todo)
        self.compile_seconds += rec["seconds"]
        return len(todo)

    def sampler_keys(self, layouts: list[Layout]) -> list[tuple[int, SamplerMode]]:
        """(logits rows, mode) of every sampler program these layouts' full steps can need."""
        return [(r, m) for r in self.sampler_rows(layouts) for m in SAMPLER_MODES]

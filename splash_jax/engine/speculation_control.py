"""Speculative decoding's controls on the engine core: which drafter and K the scheduler uses, the
draft budget, whether speculative steps overlap, and `set_speculative` to change them between
steps. `SpeculationControl` is a part of EngineCore (engine/engine_core.py), which owns the state
used here (config, scheduler, executor, MTP drafter)."""

from __future__ import annotations

from splash_jax.engine.core_output import CoreOutput
from splash_jax.engine.draft_budget import keeps_k
from splash_jax.engine.late_drafts import depends_on_step_in_flight
from splash_jax.engine.speculative import NgramDrafter


class SpeculationControl:
    """Speculation settings of EngineCore (see the module docstring)."""

    @property
    def speculates_ahead(self) -> bool:
        """Whether speculative steps overlap: a drafter that proposes behind a token still on the
        device (propose_after: n-gram, custom, and MTP, whose drafts stay on the device) and step
        programs with a variant per count of drafts a step may keep (StepShape.variants)."""
        c = self.config
        return (c.speculative_k > 0 and c.speculative_k < self.executor.spec_variants
                and hasattr(self.scheduler.drafter, "propose_after"))

    def _drafts_after_the_step_in_flight(self) -> bool:
        """Whether this step reads the step in flight back before it is scheduled and drafts from
        its tokens (--speculative-ngram-drafts sync): n-gram drafts while the draft budget's level,
        chosen at the last step, is above 0 (always without a budget). Also in `late` mode while a
        request that keeps its K runs (a seeded sampled one, which drafts at every level): its
        drafts, and so its tokens, must not depend on whether a lookup ran before or after the
        step in flight; and on an MTP engine, whose steps also carry next tokens late binding does
        not rewrite. A level-0 step drafts nothing and overlaps as with speculation off."""
        mode = self.config.speculative_ngram_drafts
        if mode == "ahead" or not (self.config.overlap_scheduling and isinstance(self.scheduler.drafter, NgramDrafter)):
            return False
        keeping = any(keeps_k(r) for r in self.scheduler.running)
        if self._late_binding() and not keeping:
            return False
        budget = self.draft_budget
        return budget is None or budget.level > 0 or keeping

    def _late_binding(self) -> bool:
        """n-gram drafts behind a step in flight are bound late (--speculative-ngram-drafts late)."""
        return (self.config.speculative_ngram_drafts == "late" and self.mtp is None
                and isinstance(self.scheduler.drafter, NgramDrafter))

    def _binds_late_drafts(self, chunks) -> bool:
        """Whether a step dispatched behind another fills its n-gram drafts from that step's tokens
        before its launch (engine/late_drafts.py): only a step with such drafts waits
        for the step in flight."""
        return self._late_binding() and any(map(depends_on_step_in_flight, chunks))

    def _set_drafting(self) -> None:
        """Overlapped speculation pauses while a layout switch runs: its plans copy the pages of
        verified tokens, which an ahead chunk's host state does not name yet."""
        ahead = self.overlapped  # (with K > 0: only when speculates_ahead)
        switching = self.switcher is not None and self.switcher.active is not None
        self.scheduler.speculate_ahead = ahead and not switching
        self.scheduler.drafting_paused = ahead and switching
        self.scheduler.pad_drafts = ahead and self._late_binding()

    def _drafter(self):
        c = self.config
        if not c.speculative_k:
            return None
        if c.speculative_method == "mtp":
            return self.mtp_drafter
        if c.speculative_method == "custom":
            return self._custom_drafter
        return NgramDrafter(c.speculative_ngram_min, c.speculative_ngram_max)

    @property
    def _mtp_drafting(self) -> bool:
        return self.mtp is not None and self.config.speculative_method == "mtp"

    def _mtp_keeps(self, chunks) -> bool:
        """Whether the draft program after a step of these chunks computes drafts (else only its
        MTP latents: MtpDraftRunner.arm): MTP speculation is on and the draft budget's level for
        this step is above 0, or a request sampling in it keeps its K (keeps_k). The next step
        mostly runs at this step's level; when the budget then leaves level 0 (an exploration, a
        new batch size), that one step verifies no MTP drafts, and the budget does not measure
        the first step at a new level anyway (DraftBudget.observe)."""
        if not self._mtp_drafting:
            return False
        budget = self.draft_budget
        return budget is None or budget.level > 0 or any(c.samples and keeps_k(c.request) for c in chunks)

    def set_speculative(self, method: str, num_tokens: int | None = None, drafter=None) -> list[CoreOutput]:
        """Turn speculative decoding on ("ngram") or off ("off"), or change K, between steps
        (returns the flushed outputs; the counters start again). Drafts use the logits rows the
        engine was built with: max_num_seqs x (1 + K) when it started with speculation on, else
        max_num_seqs, so a batch that fills the rows verifies fewer drafts. Nothing compiles.
        drafter: a drafter object of the library's (speculative.NgramDrafter's methods), used with
        method "custom" (benchmarks: set_acceptance.SetAcceptanceDrafter)."""
        if (method == "custom") != (drafter is not None):
            raise ValueError('a drafter object goes with method "custom" (and "custom" needs one)')
        outputs = self._flush()
        previous = (self.config.speculative_method, self.config.speculative_tokens, self._custom_drafter)
        self._custom_drafter = drafter
        self.config.speculative_method = method
        if num_tokens is not None:
            self.config.speculative_tokens = num_tokens
        try:
            self.config.validate()
            if method == "mtp" and self.mtp is None:
                raise ValueError("MTP drafts need the engine started with --speculative-method mtp "
                                 "(the MTP layer and its draft programs are built at start-up)")
            if method == "mtp" and self.config.speculative_tokens > self.mtp.k:
                raise ValueError(f"this engine's MTP draft programs chain {self.mtp.k} drafts; "
                                 f"--speculative-tokens {self.config.speculative_tokens} needs a restart")
        except ValueError:
            self.config.speculative_method, self.config.speculative_tokens, self._custom_drafter = previous
            raise
        if self.mtp_drafter is not None:
            self.mtp_drafter.forget()
        self._set_speculation()
        return outputs

    def _set_speculation(self) -> None:
        """The scheduler's drafter, K and draft budget from the config (counters start again)."""
        c = self.config
        self.draft_budget = None
        if c.speculative_k and c.speculative_adaptive:
            from splash_jax.engine.draft_budget import DraftBudget

            self.draft_budget = DraftBudget(c.speculative_k)
        self.scheduler.set_speculation(self._drafter(), c.speculative_k, self.draft_budget)


"""The engine for notebooks and the library: the engine core plus its front end, in one process.

    engine = Engine(EngineConfig(model="path/to/deepseek"))
    outs = engine.generate(["Hello", "Tell me"], SamplingParams(max_tokens=32))

`Engine` is an `EngineCore` (engine/engine_core.py: scheduling, device steps, switches) whose
`step()` also runs the front end's output processing (engine/output_processor.py: text, stop
strings, metrics) and whose `make_request` tokenizes and validates (engine/request_factory.py).
The API server runs the same two halves in two processes (engine/core_server.py,
engine/core_client.py); this class keeps them in one for code that steps the engine itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from splash_jax.engine.core_output import CoreOutput
from splash_jax.engine.engine_core import EngineCore
from splash_jax.engine.output_processor import OutputProcessor
from splash_jax.engine.request import Request, RequestError, RequestOutput, SamplingParams
from splash_jax.engine.request_factory import EngineFacts, RequestFactory


class Engine(EngineCore):
    def __init__(self, config=None, model=None, tokenizer=None, **overrides):
        super().__init__(config, model, tokenizer, **overrides)
        self.facts = EngineFacts.of(self)
        self.requests_in = RequestFactory(self.facts, self.tokenizer, lambda: self.grammars)
        self.outputs = OutputProcessor(self.tokenizer)

    # --- requests ------------------------------------------------------------------------
    def make_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None,
                     cache_salt: str | None = None) -> Request:
        """Validate and tokenize a request without touching engine state (safe from any thread).
        `cache_salt`: only requests with the same salt share prefix-cache pages (tenants)."""
        self.requests_in.tokenizer = self.tokenizer  # tests swap it
        return self.requests_in.make(prompt, params, request_id, cache_salt)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    cache_salt: str | None = None) -> str:
        request = prompt if isinstance(prompt, Request) else self.make_request(prompt, params, request_id, cache_salt)
        super().add_request(request)
        self.outputs.add(request)
        return request.request_id

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        self.outputs.remove(request_id)
        return super().abort(request_id, reason)

    # --- steps ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:  # type: ignore[override]
        """One core step; the deltas of the step that completed (text, stops applied)."""
        return self._deltas(super().step())

    def flush(self) -> list[RequestOutput]:  # type: ignore[override]
        return self._deltas(super().flush())

    def set_speculative(self, method: str, num_tokens: int | None = None, drafter=None) -> list[RequestOutput]:  # type: ignore[override]
        return self._deltas(super().set_speculative(method, num_tokens, drafter))

    def set_overlap(self, enabled: bool) -> list[RequestOutput]:  # type: ignore[override]
        return self._deltas(super().set_overlap(enabled))

    def _deltas(self, outputs: list[CoreOutput]) -> list[RequestOutput]:
        deltas, stopped = self.outputs.process_all(outputs)
        for request_id in stopped:  # a stop string: the core stops computing it now
            super().abort(request_id, "stop")
        return deltas

    # --- convenience ---------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; a bad prompt returns an output with `error` set, the rest run."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        results: dict[int, RequestOutput] = {}
        ids: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                request = self.make_request(prompt, p)
                ids[self.add_request(request)] = i
                results[i] = RequestOutput(
                    request.request_id, [], "", False, None, num_prompt_tokens=len(request.prompt_ids),
                    prompt_ids=request.prompt_ids,
                )
            except RequestError as e:
                results[i] = RequestOutput(f"invalid-{i}", [], "", True, "error", error=str(e))
        while any(not o.finished for o in results.values()):
            for out in self.step():
                if out.request_id in ids:
                    results[ids[out.request_id]].accumulate(out)
        return [results[i] for i in range(len(prompts))]

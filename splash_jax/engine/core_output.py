"""What the engine core sends per request per step: new token ids and what only the core knows.

The core never detokenizes. Text, stop strings and output formatting belong to the front end
(`OutputProcessor`), in the same process for notebooks (`Engine`) or in the API server's process
(`serve`), so a `CoreOutput` is plain data: a msgspec struct that crosses the process boundary as
msgpack without pickling.
"""

from __future__ import annotations

import msgspec


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS / a stop token / a complete grammar), "length", "abort", "error"
    stop_reason: int | None = None  # the stop_token_id that ended it (None for EOS)
    stop_token: bool = False  # the last new token is the stop token: its text is never shown
    logprobs: list[float] | None = None  # the chosen tokens' logprobs, when the request asked for logprobs
    top_logprobs: list[dict[int, float]] | None = None  # each token's top-n alternatives
    num_cached_tokens: int = 0  # prompt tokens its admission found in the prefix cache
    error: str | None = None  # why it failed (finish_reason "error")
    step_failed: bool = False  # it failed because a device step failed (the front end raises EngineStepError)
    prompt_logprobs: list[float | None] | None = None  # on its first output only (vLLM's shape: None first)
    prompt_top_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

"""Which tokens of a request need a mask row: grammars that start after a reasoning block, and
a thinking-token budget (SamplingParams.reasoning_end_token_id, thinking_token_budget).

A request whose output begins inside a reasoning block (`<think> ... </think>`) is "reasoning"
until its end token reaches the host; reasoning tokens are the output tokens before that end
token (the end token itself is not one). While reasoning, its grammar is neither applied nor
advanced (the scheduler skips it, and the end token is not fed to it either): the grammar starts
with the token after the end token, as in vLLM and SGLang. With a budget b, the token at output
position b is forced to be the end token if the request is still reasoning then.

The state is `Request.reasoning_end` (the end token's index in output_ids, -1 before it), set
where output_ids grows (scheduler._apply), so it survives preemption and step-failure recovery
with the tokens it describes. Every module asks here whether a request needs masks, so device
steps, mask fills and speculation always agree.
"""

from __future__ import annotations

from splash_jax.engine.request import Request


def reasoning(request: Request) -> bool:
    """Whether the request's known output is still inside its reasoning block."""
    return request.params.reasoning_end_token_id is not None and request.reasoning_end < 0


def needs_masks(request: Request, index: int | None = None) -> bool:
    """Whether the token at output position `index` may need a mask row (None: any later token).

    Conservative: it reads the host's state, which under overlapped scheduling is a token behind
    (a reasoning end still on the device counts as not yet sampled), so it may say yes where the
    mask turns out all ones, never no where a mask is needed (`mask_row` decides exactly). A budget
    request needs no masks for its first `budget` reasoning tokens, so those steps keep overlap."""
    if request.grammar is not None:
        return True
    budget = request.params.thinking_token_budget
    return budget is not None and reasoning(request) and (index is None or index >= budget)


def mask_row(request: Request):
    """What constrains the request's next token, from its state once every earlier token is
    applied: its grammar matcher, the end token id (an int: the row allows only that token, the
    budget is spent), or None (all ones: reasoning under budget, or unconstrained)."""
    if reasoning(request):
        budget = request.params.thinking_token_budget
        if budget is not None and len(request.output_ids) >= budget:
            return request.params.reasoning_end_token_id
        return None
    return request.grammar


def after_token(request: Request, token: int) -> bool:
    """Record a token just appended to output_ids; True if the grammar should consume it (the
    request is past its reasoning block and the token is not the end token)."""
    if reasoning(request):
        if token == request.params.reasoning_end_token_id:
            request.reasoning_end = len(request.output_ids) - 1
        return False
    return request.grammar is not None

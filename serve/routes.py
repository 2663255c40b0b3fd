"""The HTTP routes; each hands off to the module that does the work."""

from __future__ import annotations

import asyncio
import time

import jax
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

import splash_jax
from serve.chat import create_chat_completion
from serve.completions import create_completion
from serve.context import ServerContext
from serve.errors import APIError
from serve.metrics import num_switches
from serve.protocol import (
    ChatCompletionRequest, CompletionRequest, LayoutInfo, LayoutRequest, LayoutSwitchResponse, ModelCard, ModelList,
    VersionInfo,
)
from serve.responses import create_response
from serve.responses_protocol import ResponsesRequest
from serve.tokenize import (
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, detokenize, tokenize, tokenizer_info,
)

router = APIRouter()


def get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


@router.get("/health")
async def health(ctx: ServerContext = Depends(get_ctx)) -> dict:
    if not ctx.engine.is_running:
        raise APIError("the engine is not running", 503)
    return {"status": "ok"}


@router.get("/version")
async def version(ctx: ServerContext = Depends(get_ctx)) -> VersionInfo:
    f = ctx.facts
    return VersionInfo(
        version=getattr(splash_jax, "__version__", "0.1.0"), jax=jax.__version__, backend=f.platform,
        device_kind=f.device_kind, num_devices=f.num_devices,
    )


@router.get("/metrics")
async def metrics(ctx: ServerContext = Depends(get_ctx)) -> Response:
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _card(ctx: ServerContext, name: str) -> ModelCard:
    return ModelCard(id=name, root=ctx.model_root, max_model_len=ctx.engine.max_model_len)


@router.get("/v1/models")
async def list_models(ctx: ServerContext = Depends(get_ctx)) -> ModelList:
    return ModelList(data=[_card(ctx, name) for name in ctx.served_model_names])


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, ctx: ServerContext = Depends(get_ctx)) -> ModelCard:
    return _card(ctx, ctx.resolve_model(model_id))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request, ctx: ServerContext = Depends(get_ctx)) -> Response:
    return await create_completion(ctx, body, raw)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request, ctx: ServerContext = Depends(get_ctx)) -> Response:
    return await create_chat_completion(ctx, body, raw)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, raw: Request, ctx: ServerContext = Depends(get_ctx)) -> Response:
    return await create_response(ctx, body, raw)


# --- tokenizer (server root, as vLLM serves them) ------------------------------------------
@router.post("/tokenize")
async def tokenize_route(body: TokenizeRequest, ctx: ServerContext = Depends(get_ctx)) -> TokenizeResponse:
    return await tokenize(ctx, body)


@router.post("/detokenize")
async def detokenize_route(body: DetokenizeRequest, ctx: ServerContext = Depends(get_ctx)) -> DetokenizeResponse:
    return await detokenize(ctx, body)


@router.get("/tokenizer_info")
async def tokenizer_info_route(ctx: ServerContext = Depends(get_ctx)) -> dict:
    return await tokenizer_info(ctx)


# --- attention layout ----------------------------------------------------------------------
SWITCH_WAIT_S = 600.0  # `wait: true` answers after this long at most (the switch carries on)


def _switching_available(ctx: ServerContext) -> bool:
    return bool(ctx.facts.enable_switching)


async def _layout_info(ctx: ServerContext) -> LayoutInfo:
    stats = await ctx.engine.utility("stats")  # fresh, not the snapshot
    return LayoutInfo(
        layout=str(stats.get("layout", "unknown")), num_switches=num_switches(stats),
        switching_available=_switching_available(ctx), switch=stats.get("switch"),
    )


@router.get("/v1/layout")
async def get_layout(ctx: ServerContext = Depends(get_ctx)) -> LayoutInfo:
    return await _layout_info(ctx)


@router.post("/v1/layout")
async def set_layout(body: LayoutRequest, ctx: ServerContext = Depends(get_ctx)) -> LayoutSwitchResponse:
    """Start a live switch of the attention layout: the engine migrates between steps while
    requests keep running, and hands off at a batch boundary. 409 if the engine refuses it now."""
    if not _switching_available(ctx):
        current = (await _layout_info(ctx)).layout
        raise APIError(
            f"layout switching is not available in this server (the current layout is {current!r}; "
            "start it with --enable-switching, in a build whose engine can switch)",
            501, param="layout", code="layout_switching_unavailable",
        )

    try:
        result = await ctx.engine.utility("switch_layout", body.layout, bool(body.preempt))
    except ValueError as e:  # unknown layout, or one this mesh cannot run
        raise APIError(str(e), 400, param="layout") from e
    if body.wait and result.get("state") == "migrating":
        deadline = time.monotonic() + SWITCH_WAIT_S
        while ctx.engine.is_running and time.monotonic() < deadline and not await ctx.engine.utility("switch_done"):
            await asyncio.sleep(0.02)  # the engine core advances it between steps
        result = await ctx.engine.utility("last_switch") or result
    if result.get("state") == "refused":
        raise APIError(f"the switch to {body.layout!r} was refused: {result.get('reason')}", 409,
                       param="layout", code="layout_switch_refused")
    return LayoutSwitchResponse(**(await _layout_info(ctx)).model_dump(), result=result)

"""The FastAPI application around an AsyncEngine (build it yourself to serve from a notebook:
`uvicorn.run(build_app(AsyncEngine(engine), ServerConfig()))`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import serve.routes
from serve.body_limit import BodyLimit
from serve.config import ServerConfig
from serve.context import ServerContext
from serve.errors import error_body, install_error_handlers
from serve.metrics import ServerMetrics
from serve.outputs import TokenText
from serve.reasoning import ReasoningMarkers
from splash_jax.engine.async_engine import AsyncEngine
from splash_jax.engine.core_client import EngineClient
from splash_jax.paths import DEFAULT_MODEL

log = logging.getLogger(__name__)


def model_folder(engine: AsyncEngine | EngineClient) -> Path:
    return Path(engine.facts.model) if engine.facts.model else DEFAULT_MODEL


def build_app(engine: AsyncEngine | EngineClient, config: ServerConfig | None = None, shutdown_engine: bool = True) -> FastAPI:
    """The app; when the server stops (after open requests had their grace period) it also stops
    the engine loop, unless shutdown_engine is False (a notebook that keeps using the engine)."""
    config = config or ServerConfig()
    markers = ReasoningMarkers.of(engine.tokenizer, config.reasoning_parser)  # ValueError: the parser cannot work here
    folder = model_folder(engine)
    metrics = ServerMetrics(engine.stats)
    pool = concurrent.futures.ThreadPoolExecutor(config.limits.tokenizer_threads, thread_name_prefix="splash-tokenize")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        pool.shutdown(wait=False, cancel_futures=True)
        if shutdown_engine:
            log.info("stopping the engine")
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="splash-jax", summary="OpenAI-compatible server for MLA models in JAX", lifespan=lifespan)
    app.state.ctx = ServerContext(
        engine=engine,
        metrics=metrics,
        served_model_names=config.served_model_name or [folder.resolve().name],
        model_root=str(folder),
        token_text=TokenText(engine.tokenizer),
        limits=config.limits,
        facts=engine.facts,
        pool=pool,
        reasoning_parser=config.reasoning_parser,
        reasoning_markers=markers,
    )
    install_error_handlers(app, on_error=lambda status: metrics.errors.labels(str(status)).inc())
    app.add_middleware(BodyLimit, max_bytes=config.limits.max_body_bytes, on_reject=lambda: metrics.errors.labels("413").inc())
    if config.api_key:
        _require_api_key(app, config.api_key, metrics)
    app.include_router(serve.routes.router)
    return app


def _require_api_key(app: FastAPI, key: str, metrics: ServerMetrics) -> None:
    expected = f"Bearer {key}".encode()

    @app.middleware("http")
    async def check(request: Request, call_next):
        if request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                metrics.errors.labels("401").inc()
                body = error_body("missing or wrong API key (send 'Authorization: Bearer <key>')", 401, code="invalid_api_key")
                return JSONResponse(body.model_dump(), status_code=401)
        return await call_next(request)

"""The serving engine: requests, scheduler, AOT step executor, sampling."""

from splash_jax.engine.async_engine import AsyncEngine
from splash_jax.engine.config import EngineConfig
from splash_jax.engine.engine import Engine
from splash_jax.engine.request import RequestError, RequestOutput, SamplingParams

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "RequestError", "RequestOutput", "SamplingParams"]

"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the matching status.

Every failure path ends here, so clients (the `openai` package maps statuses to exception
classes) see one shape whatever went wrong: 400 bad values or a malformed body (as OpenAI,
vLLM and SGLang answer, so clients raise BadRequestError), 401 bad key, 404 unknown model or
route, 405 wrong method (with `Allow`), 409 refused layout switch, 413 body too large, 501
unavailable feature, 503 engine down, 500 bugs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.protocol import ErrorInfo, ErrorResponse
from splash_jax.engine.async_engine import EngineDeadError, EngineStepError
from splash_jax.engine.request import RequestError

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client as is."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.headers = message, status, param, code, headers


def printable(text: str) -> str:
    """Text that always encodes as UTF-8 (a lone surrogate from a client would break the response)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(
        message=printable(message), type=_TYPES.get(status, "invalid_request_error"),
        param=printable(param) if param is not None else None, code=code,
    ))


def to_api_error(exc: BaseException) -> APIError:
    """Map anything raised while serving a request to what the client is told."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return APIError(str(exc), 400, param=getattr(exc, "field", None))
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), 503)
    if isinstance(exc, EngineStepError):
        return APIError(str(exc), 500)
    log.error("unexpected error while serving a request", exc_info=exc)
    return APIError(f"internal error: {type(exc).__name__}", 500)


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] = lambda status: None) -> None:
    def respond(err: APIError) -> JSONResponse:
        on_error(err.status)
        body = error_body(err.message, err.status, err.param, err.code).model_dump()
        return JSONResponse(body, status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    @app.exception_handler(RequestError)
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineStepError)
    async def _api(request: Request, exc: Exception) -> JSONResponse:
        return respond(to_api_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(exc.errors())
        return respond(APIError(message, 400, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return respond(APIError(message, exc.status_code, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return respond(to_api_error(exc))


def describe_validation_errors(errors: Sequence[dict]) -> tuple[str, str | None]:
    """pydantic's errors as one line, one entry per field (a union field fails once per member
    type; those become one entry naming the accepted types). A body that is not JSON at all has
    no field to name (param null; pydantic's location is a character offset)."""
    for e in errors:
        if e.get("type") == "json_invalid":
            reason = (e.get("ctx") or {}).get("error", "")
            return "the request body is not valid JSON" + (f" ({reason})" if reason else ""), None
    by_field: dict[str, list[dict]] = {}
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        by_field.setdefault(loc[0] if loc else "body", []).append({**e, "loc": loc})
    if not by_field:
        return "malformed request body", None
    parts = []
    for field, errs in by_field.items():
        if len(errs) > 1 and all(len(e["loc"]) >= 2 for e in errs):
            kinds = ", ".join(dict.fromkeys(e["loc"][1] for e in errs))
            parts.append(f"{field}: expected one of {kinds}")
        else:
            e = errs[0]
            parts.append(f"{'.'.join(e['loc']) or 'body'}: {e.get('msg', 'invalid')}")
    first = next(iter(by_field))
    return "malformed request body: " + "; ".join(parts), (first if first != "body" else None)

"""Every error answered in OpenAI's JSON shape: the app's exception handlers, and the scheduler's
refusals (:class:`~.scheduler.QueueFull`, :class:`~.scheduler.ShuttingDown`) as API errors."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

import lloyal

from ..scheduling.scheduler import QueueFull, ShuttingDown
from .protocol import ApiError, error_body

__all__ = ["RETRY_AFTER", "add_error_handlers", "document_errors", "scheduler_error"]

RETRY_AFTER = {"Retry-After": "1"}


def scheduler_error(exc: QueueFull | ShuttingDown) -> ApiError:
    """A scheduler refusal as the API error it is answered with (429 or 503)."""
    if isinstance(exc, QueueFull):
        return ApiError(str(exc), status=429, type="rate_limit_error", code="queue_full", headers=RETRY_AFTER)
    return ApiError(str(exc), status=503, type="unavailable_error", code="shutting_down")


async def api_error(_r: Request, exc: ApiError) -> JSONResponse:
    """An :class:`ApiError` with its status, type, param, code and headers."""
    body = error_body(exc.message, exc.type, exc.param, exc.code)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


async def queue_full(r: Request, exc: QueueFull) -> JSONResponse:
    """Too many requests waiting: 429 with ``Retry-After``."""
    return await api_error(r, scheduler_error(exc))


async def shutting_down(r: Request, exc: ShuttingDown) -> JSONResponse:
    """Refused while draining: 503."""
    return await api_error(r, scheduler_error(exc))


async def validation_error(_r: Request, exc: RequestValidationError) -> JSONResponse:
    """Malformed JSON, and a body that parses but breaks the schema: 400 (as OpenAI and vLLM
    answer), ``code`` ``json_invalid`` or ``invalid_schema``."""
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    # a model validator's own message, without pydantic's "Value error, " before it
    said = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    msg = f"{loc}: {said}" if loc else said
    if first.get("type") == "json_invalid":
        body = error_body(f"the body is not valid JSON ({msg})", "invalid_request_error", code="json_invalid")
        return JSONResponse(body, status_code=400)
    return JSONResponse(
        error_body(msg, "invalid_request_error", loc or None, code="invalid_schema"), status_code=400
    )


async def http_error(r: Request, exc: HTTPException) -> JSONResponse:
    """The router's own refusals (a path that does not exist: 404; a method it does not take:
    405) in OpenAI's shape."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = f"{r.method} {r.url.path}: {exc.detail}"
    return JSONResponse(
        error_body(msg, "invalid_request_error", code=code), status_code=exc.status_code, headers=exc.headers
    )


async def internal_error(_r: Request, exc: Exception) -> JSONResponse:
    """Anything else (a bug): 500 in OpenAI's shape (the traceback goes to the server's log)."""
    msg = f"internal server error ({type(exc).__name__}): please report it; the request was not completed"
    return JSONResponse(error_body(msg, "server_error", code="internal_error"), status_code=500)


async def lloyal_error(_r: Request, exc: lloyal.LloyalError) -> JSONResponse:
    """The core's errors: 400 for the caller's (tokens, grammar, chat template), else 500."""
    user = isinstance(exc, lloyal.InvalidTokenError | lloyal.GrammarError | lloyal.ChatTemplateError)
    status, kind = (400, "invalid_request_error") if user else (500, "server_error")
    return JSONResponse(error_body(str(exc), kind, code=type(exc).__name__), status_code=status)


async def value_error(_r: Request, exc: ValueError) -> JSONResponse:
    """A ``ValueError`` from a request's values: 400."""
    return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=400)


def add_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app``."""
    app.exception_handler(ApiError)(api_error)
    app.exception_handler(QueueFull)(queue_full)
    app.exception_handler(ShuttingDown)(shutting_down)
    app.exception_handler(RequestValidationError)(validation_error)
    app.exception_handler(lloyal.LloyalError)(lloyal_error)
    app.exception_handler(ValueError)(value_error)
    app.exception_handler(HTTPException)(http_error)
    app.exception_handler(Exception)(internal_error)


# The statuses a route may answer with OpenAI's error JSON, as its OpenAPI document lists them.
_ERRORS = {
    "400": "a value the request may not have (the body not JSON, or breaking the schema, included)",
    "401": "--api-key is set and the bearer token differs",
    "404": "the model is not the one served",
    "408": "the request ran past --request-timeout",
    "413": "the body is over the server's limit",
    "429": "--max-queue requests already wait (with Retry-After)",
    "500": "a fault in the server",
    "503": "the server is shutting down",
}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def document_errors(app: FastAPI) -> None:
    """Make ``app``'s OpenAPI document say what its routes answer: each route that takes a body
    lists the error statuses above with OpenAI's error JSON, in place of FastAPI's 422 (a body
    that breaks the schema is a 400 here: :func:`validation_error`)."""
    plain = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = plain()
        for item in doc.get("paths", {}).values():
            for op in item.values():
                responses = op.get("responses", {})
                if responses.pop("422", None) is None:
                    continue
                body = {"application/json": {"schema": _ERROR_SCHEMA}}
                for status, when in _ERRORS.items():
                    responses.setdefault(status, {"description": when, "content": body})
        doc.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
        doc.get("components", {}).get("schemas", {}).pop("ValidationError", None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]

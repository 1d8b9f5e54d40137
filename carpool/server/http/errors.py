"""Every error a client sees, mapped to HTTP in one place, in its protocol's shape.

/v2 (Open Inference Protocol): ``{"error": "<message>"}``.
/v1/messages (Anthropic): ``{"type": "error", "error": {"type", "message"}}``.
TGI's and TEI's routes: ``{"error": "<message>", "error_type": "<kind>"}``, a bad
request 422 and a model's failure 424, as their routers answer.
Everything else (OpenAI): ``{"error": {"message", "type", "param", "code"}}``.
The KServe v2 gRPC service: a gRPC status code (``grpc_code_of``) and the message.
A malformed request is a 400 (OpenAI's, vLLM's and Anthropic's answer) that names
the field, never pydantic's 422.
A client never sees a stack trace; an unexpected exception is logged with its
trace and answered 500 with a short message.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from carpool.errors import (
    CarpoolError,
    InvalidRequest,
    ModelExecutionError,
    ModelNotFound,
    Overloaded,
    QueueTimeout,
    ReplicaFailed,
    RequestTooLarge,
    RuntimeDead,
    Unauthorized,
)
from carpool.server.tgi.tgi_shaping import error_body as tgi_error

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

_STATUS: list[tuple[type[CarpoolError], int, str]] = [
    (RequestTooLarge, 413, "invalid_request_error"),
    (InvalidRequest, 400, "invalid_request_error"),
    (Unauthorized, 401, "authentication_error"),
    (ModelNotFound, 404, "not_found_error"),
    (Overloaded, 503, "overloaded_error"),
    (QueueTimeout, 504, "timeout_error"),
    (ModelExecutionError, 500, "model_error"),
    (RuntimeDead, 503, "service_unavailable"),
    (ReplicaFailed, 502, "server_error"),
]


# gRPC status codes (``grpc.StatusCode`` names) as Triton's gRPC frontend maps its
# errors: a full queue and a request that timed out waiting are UNAVAILABLE there too.
_GRPC_CODES: list[tuple[type[CarpoolError], str]] = [
    (InvalidRequest, "INVALID_ARGUMENT"),
    (Unauthorized, "UNAUTHENTICATED"),
    (ModelNotFound, "NOT_FOUND"),
    (Overloaded, "UNAVAILABLE"),
    (QueueTimeout, "UNAVAILABLE"),
    (RuntimeDead, "UNAVAILABLE"),
    (ReplicaFailed, "UNAVAILABLE"),
    (ModelExecutionError, "INTERNAL"),
]


def grpc_code_of(exc: CarpoolError) -> str:
    """The gRPC status code's name for ``exc``."""
    for cls, code in _GRPC_CODES:
        if isinstance(exc, cls):
            return code
    return "INTERNAL"


def status_of(exc: CarpoolError) -> tuple[int, str]:
    """HTTP status and OpenAI error type of ``exc``."""
    for cls, status, kind in _STATUS:
        if isinstance(exc, cls):
            return status, kind
    return 500, "server_error"


V2, ANTHROPIC, OPENAI, TGI = "v2", "anthropic", "openai", "tgi"

# TGI's routes, and TEI's that no other protocol shares.
_TGI_PATHS = frozenset(
    {"/", "/generate", "/generate_stream", "/info", "/embed", "/embed_all", "/decode"}
)

# Anthropic's error types, by status.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def protocol_of(path: str) -> str:
    """Which protocol's error shape a request to ``path`` gets."""
    if path.startswith("/v2"):
        return V2
    if path.startswith("/v1/messages"):
        return ANTHROPIC
    if path in _TGI_PATHS:
        return TGI
    return OPENAI


def tgi_status(status: int) -> int:
    """TGI's and TEI's status for carpool's: a bad request is their 422 (input
    validation), a model's failure their 424 (generation or backend error)."""
    return {400: 422, 500: 424}.get(status, status)


def anthropic_error(status: int, kind: str, message: str, param: str | None) -> dict[str, str]:
    """The ``error`` object of Anthropic's error body (its message names the field,
    as Anthropic's has no ``param``)."""
    if status < 500:
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error")
    else:
        kind = _ANTHROPIC_TYPES.get(status, "api_error")
    if param is not None and param not in message:
        message = f"{param}: {message}"
    return {"type": kind, "message": message}


def error_response(
    request: Request,
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The error response for ``request``'s protocol."""
    if protocol_of(request.url.path) == TGI:
        status = tgi_status(status)
    body = error_body(status, message, kind=kind, param=param, path=request.url.path)
    return JSONResponse(body, status_code=status, headers=headers)


def error_body(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    path: str = "",
) -> dict[str, object]:
    """Every error body a client sees, in the shape of the protocol that ``path``
    belongs to (``protocol_of``)."""
    protocol = protocol_of(path)
    if protocol == V2:
        return {"error": message}
    if protocol == ANTHROPIC:
        return {"type": "error", "error": anthropic_error(status, kind, message, param)}
    if protocol == TGI:
        return dict(tgi_error(status, message))
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def response_for(request: Request, exc: CarpoolError) -> JSONResponse:
    status, kind = status_of(exc)
    headers = None
    if isinstance(exc, Overloaded):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
    return error_response(request, status, exc.message, kind=kind, param=exc.param, headers=headers)


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """A message naming the offending field, and the field. Pydantic reports a value
    that matches no member of a union once per member; those become one message."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}", None
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if not loc:
        return str(first.get("msg", "invalid request body")), None
    field = str(loc[0])
    same_field = [e for e in errors if [p for p in e.get("loc", ()) if p != "body"][:1] == loc[:1]]
    if len(same_field) > 1:
        reasons = sorted({str(e.get("msg")) for e in same_field})
        return f"'{field}' has an invalid value: {'; or '.join(reasons[:4])}", field
    path = ".".join(str(p) for p in loc)
    return f"'{path}': {first.get('msg', 'invalid value')}", field


def validated(schema: type[M], raw: Any, at: tuple[str, ...] = ("body",)) -> M:
    """``raw`` validated as ``schema`` in a route (a body read by hand, or a part of
    one): a bad value is the same 400 naming the field as a body FastAPI validated,
    its path starting at ``at``."""
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": (*at, *e["loc"])} for e in exc.errors()]
        ) from None


def _is_json(request: Request) -> bool:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")


def _body_not_an_object(exc: RequestValidationError) -> bool:
    """FastAPI reads a body without a JSON content type as raw bytes, which then fail
    as 'not an object' at the body itself."""
    return any(tuple(e.get("loc", ())) == ("body",) for e in exc.errors())


def install(app: FastAPI) -> None:
    """Register the exception handlers on ``app``."""

    @app.exception_handler(CarpoolError)
    async def _carpool(request: Request, exc: CarpoolError) -> JSONResponse:
        return response_for(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if not _is_json(request) and _body_not_an_object(exc):
            return error_response(
                request,
                400,
                "the request body must be JSON sent with 'Content-Type: application/json' "
                f"(got {request.headers.get('content-type') or 'no Content-Type'})",
            )
        message, field = _describe_validation(exc)
        return error_response(request, 400, message, param=field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(request, exc.status_code, str(exc.detail), kind=kind)

    @app.exception_handler(json.JSONDecodeError)
    async def _json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(request, 400, f"request body is not valid JSON: {exc.msg}")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error on %s", request.url.path, exc_info=exc)
        return error_response(request, 500, "internal server error", kind="server_error")

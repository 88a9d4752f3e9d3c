"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the gateway returns goes through ``APIError``; validation errors
become 400s naming the field; anything unexpected becomes a 500 with a generic
message (the trace goes to the log, never to the client).
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as one SSE event (after a stream has started, the status is already 200)."""
        return f"data: {json.dumps(self.body(), separators=(',', ':'))}\n\n"


def upstream(status: int, message: str) -> APIError:
    """An error a worker reported: 4xx and 503 pass through; any other failure of the worker is a 502."""
    if 400 <= status < 500 or status in (503, 504):
        return APIError(status, message)
    return APIError(502, f"the worker failed: {message}")


# pydantic names the member of a union that failed (``prompt.list[int].0``); the client
# named only the field.
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "TextPart", "function-after", "function-wrap"}


def _is_tag(part) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part.startswith("function-"))


def validation_error(errors: list[dict]) -> APIError:
    """The first of pydantic's errors as an OpenAI 400."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    kind = first.get("type", "")
    ctx = first.get("ctx") or {}
    if kind == "named_field_error":  # a cross-field check naming its field (output_schemas.field_error)
        return APIError(400, str(ctx.get("message", first.get("msg", ""))), ctx.get("param"),
                        ctx.get("code", "invalid_value"))
    if kind == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    raw_loc = [p for p in first.get("loc", ()) if p != "body"]
    if not raw_loc and kind in ("model_type", "dict_type", "model_attributes_type"):
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    union = any(_is_tag(p) for p in raw_loc)
    param = ".".join(str(p) for p in raw_loc if not _is_tag(p)) or None
    if kind == "missing":
        return APIError(400, f"missing required parameter: {param}", param, "missing_required_parameter")
    msg = str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if union:
        msg = f"invalid type or value for {param}"
    elif param:
        msg = f"invalid value for {param}: {msg}"
    return APIError(400, msg, param, "invalid_value")


def from_pydantic(exc: ValidationError) -> APIError:
    return validation_error(exc.errors(include_url=False, include_input=False))


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, "internal error").response()

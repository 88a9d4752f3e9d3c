"""A request body as a pydantic model: JSON whatever the content type, read up to a cap, with
OpenAI-shaped errors (413 over the cap, 400 empty or invalid). Every route that takes a JSON body
reads it here."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from gateway import errors
from gateway.errors import APIError

MAX_BODY_BYTES = 32 << 20  # a 128k-token prompt as JSON ids is ~1 MB
M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        parts.append(part)
    return b"".join(parts)


def parse_json(raw: bytes, model: type[M], empty: bytes | None = None) -> M:
    """``raw`` as ``model``; an empty body is a 400, or ``empty`` when given (an optional body)."""
    if not raw.strip():
        if empty is None:
            raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
        raw = empty
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise errors.from_pydantic(e) from None


async def parse_body(request: Request, model: type[M], empty: bytes | None = None) -> tuple[M, int]:
    """The body as ``model`` and its size in bytes (what rendering and tokenizing it will cost)."""
    raw = await read_body(request)
    return parse_json(raw, model, empty), len(raw)

"""``/v1/files``: upload (multipart, purpose ``batch``), list, retrieve, download, delete.

Files live in JetStream's object store and their records in the batches bucket
(``gateway.batches.store``); a file belongs to the tenant whose key uploaded it: another tenant's
ids are 404. Uploads are capped by ``--batch-max-file-bytes`` (not the request body cap of the
completion routes: ``gateway.auth.BodyCap`` leaves this route to its own), and a tenant keeps at
most ``--batch-max-files`` batch inputs of at most ``--batch-max-file-bytes`` in all (429 past
either). Batch output and error files are written by the runner and read here like any other.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response

from gateway.batches.store import BatchStore, FileRecord, RunAs
from gateway.errors import APIError
from mesh import metrics

UPLOAD_SCHEMA = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"type": "string", "enum": ["batch"]}},
}}}}}
_BOUNDARY = re.compile(r'boundary=(?:"([^"]{1,70})"|([^\s;"]{1,70}))', re.IGNORECASE)
_PARAM = re.compile(r'\b(name|filename)="([^"]*)"', re.IGNORECASE)
MAX_FILENAME = 255


def store_of(request: Request) -> BatchStore:
    store = request.app.state.batches.store
    if store is None:
        raise APIError(503, "the batch store is not open yet (JetStream); retry shortly")
    return store


def owner_of(request: Request) -> RunAs:
    return RunAs.of(request.scope.get("state", {}).get("api_key"))


def install_file_routes(app: FastAPI) -> None:
    @app.post("/v1/files", openapi_extra=UPLOAD_SCHEMA)
    async def upload_file(request: Request):
        config = request.app.state.batches.config
        store = store_of(request)
        body = await _read_capped(request, config.max_file_bytes)
        parse = (parse_multipart, request.headers.get("content-type", ""), body)
        # a large upload is split and scanned in a thread: the event loop serves streams meanwhile
        fields, upload = await asyncio.to_thread(*parse) if len(body) > (1 << 20) else parse[0](*parse[1:])
        if fields.get("purpose") != "batch":
            raise APIError(400, "purpose must be \"batch\" (the only files this server keeps)", "purpose")
        if upload is None:
            raise APIError(400, "missing required parameter: file", "file", "missing_required_parameter")
        filename, data = upload
        if len(data) > config.max_file_bytes:
            raise APIError(413, f"the file is over --batch-max-file-bytes ({config.max_file_bytes} bytes)", "file")
        owner = owner_of(request).owner
        kept = [f for f in await store.list_files(owner) if f.purpose == "batch"]
        if len(kept) + 1 > config.max_files or sum(f.bytes for f in kept) + len(data) > config.max_file_bytes:
            metrics.GATEWAY_REJECTED.labels("batch_files").inc()
            raise APIError(429, f"this tenant keeps {len(kept)} batch files ({sum(f.bytes for f in kept)} bytes); "
                                f"the limit is {config.max_files} files and {config.max_file_bytes} bytes: delete "
                                "some first", code="quota_exceeded")
        lines = await asyncio.to_thread(_count_lines, data) if len(data) > (1 << 20) else _count_lines(data)
        rec = FileRecord(f"file-{uuid.uuid4().hex}", owner, filename[:MAX_FILENAME] or "upload.jsonl", len(data),
                         int(time.time()), "batch", lines)
        await store.put_file(rec, data)
        return rec.public()

    @app.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = Query(None, max_length=64),
                         limit: int = Query(10_000, ge=1, le=10_000), after: str | None = Query(None, max_length=64),
                         order: str = Query("desc", pattern="^(asc|desc)$")):
        files = await store_of(request).list_files(owner_of(request).owner)
        files = [f for f in files if purpose is None or f.purpose == purpose]
        return page([f.public() for f in files], limit, after, order == "desc")

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(request: Request, file_id: str):
        return (await _file(request, file_id)).public()

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str):
        rec = await _file(request, file_id)
        return Response(await store_of(request).file_data(rec), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str):
        rec = await _file(request, file_id)
        await store_of(request).delete_file(rec)
        return {"id": rec.id, "object": "file", "deleted": True}


async def _file(request: Request, file_id: str) -> FileRecord:
    rec = await store_of(request).get_file(owner_of(request).owner, file_id)
    if rec is None:
        raise APIError(404, f"no such file: {file_id!r}", "file_id", "not_found")
    return rec


def _count_lines(data: bytes) -> int:
    return sum(1 for line in data.split(b"\n") if line.strip())


def page(items: list[dict], limit: int, after: str | None, newest_first: bool = True) -> dict:
    """OpenAI's cursor page: ``limit`` items after the one with id ``after``, by ``created_at``."""
    items = sorted(items, key=lambda i: (i["created_at"], i["id"]), reverse=newest_first)
    if after is not None:
        at = next((n for n, i in enumerate(items) if i["id"] == after), None)
        items = items[at + 1:] if at is not None else []
    data = items[:limit]
    return {"object": "list", "data": data, "has_more": len(items) > limit,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


async def _read_capped(request: Request, cap: int) -> bytes:
    """The body, refused (413) once it is past ``cap`` plus room for the form's other parts."""
    limit = cap + (64 << 10)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the file is over --batch-max-file-bytes ({cap} bytes)", "file")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"the file is over --batch-max-file-bytes ({cap} bytes)", "file")
        parts.append(part)
    return b"".join(parts)


def parse_multipart(content_type: str, body: bytes) -> tuple[dict[str, str], tuple[str, bytes] | None]:
    """A multipart/form-data body: its text fields, and the ``file`` part (filename, bytes) if any.
    Exact bytes (no line-ending rewriting); 400 for anything that is not such a form."""
    m = _BOUNDARY.search(content_type) if content_type.lower().startswith("multipart/form-data") else None
    if m is None:
        raise APIError(400, "send the file as multipart/form-data (fields: file, purpose)", "file")
    delimiter = b"\r\n--" + (m.group(1) or m.group(2)).encode("latin-1")
    chunks = (b"\r\n" + body).split(delimiter)
    fields: dict[str, str] = {}
    upload = None
    for chunk in chunks[1:]:
        if chunk.startswith(b"--"):
            break
        head, sep, content = chunk.partition(b"\r\n\r\n")
        if not sep:
            raise APIError(400, "a part of the multipart body has no headers", "file")
        params = {}
        for header in head.decode("latin-1").split("\r\n"):
            name, _, value = header.partition(":")
            if name.strip().lower() == "content-disposition":
                params = {k.lower(): v for k, v in _PARAM.findall(value)}
        name = params.get("name")
        if name == "file":
            upload = (params.get("filename", ""), content)
        elif name:
            try:
                fields[name] = content.decode()
            except UnicodeDecodeError:
                raise APIError(400, f"the form field {name!r} is not UTF-8 text", name) from None
    else:
        raise APIError(400, "the multipart body does not end with its closing boundary", "file")
    return fields, upload

"""A batch input file's lines, checked one by one, and the output and error lines they become.

An input line is ``{"custom_id": ..., "method": "POST", "url": ..., "body": {...}}``. A line that
is not JSON, has no ``custom_id`` (or repeats an earlier one), names a url outside ``BATCH_URLS``,
or asks to stream, is not run: it becomes a line of the error file, and the batch goes on. So does
a line the route refuses (a 4xx): its status and error body are in the error file. Lines run:
their responses, in input order, make the output file. Pure functions: no I/O.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import msgspec

from gateway.batches.store import BATCH_PRIORITY

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
MAX_CUSTOM_ID = 512


@dataclass(frozen=True)
class Line:
    """One input line: what to run, or why it is not run (``error``: code, message)."""

    index: int  # 0-based line of the input file (blank lines skipped, but counted)
    custom_id: str | None
    url: str = ""
    body: bytes = b""  # the request body, as JSON
    error: tuple[str, str] | None = None

    @property
    def runnable(self) -> bool:
        return self.error is None


_DECODE = msgspec.json.Decoder()
_ENC = msgspec.json.Encoder()


def parse_lines(data: bytes) -> list[Line]:
    """Every non-blank line of an input file, checked; duplicates of a ``custom_id`` after its
    first line are errors."""
    out: list[Line] = []
    seen: set[str] = set()
    for index, raw in enumerate(data.split(b"\n")):
        if not raw.strip():
            continue
        line = check_line(index, raw)
        if line.custom_id is not None and line.custom_id in seen:
            line = Line(index, line.custom_id, error=("duplicate_custom_id",
                                                      f"custom_id {line.custom_id!r} is used by an earlier line"))
        elif line.custom_id is not None:
            seen.add(line.custom_id)
        out.append(line)
    return out


def check_line(index: int, raw: bytes) -> Line:
    try:
        obj = _DECODE.decode(raw)
    except msgspec.DecodeError as e:
        return Line(index, None, error=("invalid_json", f"line {index + 1} is not JSON: {e}"))
    if not isinstance(obj, dict):
        return Line(index, None, error=("invalid_request", f"line {index + 1} is not a JSON object"))
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return Line(index, None, error=("missing_custom_id", f"line {index + 1} has no custom_id (a string of "
                                                             f"1 to {MAX_CUSTOM_ID} characters)"))
    method = obj.get("method", "POST")
    if method != "POST":
        return Line(index, custom_id, error=("invalid_method", f"method must be POST, not {method!r}"))
    url = obj.get("url")
    if url not in BATCH_URLS:
        return Line(index, custom_id, error=("invalid_url", f"url must be one of {', '.join(BATCH_URLS)}; "
                                                            f"got {url!r}"))
    body = obj.get("body")
    if not isinstance(body, dict):
        return Line(index, custom_id, url, error=("invalid_body", "body must be a JSON object"))
    if body.get("stream"):
        return Line(index, custom_id, url, error=("stream_not_supported",
                                                  "a batch line cannot stream: drop \"stream\" from its body"))
    if "priority" in body:  # a line runs at the lowest priority, whatever it asks for
        body["priority"] = BATCH_PRIORITY
    return Line(index, custom_id, url, _ENC.encode(body))


class LineResult(msgspec.Struct, frozen=True):
    """What one line came to, as kept in the store (``done.{batch}.{line}``)."""

    custom_id: str | None
    status: int  # the route's HTTP status; 0: the line never ran (``code``, ``message`` say why)
    body: msgspec.Raw = msgspec.Raw(b"null")  # the route's response body (JSON)
    code: str = ""
    message: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def not_run(line: Line) -> LineResult:
    code, message = line.error or ("", "")
    return LineResult(line.custom_id, 0, code=code, message=message)


def encode_result(result: LineResult) -> bytes:
    return _ENC.encode(result)


def decode_result(data: bytes) -> LineResult:
    return msgspec.json.decode(data, type=LineResult)


def output_line(result: LineResult, request_id: str = "") -> bytes:
    """The line of the output file (a success) or the error file (anything else), OpenAI's shape."""
    rid = f"batch_req_{uuid.uuid4().hex}"
    if result.status == 0:
        row = {"id": rid, "custom_id": result.custom_id, "response": None,
               "error": {"code": result.code, "message": result.message}}
    else:
        row = {"id": rid, "custom_id": result.custom_id,
               "response": {"status_code": result.status, "request_id": request_id or rid, "body": result.body},
               "error": None}
        if not result.ok:
            row["error"] = {"code": result.code or "request_failed", "message": result.message or
                            f"the request failed with status {result.status}"}
    return _ENC.encode(row) + b"\n"


def count_kept(done: dict[int, bytes]) -> tuple[int, int]:
    """(completed, failed) among kept results."""
    ok = sum(1 for v in done.values() if decode_result(v).ok)
    return ok, len(done) - ok


def line_usage(result: LineResult) -> dict[str, int]:
    """The tokens a completed line's response reports, in the Batch object's terms (chat and
    completions: prompt/completion tokens; responses: input/output tokens; embeddings: prompt)."""
    try:
        usage = msgspec.json.decode(result.body).get("usage") or {}
    except (msgspec.DecodeError, AttributeError):
        return {}
    if not isinstance(usage, dict):
        return {}

    def count(*path: str) -> int:
        value = usage
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value if isinstance(value, int) and value >= 0 else 0

    return {"input": count("input_tokens") or count("prompt_tokens"),
            "output": count("output_tokens") or count("completion_tokens"),
            "cached": count("input_tokens_details", "cached_tokens") or count("prompt_tokens_details", "cached_tokens"),
            "reasoning": (count("output_tokens_details", "reasoning_tokens")
                          or count("completion_tokens_details", "reasoning_tokens"))}


def batch_usage(totals: dict[str, int]) -> dict:
    """The Batch object's ``usage`` from summed ``line_usage``s."""
    inp, out = totals.get("input", 0), totals.get("output", 0)
    return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": totals.get("cached", 0)},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": totals.get("reasoning", 0)},
            "total_tokens": inp + out}


def render_files(lines: list[Line], done: dict[int, bytes], expired: bool) -> tuple[bytes, bytes, int, int, dict]:
    """The output file, the error file (lines in input order), the (completed, failed) counts and
    the token usage of a finished batch; lines without a result are left out, or, when the batch
    ``expired``, written to the error file as ``batch_expired`` (or, never runnable, as what is
    wrong with them)."""
    out, err = bytearray(), bytearray()
    completed = failed = 0
    totals: dict[str, int] = {}
    for line in lines:
        raw = done.get(line.index)
        if raw is None:
            if expired:
                err += output_line(not_run(line) if not line.runnable else LineResult(
                    line.custom_id, 0, code="batch_expired", message="the batch expired before this line ran"))
            continue
        result = decode_result(raw)
        completed += result.ok
        failed += not result.ok
        (out if result.ok else err).extend(output_line(result))
        if result.ok:
            for key, n in line_usage(result).items():
                totals[key] = totals.get(key, 0) + n
    return bytes(out), bytes(err), completed, failed, batch_usage(totals)

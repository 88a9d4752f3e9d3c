"""Batch input lines checked one by one, the output and error lines they become, the upload's
multipart parsing, and the governor that paces batch lines by the workers' load."""

from __future__ import annotations

import json

import pytest
from msgspec import Raw

from gateway.batches.files import page, parse_multipart
from gateway.batches.governor import Governor
from gateway.batches.lines import LineResult, not_run, output_line, parse_lines
from gateway.batches.store import BATCH_PRIORITY
from gateway.errors import APIError
from mesh.protocol import LoadReport

GOOD = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "hi"}}


def lines_of(*rows) -> bytes:
    return b"\n".join(r if isinstance(r, bytes) else json.dumps(r).encode() for r in rows)


@pytest.mark.parametrize(("row", "code"), [
    (b"{nope", "invalid_json"),
    (b"[1, 2]", "invalid_request"),
    ({**GOOD, "custom_id": None}, "missing_custom_id"),
    ({**GOOD, "custom_id": ""}, "missing_custom_id"),
    ({**GOOD, "custom_id": "x" * 513}, "missing_custom_id"),
    ({**GOOD, "method": "GET"}, "invalid_method"),
    ({**GOOD, "url": "/v1/models"}, "invalid_url"),
    ({**GOOD, "url": None}, "invalid_url"),
    ({**GOOD, "body": "prompt"}, "invalid_body"),
    ({**GOOD, "body": {**GOOD["body"], "stream": True}}, "stream_not_supported"),
])
def test_a_bad_line_is_an_error_of_its_own(row, code):
    (line,) = parse_lines(lines_of(row))
    assert not line.runnable and line.error[0] == code


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"])
def test_every_batch_url_is_accepted(url):
    (line,) = parse_lines(lines_of({**GOOD, "url": url}))
    assert line.runnable and line.url == url and json.loads(line.body) == GOOD["body"]


def test_blank_lines_are_skipped_duplicates_are_errors_and_priority_is_lowered():
    rows = lines_of(GOOD, b"", b"   ", {**GOOD, "body": {"prompt": "x", "priority": 5}}, {**GOOD, "custom_id": "b"})
    lines = parse_lines(rows + b"\n")
    assert [(line.index, line.custom_id, line.runnable) for line in lines] == [
        (0, "a", True), (3, "a", False), (4, "b", True)]
    assert lines[1].error[0] == "duplicate_custom_id"
    (lowered,) = parse_lines(lines_of({**GOOD, "body": {"prompt": "x", "priority": 5}}))
    assert json.loads(lowered.body)["priority"] == BATCH_PRIORITY


def test_output_and_error_lines_have_openais_shape():
    ok = json.loads(output_line(LineResult("a", 200, Raw(b'{"object": "text_completion"}'))))
    assert ok["id"].startswith("batch_req_") and ok["custom_id"] == "a" and ok["error"] is None
    assert ok["response"]["status_code"] == 200 and ok["response"]["body"] == {"object": "text_completion"}
    refused = json.loads(output_line(LineResult("b", 404, Raw(b'{"error": {}}'), "model_not_found", "no model")))
    assert refused["response"]["status_code"] == 404 and refused["error"] == {"code": "model_not_found",
                                                                              "message": "no model"}
    (bad,) = parse_lines(b"{nope")
    never = json.loads(output_line(not_run(bad)))
    assert never["response"] is None and never["custom_id"] is None and never["error"]["code"] == "invalid_json"


def form(boundary: str, *parts: tuple[str, str | None, bytes]) -> bytes:
    out = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + content + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def test_multipart_upload_keeps_the_files_bytes_exactly():
    data = b'{"a": 1}\r\n{"b": 2}\n\r\n--not-the-boundary\n'
    body = form("XyZ", ("purpose", None, b"batch"), ("file", "in.jsonl", data))
    fields, upload = parse_multipart('multipart/form-data; boundary="XyZ"', body)
    assert fields == {"purpose": "batch"} and upload == ("in.jsonl", data)
    assert parse_multipart("multipart/form-data; boundary=XyZ", form("XyZ", ("purpose", None, b"batch"))) == (
        {"purpose": "batch"}, None)


@pytest.mark.parametrize(("content_type", "body"), [
    ("application/json", b"{}"),
    ("multipart/form-data", b"--x\r\n"),  # no boundary parameter
    ("multipart/form-data; boundary=x", b"--x\r\nno headers here"),
    ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nunfinished"),
    ("multipart/form-data; boundary=x", b"nothing"),
])
def test_a_body_that_is_not_a_form_is_a_400(content_type, body):
    with pytest.raises(APIError) as e:
        parse_multipart(content_type, body)
    assert e.value.status == 400


def test_pages_are_cursors_by_creation_time():
    items = [{"id": f"x{i}", "created_at": i} for i in range(5)]
    first = page(items, 2, None)
    assert [i["id"] for i in first["data"]] == ["x4", "x3"] and first["has_more"] and first["last_id"] == "x3"
    rest = page(items, 10, "x3")
    assert [i["id"] for i in rest["data"]] == ["x2", "x1", "x0"] and not rest["has_more"]
    assert page(items, 2, "unknown")["data"] == []


def load(running=0, waiting=0, capacity=16, interactive=0) -> LoadReport:
    return LoadReport("w", "m", "decode", 0.0, waiting=waiting, running=running, capacity=capacity,
                      deferrable=running + waiting - interactive)


def test_the_governor_grows_on_idle_workers_and_backs_off_for_interactive_work():
    g = Governor(ceiling=20, headroom=0.25)
    trace = []
    for _ in range(12):  # idle workers: grow by a quarter (at least one) a look
        g.inflight = g.limit
        trace.append(g.observe([load(0), load(0)]))
    assert trace == [2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 18, 20]  # up to the ceiling
    g.inflight = g.limit
    assert g.observe([load(13), load(9)]) == 20  # room 24 - 22 = 2: no growth past it, no cut
    assert g.observe([load(10, waiting=1), load(8)]) == 10  # a request queued: halve
    assert g.observe([load(16), load(16)]) == 5  # past the headroom: halve
    assert g.observe([load(0), load(0)], lag=0.2) == 2  # this gateway's loop runs late: halve
    g.limit = g.inflight = 8
    assert g.observe([load(9, interactive=1), load(0)]) == 6  # interactive requests run: shed a quarter
    g.inflight = 1  # the limit not in use: no reason to grow it
    assert g.observe([load(0), load(0)]) == 6
    for _ in range(5):
        g.observe([load(16, waiting=3)])
    assert g.limit == 1  # never below one: a batch moves on a busy mesh
    assert g.observe([]) == 1  # no workers: nothing to grow into


async def test_the_governor_admits_up_to_its_limit():
    g = Governor(ceiling=4)
    await g.acquire()
    assert g.inflight == 1
    g.limit = 2
    await g.acquire()
    assert g.inflight == 2
    await g.release()
    await g.release()
    assert g.inflight == 0
    with pytest.raises(ValueError):
        Governor(ceiling=0)

"""Planner connectors: the Kubernetes scale subresource calls, exactly; the local pool's processes."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from mesh.planner.connectors import KubernetesConnector, LocalConnector


class FakeApiServer:
    """A tiny stand-in for the Kubernetes API: deployments/{name}/scale, GET and merge PATCH only."""

    def __init__(self):
        self.calls: list[tuple[str, str, dict, dict]] = []
        self.replicas = {"pdmesh-prefill": 1, "pdmesh-decode": 2}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _scale_name(self):
                parts = self.path.strip("/").split("/")
                ok = parts[:4] == ["apis", "apps", "v1", "namespaces"] and parts[5] == "deployments" \
                    and parts[7] == "scale" and len(parts) == 8
                return (parts[4], parts[6]) if ok else (None, None)

            def _reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _scale_body(self, ns, name):
                return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                        "metadata": {"name": name, "namespace": ns},
                        "spec": {"replicas": outer.replicas[name]}}

            def do_GET(self):
                ns, name = self._scale_name()
                outer.calls.append(("GET", self.path, dict(self.headers), {}))
                if name not in outer.replicas:
                    return self._reply(404, {"kind": "Status", "code": 404})
                return self._reply(200, self._scale_body(ns, name))

            def do_PATCH(self):
                ns, name = self._scale_name()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.calls.append(("PATCH", self.path, dict(self.headers), body))
                if name not in outer.replicas or self.headers["Content-Type"] != "application/merge-patch+json":
                    return self._reply(415, {"kind": "Status"})
                outer.replicas[name] = body["spec"]["replicas"]
                return self._reply(200, self._scale_body(ns, name))

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture
def api():
    server = FakeApiServer()
    yield server
    server.close()


async def test_kubernetes_connector_uses_the_scale_subresource(api):
    k8s = KubernetesConnector(namespace="serving", api=api.url, token="secret-token")
    try:
        assert await k8s.replicas("decode") == 2
        await k8s.scale("decode", 5, victims=["ignored"])
        assert await k8s.replicas("decode") == 5
        assert await k8s.replicas("prefill") == 1
    finally:
        await k8s.close()
    path = "/apis/apps/v1/namespaces/serving/deployments/pdmesh-decode/scale"
    assert [(m, p) for m, p, _, _ in api.calls] == [
        ("GET", path), ("PATCH", path), ("GET", path),
        ("GET", "/apis/apps/v1/namespaces/serving/deployments/pdmesh-prefill/scale"),
    ]
    _, _, headers, body = api.calls[1]
    assert body == {"spec": {"replicas": 5}}
    assert headers["Content-Type"] == "application/merge-patch+json"
    assert all(h["Authorization"] == "Bearer secret-token" for _, _, h, _ in api.calls)


async def test_kubernetes_connector_reports_api_errors(api):
    k8s = KubernetesConnector(namespace="serving", api=api.url, token="t",
                              deployments={"prefill": "missing", "decode": "pdmesh-decode"})
    try:
        with pytest.raises(Exception, match="404"):
            await k8s.replicas("prefill")
    finally:
        await k8s.close()


def test_kubernetes_connector_outside_a_cluster_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="not in a cluster"):
        KubernetesConnector(namespace="x")


async def test_local_connector_starts_and_drains_processes(tmp_path):
    # each sleeper leaves a file once its SIGTERM handler is in place (a loaded machine may take seconds);
    # it drains for 0.5 s, and a second SIGTERM meanwhile kills it, as it would cut a worker's drain
    sleeper = [sys.executable, "-c", "import os, signal, sys, time; "
               "signal.signal(signal.SIGTERM, lambda *a: (signal.signal(signal.SIGTERM, signal.SIG_DFL), "
               "time.sleep(0.5), sys.exit(0))); "
               f"open(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w').close(); time.sleep(60)"]
    pools = LocalConnector({"prefill": sleeper, "decode": sleeper}, drain_timeout=10)
    try:
        await pools.scale("decode", 3)
        assert await pools.replicas("decode") == 3
        for _ in range(600):  # let the sleepers install their SIGTERM handler
            if len(list(tmp_path.iterdir())) >= 3:
                break
            await asyncio.sleep(0.05)
        ids = pools.worker_ids("decode")
        await pools.scale("decode", 1, victims=[ids[0]])
        assert await pools.replicas("decode") == 1
        assert pools.worker_ids("decode") != [ids[0]]  # the named victim went first
        assert await pools.replicas("prefill") == 0
    finally:
        await pools.close()
    assert {rc for _, rc in pools.exited} == {0}  # every process exited on its own after SIGTERM

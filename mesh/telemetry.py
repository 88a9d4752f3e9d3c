"""Tracing and metrics setup for every role, from the standard OpenTelemetry variables.

Tracing is off unless asked for: ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``,
``file``, ``none``; default ``otlp`` when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is
set, else ``none``), ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc`` or
``http/protobuf``, the default), ``OTEL_SERVICE_NAME`` (default per role:
``pdmesh-gateway``, ``pdmesh-decode``, ...). ``file`` is ours: JSON lines of
finished spans appended to ``MESH_TRACE_FILE`` (tests and offline debugging).
When off, the global tracer is OpenTelemetry's no-op one: a span costs a
function call.

Metrics: one ``prometheus_client`` registry per process (``REGISTRY``), served
by the gateway on ``/metrics`` and by each worker on its own port (advertised in
its card). GPU telemetry comes from NVML where there is a GPU and is absent
otherwise.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Iterator, Sequence

from opentelemetry import trace
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_configured = False


def setup_tracing(default_service: str) -> bool:
    """Install a tracer provider if the environment asks for one; True when tracing is on."""
    global _configured
    if _configured:
        return True
    env = os.environ
    kind = env.get("OTEL_TRACES_EXPORTER")
    if kind is None:
        kind = "otlp" if (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) else "none"
    kind = kind.split(",")[0].strip().lower()
    if kind in ("none", ""):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or default_service})
    provider = TracerProvider(resource=resource)
    if kind == "otlp":
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(env)))
    elif kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif kind == "file":
        path = env.get("MESH_TRACE_FILE")
        if not path:
            raise ValueError("OTEL_TRACES_EXPORTER=file needs MESH_TRACE_FILE")
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
    else:
        raise ValueError(f"unknown OTEL_TRACES_EXPORTER {kind!r} (otlp, console, file, none)")
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)
    _configured = True
    return True


def _otlp_exporter(env):
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"unsupported OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r} (grpc, http/protobuf)")
    return OTLPSpanExporter()  # endpoint, headers and timeouts come from the standard variables


class JsonLinesExporter:
    """Finished spans as JSON lines (``ReadableSpan.to_json``), appended to one file."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence) -> object:
        from opentelemetry.sdk.trace.export import SpanExportResult

        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            for span in spans:
                f.write(span.to_json(indent=None) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


# -- metrics ------------------------------------------------------------------------------


def serve_metrics(port: int = 0, host: str = "0.0.0.0") -> int:
    """Serve ``REGISTRY`` over HTTP on ``port`` (0: any free port); returns the port."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    return server.server_port


class GpuCollector:
    """NVML gauges per visible GPU: memory used/total, utilization, power. Nothing without a GPU."""

    def __init__(self):
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._count = pynvml.nvmlDeviceGetCount()
        except Exception:
            self._nvml = None

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self._nvml is None:
            return
        nv = self._nvml
        used = GaugeMetricFamily("pdmesh_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"])
        total = GaugeMetricFamily("pdmesh_gpu_memory_total_bytes", "GPU memory", labels=["gpu"])
        util = GaugeMetricFamily("pdmesh_gpu_utilization_ratio", "GPU busy share, last sample", labels=["gpu"])
        power = GaugeMetricFamily("pdmesh_gpu_power_watts", "GPU power draw", labels=["gpu"])
        for i in range(self._count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                used.add_metric([str(i)], mem.used)
                total.add_metric([str(i)], mem.total)
                util.add_metric([str(i)], nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
                power.add_metric([str(i)], nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
            except Exception as e:  # a GPU that fell off the bus must not break the scrape
                log.debug("NVML read of GPU %d failed: %s", i, e)
        yield from (used, total, util, power)


_gpu_registered = False


def register_gpu_collector() -> bool:
    global _gpu_registered
    if _gpu_registered:
        return True
    gpu = GpuCollector()
    if not gpu.available:
        return False
    REGISTRY.register(gpu)
    _gpu_registered = True
    return True

"""Trace context across the bus: W3C ``traceparent`` in NATS headers."""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace


def outgoing_headers(extra: dict[str, str] | None = None, span: trace.Span | None = None) -> dict[str, str] | None:
    """Headers carrying the trace context of ``span`` (default: the current one); None when empty."""
    carrier: dict[str, str] = dict(extra or {})
    ctx = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(carrier, context=ctx)
    return carrier or None


def context_from(headers: dict[str, str] | None) -> otel_context.Context:
    return propagate.extract(headers or {})


def child_context(span: trace.Span | None) -> otel_context.Context | None:
    """A context whose parent is ``span`` (for spans started outside a ``with`` block)."""
    return trace.set_span_in_context(span) if span is not None else None

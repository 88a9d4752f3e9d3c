"""Trace context across the bus: W3C ``traceparent`` in NATS headers."""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import propagate


def outgoing_headers(extra: dict[str, str] | None = None) -> dict[str, str] | None:
    """Headers carrying the current trace context (None when there is nothing to carry)."""
    carrier: dict[str, str] = dict(extra or {})
    propagate.inject(carrier)
    return carrier or None


def context_from(headers: dict[str, str] | None) -> otel_context.Context:
    return propagate.extract(headers or {})

"""The gateway's Prometheus text: request counts by endpoint and status, tokens, cancels, load.

Plain counters bumped on the event loop (one process, one thread), rendered on scrape.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.service import Gateway


@dataclass
class GatewayStats:
    requests: Counter = field(default_factory=Counter)  # (endpoint, status) -> count
    completion_tokens: int = 0
    cancels: int = 0  # requests cancelled on a worker (client gone, stop string, error)
    migrations: int = 0  # streams resumed on another worker after theirs died or went silent mid-stream
    reroutes: int = 0  # requests sent to another worker after theirs died or went silent before a token

    def request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def render(self, gw: Gateway) -> str:
        lines = [
            "# HELP pdmesh_gateway_requests_total Requests answered, by endpoint and HTTP status.",
            "# TYPE pdmesh_gateway_requests_total counter",
        ]
        for (endpoint, status), n in sorted(self.requests.items()):
            lines.append(f'pdmesh_gateway_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
        lines += [
            "# HELP pdmesh_gateway_completion_tokens_total Tokens streamed from workers.",
            "# TYPE pdmesh_gateway_completion_tokens_total counter",
            f"pdmesh_gateway_completion_tokens_total {self.completion_tokens}",
            "# HELP pdmesh_gateway_cancels_total Requests cancelled on a worker before they finished.",
            "# TYPE pdmesh_gateway_cancels_total counter",
            f"pdmesh_gateway_cancels_total {self.cancels}",
            "# HELP pdmesh_gateway_migrations_total Streams resumed on another worker mid-request.",
            "# TYPE pdmesh_gateway_migrations_total counter",
            f"pdmesh_gateway_migrations_total {self.migrations}",
            "# HELP pdmesh_gateway_reroutes_total Requests sent to another worker after theirs died before a token.",
            "# TYPE pdmesh_gateway_reroutes_total counter",
            f"pdmesh_gateway_reroutes_total {self.reroutes}",
            "# HELP pdmesh_gateway_inflight_requests Choices admitted and not finished.",
            "# TYPE pdmesh_gateway_inflight_requests gauge",
            f"pdmesh_gateway_inflight_requests {gw.inflight}",
            "# HELP pdmesh_gateway_live_workers Ready decode workers per model.",
            "# TYPE pdmesh_gateway_live_workers gauge",
        ]
        for m in gw.live_models():
            lines.append(f'pdmesh_gateway_live_workers{{model="{_label(m)}"}} {len(gw.decode_workers(m))}')
        return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

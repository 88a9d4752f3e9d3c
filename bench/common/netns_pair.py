"""Two simulated hosts for a benchmark: two network namespaces joined by a veth pair (root only).

Names carry the prefix ``pdmx-`` and this process's pid, so that several runs (and other
people's namespaces) never collide; ``close`` removes both namespaces (and with them the veth
pair) whatever happened, and runs at exit too. Traffic goes only to these two addresses.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
from dataclasses import dataclass, field

PREFIX = "pdmx-"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


@dataclass
class HostPair:
    """Namespace ``a`` (address ``addr_a``) and ``b`` (``addr_b``) on one veth link."""

    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    mtu: int = 9000
    made: list[str] = field(default_factory=list)

    @property
    def ns_a(self) -> str:
        return f"{PREFIX}{self.tag}-a"

    @property
    def ns_b(self) -> str:
        return f"{PREFIX}{self.tag}-b"

    @property
    def addr_a(self) -> str:
        return f"10.213.{int(self.tag) % 250}.1"

    @property
    def addr_b(self) -> str:
        return f"10.213.{int(self.tag) % 250}.2"

    def open(self) -> HostPair:
        atexit.register(self.close)
        try:
            veth_a, veth_b = f"pdmx{self.tag}a", f"pdmx{self.tag}b"  # interface names: 15 chars at most
            for ns in (self.ns_a, self.ns_b):
                _ip("netns", "add", ns)
                self.made.append(ns)
                _ip("link", "set", "lo", "up", ns=ns)
            _ip("link", "add", veth_a, "mtu", str(self.mtu), "type", "veth", "peer", "name", veth_b,
                "mtu", str(self.mtu))
            _ip("link", "set", veth_a, "netns", self.ns_a)
            _ip("link", "set", veth_b, "netns", self.ns_b)
            for ns, dev, addr in ((self.ns_a, veth_a, self.addr_a), (self.ns_b, veth_b, self.addr_b)):
                _ip("addr", "add", f"{addr}/24", "dev", dev, ns=ns)
                _ip("link", "set", dev, "up", ns=ns)
        except Exception:
            self.close()
            raise
        return self

    def run(self, ns: str, cmd: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """``cmd`` inside namespace ``ns``."""
        return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env={**os.environ, **(env or {})}, **kw)

    def close(self) -> None:
        while self.made:
            ns = self.made.pop()
            with contextlib.suppress(Exception):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)

    def __enter__(self) -> HostPair:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

"""A client that runs inside one simulated host: ``python -m tests.helpers.hostclient URL WORKER``
connects to that host's own nats-server, says ``connected``, then for every line of stdin (a JSON
list of token ids) sends one greedy request of ``tiny`` straight to the decode worker and answers
with a line (its tokens as JSON, or ``error ...``). Started before a partition, it is the local
traffic a cut-off host still serves (a new connection would find no JetStream quorum there)."""

from __future__ import annotations

import asyncio
import json
import sys

from mesh.bus import Bus
from tests.helpers.cluster import stream_tokens


async def main(url: str, worker: str) -> None:
    bus = await Bus.connect(url, "host-client")
    print("connected", flush=True)
    try:
        while line := await asyncio.to_thread(sys.stdin.readline):
            try:
                toks, _ = await asyncio.wait_for(stream_tokens(bus, worker, json.loads(line), max_tokens=4), 60)
                print(json.dumps(toks), flush=True)
            except Exception as e:  # the test reads the reason
                print(f"error {type(e).__name__}: {e}", flush=True)
    finally:
        await bus.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))

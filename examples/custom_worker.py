"""A custom decode worker: a rule-based "model" that joins a running mesh.

The gateway lists it in ``/v1/models`` and routes requests for it like any other
model, because it speaks the worker protocol (docs/protocol.md) through the same
Python API our own decode workers use:

    RuleEngine(EngineCore)    the torch-free scheduler, block pool and prefix cache, with an
                              ``execute()`` that applies rules instead of running a network
    RuleWorker(DecodeWorker)  the decode worker's request handling, streaming, cancel, KV
                              events, load reports and registry card, with ``build()``
                              returning the RuleEngine

The rules, applied to the prompt's text (special tokens dropped):

    1. "<a> <op> <b>" anywhere (op one of + - *): the reply is the result, e.g. "42"
    2. anything else: the reply is the prompt's text in upper case ("shouting echo")

then the end-of-sequence token, so a request ends with finish_reason "stop" (or "length"
when max_tokens is smaller than the reply).

Run it next to a mesh (the gateway needs a tokenizer for the served name to accept text):

    mesh model tiny models/tiny
    mesh gateway --nats nats://127.0.0.1:4222 --model models/tiny --served-name echo
    python examples/custom_worker.py --nats nats://127.0.0.1:4222 --tokenizer models/tiny

    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"model": "echo", "prompt": "What is 19 + 23?", "max_tokens": 16}'

A worker in another language does the same over NATS directly: docs/protocol.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys
from collections import OrderedDict

from decode.worker import DecodeWorker
from engine.core import CoreConfig, EngineCore
from engine.scheduler import SchedulerOutput
from engine.sequence import SampledToken, Sequence
from mesh.config import settings
from mesh.protocol import WorkerCard
from mesh.tokenizer import Tokenizer
from worker.core import new_worker_id
from worker.settings import WorkerSettings

ARITHMETIC = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)")


def reply_text(prompt: str) -> str:
    """The rules: arithmetic if the prompt has a sum, else the prompt shouted back."""
    m = ARITHMETIC.search(prompt)
    if m:
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        return str(a + b if op == "+" else a - b if op == "-" else a * b)
    return prompt.strip().upper()


class RuleEngine(EngineCore):
    """An engine whose "forward pass" looks up the next token of a precomputed reply.

    Everything else is the real core: requests are scheduled in chunks, take blocks from
    the pool, hit the prefix cache and produce KV events, so the router treats this worker
    like any other.
    """

    MAX_PLANS = 4096  # replies kept for requests in flight (an aborted request's plan ages out)

    def __init__(self, tokenizer: Tokenizer, model_name: str, num_blocks: int = 4096, block_size: int = 16,
                 max_model_len: int = 16384):
        eos = tokenizer.token_to_id(tokenizer.eos_token) if tokenizer.eos_token else None
        if eos is None:
            raise ValueError("the tokenizer has no end-of-sequence token to end replies with")
        super().__init__(CoreConfig(
            model_name=model_name, vocab_size=tokenizer.vocab_size, block_size=block_size,
            num_blocks=num_blocks, max_model_len=max_model_len, eos_token_ids=(eos,),
        ))
        self.tokenizer = tokenizer
        self.eos = eos
        self._plans: OrderedDict[str, list[int]] = OrderedDict()

    def plan(self, seq: Sequence) -> list[int]:
        """The whole reply of ``seq`` as token ids, ending with EOS (a pure function of the prompt)."""
        plan = self._plans.get(seq.request_id)
        if plan is None:
            text = self.tokenizer.decode(seq.prompt_token_ids)
            plan = [*self.tokenizer.encode(reply_text(text), add_special_tokens=False), self.eos]
            self._plans[seq.request_id] = plan
            while len(self._plans) > self.MAX_PLANS:
                self._plans.popitem(last=False)
        return plan

    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        sampled = []
        for chunk in out.sampling_chunks:
            seq = chunk.seq
            plan = self.plan(seq)
            i = min(seq.num_output_tokens, len(plan) - 1)
            if i == len(plan) - 1:
                self._plans.pop(seq.request_id, None)  # the last token: the scheduler stops here
            sampled.append(SampledToken(plan[i]))
        return sampled


class RuleWorker(DecodeWorker):
    """A decode worker on the RuleEngine. No KV bytes exist, so it offers no KV transports
    and always prefills locally (its prefill costs nothing)."""

    def __init__(self, settings: WorkerSettings, tokenizer: Tokenizer, model_name: str):
        super().__init__(settings)
        self.tokenizer = tokenizer
        self.model_name = model_name

    def build(self) -> EngineCore:
        return RuleEngine(self.tokenizer, self.model_name)

    def transport_names(self) -> list[str]:
        return []

    def card(self) -> WorkerCard:
        card = super().card()
        card.engine = "rules"
        return card


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nats", default=None, help="NATS URL (default: $MESH_NATS_URL)")
    p.add_argument("--ns", default=None, help="subject namespace (default: $MESH_NS or mesh)")
    p.add_argument("--tokenizer", required=True, help="a model directory with tokenizer.json (e.g. models/tiny)")
    p.add_argument("--served-name", default="echo", help="the model name in /v1/models (default: echo)")
    p.add_argument("--worker-id", default="", help="default: rules-<host>-<pid>-<random>")
    p.add_argument("--log-level", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = settings()
    logging.basicConfig(level=(args.log_level or env.log_level).upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    url = args.nats or env.nats_url
    if not url:
        print("custom_worker: --nats URL is required (or MESH_NATS_URL)", file=sys.stderr)
        return 2
    worker_settings = WorkerSettings(
        nats_url=url, ns=args.ns or env.ns, worker_id=args.worker_id or new_worker_id("rules"),
        disagg_threshold=1 << 30,  # never ask a prefill pool: there is no KV to send
    )
    worker = RuleWorker(worker_settings, Tokenizer(args.tokenizer), args.served_name)
    asyncio.run(worker.run())  # SIGINT/SIGTERM: drain, deregister, exit
    return 0


if __name__ == "__main__":
    sys.exit(main())

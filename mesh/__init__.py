"""pdmesh: a disaggregated prefill/decode LLM serving mesh over NATS."""

__version__ = "0.1.0"

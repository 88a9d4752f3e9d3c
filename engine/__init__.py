"""The model engine: paged KV, continuous batching, chunked prefill, prefix caching.

The package imports nothing itself: its torch-free parts (``core``, ``scheduler``, ``sequence``,
what the mocker runs) load without torch, and everything else is imported from its own module
(``engine.engine.Engine``, ``engine.config.EngineConfig``, ``engine.sampling.SamplingParams``).
"""

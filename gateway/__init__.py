"""The OpenAI-compatible gateway: the shared core at this level (app, service, auth and tenancy,
limits, metrics, streaming), one package per API it serves (``completions``, ``responses``,
``batches``, ``embeddings``, ``adapters``), and the parts several APIs share (``requests``,
``outputs``, ``choices``). docs/architecture.md maps them."""

"""Builders and checks the test modules share; test modules import these, never each other.

- ``checkpoints``: small random Hugging Face checkpoints (dense families, MoE families).
- ``references``: Hugging Face transformers as the numerical reference: random prompts, greedy
  generation, the per-step logits check, an engine run that keeps every step's logits.
- ``lora``: PEFT adapters on a base checkpoint, and transformers + peft greedy references.
- ``greedy_checks``: greedy agreement of two engines up to float32 near ties (the GPU tests).
- ``cluster``: real clusters for the integration tests (processes started with the ``mesh`` CLI,
  a bus watcher, HTTP readiness, one request streamed from a worker, ``mesh up``).
- ``procs``: is a pid running, its descendants, stop what a test started.
- ``chat_templates``: tokenizer directories carrying the real chat templates of ``tests/data``.

Fixtures stay in the ``conftest.py`` files, built on these.
"""

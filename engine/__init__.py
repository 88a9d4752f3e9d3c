"""The model engine: paged KV, continuous batching, chunked prefill, prefix caching.

Names are imported lazily so that torch-free parts (the scheduler, used by the
mocker) do not pull in torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

_EXPORTS = {
    "Engine": "engine.engine",
    "RequestError": "mesh.errors",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "ModelError": "mesh.errors",
    "SamplingParams": "engine.sampling",
}

__all__ = ["Engine", "EngineConfig", "ModelConfig", "ModelError", "RequestError", "SamplingParams"]

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams
    from mesh.errors import ModelError, RequestError


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(name)

"""The model engine: paged KV, continuous batching, chunked prefill, prefix caching.

Names are imported lazily so that torch-free parts (the scheduler, used by the
mocker) do not pull in torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

_EXPORTS = {
    "Engine": "mesh.engine.engine",
    "RequestError": "mesh.engine.errors",
    "EngineConfig": "mesh.engine.config",
    "ModelConfig": "mesh.engine.config",
    "ModelError": "mesh.engine.errors",
    "SamplingParams": "mesh.engine.sampling",
}

__all__ = ["Engine", "EngineConfig", "ModelConfig", "ModelError", "RequestError", "SamplingParams"]

if TYPE_CHECKING:
    from mesh.engine.config import EngineConfig, ModelConfig
    from mesh.engine.engine import Engine
    from mesh.engine.errors import ModelError, RequestError
    from mesh.engine.sampling import SamplingParams


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(name)

"""The model engine: paged KV, continuous batching, chunked prefill, prefix caching."""

from mesh.engine.config import EngineConfig, ModelConfig, ModelError
from mesh.engine.engine import Engine, RequestError
from mesh.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "ModelConfig", "ModelError", "RequestError", "SamplingParams"]

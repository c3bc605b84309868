"""firsttoken's bundled inference engine: prefix cache, chunked prefill, OpenAI-shaped API.

`LocalEngine.from_model(...)` is the entry point for embedding; `engine_backend.server`
serves it over HTTP on its own.
"""

from engine_backend.config import EngineConfig
from engine_backend.demo import build_demo_model
from engine_backend.engine_thread import EngineClosedError, RequestFailedError
from engine_backend.openai_api import EngineRequestError, LocalEngine
from engine_backend.sampling import SamplingParams

__all__ = [
    "EngineClosedError",
    "EngineConfig",
    "EngineRequestError",
    "LocalEngine",
    "RequestFailedError",
    "SamplingParams",
    "build_demo_model",
]

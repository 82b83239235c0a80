"""An OpenAI-compatible HTTP server over continuous batching (``portable-llm serve``)."""

from portable_llm.serve.app import create_app
from portable_llm.serve.engine import Engine, Job, TokenEvent
from portable_llm.serve.protocol import APIError

__all__ = ["APIError", "Engine", "Job", "TokenEvent", "create_app"]

"""Backends: RuntimeEndpoint (this server's native API), OpenAI (any OpenAI-compatible server),
Anthropic (any Messages API server), EngineBackend (the offline Engine in this process)."""

from serving.lang.backends.anthropic import Anthropic
from serving.lang.backends.base import Backend
from serving.lang.backends.engine import EngineBackend
from serving.lang.backends.openai import OpenAI
from serving.lang.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["Anthropic", "Backend", "EngineBackend", "OpenAI", "RuntimeEndpoint"]

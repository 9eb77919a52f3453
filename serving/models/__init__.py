"""Model implementations, registered by HF ``architectures`` name (see ``registry``)."""

from serving.models import llama, qwen2  # noqa: F401 - import registers the classes

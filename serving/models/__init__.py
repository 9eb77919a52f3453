"""Model implementations, registered by HF ``architectures`` name (see ``registry``)."""

from serving.models import (  # noqa: F401 - import registers the classes
    deepseek_v2,
    deepseek_v3,
    gemma3,
    gpt_oss,
    llama,
    nemotron_h,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_moe,
)

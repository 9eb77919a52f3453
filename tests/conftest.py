"""Shared fixtures (keep small)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (fast server tests)."""
    from tests.model_utils import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny-chat"), with_tokenizer=True, max_position_embeddings=512)


@pytest.fixture(scope="session")
def lang_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model with SmolLM2's real EOS (``<|im_end|>``, a special token, so its text
    never shows), for serving.lang's tests."""
    from tests.model_utils import tiny_model

    return tiny_model(tmp_path_factory.mktemp("lang-chat"), with_tokenizer=True, max_position_embeddings=512,
                      eos_token_id=2)

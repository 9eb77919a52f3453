"""Loading a HF tokenizer folder, without importing torch where that changes nothing.

``transformers.AutoTokenizer`` imports torch (and torch._dynamo, the model configs, the
processors) before it decides which class to build: about 4-6 CPU-seconds and 1.5 s more at
exit, in processes that never run torch (the worker's HTTP process; the router and each of its
key processes, which must build the worker's class to key on the ids the worker prefills).
For the folders where its answer is known without them (``tokenizer_config.json`` names
``TokenizersBackend``, no custom code, a model type whose registered tokenizer does not override
that class) the same class is built directly, with the arguments AutoTokenizer passes it; every
other folder goes through AutoTokenizer as before. tests/models/test_tokenizer_load.py checks the direct path against
AutoTokenizer (same class, same ids, texts and chat template) and against transformers' tables.

``load_tokenizer`` is what the worker and the router call: the LightTokenizer of
common/tokenizer_light.py when the folder has a snapshot (no transformers import at all), else
the HF tokenizer, whose snapshot it writes for the next process. ``hf_tokenizer`` is the HF one
behind either (for xgrammar).
"""

from __future__ import annotations

import json
import os
from typing import Any

DIRECT_CLASS = "TokenizersBackend"
# Model types whose AutoTokenizer, given tokenizer_class TokenizersBackend, builds that class itself
# (not in transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS; checked by the test above).
DIRECT_MODEL_TYPES = frozenset({"llama"})


def _json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def builds_directly(path: str) -> bool:
    """Whether ``load_hf_tokenizer(path)`` skips AutoTokenizer (its answer known from the files)."""
    tok_cfg = _json(os.path.join(path, "tokenizer_config.json"))
    model_cfg = _json(os.path.join(path, "config.json"))
    return (
        tok_cfg.get("tokenizer_class") == DIRECT_CLASS
        and "auto_map" not in tok_cfg
        and "auto_map" not in model_cfg
        and model_cfg.get("model_type") in DIRECT_MODEL_TYPES
        and os.path.exists(os.path.join(path, "tokenizer.json"))
    )


def load_tokenizer(path: str) -> Any:
    """A tokenizer for ``path`` that encodes, decodes and renders chats as the HF one does: the
    light one from the folder's snapshot, else the HF one (and its snapshot written)."""
    from common import tokenizer_light

    state = tokenizer_light.recall(path)
    if state is not None and state["light"]:
        return tokenizer_light.LightTokenizer(path, state, load_hf_tokenizer)
    hf = load_hf_tokenizer(path)
    if state is None:
        tokenizer_light.remember(path, hf)
    return hf


def hf_tokenizer(tok: Any) -> Any:
    """The HF tokenizer of ``tok`` (``load_tokenizer``'s answer)."""
    full = getattr(tok, "full", None)
    return full() if callable(full) else tok


def load_hf_tokenizer(path: str) -> Any:
    """The tokenizer ``AutoTokenizer.from_pretrained(path, local_files_only=True)`` builds."""
    if builds_directly(path):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path, local_files_only=True, _from_auto=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)

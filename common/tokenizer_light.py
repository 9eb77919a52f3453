"""A HF tokenizer folder served without importing transformers, from a snapshot of what it built.

Importing ``transformers`` costs ~0.7 CPU-seconds in every process that loads a tokenizer (the
worker's HTTP and engine processes, the router and its key processes), for a tokenizer whose work
is done by the ``tokenizers`` library. The first load of a folder builds the HF tokenizer as
before and, when its class is plain ``TokenizersBackend`` (no subclass overriding a method), with
no decode clean-up and one chat template (a string), writes a snapshot: the backend that
transformers prepared (``to_str()``: normalizer, pre-tokenizer, model, added tokens,
post-processor, exactly as loaded), its special tokens, length, EOS id and chat template. Later
loads of the same files, in any process, build a ``LightTokenizer`` from it: ``tokenizers`` for
encode / decode, common.chat_jinja for the chat template; ``full()`` builds the HF tokenizer
when something needs it (xgrammar's tokenizer info, at the first grammar).

The snapshot's name is a hash of the folder's tokenizer files and of the transformers and
tokenizers versions (another version may prepare another backend), under
``$HICACHE_TOKENIZER_CACHE`` or ``~/.cache/hicache/tokenizers``; written to a temporary file then
renamed, so concurrent first loads never leave half a file; a folder that cannot be snapshotted
gets a record saying why (its loads go to transformers without trying again).
tests/models/test_tokenizer_light.py compares both on ids, texts, tokens and chat templates.

Thread-safety: see ``LightTokenizer``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

from common import chat_jinja

log = logging.getLogger(__name__)
FORMAT = 1
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
         "chat_template.jinja", "chat_template.json", "config.json")


def cache_dir() -> str:
    return os.environ.get("HICACHE_TOKENIZER_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "hicache", "tokenizers")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def snapshot_path(path: str) -> str:
    """Where the snapshot of the tokenizer folder ``path`` (as its files are now) lives."""
    h = hashlib.sha256(f"{FORMAT}|{_version('transformers')}|{_version('tokenizers')}".encode())
    for name in FILES:
        try:
            with open(os.path.join(path, name), "rb") as f:
                data = f.read()
        except OSError:
            data = None
        h.update(f"|{name}:{'-' if data is None else len(data)}|".encode())
        h.update(data or b"")
    return os.path.join(cache_dir(), h.hexdigest()[:32] + ".json")


def why_not_light(hf: Any) -> str | None:
    """Why the HF tokenizer ``hf`` cannot be served light (None: it can)."""
    cls = type(hf)
    if (cls.__name__, cls.__module__) != ("TokenizersBackend", "transformers.tokenization_utils_tokenizers"):
        return f"class {cls.__module__}.{cls.__name__} (only TokenizersBackend itself)"
    if hf.clean_up_tokenization_spaces:
        return "clean_up_tokenization_spaces is set"
    if not isinstance(hf.chat_template, (str, type(None))):
        return "several named chat templates"
    return None


def snapshot(hf: Any) -> dict[str, Any]:
    """What a LightTokenizer needs of ``hf`` (or ``{"light": False, "why": ...}``)."""
    why = why_not_light(hf)
    if why is not None:
        return {"format": FORMAT, "light": False, "why": why}
    return {"format": FORMAT, "light": True, "backend": hf.backend_tokenizer.to_str(),
            "split_special_tokens": bool(hf.split_special_tokens), "len": len(hf), "eos_token_id": hf.eos_token_id,
            "chat_template": hf.chat_template, "special_tokens_map": chat_jinja.plain(hf.special_tokens_map),
            "all_special_ids": [int(i) for i in hf.all_special_ids]}


def remember(path: str, hf: Any) -> None:
    """Write the snapshot of ``hf``, loaded from ``path``, for the next load (best effort)."""
    target = snapshot_path(path)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(snapshot(hf), f)
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
    except (OSError, TypeError, ValueError) as e:  # a read-only home, an odd special token: load it fully next time
        log.debug("no tokenizer snapshot for %s: %s", path, e)


def recall(path: str) -> dict[str, Any] | None:
    """The snapshot of ``path`` as its files are now (None: none yet, or unreadable)."""
    try:
        with open(snapshot_path(path)) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and state.get("format") == FORMAT else None


class LightTokenizer:
    """The part of a HF ``TokenizersBackend`` the server and the router call, from a snapshot
    (see the module doc); ``full()`` is the HF tokenizer itself, built on first call.

    Concurrency: any thread may call ``encode`` / ``decode`` / ``convert_ids_to_tokens`` /
    ``apply_chat_template`` at any time (the Rust tokenizer is not changed after ``__init__``;
    compiled templates are cached read-only); ``_lock`` guards only ``_full``, so concurrent first
    calls of ``full()`` build the HF tokenizer once and the others wait for it."""

    def __init__(self, path: str, state: dict[str, Any], load_full: Callable[[], Any]) -> None:
        from tokenizers import Tokenizer

        self.name_or_path = path
        self._tok = Tokenizer.from_str(state["backend"])
        self._tok.no_truncation()  # as transformers' encode(), which pads and truncates nothing unless asked
        self._tok.no_padding()
        self._tok.encode_special_tokens = state["split_special_tokens"]
        self._len = int(state["len"])
        self.eos_token_id: int | None = state["eos_token_id"]
        self.chat_template: str | None = state["chat_template"]
        self.special_tokens_map: dict[str, Any] = state["special_tokens_map"]
        self.all_special_ids: list[int] = state["all_special_ids"]
        self._load_full = load_full
        self._full: Any = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._len

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([ids] if isinstance(ids, int) else [int(i) for i in ids],
                                skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str | list[str]:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tok.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def apply_chat_template(self, conversation: list[dict[str, Any]], *, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, **kwargs: Any) -> str:
        """The chat's text, as transformers' with ``tokenize=False`` (the only form served light:
        the callers encode the text themselves; tools and documents as JSON schemas / dicts)."""
        if tokenize:
            raise TypeError("LightTokenizer.apply_chat_template renders text only: pass tokenize=False")
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set and no "
                             "template argument was passed!")
        return chat_jinja.render(template, conversation, add_generation_prompt, self.special_tokens_map,
                                 tools=tools, documents=documents, **kwargs)

    def full(self) -> Any:
        """The HF tokenizer of the same folder (imports transformers; built once)."""
        with self._lock:
            if self._full is None:
                self._full = self._load_full(self.name_or_path)
            return self._full

"""Routing keys off the event loop: chat templating and tokenization run in a process pool.

A chat template (Jinja) and a long prompt's tokenization cost milliseconds of pure Python that
would stall every other request on the router's event loop; with ``tokenizer_workers`` > 0 they
run in that many processes (spawned, each loading the tokenizer once). Bodies that need neither
(token ids, or no tokenizer: text keys) are keyed on the loop. ``tokenizer_workers: 0`` keys
everything on the loop. Each process is independent; the pool is the only shared state, and
only the event loop submits to it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from router.policies import RouteRequest
from router.routing_key import KeyMaker, load_tokenizer

_KEYS: KeyMaker | None = None  # in a pool process


def _init(tokenizer_path: str | None) -> None:
    global _KEYS
    _KEYS = KeyMaker(load_tokenizer(tokenizer_path))


def _route(path: str, body: dict[str, Any]) -> RouteRequest:
    assert _KEYS is not None
    return _KEYS.for_body(path, body)


class KeyPool:
    def __init__(self, tokenizer_path: str | None, workers: int) -> None:
        self.inline = KeyMaker(load_tokenizer(tokenizer_path))
        self.tok = self.inline.tok
        self.pool: ProcessPoolExecutor | None = None
        if workers > 0 and self.tok is not None:
            self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_init, initargs=(tokenizer_path,))
        self.offloaded = 0

    async def warm(self) -> None:
        """Start the processes (and load their tokenizers) before the first request needs them."""
        if self.pool is not None:
            loop = asyncio.get_running_loop()
            await asyncio.gather(*(loop.run_in_executor(self.pool, _route, "/generate", {"text": "warm"})
                                   for _ in range(self.pool._max_workers)))

    def _needs_tokenizer(self, path: str, body: dict[str, Any]) -> bool:
        if path == "/v1/chat/completions":
            return True
        prompt = body.get("prompt") if path == "/v1/completions" else (
            body.get("text") if body.get("input_ids") is None else None)
        return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str))

    async def for_body(self, path: str, body: dict[str, Any]) -> RouteRequest:
        if self.pool is None or not self._needs_tokenizer(path, body):
            return self.inline.for_body(path, body)
        self.offloaded += 1
        return await asyncio.get_running_loop().run_in_executor(self.pool, _route, path, body)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

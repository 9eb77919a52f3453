"""Routing keys off the event loop: chat templating and tokenization run in a process pool.

A chat template (Jinja) and a long prompt's tokenization cost milliseconds of pure Python that
would stall every other request on the router's event loop; with ``tokenizer_workers`` > 0 they
run in that many processes (spawned, each loading the tokenizer once). Bodies that need neither
(token ids, or no tokenizer: text keys) are keyed on the loop. ``tokenizer_workers: 0`` keys
everything on the loop.

What a key costs is bounded (router/routing_key.py): a body is clipped to the first
``max_routing_tokens * 8`` characters of its prompt before it is sent to a process, and the
process tokenizes no more. Large bodies (over :data:`LARGE_BODY_BYTES`) take a lane of their
own: at most ``tokenizer_workers - 1`` of them are keyed at once (the others wait their turn,
in order), so at least one process is always free for the small ones: a short request never
queues behind a long prompt's tokenization (with ``tokenizer_workers: 1`` it may, behind one).

Concurrency contract: only the event loop submits to the pool and touches the counters and the
large lane's semaphore; each process is independent.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from router.policies import RouteRequest
from router.routing_key import CHAT_PATHS, DEFAULT_ROUTING_TOKENS, KeyMaker, clip_body, load_tokenizer

LARGE_BODY_BYTES = 64 * 1024  # a body this large is keyed in the large lane
_KEYS: KeyMaker | None = None  # in a pool process


def _init(tokenizer_path: str | None, max_tokens: int) -> None:
    global _KEYS
    _KEYS = KeyMaker(load_tokenizer(tokenizer_path), max_tokens)


def _route(path: str, body: dict[str, Any]) -> RouteRequest:
    assert _KEYS is not None
    return _KEYS.for_body(path, body)


class KeyPool:
    def __init__(self, tokenizer_path: str | None, workers: int, max_tokens: int = DEFAULT_ROUTING_TOKENS) -> None:
        self.inline = KeyMaker(load_tokenizer(tokenizer_path), max_tokens)
        self.tok = self.inline.tok
        self.max_tokens = max_tokens
        self.workers = workers
        self.pool: ProcessPoolExecutor | None = None
        if workers > 0 and self.tok is not None:
            self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_init, initargs=(tokenizer_path, max_tokens))
        self.large = asyncio.Semaphore(max(1, workers - 1))  # the large lane (used on the event loop only)
        self.offloaded = 0  # bodies keyed in a process
        self.offloaded_large = 0  # ... of them in the large lane

    async def warm(self) -> None:
        """Start the processes (and load their tokenizers) before the first request needs them."""
        if self.pool is not None:
            loop = asyncio.get_running_loop()
            await asyncio.gather(*(loop.run_in_executor(self.pool, _route, "/generate", {"text": "warm"})
                                   for _ in range(self.workers)))

    def _needs_tokenizer(self, path: str, body: dict[str, Any]) -> bool:
        if path in CHAT_PATHS:  # a chat template, then its text's tokens
            return True
        prompt = body.get("prompt") if path == "/v1/completions" else (
            body.get("text") if body.get("input_ids") is None else None)
        return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str))

    async def for_body(self, path: str, body: dict[str, Any], size: int = 0) -> RouteRequest:
        """The routing key of ``body`` (``size``: its bytes on the wire; over LARGE_BODY_BYTES it
        is keyed in the large lane)."""
        if self.pool is None or not self._needs_tokenizer(path, body):
            return self.inline.for_body(path, body)
        body = clip_body(path, body, self.inline.max_chars)  # never more to pickle than the key needs
        self.offloaded += 1
        loop = asyncio.get_running_loop()
        if size <= LARGE_BODY_BYTES or self.workers == 1:
            return await loop.run_in_executor(self.pool, _route, path, body)
        self.offloaded_large += 1
        async with self.large:
            return await loop.run_in_executor(self.pool, _route, path, body)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

"""Relaying a worker's stream to the client, whole events at a time, and ending it right when
the worker's side breaks.

A streamed answer is committed once the worker answered 200; if the worker's stream then
breaks (the worker died or was killed, the connection was reset, the chunked body ended short,
a read timed out), the client must not see a stream that merely stops: it gets the error event
of its API and that API's terminator (router/errors.py: OpenAI / SGLang ``data: {"error": ...}``
then ``data: [DONE]``, Anthropic ``event: error``, Ollama an NDJSON ``{"error": ...}`` line), so
SDKs raise instead of ending "normally" with no finish reason.

What was relayed is cut at the stream's event delimiter, so a break in the middle of an event
drops its incomplete part and the error event is never glued to half an event. Bytes are
passed on as soon as an event is complete (a worker writes one event per chunk: nothing
waits); a run of more than ``MAX_PENDING`` bytes without a delimiter is passed on as it is.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx

from router.errors import Shape

log = logging.getLogger("hicache.router")
MAX_PENDING = 1 << 20


class StreamRelay:
    """One stream's relay; after :meth:`events` ended, ``broken`` says whether the worker's
    side failed (a client that went away is not the worker's failure: ``broken`` stays False).
    Used by one task (the response's)."""

    def __init__(self, shape: Shape, source: str) -> None:
        self.shape = shape
        self.source = source  # the worker's url, for the log and the error message
        self.broken = False

    async def events(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        pending = b""
        delim = self.shape.delimiter
        try:
            async for chunk in chunks:
                pending += chunk
                cut = pending.rfind(delim)
                if cut >= 0:
                    cut += len(delim)
                    out, pending = pending[:cut], pending[cut:]
                    yield out
                elif len(pending) > MAX_PENDING:
                    out, pending = pending, b""
                    yield out
        except httpx.HTTPError as e:
            self.broken = True
            log.warning("stream from %s broke: %r", self.source, e)
            yield self.shape.stream_error(
                502, f"worker {self.source} failed while streaming ({type(e).__name__}: {e}); the answer is incomplete")
            return
        if pending:
            yield pending

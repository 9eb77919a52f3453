"""One request as the HTTP side sees it: cumulative state, the handle that streams it, and
helpers to run several at once. Closing a handle before its request finished aborts it in
the engine, which frees its pages. A client's rid is its tenant's (serving/scoped_ids.py): the
engine's rid is scoped, the state's is the client's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from serving import ipc as m
from serving.scoped_ids import unscoped
from serving.server.errors import APIError

if TYPE_CHECKING:
    from serving.server.engine_client import EngineClient


@dataclass
class ReqState:
    rid: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    l3_decision: dict[str, Any] | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    # logprobs so far (serving.runner.logprobs): input, output (+ _top, _ids), each a list of [logprob, token_id]
    logprobs: dict[str, list[Any]] = field(default_factory=dict)
    spec: dict[str, Any] | None = None  # speculative decoding's meta_info fields (None: off)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, out: m.TokenOut) -> None:
        if out.offset != len(self.output_ids):
            raise RuntimeError(
                f"request {self.rid}: engine sent ids from {out.offset}, have {len(self.output_ids)}"
            )
        self.output_ids.extend(out.new_ids)
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.cached_by_tier = out.cached_by_tier
        self.l3_decision = out.l3_decision
        self.finish_reason = out.finish_reason
        self.spec = out.spec
        for key, entries in (out.logprobs or {}).items():
            self.logprobs.setdefault(key, []).extend(entries)


class ReqHandle:
    """``rid``: the engine's (a client's rid scoped by its tenant, serving/scoped_ids.py), what
    ``EngineClient.handles`` is keyed by; ``state.rid``: the client's, what answers carry."""

    def __init__(self, client: EngineClient, rid: str) -> None:
        self.client = client
        self.rid = rid
        self.state = ReqState(unscoped(rid))
        self.queue: asyncio.Queue[m.Message] = asyncio.Queue()
        self.closed = False
        self.received = False  # the engine acknowledged receipt (messages.Received); not yet accepted

    def apply(self, msg: m.Message) -> None:
        """Take one engine message for this request: a TokenOut updates the state (and the token
        metrics); an Error closes the handle and raises it as an APIError."""
        if isinstance(msg, m.Error):
            self.close()
            raise APIError(msg.status, msg.message)
        assert isinstance(msg, m.TokenOut)
        n = len(self.state.output_ids)
        self.state.apply(msg)
        self.client.metrics.on_tokens(self.state, len(self.state.output_ids) - n)

    async def updates(self) -> AsyncIterator[ReqState]:
        """Yield the state each time new ids arrived (several engine steps may be merged);
        the last one is finished. Closes the handle when done or abandoned."""
        try:
            if self.state.finished:
                yield self.state
                return
            while not self.state.finished:
                self.apply(await self.queue.get())
                while not self.queue.empty() and not self.state.finished:
                    self.apply(self.queue.get_nowait())
                yield self.state
        finally:
            self.close()

    async def result(self) -> ReqState:
        async for _ in self.updates():
            pass
        return self.state

    def close(self) -> None:
        """Stop listening; abort the request in the engine if it has not finished. Synchronous,
        so it is safe in ``finally`` blocks of cancelled tasks."""
        if self.closed:
            return
        self.closed = True
        self.client.handles.pop(self.rid, None)
        if not self.state.finished:
            self.client.send(m.AbortReq(self.rid))


async def submit_all(client: EngineClient, reqs: list[m.GenerateReq]) -> list[ReqHandle]:
    """Submit several requests at once; if any is refused, abort the others and raise."""
    results = await asyncio.gather(*(client.submit(r) for r in reqs), return_exceptions=True)
    handles = [h for h in results if isinstance(h, ReqHandle)]
    errors = [e for e in results if isinstance(e, BaseException)]
    if errors:
        for h in handles:
            h.close()
        raise errors[0]
    return handles


async def run_all(client: EngineClient, reqs: list[m.GenerateReq]) -> list[ReqState]:
    """Run requests to completion; cancelling this aborts whatever is unfinished."""
    handles = await submit_all(client, reqs)
    try:
        return [await h.result() for h in handles]
    finally:
        for h in handles:
            h.close()


async def merged_updates(handles: list[ReqHandle]) -> AsyncIterator[tuple[int, ReqState]]:
    """Updates of several requests as they come: ``(index, state)``."""
    inbox: asyncio.Queue[tuple[int, ReqState | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, h: ReqHandle) -> None:
        try:
            async for st in h.updates():
                inbox.put_nowait((i, st))
        except APIError as e:
            inbox.put_nowait((i, e))
        finally:
            inbox.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        open_ = len(handles)
        while open_:
            i, item = await inbox.get()
            if item is None:
                open_ -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for h in handles:
            h.close()

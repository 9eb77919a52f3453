"""The watchdog and the engine-call timeouts without a server: the stall measure, the HTTP
side's 504 for a call the engine never answers (and 503 at once once stalled), and the
engine dropping a call whose caller already gave up."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest

from serving import ipc as m
from serving.engine.heartbeat import HeartbeatWriter
from serving.engine.loop import EngineLoop
from serving.engine.offline import config_from_kwargs
from serving.server import watchdog as wd
from serving.server.config import ServerConfig
from serving.server.engine_client import EngineClient
from serving.server.errors import APIError
from serving.structs.sampling_params import SamplingParams


def beat(hb: list[float], at: float, busy: bool, progressed: bool) -> None:
    hb[m.BEAT] = at
    if progressed or not busy:
        hb[m.PROGRESS] = at
    hb[m.BUSY] = float(busy)


def test_stall_is_counted_only_while_work_is_pending() -> None:
    hb = [0.0] * m.SLOTS
    beat(hb, 100.0, busy=False, progressed=False)
    assert wd.stall_seconds(hb, None, now=500.0) == 0.0  # idle (even if the engine stopped since): no stall
    assert wd.stall_seconds(hb, 490.0, now=500.0) == 10.0  # asked something at 490, nothing since
    beat(hb, 200.0, busy=True, progressed=True)  # last progress at 200 with requests in it
    assert wd.stall_seconds(hb, None, now=230.0) == 30.0  # its own requests count as pending work
    beat(hb, 229.0, busy=True, progressed=False)  # the loop turns, nothing moves
    assert wd.stall_seconds(hb, None, now=230.0) == 30.0
    beat(hb, 229.5, busy=True, progressed=True)
    assert wd.stall_seconds(hb, 100.0, now=230.0) == pytest.approx(0.5)
    assert wd.stall_seconds(None, 100.0, now=230.0) == 0.0  # no heartbeat (no engine process): never stalled


async def turn_loop(hb: list[float]) -> None:
    """An engine loop that goes round (BEAT) without moving anything (PROGRESS stays)."""
    while True:
        hb[m.BEAT] = time.monotonic()
        await asyncio.sleep(0.05)


def _client(**server: float) -> tuple[EngineClient, object]:
    client = EngineClient(config_from_kwargs(model_path="unused"), ServerConfig(**server), metrics=None)
    client._rx_engine, client._tx_http = Pipe(duplex=False)
    client._rx_http, tx_engine = Pipe(duplex=False)
    client.heartbeat = [time.monotonic()] * 2 + [0.0, 0.0]
    client.alive = True
    return client, tx_engine


def test_a_call_the_engine_never_answers_is_a_504_then_a_503_once_stalled() -> None:
    async def scenario() -> None:
        client, _ = _client(engine_call_timeout_s=0.3, watchdog_timeout=0.8)
        client.attach(asyncio.get_running_loop())
        turning = asyncio.ensure_future(turn_loop(client.heartbeat))  # its loop turns, answering nothing
        t0 = time.monotonic()
        with pytest.raises(APIError) as exc:
            await client.call(m.FlushCache)
        assert exc.value.status == 504 and "engine_call_timeout_s" in exc.value.message
        assert 0.3 <= time.monotonic() - t0 < 2.0
        assert not client.calls  # nothing left waiting
        sent = m.decode(client._rx_engine.recv_bytes())
        assert isinstance(sent[0], m.FlushCache) and 0 < sent[0].deadline <= time.monotonic()
        with pytest.raises(APIError) as exc:  # a request's acceptance is bounded too
            await client.submit(m.GenerateReq("r1", [1, 2], SamplingParams()))
        assert exc.value.status == 504 and "did not accept" in exc.value.message
        assert not client.handles
        await asyncio.sleep(0.3)  # still waiting on nothing: not stalled (its loop turns)
        assert client.stall_s() < 0.3 and not client.stalled
        pending = asyncio.ensure_future(client.call(m.Stats, timeout=5.0))
        await asyncio.sleep(1.0)  # a call pending for longer than watchdog_timeout, no progress
        assert client.stalled and "no progress" in client.stall_message()
        t0 = time.monotonic()
        with pytest.raises(APIError) as exc:
            await client.call(m.FlushCache)
        assert exc.value.status == 503 and time.monotonic() - t0 < 0.1  # at once
        client.heartbeat[m.PROGRESS] = time.monotonic()  # the engine moves again
        assert not client.stalled
        pending.cancel()
        turning.cancel()
        client._outbox.put(None)

    asyncio.run(scenario())


class _Core:
    def __init__(self) -> None:
        self.flushes = 0
        self.scheduler = SimpleNamespace(has_work=False, stats=SimpleNamespace(forward_passes=0))
        # what the loop's KV control API reads at start-up (serving/cache/kv_control.py); never used here
        self.tree, self.storage = None, None
        self.config = SimpleNamespace(cache=SimpleNamespace(page_size=1))

    def flush_cache(self, keep: set[int] | None = None, clear_storage: bool = False) -> bool:  # EngineCore's
        self.flushes += 1
        return True


def test_the_engine_drops_a_call_whose_caller_gave_up() -> None:
    core = _Core()
    loop = EngineLoop(core, None, None, ServerConfig().engine_process())  # type: ignore[arg-type]
    loop.handle(m.FlushCache(call_id=1, deadline=time.monotonic() - 1.0))
    assert core.flushes == 0 and loop.out == []
    loop.handle(m.FlushCache(call_id=2, deadline=time.monotonic() + 10.0))
    loop.handle(m.FlushCache(call_id=3))  # no deadline
    assert core.flushes == 2 and [r.call_id for r in loop.out] == [2, 3]


def test_the_loop_beats_the_heartbeat() -> None:
    hb = m.make_heartbeat(multiprocessing.get_context("spawn"))
    writer = HeartbeatWriter(hb)
    start = hb[m.PROGRESS]
    time.sleep(0.01)
    writer.beat(busy=True, progressed=False, forward_passes=7)
    assert hb[m.PROGRESS] == start and hb[m.BEAT] > start and hb[m.BUSY] == 1.0 and hb[m.FORWARD_PASSES] == 7
    writer.beat(busy=True, progressed=True, forward_passes=8)
    assert hb[m.PROGRESS] == hb[m.BEAT]
    writer.beat(busy=False, progressed=False, forward_passes=8)
    assert hb[m.BUSY] == 0.0 and hb[m.PROGRESS] == hb[m.BEAT]

"""Receipt and acceptance without a server (issue 25, finding 4): the engine's receiver thread
acknowledges a request while the loop thread is busy, hands messages over in order and reports
EOF after them; the HTTP side, once receipt is acknowledged, waits for acceptance past
engine_call_timeout_s while the engine's loop turns, and fails it with 503 once the watchdog
trips. The same over real servers: tests/server/test_server_liveness.py."""

from __future__ import annotations

import asyncio
import time
from multiprocessing import Pipe

import pytest

from serving import ipc as m
from serving.engine.inbox import EngineInbox
from serving.engine.offline import config_from_kwargs
from serving.server.config import ServerConfig
from serving.server.engine_client import EngineClient
from serving.server.errors import APIError
from serving.server.metrics import ServerMetrics
from serving.structs.sampling_params import SamplingParams


def test_the_receiver_acknowledges_while_the_loop_is_busy_and_keeps_the_order() -> None:
    rx_engine, tx_http = Pipe(duplex=False)
    rx_http, tx_engine = Pipe(duplex=False)
    inbox = EngineInbox(rx_engine, tx_engine)
    inbox.start()
    tx_http.send_bytes(m.encode([m.GenerateReq("a", [1], SamplingParams()), m.Stats(call_id=7),
                                 m.GenerateReq("b", [2], SamplingParams())]))
    # nobody calls inbox.get() (the loop thread is in a forward pass): the receipt comes anyway
    assert rx_http.poll(10)
    assert m.decode(rx_http.recv_bytes()) == [m.Received(["a", "b"])]
    tx_http.send_bytes(m.encode([m.AbortReq("a")]))  # no request in it: no receipt
    deadline = time.monotonic() + 10
    got: list[m.Message] = []
    while len(got) < 4:
        assert time.monotonic() < deadline, got
        got += inbox.get(0.1)
    assert [type(x).__name__ for x in got] == ["GenerateReq", "Stats", "GenerateReq", "AbortReq"]
    assert not rx_http.poll(0.2)
    tx_http.send_bytes(m.encode([m.Shutdown()]))
    tx_http.close()  # the HTTP process goes away: what it sent first still comes out, then EOF
    deadline = time.monotonic() + 10
    last: list[m.Message] = []
    while not last:
        assert time.monotonic() < deadline
        last = inbox.get(0.1)
    assert last == [m.Shutdown()]
    for _ in range(2):  # for good
        with pytest.raises(EOFError):
            inbox.get(0.1)


def _client(**server: float) -> tuple[EngineClient, object]:
    client = EngineClient(config_from_kwargs(model_path="unused"), ServerConfig(**server), metrics=ServerMetrics())
    client._rx_engine, client._tx_http = Pipe(duplex=False)
    client._rx_http, tx_engine = Pipe(duplex=False)
    client.heartbeat = [time.monotonic()] * 2 + [0.0, 0.0]
    client.alive = True
    return client, tx_engine


async def turn_loop(hb: list[float], progress: bool) -> None:
    """An engine loop that goes round (BEAT), making progress or not."""
    while True:
        hb[m.BEAT] = time.monotonic()
        if progress:
            hb[m.PROGRESS] = hb[m.BEAT]
        await asyncio.sleep(0.05)


def test_a_received_request_waits_past_the_call_timeout_for_its_acceptance() -> None:
    async def scenario() -> None:
        client, tx_engine = _client(engine_call_timeout_s=0.3, watchdog_timeout=1.0)
        client.attach(asyncio.get_running_loop())
        turning = asyncio.ensure_future(turn_loop(client.heartbeat, progress=True))  # a long pass: beats
        submit = asyncio.ensure_future(client.submit(m.GenerateReq("r1", [1, 2], SamplingParams())))
        await asyncio.sleep(0.1)
        tx_engine.send_bytes(m.encode([m.Received(["r1"])]))
        await asyncio.sleep(1.5)  # five call timeouts, more than the watchdog's
        assert not submit.done()
        tx_engine.send_bytes(m.encode([m.TokenOut("r1", 0, [], 2, 0)]))
        handle = await asyncio.wait_for(submit, 5)
        assert handle.received and handle.state.prompt_tokens == 2
        handle.close()

        # received, then the engine stops making progress: a 503 once the watchdog trips, not a 504
        turning.cancel()
        turning = asyncio.ensure_future(turn_loop(client.heartbeat, progress=False))
        t0 = time.monotonic()
        submit = asyncio.ensure_future(client.submit(m.GenerateReq("r2", [1, 2], SamplingParams())))
        await asyncio.sleep(0.1)
        tx_engine.send_bytes(m.encode([m.Received(["r2"])]))
        with pytest.raises(APIError) as exc:
            await asyncio.wait_for(submit, 10)
        assert exc.value.status == 503 and "no progress" in exc.value.message
        assert time.monotonic() - t0 >= 1.0 and not client.handles
        turning.cancel()
        client._outbox.put(None)

    asyncio.run(scenario())

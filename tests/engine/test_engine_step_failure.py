"""A step that raises (issue 11, item 8): the requests of that step fail with a 500, their pages
come back, the cache's invariants are checked; the other requests and later ones are served
as usual. If the invariants cannot be restored, the engine process exits non-zero (and the
HTTP side answers 503, never hangs)."""

from __future__ import annotations

import asyncio
import signal
import threading
from multiprocessing import Pipe
from typing import Any

import pytest

from harness.model_utils import hf_greedy, tiny_model
from serving import ipc as m
from serving.engine.core import EngineCore
from serving.engine.loop import EngineLoop
from serving.engine.main import engine_main
from serving.engine.offline import config_from_kwargs
from serving.ipc import EXIT_BROKEN
from serving.server.config import ServerConfig
from serving.server.engine_client import EngineClient
from serving.server.errors import APIError
from serving.structs.sampling_params import SamplingParams

NEW = 6
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
# A and B are admitted first (max_running_requests=2); C and D wait with nothing allocated.
PROMPTS = {
    "A": [(7 * i + 3) % 500 + 1 for i in range(21)],
    "B": [(11 * i + 5) % 500 + 1 for i in range(18)],
    "C": [(13 * i + 1) % 500 + 1 for i in range(15)],
    "D": [(17 * i + 2) % 500 + 1 for i in range(26)],
    "E": [(19 * i + 4) % 500 + 1 for i in range(12)],  # sent after the failure
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("stepfail"))
    names = list(PROMPTS)
    ref = hf_greedy(path, [PROMPTS[n] for n in names], NEW)
    return path, dict(zip(names, ref, strict=True))


def engine_config(path, **kw):
    kw = {"page_size": 4, "max_total_tokens": 512, "max_running_requests": 2, "schedule_policy": "fcfs", **kw}
    return config_from_kwargs(model_path=str(path), **kw)


class Driver:
    """An EngineLoop driven in-process over a pair of pipes, one loop iteration at a time."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.rx_engine, self.tx_http = Pipe(duplex=False)
        self.rx_http, self.tx_engine = Pipe(duplex=False)
        self.loop = EngineLoop(core, self.rx_engine, self.tx_engine, ServerConfig().engine_process())
        self.out: dict[str, list[int]] = {}
        self.finished: dict[str, Any] = {}
        self.errors: dict[str, m.Error] = {}

    def submit(self, name: str) -> None:
        self.loop.handle(m.GenerateReq(rid=name, input_ids=PROMPTS[name], sampling_params=PARAMS))

    def tick(self) -> None:
        if self.core.scheduler.has_work:
            self.loop._step()
        self.loop._collect()
        self.loop.flush()
        self.read()

    def read(self) -> None:
        while self.rx_http.poll(0):
            for msg in m.decode(self.rx_http.recv_bytes()):
                if isinstance(msg, m.Error):
                    self.errors[msg.rid] = msg
                elif isinstance(msg, m.TokenOut):
                    ids = self.out.setdefault(msg.rid, [])
                    assert msg.offset == len(ids)
                    ids += msg.new_ids
                    if msg.finish_reason is not None:
                        self.finished[msg.rid] = msg.finish_reason

    def run_until_idle(self, max_ticks: int = 200) -> None:
        for _ in range(max_ticks):
            self.tick()
            if not self.core.scheduler.has_work and not self.loop.live:
                return
        raise AssertionError("the engine did not finish its requests")


def device_pages_in_tree(core: EngineCore) -> int:
    return sum(len(nd.device_pages) for nd in core.tree.nodes() if nd.device_pages is not None)


def assert_no_leak(core: EngineCore) -> None:
    core.check_integrity()
    assert not core.scheduler.running and not core.scheduler.waiting
    assert core.runner.pool.allocator.num_used == device_pages_in_tree(core)


def raise_once(fn, exc: Exception, before=None):
    state = {"armed": True}

    def wrapper(*args, **kwargs):
        if state["armed"]:
            state["armed"] = False
            if before is not None:
                before()
            raise exc
        return fn(*args, **kwargs)

    return wrapper


def test_failed_forward_fails_only_its_requests(tiny):
    path, ref = tiny
    core = EngineCore(engine_config(path))
    d = Driver(core)
    for name in "ABCD":
        d.submit(name)
    d.tick()  # A and B prefilled; C and D wait (max_running_requests=2) without pages
    d.tick()
    sched = core.scheduler
    assert {r.rid for r in sched.running} == {"A", "B"}
    assert {r.rid for r in sched.waiting} == {"C", "D"}
    assert all(not r.kv.pages and r.kv.lock_node is None for r in sched.waiting)
    sched.forward = raise_once(sched.forward, RuntimeError("injected forward failure"))
    d.tick()  # the failing step
    assert set(d.errors) == {"A", "B"}
    for name in "AB":
        assert d.errors[name].status == 500
        assert d.errors[name].message == "engine step failed: RuntimeError: injected forward failure"
        assert name not in d.finished
    core.check_integrity()  # their pages came back right away
    assert d.loop.broken is None and d.loop.running
    d.run_until_idle()
    assert set(d.errors) == {"A", "B"}  # C and D were served, with the right tokens
    assert d.out["C"] == ref["C"] and d.out["D"] == ref["D"]
    assert_no_leak(core)
    d.submit("E")  # a later request is served normally
    d.submit("A")  # and so is a retry of a failed one
    d.errors.clear()
    d.out.pop("A")
    d.run_until_idle()
    assert not d.errors
    assert d.out["E"] == ref["E"] and d.out["A"] == ref["A"]
    assert_no_leak(core)


def test_failure_while_admitting_releases_the_lock(tiny):
    """The step raises after a waiting request locked its matched prefix but before it ran:
    that request holds a lock and pages while still waiting, so it fails; the others go on."""
    path, ref = tiny
    core = EngineCore(engine_config(path))
    d = Driver(core)
    d.submit("D")
    d.run_until_idle()  # D's prompt is in the tree now
    assert d.out["D"] == ref["D"]
    d.out.clear()
    d.finished.clear()
    for name in "DC":
        d.submit(name)
    cache = core.scheduler.cache
    cache.reserve = raise_once(cache.reserve, RuntimeError("injected reserve failure"))
    d.tick()
    assert set(d.errors) == {"D"}  # admitted first (fcfs): locked its prefix, then reserve raised
    assert d.errors["D"].message == "engine step failed: RuntimeError: injected reserve failure"
    assert all(nd.lock_ref == 0 for nd in core.tree.nodes())  # the lock was given back
    core.check_integrity()
    d.run_until_idle()
    assert set(d.errors) == {"D"} and d.out["C"] == ref["C"]
    assert_no_leak(core)


def leak_a_page(core: EngineCore):
    return lambda: core.runner.pool.allocator.alloc(1)  # a page nobody owns: the pool no longer adds up


def test_broken_tree_stops_the_loop_non_zero(tiny):
    path, _ = tiny
    core = EngineCore(engine_config(path))
    d = Driver(core)
    for name in "ABC":
        d.submit(name)
    d.tick()
    sched = core.scheduler
    sched.forward = raise_once(sched.forward, RuntimeError("injected"), before=leak_a_page(core))
    with pytest.raises(SystemExit) as exc:
        d.tick()
    assert exc.value.code == EXIT_BROKEN != 0
    assert d.loop.broken and "check_integrity" in d.loop.broken
    assert not d.loop.running
    d.read()  # every live request was told before the loop stopped
    assert {r: e.status for r, e in d.errors.items()} == {"A": 500, "B": 500, "C": 503}


def test_abort_that_raises_stops_the_loop(tiny):
    path, _ = tiny
    core = EngineCore(engine_config(path))
    d = Driver(core)
    for name in "AB":
        d.submit(name)
    d.tick()
    sched = core.scheduler
    sched.forward = raise_once(sched.forward, RuntimeError("injected"))
    sched.cache.release = raise_once(sched.cache.release, RuntimeError("release failed"))
    with pytest.raises(SystemExit) as exc:
        d.tick()
    assert exc.value.code == EXIT_BROKEN
    assert "abort of A raised RuntimeError: release failed" in d.loop.broken


def test_engine_main_exits_non_zero_on_a_broken_tree(tiny, monkeypatch):
    """The engine process's entry point, run in-process: the loop stops, the pipe to the HTTP
    side closes, nothing is persisted, and SystemExit carries EXIT_BROKEN (the process's exit
    status under multiprocessing)."""
    path, _ = tiny
    step = EngineCore.step

    def failing_step(self):
        if self.scheduler.stats.forward_passes >= 1:
            self.runner.pool.allocator.alloc(1)
            raise RuntimeError("injected")
        return step(self)

    monkeypatch.setattr(EngineCore, "step", failing_step)
    rx_engine, tx_http = Pipe(duplex=False)
    rx_http, tx_engine = Pipe(duplex=False)
    tx_http.send_bytes(m.encode([m.GenerateReq(rid="A", input_ids=PROMPTS["A"], sampling_params=PARAMS)]))
    guard = threading.Timer(60, lambda: tx_http.send_bytes(m.encode([m.Shutdown()])))  # old code: never exits
    guard.start()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as exc:
            engine_main(engine_config(path), ServerConfig().engine_process(), rx_engine, tx_engine)
    finally:
        guard.cancel()
        for s, h in handlers.items():
            signal.signal(s, h)
    assert exc.value.code == EXIT_BROKEN
    msgs = []
    with pytest.raises(EOFError):  # the engine's end of the pipe is closed
        while True:
            msgs += m.decode(rx_http.recv_bytes())
    assert isinstance(msgs[0], m.Ready)
    errors = [x for x in msgs if isinstance(x, m.Error)]
    assert [(e.rid, e.status) for e in errors] == [("A", 500)]


def test_http_side_answers_503_when_the_engine_dies():
    """What the HTTP process does when the engine process exits: requests in flight and new
    requests get a 503 at once, /health's check says not alive; nothing hangs."""

    async def scenario() -> None:
        client = EngineClient(config_from_kwargs(model_path="unused"), ServerConfig(), metrics=None)
        client._rx_engine, client._tx_http = Pipe(duplex=False)
        client._rx_http, tx_engine = Pipe(duplex=False)
        client.alive = True
        gone = asyncio.Event()
        client.on_gone = gone.set
        client.attach(asyncio.get_running_loop())
        pending = asyncio.ensure_future(client.submit(m.GenerateReq("r1", [1, 2, 3], SamplingParams())))
        await asyncio.sleep(0.05)
        tx_engine.close()  # the engine process exits
        with pytest.raises(APIError) as exc:
            await asyncio.wait_for(pending, 10)
        assert exc.value.status == 503
        await asyncio.wait_for(gone.wait(), 10)  # launch.py's on_gone: the server shuts down
        assert not client.alive
        with pytest.raises(APIError) as exc:
            await client.submit(m.GenerateReq("r2", [1], SamplingParams()))
        assert exc.value.status == 503
        client._outbox.put(None)

    asyncio.run(scenario())

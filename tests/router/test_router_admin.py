"""Who may administer the router (router/admin.py, router/urls.py), against a real worker with an
admin key and tenants (alice, bob), and a recording listener standing in for a worker someone
tries to register (a real HTTP server on 127.0.0.1 that records what it is sent):

- a tenant's key cannot add, remove, flush or list workers (403 naming the admin key), so the
  workers' key never reaches a worker a tenant named; with tenants and no admin key nobody can;
- a router without keys takes no workers over HTTP unless started with
  --enable-worker-registration; worker URLs are scheme + host + port only, never the router;
- the PD router's versions of the admin routes alike.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from harness.fake_pd_worker import FakeWorker
from harness.server_utils import ServerProcess
from router.config import RouterConfig
from router.embedded import RouterThread, free_port

ADMIN_KEY = "admin-key-0001"
KEYS = {"keys": {"sk-alice-0001": "alice", "sk-bob-00001": "bob"}}
ADMIN, ALICE, BOB = ({"Authorization": f"Bearer {k}"} for k in (ADMIN_KEY, "sk-alice-0001", "sk-bob-00001"))
ADMIN_ROUTES = (("POST", "/add_worker"), ("POST", "/remove_worker"), ("POST", "/flush_cache"),
                ("GET", "/list_workers"), ("GET", "/get_load"))


class Listener:
    """A real HTTP server that records (method, path, Authorization) of every request and answers
    like a worker would: /health 200, /get_load a load, anything else a fabricated generation."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None]] = []
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                listener.seen.append((self.command, self.path, self.headers.get("authorization")))
                body = {"load": 0} if self.path == "/get_load" else {"text": "fabricated", "meta_info": {}}
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("admin") / "keys.yaml"
    path.write_text(yaml.safe_dump(KEYS))
    return path


@pytest.fixture(scope="module")
def worker(tiny_chat_model: Path, keys_file: Path) -> Iterator[ServerProcess]:
    args = ["--model-path", str(tiny_chat_model), "--served-model-name", "tiny", "--max-total-tokens", "2048",
            "--api-keys-file", str(keys_file)]
    w = ServerProcess(args, api_key=ADMIN_KEY)
    w.start()
    yield w
    w.stop()


@pytest.fixture()
def listener() -> Iterator[Listener]:
    x = Listener()
    yield x
    x.stop()


def router(**kw: object) -> RouterThread:
    return RouterThread(RouterConfig(health_check_interval_s=0.2, load_poll_interval_s=0.05,  # type: ignore[arg-type]
                                     tokenizer_workers=0, **kw))


def call(c: httpx.Client, method: str, path: str, url: str, headers: dict[str, str]) -> httpx.Response:
    return c.request(method, path, params={"url": url} if path.endswith("_worker") else None, headers=headers)


def message(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


def gen(c: httpx.Client, headers: dict[str, str]) -> httpx.Response:
    return c.post("/generate", headers=headers, json={"text": "hello there", "sampling_params": {"max_new_tokens": 1}})


def test_a_tenant_key_cannot_administer_the_router(worker: ServerProcess, keys_file: Path,
                                                   listener: Listener) -> None:
    with router(worker_urls=(worker.url,), api_key=ADMIN_KEY, api_keys_file=str(keys_file)) as r, \
            httpx.Client(base_url=r.url, timeout=30) as c:
        for method, path in ADMIN_ROUTES:
            for url in (listener.url, worker.url):
                resp = call(c, method, path, url, BOB)
                assert resp.status_code == 403 and "admin key" in message(resp), (path, resp.text)
        assert c.post("/remove_worker", params={"url": worker.url, "drain": "true"}, headers=BOB).status_code == 403
        assert gen(c, ALICE).headers["x-hicache-worker"] == worker.url  # still there, still serving
        assert listener.seen == []  # never added, never sent a key
        # the admin may: the worker it adds is one it configured, and gets the workers' key
        assert call(c, "POST", "/add_worker", listener.url, ADMIN).status_code == 200
        assert [w["url"] for w in c.get("/list_workers", headers=ADMIN).json()["workers"]] == [worker.url,
                                                                                               listener.url]
        deadline = time.monotonic() + 30
        while ("GET", "/get_load", f"Bearer {ADMIN_KEY}") not in listener.seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ("GET", "/get_load", f"Bearer {ADMIN_KEY}") in listener.seen
        assert call(c, "POST", "/remove_worker", listener.url, ADMIN).status_code == 200
        assert c.post("/flush_cache", headers=ADMIN).json()["success"] is True
    # tenants but no admin key: nobody administers this router over HTTP
    with router(worker_urls=(worker.url,), worker_api_key=ADMIN_KEY, api_keys_file=str(keys_file)) as r, \
            httpx.Client(base_url=r.url, timeout=30) as c:
        for method, path in ADMIN_ROUTES:
            resp = call(c, method, path, listener.url, ALICE)
            assert resp.status_code == 403 and "has no admin key" in message(resp), (path, resp.text)
        assert gen(c, ALICE).status_code == 200


def test_a_router_without_keys_takes_no_workers_unless_told(worker: ServerProcess, listener: Listener) -> None:
    with router(worker_urls=(worker.url,), worker_api_key=ADMIN_KEY) as r, httpx.Client(base_url=r.url,
                                                                                       timeout=30) as c:
        for path, url in (("/add_worker", listener.url), ("/remove_worker", worker.url)):
            resp = call(c, "POST", path, url, {})
            assert resp.status_code == 403 and "--enable-worker-registration" in message(resp), resp.text
        assert {gen(c, {}).headers["x-hicache-worker"] for _ in range(6)} == {worker.url}
    assert listener.seen == []
    with pytest.raises(ValueError, match="would send worker_api_key"):
        RouterConfig(enable_worker_registration=True, worker_api_key=ADMIN_KEY)
    # with the flag: a keyless router takes workers, URLs are checked, and there is no key to send
    with router(enable_worker_registration=True) as r, httpx.Client(base_url=r.url, timeout=30) as c:
        port = r.cfg.port
        bad = {f"{listener.url}/internal/admin?next=": "without a path", f"{listener.url}?next=x": "without a query",
               f"{listener.url}#x": "without a fragment", listener.url.replace("//", "//user:pw@"): "user info",
               "ftp://127.0.0.1:21": "scheme http or https", f"{listener.url}/x": "without a path",
               f"http://127.0.0.1:{port}": "this router itself", f"http://localhost:{port}/": "this router itself",
               f"http://0.0.0.0:{port}": "this router itself", f"http://[::1]:{port}": "this router itself"}
        for url, why in bad.items():
            resp = call(c, "POST", "/add_worker", url, {})
            assert resp.status_code == 400 and why in message(resp), (url, resp.text)
            resp = c.post("/add_worker", json={"url": url})
            assert resp.status_code == 400 and why in message(resp), (url, resp.text)
        assert c.get("/list_workers").json()["workers"] == []
        assert listener.seen == []
        assert c.post("/add_worker", json={"url": listener.url + "/"}).json()["worker"]["url"] == listener.url
        assert gen(c, {}).headers["x-hicache-worker"] == listener.url
        assert listener.seen and {p for _, p, _ in listener.seen} <= {"/health", "/get_load", "/generate"}
        assert {a for _, _, a in listener.seen} == {None}
        assert c.post("/remove_worker", json={"url": listener.url}).status_code == 200
    for url in (f"{listener.url}/x", "http://u@127.0.0.1:1", "http://127.0.0.1:1?a"):
        with pytest.raises(ValueError, match="worker url must be"):
            RouterConfig(worker_urls=(url,))
    with pytest.raises(ValueError, match="this router itself"):
        RouterConfig(port=port, worker_urls=(f"http://localhost:{port}",))


def test_the_router_refuses_itself_by_any_name() -> None:
    """Listening on every interface, the router is also its host name and its other addresses: the
    /health answer carries its id, so /add_worker refuses those names too."""
    port = free_port("0.0.0.0")
    names = {socket.gethostname()} | set(socket.gethostbyname_ex(socket.gethostname())[2])
    with router(host="0.0.0.0", port=port, enable_worker_registration=True) as r, \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        for name in names:
            resp = c.post("/add_worker", json={"url": f"http://{name}:{port}"})
            assert resp.status_code == 400 and "this router itself" in message(resp), (name, resp.text)
        assert c.get("/list_workers").json()["workers"] == [] and r.state.pool.workers == {}


def test_pd_admin_routes_need_the_admin_key(keys_file: Path) -> None:
    p, d, extra = FakeWorker("prefill", "p"), FakeWorker("decode", "d"), FakeWorker("decode", "x")
    for w in (p, d, extra):
        w.start()
    try:
        kw = {"pd_disaggregation": True, "prefill_urls": ((p.url, None),), "decode_urls": (d.url,)}
        with router(**kw, api_key=ADMIN_KEY, api_keys_file=str(keys_file)) as r, \
                httpx.Client(base_url=r.url, timeout=30) as c:
            for method, path in ADMIN_ROUTES:
                resp = call(c, method, path, extra.url, BOB)
                assert resp.status_code == 403 and "admin key" in message(resp), (path, resp.text)
            assert ("/flush_cache", {}) not in p.received + d.received
            assert c.post("/add_worker", params={"url": extra.url}, headers=ADMIN).json()["worker"]["role"] == "decode"
            assert c.post("/flush_cache", headers=ADMIN).json()["success"] is True
            assert extra.auth[-1] == f"Bearer {ADMIN_KEY}"  # added by the admin: a worker the admin configured
        with router(**kw) as r, httpx.Client(base_url=r.url, timeout=30) as c:
            resp = c.post("/add_worker", params={"url": extra.url})
            assert resp.status_code == 403 and "--enable-worker-registration" in message(resp)
            resp = c.post("/add_worker", params={"url": f"{extra.url}/x"})
            assert resp.status_code == 403  # refused before the URL is even read
    finally:
        for w in (p, d, extra):
            w.stop()

"""The mixed streaming load of bench/pd.py: long answers decoding while long prompts arrive.

- **decoders**: ``decoders`` loops at once; each streams a short prompt with ``decode_tokens`` new
  tokens (``ignore_eos``) and starts the next request as soon as one ends. The gaps between their
  streamed tokens are the inter-token latency (ITL).
- **long prompts**: one every ``long_interval_s`` (open loop: not waiting for the previous one),
  ``long_prompt_len`` tokens, ``long_tokens`` new tokens, streamed so that TTFT is measured.

Every request is ``POST /generate`` with ``input_ids`` (exact, unique random prompts: no prefix
cache hits) and ``stream: true``. A streamed chunk carries the cumulative ``output_ids``; a chunk
with k new tokens after a gap g counts k tokens and k ITL samples of g/k (SGLang's
bench_serving convention); the largest raw gap between chunks is kept too (``max_gap``).

At the deadline no new request starts; decoders are cancelled (closing a stream aborts its
request) and long prompts in flight get ``grace_s`` to finish (so a queue that built up still
shows in TTFT). Throughput counts the tokens (output) and prompts (first token seen) that came
before the deadline, over ``duration_s``.

Also here: :class:`Router` (a ``hicache router`` subprocess) and the servers' CPU accounting.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from harness.server_utils import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
ROUTER_READY = "The router is ready to route!"


@dataclass(frozen=True)
class Load:
    duration_s: float = 48.0
    decoders: int = 4
    decode_prompt_len: int = 32
    decode_tokens: int = 128
    long_prompt_len: int = 512
    long_interval_s: float = 4.0
    long_tokens: int = 4
    grace_s: float = 120.0
    vocab: int = 40000
    seed: int = 0


@dataclass
class Rec:
    kind: str  # "decode" | "long"
    prompt_tokens: int
    start: float
    first: float | None = None
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, new tokens in that chunk)
    error: str | None = None
    done: bool = False


async def stream_one(client: httpx.AsyncClient, url: str, rec: Rec, ids: list[int], max_tokens: int) -> None:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}}
    seen = 0
    try:
        async with client.stream("POST", url + "/generate", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:300]
                    return
                n = len(chunk.get("output_ids") or ())
                if n > seen:
                    now = time.perf_counter()
                    if rec.first is None:
                        rec.first = now
                    rec.arrivals.append((now, n - seen))
                    seen = n
            rec.done = True
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"


async def run_load(url: str, load: Load) -> tuple[list[Rec], float, float]:
    """Run the load against ``url``; returns (records, start, deadline) in perf_counter time."""
    rng = random.Random(load.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, load.vocab) for _ in range(n)]

    recs: list[Rec] = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client:
        t0 = time.perf_counter()
        deadline = t0 + load.duration_s

        async def decoder() -> None:
            while time.perf_counter() < deadline:
                rec = Rec("decode", load.decode_prompt_len, time.perf_counter())
                recs.append(rec)
                await stream_one(client, url, rec, prompt(load.decode_prompt_len), load.decode_tokens)
                if rec.error:
                    await asyncio.sleep(0.5)  # do not spin on a failing server

        longs: list[asyncio.Task] = []

        async def arrivals() -> None:
            nxt = t0 + load.long_interval_s / 2
            while nxt < deadline:
                await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
                rec = Rec("long", load.long_prompt_len, time.perf_counter())
                recs.append(rec)
                longs.append(asyncio.create_task(
                    stream_one(client, url, rec, prompt(load.long_prompt_len), load.long_tokens)))
                nxt += load.long_interval_s

        decs = [asyncio.create_task(decoder()) for _ in range(load.decoders)]
        await arrivals()
        await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
        for t in decs:
            t.cancel()
        for t in decs:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if longs:
            _, pending = await asyncio.wait(longs, timeout=load.grace_s)
            for t in pending:
                t.cancel()
    return recs, t0, deadline


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(recs: list[Rec], t0: float, deadline: float) -> dict[str, Any]:
    """Latencies in ms, throughputs in tokens/s over the load window."""
    window = deadline - t0
    ttft_long = [(r.first - r.start) * 1e3 for r in recs if r.kind == "long" and r.first is not None]
    ttft_all = [(r.first - r.start) * 1e3 for r in recs if r.first is not None]
    itl, gaps = [], []
    for r in recs:
        if r.kind != "decode":
            continue
        for (ta, _), (tb, k) in zip(r.arrivals, r.arrivals[1:], strict=False):
            gaps.append((tb - ta) * 1e3)
            itl.extend([(tb - ta) * 1e3 / k] * k)
    out_tokens = sum(k for r in recs for t, k in r.arrivals if t <= deadline)
    prompt_tokens = sum(r.prompt_tokens for r in recs if r.first is not None and r.first <= deadline)
    longs = [r for r in recs if r.kind == "long"]
    return {
        "ttft_long_p50_ms": pct(ttft_long, 0.5), "ttft_long_p99_ms": pct(ttft_long, 0.99),
        "ttft_all_p50_ms": pct(ttft_all, 0.5), "ttft_all_p99_ms": pct(ttft_all, 0.99),
        "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99), "max_gap_ms": max(gaps, default=None),
        "output_tok_s": out_tokens / window, "prompt_tok_s": prompt_tokens / window,
        "long_requests": len(longs), "long_done": sum(r.done for r in longs),
        "decode_requests": sum(r.kind == "decode" for r in recs), "itl_samples": len(itl),
        "errors": sum(r.error is not None for r in recs),
        "error_samples": sorted({r.error for r in recs if r.error})[:3],
    }


class Router:
    def __init__(self, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "serving.launch.cli", "router", *args,
                     "--host", "127.0.0.1", "--port", str(self.port)]
        self.lines: collections.deque[str] = collections.deque(maxlen=300)
        self.ready = threading.Event()
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 60.0) -> None:
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        threading.Thread(target=self._drain, daemon=True).start()
        if not self.ready.wait(timeout):
            raise RuntimeError("router did not start:\n" + "".join(self.lines)[-3000:])

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if ROUTER_READY in line:
                self.ready.set()

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def cpu_s(s: ServerProcess) -> float:
    """CPU seconds used so far by a server's process tree (HTTP process + engine)."""
    try:
        root = psutil.Process(s.proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def stop(s: ServerProcess) -> int | str | None:
    if s.proc is None:
        return None
    try:
        return s.stop()
    except RuntimeError as e:
        return str(e)[:200]


def cpu_snapshot() -> dict[int, tuple[float, str]]:
    """CPU seconds of every process on the host (pid -> (seconds, command line))."""
    out = {}
    for p in psutil.process_iter(["cpu_times", "cmdline"]):
        t = p.info["cpu_times"]
        if t is not None:
            out[p.pid] = (t.user + t.system, " ".join(p.info["cmdline"] or [])[:120])
    return out


def others_cpu(before: dict[int, tuple[float, str]], dt: float, ours: list[int]) -> dict[str, Any]:
    """Cores used during ``dt`` by processes outside this benchmark (``ours``: its roots), the busiest 3."""
    mine = {os.getpid(), *ours}
    for pid in ours:
        with contextlib.suppress(psutil.Error):
            mine.update(c.pid for c in psutil.Process(pid).children(recursive=True))
    after = cpu_snapshot()
    used = sorted(((after[p][0] - before[p][0]) / dt, p, after[p][1]) for p in after if p in before and p not in mine)
    return {"cores": sum(u for u, _, _ in used), "top": [[round(u, 2), p, c] for u, p, c in used[::-1][:3]]}

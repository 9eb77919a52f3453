"""Live replay: a slice of a request trace against a running ``hicache serve`` over HTTP, and
what the policy replay (bench/trace_policy.py) predicts for the same slice and capacities.

Every request is ``POST /generate`` with the prompt's ``input_ids`` (bench/trace_data.py makes
them from the hash ids), ``max_new_tokens`` = the trace's output length capped at
``max_new_tokens``, ``ignore_eos``, ``stream: true`` (TTFT = the first chunk with a token). At
most ``concurrency`` requests are in flight, started in trace order; with ``speedup`` > 0 a
request also waits for its timestamp divided by ``speedup`` (time-compressed arrivals).
With ``settle``, each request starts only once the server reports no L3 write waiting or in
flight (``write_pages_waiting`` + ``write_pages_in_flight`` in ``/get_server_info``): the policy
replay assumes a page is on L3 as soon as it is written, so a settled closed-loop replay
measures the live path against the policy itself, whatever the disk's speed (an fsync per LMDB
commit on a loaded CI disk takes long); without it, writes that lag behind the requests show
as fewer L3 hits than predicted (the regime ``write_pages_waiting_max`` describes).
Tokens hit per tier come from each response's ``meta_info.cached_tokens_details``
(device / host / storage); the server's capacities (pages per tier, the L3 store's capacity
over its bytes per page), page size, write policy and prefetch threshold come from
``/get_server_info``, so the prediction replays exactly the slice the server saw with the
server's own sizes. Requests the server could not run (a prompt over its context or its L1)
are left out of both, and counted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from bench.trace_data import BlockTokens, TraceRequest, output_tokens
from bench.trace_policy import PolicyConfig, PolicyReplay

# LMDB's defaults (hicache.tiers.lmdb.config.LMDBConfig) and per-entry cost (LMDBAccounting.cost)
_LMDB_HIGH, _LMDB_LOW, _KEY_LEN, _OS_PAGE = 0.85, 0.75, 32, 4096


@dataclass(frozen=True)
class ServerCaps:
    """What the policy replay needs to know about a server (from ``/get_server_info``)."""

    page_size: int
    l1_tokens: int
    l2_tokens: int
    l3_tokens: int
    l3_evict_to: float  # LMDB evicts from its high watermark down to its low one
    write_policy: str
    eviction_policy: str
    prefetch_threshold: int
    context_len: int
    vocab_size: int
    write_through_threshold: int = 2  # hits that make a node hot (the exclusive mode keeps its copies)
    chunked_prefill_size: int = 2048  # the scheduler's (its pass loop: bench/trace_sched.py)
    schedule_policy: str = "lpm"
    max_running_requests: int = 64
    overlap_schedule: bool = False  # on CUDA unless disable_overlap_schedule (serving/scheduler/overlap.py)

    @classmethod
    def from_server(cls, info: dict[str, Any], model_info: dict[str, Any]) -> ServerCaps:
        cache = info["cache"]
        sched = info.get("scheduler") or {}
        st = info["internal_states"][0]
        ps = int(cache["page_size"])
        pages = st["pages"]
        l3 = 0
        evict_to = 1.0
        storage = st.get("storage") or {}
        if cache.get("hicache_storage_backend") and storage.get("backend.capacity_bytes"):
            extra = cache.get("hicache_storage_backend_extra_config") or {}
            high, low = float(extra.get("high_watermark", _LMDB_HIGH)), float(extra.get("low_watermark", _LMDB_LOW))
            vlen = int(st["bytes_per_page"]["storage"])
            cost = ((vlen + 16 + _OS_PAGE - 1) // _OS_PAGE * _OS_PAGE if vlen > _OS_PAGE // 2 else vlen + 16) \
                + 3 * _KEY_LEN + 96
            l3 = int(storage["backend.capacity_bytes"] * high // cost) * ps
            evict_to = low / high
        return cls(ps, int(pages["device"]["total"]) * ps, int(pages.get("host", {}).get("total", 0)) * ps, l3,
                   evict_to, cache["hicache_write_policy"], cache["eviction_policy"],
                   int(cache["hicache_storage_prefetch_threshold"]), int(model_info["context_length"]),
                   int(model_info["vocab_size"]), int(cache.get("write_through_threshold", 2)),
                   int(sched.get("chunked_prefill_size", 2048)), str(sched.get("schedule_policy", "lpm")),
                   int(sched.get("max_running_requests", 64)),
                   not sched.get("disable_overlap_schedule", True) and str(info.get("engine", {}).get("device", "cpu"))
                   .startswith("cuda"))

    def policy(self, concurrency: int, max_new_tokens: int) -> PolicyConfig:
        return PolicyConfig(self.l1_tokens, self.l2_tokens, self.l3_tokens if self.l2_tokens else 0, self.page_size,
                            self.write_policy, self.eviction_policy, self.prefetch_threshold, concurrency,
                            max_new_tokens, self.l3_evict_to,
                            write_through_threshold=self.write_through_threshold,
                            chunked_prefill_size=self.chunked_prefill_size, schedule_policy=self.schedule_policy,
                            max_running_requests=self.max_running_requests, overlap_schedule=self.overlap_schedule)


@dataclass
class _Rec:
    prompt_tokens: int
    start: float = 0.0
    first: float | None = None
    end: float = 0.0
    cached: dict[str, int] | None = None
    error: str | None = None


def fetch_caps(url: str, headers: dict[str, str] | None = None) -> ServerCaps:
    with httpx.Client(base_url=url, headers=headers or {}, timeout=60) as c:
        info, model = c.get("/get_server_info"), c.get("/get_model_info")
        for r in (info, model):
            r.raise_for_status()
        return ServerCaps.from_server(info.json(), model.json())


def runnable(reqs: Sequence[TraceRequest], blocks: BlockTokens, caps: ServerCaps,
             max_new_tokens: int) -> tuple[list[TraceRequest], int]:
    """The requests whose prompt plus output fits the server's context and L1; and how many did not."""
    limit = min(caps.context_len, caps.l1_tokens) - max_new_tokens
    ok = [r for r in reqs if blocks.length(r) <= limit]
    return ok, len(reqs) - len(ok)


async def _one(client: httpx.AsyncClient, rec: _Rec, ids: list[int], max_new: int) -> None:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0.0}}
    rec.start = time.perf_counter()
    try:
        async with client.stream("POST", "/generate", json=body) as r:
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
                if rec.first is None and chunk.get("output_ids"):
                    rec.first = time.perf_counter()
                meta = chunk.get("meta_info") or {}
                if "cached_tokens_details" in meta:
                    rec.cached = dict(meta["cached_tokens_details"])
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        rec.end = time.perf_counter()


async def _settle(client: httpx.AsyncClient, timeout_s: float) -> None:
    """Wait until the server has no L3 write waiting or in flight (see the module docstring)."""
    end = time.monotonic() + timeout_s
    while True:
        r = await client.get("/get_server_info")
        r.raise_for_status()
        st = r.json()["internal_states"][0].get("storage") or {}
        if not st.get("write_pages_waiting", 0) + st.get("write_pages_in_flight", 0):
            return
        if time.monotonic() > end:
            raise TimeoutError(f"L3 writes did not settle within {timeout_s} s: {st}")
        await asyncio.sleep(0.005)


async def _replay(url: str, prompts: list[tuple[TraceRequest, list[int], int]], concurrency: int, speedup: float,
                  headers: dict[str, str], timeout_s: float, settle: bool = False) -> tuple[list[_Rec], float]:
    recs = [_Rec(len(ids)) for _, ids, _ in prompts]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        base_ms = prompts[0][0].timestamp_ms if prompts else 0.0

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                r, ids, max_new = prompts[i]
                if speedup > 0:
                    delay = (r.timestamp_ms - base_ms) / 1000 / speedup - (time.perf_counter() - t0)
                    if delay > 0:
                        await asyncio.sleep(delay)
                if settle:
                    await _settle(client, timeout_s)
                await _one(client, recs[i], ids, max_new)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return recs, time.perf_counter() - t0


def predict(caps: ServerCaps, reqs: Sequence[TraceRequest], blocks: BlockTokens, concurrency: int,
            max_new_tokens: int) -> dict[str, Any]:
    """What the policy replay predicts for ``reqs`` (those the server can run) on a server with ``caps``."""
    blocks = BlockTokens(blocks.block_tokens, caps.vocab_size, blocks.low)
    pred = PolicyReplay(caps.policy(concurrency, max_new_tokens))
    pred.run((blocks.tokens(r), output_tokens(r.index, max(1, min(r.output_length, max_new_tokens)), caps.vocab_size))
             for r in runnable(reqs, blocks, caps, max_new_tokens)[0])
    return pred.summary()


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def server_stats(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    with httpx.Client(base_url=url, headers=headers or {}, timeout=60) as c:
        r = c.get("/get_server_info")
        r.raise_for_status()
        return r.json()["internal_states"][0]


def run_live(url: str, reqs: Sequence[TraceRequest], blocks: BlockTokens, concurrency: int = 8,
             max_new_tokens: int = 1, speedup: float = 0.0, headers: dict[str, str] | None = None,
             timeout_s: float = 3600.0, caps: ServerCaps | None = None, settle: bool = False) -> dict[str, Any]:
    """Replay ``reqs`` against the server at ``url`` and predict the same slice (see the module
    docstring). ``blocks.vocab_size`` is replaced by the server's."""
    headers = headers or {}
    caps = caps or fetch_caps(url, headers)
    blocks = BlockTokens(blocks.block_tokens, caps.vocab_size, blocks.low)
    todo, skipped = runnable(reqs, blocks, caps, max_new_tokens)
    prompts = [(r, blocks.tokens(r), max(1, min(r.output_length, max_new_tokens))) for r in todo]
    before = server_stats(url, headers)
    recs, wall = asyncio.run(_replay(url, prompts, concurrency, speedup, headers, timeout_s, settle))
    after = server_stats(url, headers)
    ok = [r for r in recs if r.error is None and r.cached is not None]
    hit = {k: sum(r.cached.get(k, 0) for r in ok) for k in ("device", "host", "storage")}
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    ttft = [r.first - r.start for r in ok if r.first is not None]
    measured = {
        "requests": len(recs), "errors": len(recs) - len(ok), "skipped_too_long": skipped,
        "error_samples": sorted({r.error for r in recs if r.error})[:3],
        "prompt_tokens": prompt_tokens, "wall_s": wall, "prompt_tok_s": prompt_tokens / wall if wall else 0.0,
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9),
        "hit_tokens_device": hit["device"], "hit_tokens_host": hit["host"], "hit_tokens_storage": hit["storage"],
        "hit_rate": sum(hit.values()) / max(1, prompt_tokens),
    }
    st_b, st_a = before.get("storage") or {}, after.get("storage") or {}
    for key in ("write_pages_dropped", "pages_written", "pages_prefetched", "write_pages_waiting_max",
                "l2_backups_skipped_pages", "cost_l3_refusals", "store_failed", "l2_demotions_dropped_pages",
                "l3_pages_promoted", "fetches_cut"):
        if key in st_a:
            measured[key] = st_a[key] if key.endswith("_max") else st_a[key] - st_b.get(key, 0)
    predicted = predict(caps, todo, blocks, concurrency, max_new_tokens)
    return {"caps": caps.__dict__, "measured": measured, "predicted": predicted,
            "hit_rate_vs_predicted": measured["hit_rate"] / predicted["hit_rate"] if predicted["hit_rate"] else None}
